"""A trained model in Python: load a checkpoint once, then predict, score, evaluate, train.

    from t5x_lite.run.interactive import InteractiveModel

    model = InteractiveModel.load("runs/quickstart")
    model.predict(["def add(a, b):"])

`InteractiveModel.load` takes what eval and infer take: a training MODEL_DIR (its
newest intact step), one step directory, or a converted HF / T5X checkpoint. The
model is the config the step stores (`T5Config.*` gin bindings, if any, override
it) and the vocabulary its `train_meta` records (`stored_vocabulary.resolve`; the
configured vocabulary for checkpoints that record none, e.g. converted ones, or
`vocabulary=`). No gin file is needed.

Each call runs jitted functions that are compiled once per shape and reused: rows
are padded to a power of two times the mesh's data size, and token lengths to a
power of two (at least 16) up to `lengths` (`model_runner.bucket`), so new inputs
of similar size reuse a compiled function. The functions are the infer and eval
commands' (`model_runner.ModelRunner`, `task_evaluator.TaskEvaluator`) and the
training loop's (`trainer.make_train_step`), over the same gin-configurable mesh
(`partitioning.Partitioner`: `Partitioner.num_partitions`, `.fsdp`): `predict` and
`score` give what `python -m t5x_lite.infer` writes for the same checkpoint, text
and options. Decoder-only models decode at full `lengths` width (their width is
their decoding length).

Importing this module changes nothing global. `load` resolves the mesh over the
devices JAX sees; call `t5x_lite.core.console.add_cpu_xla_flags()` before JAX starts
to compile as the entry points do on a CPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import seqio

from t5x_lite import base_model, models
from t5x_lite.checkpoint import checkpoints, stored_vocabulary
from t5x_lite.core.types import PyTree
from t5x_lite.data import pipeline, vocab
from t5x_lite.run import infer_lib, model_runner
from t5x_lite.run.task_evaluator import Metrics, TaskEvaluator
from t5x_lite.training import optimizers, partitioning, trainer

# infer's defaults (gin/runs/infer.gin TASK_FEATURE_LENGTHS): inputs are cut to this
# many tokens, and predictions are at most this long.
DEFAULT_LENGTHS = {"inputs": 512, "targets": 128}


def _texts(values: Sequence[str], what: str) -> list[str]:
  """`values` as a list of strings; one string alone is a mistake worth naming."""
  if isinstance(values, str):
    raise TypeError(f"{what} must be a list of strings, got one string; pass [{what}].")
  return [str(v) for v in values]


class InteractiveModel:
  """A model with its parameters, ready to predict, score, evaluate and train.

  Attributes:
    model: the model (`models.EncoderDecoderModel` or `DecoderOnlyModel`).
    params: the current parameters (sharded by the partitioner).
    vocabulary: inputs' and targets' vocabulary.
    step: the checkpoint's step, plus the `train_step`s taken since.
    lengths: {'inputs': n, 'targets': m}: inputs are cut to n tokens (EOS included),
      targets to m, predictions are at most m tokens.
    batch_size: most rows per compiled call (predict, score, evaluate).
  """

  def __init__(
    self,
    model: base_model.BaseModel,
    params: PyTree,
    param_shardings: PyTree,
    partitioner: partitioning.Partitioner,
    *,
    step: int = 0,
    lengths: Mapping[str, int] | None = None,
    batch_size: int = 32,
    optimizer: optimizers.Optimizer | None = None,
    seed: int = 0,
  ):
    """Wraps a model and its sharded params (`load` builds both from a checkpoint).

    Args:
      model: the model.
      params: its parameters, sharded as `param_shardings`.
      param_shardings: NamedSharding per parameter (`Partitioner.abstract_params`).
      partitioner: the mesh and logical-axis rules.
      step: the training step the params are at.
      lengths: see the class attributes (default `DEFAULT_LENGTHS`).
      batch_size: see the class attributes; a multiple of the mesh's data size.
      optimizer: what `train_step` applies (default: Adafactor at a constant 1e-3,
        runs/finetune.gin's); its state starts fresh at the first `train_step`.
      seed: dropout seed of `train_step`.
    """
    self.model, self.params, self.partitioner = model, params, partitioner
    self.step, self.batch_size = step, batch_size
    self.lengths = dict(lengths or DEFAULT_LENGTHS)
    self._param_shardings = param_shardings
    self._optimizer = optimizer
    self._rng = jax.random.PRNGKey(seed)
    self._runners: dict[model_runner.DecodeConfig, model_runner.ModelRunner] = {}
    self._evaluators: dict[tuple[Any, ...], TaskEvaluator] = {}
    self._train: tuple[Any, trainer.TrainState] | None = None  # (jitted step, shardings)
    self._opt_state: Any = None
    self._aux_state: Any = None  # the model's auxiliary state (`BaseModel.start_aux_state`)

  @classmethod
  def load(
    cls,
    path: str,
    *,
    vocabulary: seqio.Vocabulary | None = None,
    lengths: Mapping[str, int] | None = None,
    batch_size: int = 32,
    optimizer: optimizers.Optimizer | None = None,
    seed: int = 0,
  ) -> InteractiveModel:
    """Loads a checkpoint with its stored config and recorded vocabulary.

    Args:
      path: a MODEL_DIR (newest intact step), a step directory, or a converted HF /
        T5X checkpoint; relative to the working directory.
      vocabulary: overrides the recorded vocabulary (needed for a checkpoint whose
        recorded file is gone, or a converted one trained with another vocabulary).
      lengths, batch_size, optimizer, seed: as in `__init__`.

    Returns:
      The model, its parameters restored straight into their shardings.

    Raises:
      CheckpointError: no checkpoint at `path`, or a corrupt one (named).
      ConfigError: the recorded vocabulary's file is gone (and the configured one
        differs), or `vocabulary` differs from the one the checkpoint records.
    """
    [(step, step_dir)] = checkpoints.find_steps(path)  # verified
    vocabulary = vocabulary or stored_vocabulary.resolve(step_dir) or vocab.get_vocabulary()
    model = models.build_model(checkpoints.model_config(step_dir), vocabulary)
    checkpoints.check_vocabulary(step_dir, model.output_vocabulary)
    partitioner = partitioning.Partitioner()
    abstract, shardings = partitioner.abstract_params(model.init_params)
    params = checkpoints.restore_params(step_dir, abstract, verify_checksums=False)
    return cls(
      model,
      params,
      shardings,
      partitioner,
      step=step,
      lengths=lengths,
      batch_size=batch_size,
      optimizer=optimizer,
      seed=seed,
    )

  @property
  def vocabulary(self) -> seqio.Vocabulary:
    """The vocabulary of inputs and targets."""
    return self.model.output_vocabulary

  # ------------------------------------------------------------ batches

  def _runner(self, decode: model_runner.DecodeConfig) -> model_runner.ModelRunner:
    """The jitted predict / score functions for `decode`, built once."""
    if decode not in self._runners:
      self._runners[decode] = model_runner.ModelRunner(
        self.model, self.partitioner, self._param_shardings, decode, self.batch_size
      )
    return self._runners[decode]

  def _examples(
    self, inputs: Sequence[str], targets: Sequence[str] | None = None
  ) -> list[infer_lib.Example]:
    """Tokenized examples, cut to `lengths` as the infer command cuts them."""
    if targets is not None and len(targets) != len(inputs):
      raise ValueError(f"Got {len(inputs)} inputs but {len(targets)} targets.")
    encode = infer_lib.encode_text
    return [
      infer_lib.Example(
        text,
        None if targets is None else targets[i],
        encode(self.model.input_vocabulary, text, self.lengths["inputs"]),
        None
        if targets is None
        else encode(self.model.output_vocabulary, targets[i], self.lengths["targets"]),
      )
      for i, text in enumerate(inputs)
    ]

  def _batch(
    self, examples: Sequence[infer_lib.Example], cut_targets: bool, cap: int | None = None
  ) -> tuple[dict[str, np.ndarray], int]:
    """(model features at bucketed lengths, rows to pad to) of `examples`.

    Inputs are cut to the bucket of the longest input; targets too if `cut_targets`
    (scoring, training), else they keep `lengths['targets']`, the decoding length.
    Decoder-only models keep `lengths` (their width is the decoding length).
    """
    lengths = dict(self.lengths)
    if self.model.network_config.architecture == "encoder_decoder":
      longest = max(len(ex.input_ids) for ex in examples)
      lengths["inputs"] = model_runner.bucket(longest, self.lengths["inputs"])
    if cut_targets:
      longest = max(0 if ex.target_ids is None else len(ex.target_ids) for ex in examples)
      lengths["targets"] = model_runner.bucket(longest, self.lengths["targets"])
    batch = infer_lib.make_batch(examples, lengths, self.model.network_config.architecture)
    rows = model_runner.row_bucket(
      len(examples), self.partitioner.data_size, cap or self.batch_size
    )
    return batch, rows

  def _chunks(self, examples: Sequence[infer_lib.Example]) -> list[list[infer_lib.Example]]:
    return [
      list(examples[i : i + self.batch_size]) for i in range(0, len(examples), self.batch_size)
    ]

  # ------------------------------------------------------------ the API

  def predict_with_scores(self, inputs: Sequence[str], **decode: Any) -> list[tuple[str, float]]:
    """Decodes each input; returns (text, score) pairs in input order.

    Args:
      inputs: texts, given to the model as written (no task preprocessing), as
        `python -m t5x_lite.infer` gives an input file's.
      **decode: `model_runner.DecodeConfig` fields: decode_fn ('greedy', 'beam',
        'sample'), num_decodes, alpha, temperature, topk, topp, max_decode_len
        (default `lengths['targets']`), min_decode_len, seed.

    Returns:
      [(prediction, score)]: the decode's log-probability (beam: length-penalised).
    """
    runner = self._runner(model_runner.DecodeConfig(**decode))
    out = []
    for chunk in self._chunks(self._examples(_texts(inputs, "inputs"))):
      batch, rows = self._batch(chunk, cut_targets=False)
      tokens, scores = runner.predict(self.params, batch, rows)
      out += [(self.vocabulary.decode(t.tolist()), float(s)) for t, s in zip(tokens, scores)]
    return out

  def predict(self, inputs: Sequence[str], **decode: Any) -> list[str]:
    """Decoded text of each input, in input order (options as `predict_with_scores`)."""
    return [text for text, _ in self.predict_with_scores(inputs, **decode)]

  def score(self, inputs: Sequence[str], targets: Sequence[str]) -> list[float]:
    """Sum of each target's token log-likelihoods given its input (infer's score mode)."""
    examples = self._examples(_texts(inputs, "inputs"), _texts(targets, "targets"))
    runner = self._runner(model_runner.DecodeConfig())
    out = []
    for chunk in self._chunks(examples):
      batch, rows = self._batch(chunk, cut_targets=True)
      out += runner.score(self.params, batch, rows).tolist()
    return out

  def evaluate(
    self,
    task_name: str,
    split: str = "validation",
    *,
    num_examples: int | None = None,
    task_feature_lengths: Mapping[str, int] | None = None,
    **decode: Any,
  ) -> Metrics:
    """A registered task's (or mixture's) seqio metrics on `split`, as the eval command.

    The task reads its data with this model's vocabulary (`vocab.resolving_to`). Its
    data is read and cached at the first call; later calls with the same arguments
    (e.g. after `train_step`s) reuse it and the compiled functions.

    Args:
      task_name: a registered seqio task or mixture (import the module that registers
        it first, e.g. `import tasks` from the repository root).
      split: the split.
      num_examples: at most this many examples per task (None: all).
      task_feature_lengths: as TASK_FEATURE_LENGTHS (None: seqio measures the longest).
      **decode: `model_runner.DecodeConfig` fields (see `predict_with_scores`).

    Returns:
      {task: {metric: value}}.
    """
    options = model_runner.DecodeConfig(**decode)
    lengths = None if task_feature_lengths is None else dict(task_feature_lengths)
    key = (task_name, split, num_examples, None if lengths is None else tuple(lengths.items()))
    with vocab.resolving_to(self.vocabulary):
      if (key, options) not in self._evaluators:
        cfg = pipeline.DatasetConfig(
          mixture_or_task_name=task_name,
          # None: TaskEvaluator reads whole examples (DatasetConfig's type names training's
          # lengths only).
          task_feature_lengths=lengths,  # pyright: ignore[reportArgumentType]
          batch_size=self.batch_size,
          split=split,
          shuffle=False,
          seed=0,
          pack=False,
          architecture=self.model.network_config.architecture,
        )
        self._evaluators[key, options] = TaskEvaluator(
          self._runner(options), cfg, num_examples=num_examples
        )
      return self._evaluators[key, options].evaluate(self.params, self.step)

  def train_step(self, examples: Sequence[tuple[str, str]]) -> dict[str, float]:
    """One optimizer update on in-memory (input, target) pairs; returns its metrics.

    All `examples` form one batch (rows padded to a bucket, with no weight). The
    optimizer (`optimizer=` of `load`) starts fresh at the first call; dropout is
    the model config's. Later `predict`, `score` and `evaluate` calls use the new
    parameters.

    Returns:
      {'loss', 'accuracy', ..., 'learning_rate', 'grad_norm'} of the step.
    """
    if isinstance(examples, (str, tuple)) or not examples:
      raise TypeError("examples must be a non-empty list of (input, target) pairs.")
    inputs, targets = zip(*examples)
    batch, rows = self._batch(
      self._examples(_texts(inputs, "inputs"), _texts(targets, "targets")),
      cut_targets=True,
      cap=len(examples) * self.partitioner.data_size,
    )
    step_fn, state = self._train_state()
    placed = {
      k: jax.device_put(v, self.partitioner.batch_sharding)
      for k, v in model_runner.pad_rows(batch, rows).items()
    }
    state, metrics = step_fn(state, placed, self._rng)
    self.params, self._opt_state, self._aux_state = state.params, state.opt_state, state.aux_state
    self.step += 1
    return {k: float(v) for k, v in jax.device_get(metrics).items()}

  def _train_state(self) -> tuple[Any, trainer.TrainState]:
    """(the jitted train step, the state to update), built at the first call."""
    if self._train is None:
      optimizer = self._optimizer or optimizers.adafactor(learning_rate=optimizers.constant(1e-3))
      abstract, shardings = trainer.abstract_train_state(self.model, optimizer, self.partitioner)
      self._aux_state = self.model.start_aux_state(abstract.aux_state, self.params)
      init = self.partitioner.jit(
        optimizer.with_param_axes(self.model.param_axes()).init,
        in_shardings=(shardings.params,),
        out_shardings=shardings.opt_state,
      )
      self._opt_state = init(self.params)
      step_fn = trainer.make_train_step(self.model, optimizer, self.partitioner, shardings)
      self._train = (step_fn, shardings)
    step_fn, shardings = self._train
    count = jax.device_put(jnp.asarray(self.step, jnp.int32), shardings.step)
    state = trainer.TrainState(
      step=count, params=self.params, opt_state=self._opt_state, aux_state=self._aux_state
    )
    return step_fn, state

  def __repr__(self) -> str:
    config = self.model.network_config
    return (
      f"InteractiveModel({config.architecture}, step {self.step}, "
      f"vocab_size {config.vocab_size}, lengths {self.lengths}, "
      f"mesh {dict(self.partitioner.mesh.shape)})"
    )


def load(path: str, **options: Any) -> InteractiveModel:
  """`InteractiveModel.load(path, **options)`."""
  return InteractiveModel.load(path, **options)
