"""seqio datasets -> per-host numpy batches -> global sharded `jax.Array`s.

Every host reads its own shard of the task/mixture
(`seqio.ShardInfo(index=process_index, num_shards=process_count)`), batches
`batch_size // process_count` examples with tf.data (which prefetches in its
own threads), and `jax.make_array_from_process_local_data` assembles the
global batch, sharded over the mesh's data axis.

Resuming exactly: the training iterator is deterministic for a fixed seed
(seqio shuffles and samples mixtures with that seed; tf.data keeps element
order), and its position is saved with every checkpoint, per host, in one of
two ways (`TrainIterator.checkpoint_mode`):

* 'iterator' (default): tf.data's own iterator checkpoint
  (`tf.train.Checkpoint(iterator=...)`). Restoring is O(1) in the number of
  batches consumed; the files hold the shuffle buffer (kilobytes to a few MB).
  Needs a pipeline tf.data can serialise (no `from_generator`/`py_function`).
* 'skip': only the number of batches consumed is saved; a restore rebuilds the
  pipeline and skips that many batches. Works for any pipeline, but a restore
  re-reads and re-preprocesses everything consumed so far.

Both give the batches the uninterrupted run would have seen. There is no
Python-side prefetch queue, so the saved position is exactly the number of
batches handed to the trainer.

Errors the user can fix come out as one `ConfigError` line:

* an unknown task or mixture name (`get_mixture_or_task`, also checked when a
  `DatasetConfig` is built) lists the closest registered names;
* a preprocessor that asks for a feature its input lacks
  (`naming_failing_task`) names the task, the preprocessor, the feature and
  the features there are, instead of a KeyError deep in a tf.data trace.

`truncation_report` counts how many examples are longer than
`task_feature_lengths` (and so are cut); training logs it at start-up.

Task ids: a model that treats the tasks of a mixture differently (a teacher per task,
`distillation_modes.MultiTeacherDistillationModel`) names them in `train_task_ids`;
training then sets `DatasetConfig.task_ids`, and every batch gets the model feature
`decoder_task_ids` [batch, targets length]: on each target token, the 1-based index in
`task_ids` of the task its example came from, 0 for the tasks not named and on padding.
The mixture samples, packs and shuffles exactly as without it (`TaskIdMixture`,
`TaskIdEncDecFeatureConverter`), so the other features of every batch are the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import importlib
import os
import sys
import json
from collections.abc import Callable, Iterator, Mapping, Sequence

import gin
import jax
import numpy as np
import seqio
import tensorflow as tf
from absl import logging
from jax.sharding import Sharding

from t5x_lite.nn import network
from t5x_lite.data import packing, preprocessors
from t5x_lite.core.errors import ConfigError
from t5x_lite.core.gin_refs import binding_name
from t5x_lite.core.types import GIN_REQUIRED

CHECKPOINT_MODES = ("iterator", "skip")
# The task feature and the model feature that carry each target token's task id.
TASK_IDS = "task_ids"
DECODER_TASK_IDS = "decoder_task_ids"
# Examples per task that `truncation_report` measures by default.
TRUNCATION_SAMPLE = 1000
Batch = dict[str, jax.Array]


def registered_names() -> list[str]:
  """Every registered seqio task and mixture name, sorted."""
  return sorted(set(seqio.TaskRegistry.names()) | set(seqio.MixtureRegistry.names()))


def get_mixture_or_task(name: str) -> seqio.Task | seqio.Mixture:
  """The registered mixture or task `name`.

  Raises:
    ConfigError: for an unknown name; lists the closest registered names.
  """
  if name in seqio.MixtureRegistry.names():
    return seqio.MixtureRegistry.get(name)
  if name in seqio.TaskRegistry.names():
    return seqio.TaskRegistry.get(name)
  close = difflib.get_close_matches(name, registered_names(), n=5, cutoff=0.5)
  hint = f" (closest: {', '.join(close)})" if close else ""
  raise ConfigError(
    f"No seqio task or mixture named {name!r}{hint}; tools/show_task.py --list shows all "
    "(a task of your own is registered by importing its module: --module_import=my_tasks "
    "or gin `import my_tasks`)"
  )


def import_task_modules(modules: Sequence[str]) -> None:
  """Imports modules that register seqio tasks, finding them in the working directory too.

  Args:
    modules: module names, e.g. `my_tasks` for `./my_tasks.py`.

  Raises:
    ConfigError: naming a module that cannot be found.
  """
  if "" not in sys.path and os.getcwd() not in sys.path:
    sys.path.insert(0, os.getcwd())
  for module in modules:
    try:
      importlib.import_module(module)
    except ModuleNotFoundError as e:
      if e.name and module.startswith(e.name):
        raise ConfigError(
          f"--module_import={module}: no module {e.name!r} in the working directory "
          f"({os.getcwd()}) or on PYTHONPATH"
        ) from e
      raise


@gin.configurable
@dataclasses.dataclass(frozen=True)
class DatasetConfig:
  """Which seqio data to read and how (T5X's `utils.DatasetConfig`).

  Attributes:
    mixture_or_task_name: registered seqio task or mixture.
    task_feature_lengths: e.g. {'inputs': 512, 'targets': 114}.
    batch_size: GLOBAL batch size (all hosts together).
    split: dataset split.
    shuffle: shuffle examples (training).
    seed: seqio seed for shuffling, mixture sampling and preprocessors.
    pack: pack several examples per row (EncDecFeatureConverter(pack=True)).
    use_cached: read the seqio cache instead of preprocessing online.
    architecture: the model's `T5Config.architecture`, which picks the feature
      converter (`feature_converter`); train, eval and precompile set it from the
      model, so gin never needs to.
    task_ids: tasks of the mixture whose target tokens carry their 1-based index here
      in the feature `decoder_task_ids` (0 for other tasks); empty: no such feature.
      Training sets it from the model's `train_task_ids`, so gin never needs to.
  """

  mixture_or_task_name: str
  task_feature_lengths: Mapping[str, int]
  batch_size: int
  split: str = "train"
  shuffle: bool = True
  seed: int | None = 0
  pack: bool = True
  use_cached: bool = False
  architecture: str = "encoder_decoder"
  task_ids: tuple[str, ...] = ()

  def __post_init__(self) -> None:
    """Fails early on a batch size below 1, feature lengths that are not a mapping of
    names to positive integers (None: evaluation's lengths from the data), an unknown
    task (naming the closest), or task ids that are not tasks of the mixture."""
    if not _positive_int(self.batch_size):
      raise ConfigError(
        f"DatasetConfig.batch_size (gin BATCH_SIZE) must be a positive integer, got "
        f"{self.batch_size!r}"
      )
    lengths = self.task_feature_lengths
    if lengths is not None and not (
      isinstance(lengths, Mapping)
      and all(isinstance(k, str) and _positive_int(v) for k, v in lengths.items())
    ):
      raise ConfigError(
        "DatasetConfig.task_feature_lengths (gin TASK_FEATURE_LENGTHS) must map feature "
        f"names to positive integers, e.g. {{'inputs': 512, 'targets': 114}}; got {lengths!r}"
      )
    if self.architecture not in network.ARCHITECTURES:
      raise ConfigError(
        f"DatasetConfig.architecture must be one of {network.ARCHITECTURES}, "
        f"got {self.architecture!r}"
      )
    provider = get_mixture_or_task(self.mixture_or_task_name)
    if self.task_ids:
      _check_task_ids(provider, tuple(self.task_ids), self.architecture)


def _positive_int(value: object) -> bool:
  """Whether `value` is a Python or numpy integer (not a bool) of at least 1."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and bool(value >= 1)


def _check_task_ids(
  provider: seqio.Task | seqio.Mixture, task_ids: tuple[str, ...], architecture: str
) -> None:
  """Raises a ConfigError unless `task_ids` are distinct tasks of `provider`."""
  if architecture != "encoder_decoder":
    raise ConfigError(
      f"Task ids in the batch (the model's train_task_ids {task_ids}) need an "
      f"encoder-decoder model; T5Config.architecture is {architecture!r}."
    )
  if len(set(task_ids)) != len(task_ids):
    raise ConfigError(f"The model's train_task_ids {task_ids} name a task twice.")
  tasks = [task.name for task in seqio.get_subtasks(provider)]
  for name in task_ids:
    if name not in tasks:
      raise ConfigError(
        f"The model's train_task_ids name task {name!r}, which is not in the training data "
        f"{provider.name!r} (its tasks: {', '.join(tasks)}); name tasks of the mixture "
        "(for distillation: build_multi_teacher_distillation_model.teacher_tasks)."
      )


class TaskIdMixture(seqio.Mixture):
  """A task or mixture whose examples gain the feature `task_ids`, their task's id.

  The mixture's tasks with their effective rates (sub-mixtures flattened) and its
  sampling function, so it samples exactly as the mixture does for the same seed;
  each task's examples get `task_ids`, an int32 vector shaped like their targets,
  filled with the task's id plus one (1 for a task not in `ids`): seqio's packing
  drops zeros as padding, so no real token may carry 0 here.
  `TaskIdEncDecFeatureConverter` takes the one off again. Not registered.

  Args:
    provider: the registered task or mixture.
    ids: {task name: id >= 1}.
  """

  def __init__(self, provider: seqio.Task | seqio.Mixture, ids: Mapping[str, int]):
    if isinstance(provider, seqio.Mixture):
      tasks = [(task, provider.get_rate(task)) for task in provider.tasks]
      sample_fn = getattr(provider, "_sample_fn", None)  # the mixture's own sampler, if set
    else:
      tasks, sample_fn = [(provider, 1.0)], None
    kwargs = {} if sample_fn is None else {"sample_fn": sample_fn}
    super().__init__(provider.name, tasks, **kwargs)
    self._ids = dict(ids)

  def get_dataset(self, sequence_length=None, *args, **kwargs) -> tf.data.Dataset:
    """`seqio.Mixture.get_dataset`; `task_ids` in `sequence_length` is left to the converter."""
    if sequence_length is not None:
      sequence_length = {k: v for k, v in sequence_length.items() if k != TASK_IDS}
    return super().get_dataset(sequence_length, *args, **kwargs)

  def get_task_dataset(self, task: seqio.Task, *args, **kwargs) -> tf.data.Dataset:
    """The task's examples (filtered as seqio does) with `task_ids` added."""
    stored_id = self._ids.get(task.name, 0) + 1  # never 0: see the class docstring

    def with_task_id(example: Mapping[str, tf.Tensor]) -> dict[str, tf.Tensor]:
      targets = example["targets"]  # [targets length]
      return {**example, TASK_IDS: tf.fill(tf.shape(targets), tf.constant(stored_id, tf.int32))}

    dataset = super().get_task_dataset(task, *args, **kwargs)
    return dataset.map(with_task_id, num_parallel_calls=tf.data.AUTOTUNE)


class TaskIdEncDecFeatureConverter(packing.EncDecFeatureConverter):
  """`seqio.EncDecFeatureConverter` that also carries `task_ids` as `decoder_task_ids`.

  `task_ids` is trimmed, padded and packed as a task feature of the targets' length,
  so it lands on the same positions as the targets (packing places every feature of
  an example at once; a feature as long as the targets adds no constraint). It holds
  the id plus one (`TaskIdMixture`); `decoder_task_ids` is the id, 0 on padding.
  """

  TASK_FEATURES = {
    **seqio.EncDecFeatureConverter.TASK_FEATURES,
    TASK_IDS: seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
  }
  MODEL_FEATURES = {
    **seqio.EncDecFeatureConverter.MODEL_FEATURES,
    DECODER_TASK_IDS: seqio.FeatureConverter.FeatureSpec(dtype=tf.int32),
  }

  def _convert_example(self, features: Mapping[str, tf.Tensor]) -> Mapping[str, tf.Tensor]:
    converted = dict(super()._convert_example(features))
    converted[DECODER_TASK_IDS] = tf.maximum(features[TASK_IDS] - 1, 0)  # padding: 0
    return converted

  def get_model_feature_lengths(self, task_feature_lengths: Mapping[str, int]) -> Mapping[str, int]:
    lengths = dict(super().get_model_feature_lengths(task_feature_lengths))
    lengths[DECODER_TASK_IDS] = task_feature_lengths[TASK_IDS]
    return lengths


def _require_inputs(name: str) -> None:
  """Raises a ConfigError if a task of `name` has no 'inputs' for an encoder to read."""
  for task in seqio.get_subtasks(get_mixture_or_task(name)):
    if "inputs" not in task.output_features:
      raise ConfigError(
        f"Task {task.name!r} has targets only (language modelling), and an "
        "encoder-decoder model needs inputs: train it with a decoder-only model "
        "(T5Config.architecture = 'decoder_only', e.g. models/decoder_only/*.gin), or "
        "pick an objective with inputs (its prefix_lm or span_corruption task)."
      )


def feature_converter(config: DatasetConfig, pack: bool | None = None) -> seqio.FeatureConverter:
  """The seqio feature converter of `config.architecture`.

  Encoder-decoder: `EncDecFeatureConverter` (`TaskIdEncDecFeatureConverter` with
  `config.task_ids`). Decoder-only and prefix LM: `DecoderFeatureConverter`, which
  concatenates inputs and targets (loss on the targets only) or, for a task with
  targets alone, makes plain language-model features. seqio's converters, packing
  without AutoGraph (`t5x_lite.data.packing`: the same rows).

  Args:
    config: the dataset config.
    pack: overrides `config.pack`.
  """
  pack = config.pack if pack is None else pack
  if config.architecture == "encoder_decoder":
    _require_inputs(config.mixture_or_task_name)
    if config.task_ids:
      return TaskIdEncDecFeatureConverter(pack=pack)
    return packing.EncDecFeatureConverter(pack=pack)
  return packing.DecoderFeatureConverter(pack=pack)


def for_model(
  config: DatasetConfig, model_config: network.T5Config, task_ids: Sequence[str] = ()
) -> DatasetConfig:
  """`config` with the architecture of `model_config` and the model's `task_ids`."""
  return dataclasses.replace(
    config, architecture=model_config.architecture, task_ids=tuple(task_ids)
  )


def converter_lengths(config: DatasetConfig) -> dict[str, int]:
  """The feature converter's task feature lengths: `task_feature_lengths`, and with
  `config.task_ids` also `task_ids` at the targets' length."""
  lengths = dict(config.task_feature_lengths)
  if config.task_ids:
    lengths[TASK_IDS] = lengths["targets"]
  return lengths


def model_feature_lengths(config: DatasetConfig) -> dict[str, int]:
  """Lengths of the model features (encoder_input_tokens, decoder_*, ...)."""
  return dict(feature_converter(config).get_model_feature_lengths(converter_lengths(config)))


def model_input_shapes(config: DatasetConfig) -> dict[str, tuple[int, int]]:
  """Global [batch, length] shape of every model feature."""
  return {
    name: (config.batch_size, length) for name, length in model_feature_lengths(config).items()
  }


def per_host_batch_size(global_batch_size: int) -> int:
  """This host's share of the global batch."""
  count = jax.process_count()
  if global_batch_size % count:
    raise ConfigError(
      f"BATCH_SIZE {global_batch_size} (the global batch) is not divisible by the {count} "
      "processes; use a multiple of the process count."
    )
  return global_batch_size // count


def _unwrapped(preprocessor: Callable) -> Callable:
  """The function under `functools.partial` layers."""
  while isinstance(preprocessor, functools.partial):
    preprocessor = preprocessor.func
  return preprocessor


def _missing_key(error: KeyError) -> str | None:
  """The key a KeyError was raised for (autograph re-raises it with a traceback as text)."""
  while isinstance(error.__context__, KeyError):
    error = error.__context__
  key = error.args[0] if error.args else None
  return key if isinstance(key, str) else None


def preprocessed_examples(
  task: seqio.Task,
  split: str,
  lengths: Mapping[str, int] | None,
  seed: int | None = None,
  *,
  trim: bool = True,
) -> tf.data.Dataset:
  """The task's split in order, through its preprocessors applied one by one.

  Unlike `task.get_dataset`, a preprocessor that asks for a feature its input
  lacks is named, and features are not cut to `lengths` at the end.

  Args:
    task: the task.
    split: one of `task.splits`.
    lengths: task feature lengths, passed to preprocessors that take them.
    seed: preprocessing seed.
    trim: False gives `seqio.preprocessors.append_eos_after_trim` no lengths,
      so features keep their full length (plus EOS).

  Returns:
    The unshuffled, unsharded, preprocessed examples.

  Raises:
    ConfigError: "Task <name>: preprocessor <p> asks for feature '<f>', but
      the source has columns [...]" (or "its input has features [...]" after
      the first preprocessor).
  """
  dataset = task.source.get_dataset(split=split, shuffle=False, seed=seed)
  # As in seqio, preprocessors before a cache placeholder get no lengths.
  cached = [isinstance(p, seqio.CacheDatasetPlaceholder) for p in task.preprocessors]
  first_with_lengths = cached.index(True) + 1 if any(cached) else 0
  with seqio.utils.map_seed_manager(seed):
    for index, preprocessor in enumerate(task.preprocessors):
      if cached[index]:
        continue
      function = _unwrapped(preprocessor)
      untrimmed = function is seqio.preprocessors.append_eos_after_trim and not trim
      apply = seqio.utils.add_kwargs_to_transform(
        preprocessor,
        output_features=task.output_features,
        sequence_length=None if untrimmed or index < first_with_lengths else lengths,
      )
      available = list(dataset.element_spec)
      try:
        dataset = apply(dataset)
      except preprocessors.MissingFeatureError as e:
        missing = e.feature
      except KeyError as e:
        missing = _missing_key(e)
        if missing is None or missing in available:
          raise
      else:
        continue
      found = "the source has columns" if index == 0 else "its input has features"
      raise ConfigError(
        f"Task {task.name}: preprocessor {getattr(function, '__name__', function)} asks for "
        f"feature {missing!r}, but {found} {available}"
      ) from None
  return dataset


@contextlib.contextmanager
def naming_failing_task(
  name: str, split: str, lengths: Mapping[str, int] | None, seed: int | None = None
) -> Iterator[None]:
  """Turns a missing-feature error of building `name`'s dataset into one line naming the task.

  Use around code that builds a dataset of the task or mixture `name` (seqio
  names no task in a preprocessor's KeyError). The error is reproduced task
  by task with `preprocessed_examples`; other errors pass unchanged.

  Args:
    name: the task or mixture.
    split: the split being read.
    lengths: its task feature lengths.
    seed: preprocessing seed.

  Raises:
    ConfigError: naming the task, preprocessor, feature and available features.
  """
  try:
    yield
  except (preprocessors.MissingFeatureError, KeyError):
    for task in seqio.get_subtasks(get_mixture_or_task(name)):
      if split in task.splits:
        preprocessed_examples(task, split, lengths, seed)
    raise


@dataclasses.dataclass(frozen=True)
class Truncation:
  """How many examples of a task have a feature longer than its length.

  Attributes:
    task: the task.
    feature: e.g. 'inputs'.
    length: the feature's length in `task_feature_lengths`.
    num_examples: examples looked at.
    num_truncated: of those, how many are longer than `length` (and cut).
  """

  task: str
  feature: str
  length: int
  num_examples: int
  num_truncated: int

  def __str__(self) -> str:
    share = 100 * self.num_truncated / max(self.num_examples, 1)
    return (
      f"{self.task}: {self.num_truncated} of {self.num_examples} examples ({share:.1f}%) "
      f"have {self.feature} longer than {self.length} tokens and are truncated"
    )


def truncation_report(
  config: DatasetConfig, num_examples: int = TRUNCATION_SAMPLE
) -> dict[str, dict[str, Truncation]]:
  """Counts examples whose features exceed `config.task_feature_lengths`.

  Looks at the first `num_examples` examples (or all, if the split is
  smaller) of each task of the mixture that has `config.split`, tokenized
  and preprocessed, before they are cut to length (EOS counted).

  Args:
    config: the task/mixture, split, lengths and seed.
    num_examples: examples per task to look at.

  Returns:
    {task name: {feature: Truncation}} for the features in the lengths.
  """
  lengths = dict(config.task_feature_lengths)
  report = {}
  for task in seqio.get_subtasks(get_mixture_or_task(config.mixture_or_task_name)):
    if config.split not in task.splits:
      continue
    dataset = preprocessed_examples(task, config.split, lengths, config.seed, trim=False)
    spec = dataset.element_spec  # {feature: TensorSpec}
    features = [name for name in lengths if isinstance(spec, Mapping) and name in spec]
    sizes = dataset.take(num_examples).map(
      lambda x, features=features: {name: tf.size(x[name]) for name in features},
      num_parallel_calls=tf.data.AUTOTUNE,
    )
    counts = next(sizes.batch(num_examples).as_numpy_iterator(), None)
    report[task.name] = {
      name: Truncation(
        task.name,
        name,
        lengths[name],
        num_examples=0 if counts is None else len(counts[name]),
        num_truncated=0 if counts is None else int((counts[name] > lengths[name]).sum()),
      )
      for name in features
    }
  return report


def log_truncation(
  config: DatasetConfig, num_examples: int = TRUNCATION_SAMPLE
) -> dict[str, dict[str, Truncation]]:
  """`truncation_report`, with a warning line for every feature that gets cut."""
  report = truncation_report(config, num_examples)
  for per_feature in report.values():
    for truncation in per_feature.values():
      if truncation.num_truncated:
        logging.warning("%s", truncation)
  return report


def host_dataset(
  config: DatasetConfig, *, num_epochs: int | None, drop_remainder: bool = True
) -> tf.data.Dataset:
  """This host's shard, batched to `batch_size // process_count`, prefetched.

  The one pipeline that training and evaluation read (and that
  tools/data_benchmark.py times): seqio.get_dataset with the config's feature
  converter, shuffled with its seed when `config.shuffle`.

  Args:
    config: what to read.
    num_epochs: None repeats forever (training); 1 reads the split once.
    drop_remainder: drop a last partial batch (training); False keeps it.

  Returns:
    A tf.data.Dataset of dicts of int32 [per_host_batch, length] tensors.

  Raises:
    ConfigError: for a preprocessor asking for a feature its input lacks.
  """
  name = config.mixture_or_task_name
  provider: str | seqio.Mixture = name
  if config.task_ids:
    ids = {task: i + 1 for i, task in enumerate(config.task_ids)}
    provider = TaskIdMixture(get_mixture_or_task(name), ids)
  with naming_failing_task(name, config.split, config.task_feature_lengths, config.seed):
    dataset = seqio.get_dataset(
      provider,
      task_feature_lengths=converter_lengths(config),
      feature_converter=feature_converter(config),
      dataset_split=config.split,
      use_cached=config.use_cached,
      shuffle=config.shuffle,
      num_epochs=num_epochs,
      shard_info=seqio.ShardInfo(index=jax.process_index(), num_shards=jax.process_count()),
      seed=config.seed,
    )
  dataset = dataset.batch(per_host_batch_size(config.batch_size), drop_remainder=drop_remainder)
  return dataset.prefetch(tf.data.AUTOTUNE)


def _zero_padded(
  batch: Mapping[str, np.ndarray] | None, rows: int, lengths: Mapping[str, int]
) -> dict[str, np.ndarray]:
  """`batch` with all-zero rows appended up to `rows` (all zeros when None)."""
  padded = {}
  for name, length in lengths.items():
    value = np.zeros((rows, length), np.int32)  # [rows, length]
    if batch is not None:
      value[: batch[name].shape[0]] = batch[name]
    padded[name] = value
  return padded


def to_global(local: Mapping[str, np.ndarray], sharding: Sharding) -> Batch:
  """Assembles per-host numpy batches into global arrays.

  Args:
    local: feature -> [per_host_batch, length] array of this host.
    sharding: target sharding of [global_batch, length] arrays.

  Returns:
    feature -> [global_batch, length] jax.Array.
  """
  return {
    name: jax.make_array_from_process_local_data(sharding, np.asarray(value))
    for name, value in local.items()
  }


class TrainIterator:
  """Endless training batches whose position is saved with checkpoints.

  Implements `train_checkpointer.CheckpointableIterator`.
  """

  def __init__(
    self,
    make_dataset: Callable[[], tf.data.Dataset],
    sharding: Sharding,
    checkpoint_mode: str = "iterator",
    name: str = "The training data",
  ):
    """Wraps an (endless, deterministic) per-host dataset.

    Args:
      make_dataset: builds the dataset, e.g. `host_dataset(..., num_epochs=None)`.
        A fresh dataset object per iterator matters: a seeded shuffle with
        `reshuffle_each_iteration` gives a second iterator of the SAME object
        a different order.
      sharding: sharding of the global [batch, length] arrays.
      checkpoint_mode: 'iterator' or 'skip' (see the module docstring).
      name: what the data is, for the error when it holds no examples.
    """
    if checkpoint_mode not in CHECKPOINT_MODES:
      raise ValueError(
        f"checkpoint_mode must be one of {CHECKPOINT_MODES}, got {checkpoint_mode!r}"
      )
    self._make_dataset = make_dataset
    self._sharding = sharding
    self._mode = checkpoint_mode
    self._iterator: Iterator[Mapping[str, tf.Tensor]] | None = None
    self.batches_consumed = 0
    self._name = name

  def __iter__(self) -> TrainIterator:
    return self

  def _tf_iterator(self) -> Iterator[Mapping[str, tf.Tensor]]:
    if self._iterator is None:
      self._iterator = iter(self._make_dataset())
    return self._iterator

  def __next__(self) -> Batch:
    try:
      local = next(self._tf_iterator())
    except StopIteration:  # an endless dataset that ends holds no examples
      raise ConfigError(f"{self._name} holds no examples: there is nothing to train on.") from None
    self.batches_consumed += 1
    return to_global({k: v.numpy() for k, v in local.items()}, self._sharding)

  def save_state(self, path: str) -> None:
    """Writes `<path>.json` (count, mode) and, in 'iterator' mode, tf files."""
    tf.io.gfile.makedirs(path.rsplit("/", 1)[0])
    with tf.io.gfile.GFile(path + ".json", "w") as f:
      json.dump({"batches_consumed": self.batches_consumed, "mode": self._mode}, f)
    if self._mode == "iterator":
      tf.train.Checkpoint(iterator=self._tf_iterator()).write(path)

  def restore_state(self, path: str) -> None:
    """Moves to the position written by `save_state(path)`."""
    with tf.io.gfile.GFile(path + ".json") as f:
      state = json.load(f)
    consumed = int(state["batches_consumed"])
    if self._mode == "iterator" and state["mode"] == "iterator":
      self._iterator = iter(self._make_dataset())
      tf.train.Checkpoint(iterator=self._iterator).read(path).assert_consumed()
    else:
      self._iterator = iter(self._make_dataset().skip(consumed))
    self.batches_consumed = consumed


_LOGGED_STEPS: set[tuple] = set()

# The model features whose non-padding share says how full a row is, and what a user
# calls them in TASK_FEATURE_LENGTHS (encoder-decoder; a decoder-only row is one feature).
_ROW_FEATURES = {"encoder_input_tokens": "inputs", "decoder_target_tokens": "targets"}


@dataclasses.dataclass(frozen=True)
class PassCount:
  """What one pass over a split fills, counted as training reads it.

  Attributes:
    rows: rows of the model's features (packed ones hold several examples).
    examples: examples in those rows (their segments; one per row unpacked).
    fill: task feature ('inputs', 'targets'; 'targets' alone for a decoder-only row) ->
      the share of its row length that holds tokens, not padding.
  """

  rows: int
  examples: int
  fill: Mapping[str, float]

  def packing_hint(self, lengths: Mapping[str, int]) -> str:
    """A clause saying the targets length keeps packed inputs mostly padding, or ''.

    A classification task given a few target tokens packs about one example per row
    however short its inputs: the targets fill first and the encoder runs over padding.
    The clause gives the targets length that would let the inputs fill.
    """
    if not {"inputs", "targets"} <= self.fill.keys() or not self.examples:
      return ""
    # Tokens an example takes in each feature, and how many examples a row could hold.
    used = {f: self.fill[f] * lengths[f] * self.rows / self.examples for f in self.fill}
    fits = {f: lengths[f] / max(used[f], 1e-9) for f in self.fill}
    if fits["inputs"] < 1.5 or fits["inputs"] < 1.3 * fits["targets"]:
      return ""
    wanted = -(-int(fits["inputs"] * used["targets"]) // 8) * 8  # a multiple of 8
    return (
      f"; the targets length packs {self.examples / self.rows:.1f} examples a row where "
      f"the inputs could hold {fits['inputs']:.1f}: TASK_FEATURE_LENGTHS 'targets': "
      f"{wanted} would pack more into fewer rows"
    )


@functools.lru_cache(maxsize=None)
def _pass_count(
  name: str, lengths: tuple[tuple[str, int], ...], split: str, pack: bool, architecture: str
) -> PassCount:
  """What one pass over `split` of task/mixture `name` fills (rows packed if `pack`)."""
  config = DatasetConfig(
    name, dict(lengths), 1, split=split, shuffle=False, pack=pack, architecture=architecture
  )
  with naming_failing_task(name, split, config.task_feature_lengths, config.seed):
    dataset = seqio.get_dataset(
      name,
      task_feature_lengths=config.task_feature_lengths,
      feature_converter=feature_converter(config),
      dataset_split=split,
      shuffle=False,
      num_epochs=1,
      seed=config.seed,
    )
  features = [f for f in _ROW_FEATURES if f in dataset.element_spec]
  segments = "decoder_segment_ids" if "decoder_segment_ids" in dataset.element_spec else None

  def add(counts, row):
    # counts: [rows, examples, non-padding tokens of each of `features`...] int64
    examples = tf.reduce_max(row[segments]) if segments else tf.constant(1, tf.int32)
    tokens = [tf.math.count_nonzero(row[f]) for f in features]
    return tf.stack([np.int64(1), tf.cast(examples, tf.int64), *tokens]) + counts

  counts = dataset.reduce(np.zeros(2 + len(features), np.int64), add).numpy()
  rows = int(counts[0])
  fill = {
    _ROW_FEATURES[f] if len(features) > 1 else "targets": float(n)
    / max(1, rows * dataset.element_spec[f].shape[-1])
    for f, n in zip(features, counts[2:])
  }
  return PassCount(rows=rows, examples=int(counts[1]), fill=fill)


@gin.configurable
def steps_for_epochs(
  epochs: float = GIN_REQUIRED,
  *,
  mixture_or_task_name: str = GIN_REQUIRED,
  task_feature_lengths: Mapping[str, int] = GIN_REQUIRED,
  batch_size: int = GIN_REQUIRED,
  split: str = "train",
  pack: bool = True,
  architecture: str = "encoder_decoder",
  max_steps: int | None = None,
) -> int:
  """Steps of `batch_size` rows that pass over `split` about `epochs` times.

  Counts the rows one pass fills (packed as training packs them; counted once per
  process and data, then cached), so a recipe can say how long to train in epochs:
  `TRAIN_STEPS = @train_length/steps_for_epochs()` with
  `train_length/steps_for_epochs.epochs = 10` (gin/recipes/new_task.gin).

  Args:
    epochs: passes over the split (fractions allowed).
    mixture_or_task_name: the task or mixture (a mixture counts its tasks' rows).
    task_feature_lengths: the training lengths.
    batch_size: the global batch size (rows per step).
    split: the split passed over.
    pack: count packed rows (as training packs them).
    architecture: the model's `T5Config.architecture` (its feature converter).
    max_steps: at most this many steps (None: no limit), so that a recipe counted in
      epochs keeps to a compute budget on a large task.

  Returns:
    max(1, round(epochs * rows / batch_size)), or `max_steps` if that is fewer.

  Raises:
    ConfigError: for a non-positive `epochs`, `batch_size` or `max_steps`, or an unknown
      task.
  """
  for name, value in (("epochs", epochs), ("batch_size", batch_size), ("max_steps", max_steps)):
    if value is not None and value <= 0:
      raise ConfigError(
        f"{binding_name('steps_for_epochs', name)} must be > 0"
        f"{' or None' if name == 'max_steps' else ''}, got {value}."
      )
  get_mixture_or_task(mixture_or_task_name)  # an unknown name: the closest registered ones
  counted = _pass_count(
    mixture_or_task_name, tuple(sorted(task_feature_lengths.items())), split, pack, architecture
  )
  rows = counted.rows
  steps = max(1, round(epochs * rows / batch_size))
  limit = steps if max_steps is None else min(steps, max_steps)
  key = (mixture_or_task_name, split, epochs, rows, batch_size, max_steps)
  if key not in _LOGGED_STEPS:  # gin resolves a macro at each use: say it once
    _LOGGED_STEPS.add(key)
    fill = ", ".join(f"{name} {share:.0%}" for name, share in counted.fill.items())
    logging.info(
      "%g epochs of %s (%s): %d rows of %s per pass (%d examples; rows full: %s), "
      "%d steps of %d rows%s%s.",
      epochs,
      mixture_or_task_name,
      split,
      rows,
      dict(task_feature_lengths),
      counted.examples,
      fill,
      steps,
      batch_size,
      f"; capped at max_steps={limit} ({limit * batch_size / rows:.2g} epochs)"
      if limit < steps
      else "",
      counted.packing_hint(task_feature_lengths) if pack else "",
    )
  return limit


def train_iterator(
  config: DatasetConfig, sharding: Sharding, checkpoint_mode: str = "iterator"
) -> TrainIterator:
  """The endless, shuffled training iterator for `config`."""
  return TrainIterator(
    lambda: host_dataset(config, num_epochs=None),
    sharding,
    checkpoint_mode,
    name=f"The {config.split!r} split of {config.mixture_or_task_name} (this host's shard)",
  )


def eval_batches(config: DatasetConfig, sharding: Sharding, num_batches: int) -> Iterator[Batch]:
  """Exactly `num_batches` global batches of one pass over `config.split`.

  No shuffling, no repetition. A last partial batch is zero-padded, and a
  host that runs out of data yields all-zero batches, so all hosts run the
  same number of steps; zero rows carry no loss weight.

  Args:
    config: what to read (its `shuffle` is ignored).
    sharding: sharding of the global [batch, length] arrays.
    num_batches: number of batches to yield.

  Yields:
    feature -> [global_batch, length] jax.Array.
  """
  config = dataclasses.replace(config, shuffle=False)
  rows = per_host_batch_size(config.batch_size)
  lengths = model_feature_lengths(config)
  dataset = host_dataset(config, num_epochs=1, drop_remainder=False)
  local = dataset.take(num_batches).as_numpy_iterator()
  for _ in range(num_batches):
    # (TensorFlow's stubs have as_numpy_iterator yield arrays; here each batch is a dict.)
    yield to_global(_zero_padded(next(local, None), rows, lengths), sharding)  # pyright: ignore[reportArgumentType]
