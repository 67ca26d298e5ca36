"""The training loop: state setup (fresh / resume / fine-tune), steps, logs, saves.

`train()` is gin-configured by gin/runs/pretrain.gin or gin/runs/finetune.gin
and called by `python -m t5x_lite.train`. What it guarantees:

* Resume: when MODEL_DIR holds a checkpoint, the latest one is restored
  (params, optimizer state, step, RNG, data-iterator position) straight into
  the target shardings, so the resumed run computes exactly what the
  uninterrupted run would have. A checkpoint of a different model is an error
  listing the mismatched parameters, never a silent re-initialisation.
* Fine-tune: otherwise, with `initial_checkpoint_path`, only `params` are
  restored (optimizer, step and data start fresh); `restore_config`
  (`partial_restore.RestoreConfig`) maps, skips or freshly initialises
  parameters, converts scanned / unscanned layers, or also restores the
  optimizer state and step.
* SIGTERM / SIGINT: the running step finishes, a checkpoint is saved at that
  step, `train()` returns normally (exit status 0).
* Non-finite loss or gradient norm (or parameters, checked before each save):
  `NonFiniteLossError` naming the first bad step; nothing after the last good
  periodic checkpoint is saved.
* Logging every `log_period` steps: loss, accuracy, learning rate, gradient
  norm, per-device tokens/s and sequences/s, MFU (`t5x_lite.training.throughput`),
  to TensorBoard, MODEL_DIR/metrics.jsonl and the console.

Metrics stay on device between log steps (no per-step host sync); they are
fetched and checked at log steps, before every save and at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import gin
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from t5x_lite import base_model, models
from t5x_lite.nn import network
from t5x_lite.data import pipeline
from t5x_lite.checkpoint import checkpoints, partial_restore, train_checkpointer
from t5x_lite.training import (
  early_stopping,
  metrics_logging,
  metrics_rewind,
  optimizers,
  partitioning,
  throughput,
  trainer,
)
from t5x_lite.run import eval_lib, model_dir_lock, train_checks
from t5x_lite.core.errors import ConfigError, UserError
from t5x_lite.core.types import GIN_REQUIRED

CONFIG_FILE = "config.gin"
FINAL_METRICS_FILE = "final_metrics.json"
# train_meta key: wall seconds the run had spent (all its attempts) at that save.
ELAPSED_KEY = "elapsed_s"


class NonFiniteLossError(UserError, RuntimeError):
  """Training produced a NaN/Inf loss or gradient norm."""


class StopRequest:
  """Turns SIGTERM/SIGINT into a flag the loop checks between steps.

  Attributes:
    signal_name: the signal received, or None.
    step: the last step the loop started (it keeps at most one more queued on the
      device), for the message.
  """

  def __init__(self):
    self.signal_name: str | None = None
    self.step = 0

  def __bool__(self) -> bool:
    return self.signal_name is not None

  def _handle(self, signum: int, frame: Any) -> None:
    del frame
    self.signal_name = signal.Signals(signum).name
    logging.warning(
      "Received %s during step %d: finishing it (and an evaluation in progress, if "
      "any), then saving step %d and exiting.",
      self.signal_name,
      self.step,
      self.step,
    )

  @contextlib.contextmanager
  def installed(self) -> Iterator[StopRequest]:
    """Installs the handlers (main thread only) and restores the old ones."""
    if threading.current_thread() is not threading.main_thread():
      yield self
      return
    previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
      yield self
    finally:
      for sig, handler in previous.items():
        signal.signal(sig, handler)


@dataclasses.dataclass
class _Setup:
  """Everything the loop needs, built before the first step."""

  state: trainer.TrainState
  shardings: trainer.TrainState
  rng: jax.Array
  model_config: network.T5Config
  partitioner: partitioning.Partitioner
  # Wall time the run had spent when its restored checkpoint was saved (0 if fresh).
  elapsed_s: float = 0.0
  restored_step: int | None = None


def _setup_state(
  model: base_model.BaseModel,
  optimizer: optimizers.Optimizer,
  ckpt: train_checkpointer.TrainCheckpointer,
  train_iter: pipeline.TrainIterator,
  partitioner: partitioning.Partitioner,
  *,
  random_seed: int,
  initial_checkpoint_path: str | None,
  initial_checkpoint_dtype: str | None,
  restore_config: partial_restore.RestoreConfig | None,
  check_meta: train_checkpointer.MetaCheck | None = None,
) -> _Setup:
  """Resumes from MODEL_DIR, else initialises (optionally from a checkpoint).

  Resuming restores the newest intact step of MODEL_DIR: corrupt newer steps are
  skipped with a warning (`TrainCheckpointer.restore_latest`). A fine-tuning start
  restores the initial checkpoint as `restore_config` says (default
  `RestoreConfig()` with its gin bindings; `t5x_lite.checkpoint.partial_restore`): adapter
  parameters it lacks keep their fresh (identity) init.
  """
  init_rng, rng = jax.random.split(jax.random.PRNGKey(random_seed))
  abstract, shardings = trainer.abstract_train_state(model, optimizer, partitioner)
  kept_aux = abstract.aux_state if model.checkpoint_aux_state else None
  restored = ckpt.restore_latest(
    abstract.params, abstract.opt_state, train_iter, check_meta, abstract_aux_state=kept_aux
  )
  elapsed_s = 0.0
  if restored is not None:
    elapsed_s = float(restored.meta.get(ELAPSED_KEY, 0.0))
    logging.info("Resuming from %s/%d", ckpt.directory, restored.step)
    step = jax.device_put(jnp.asarray(restored.step, jnp.int32), shardings.step)
    state = trainer.TrainState(step=step, params=restored.params, opt_state=restored.opt_state)
    rng = jnp.asarray(restored.meta["rng"], jnp.uint32)
  else:
    state, shardings = trainer.init_train_state(model, optimizer, init_rng, partitioner)
    if initial_checkpoint_path:
      config = restore_config or partial_restore.RestoreConfig()
      what = "params, optimizer state, step" if config.restore_optimizer_state else "params"
      logging.info("Fine-tuning from %s (%s)", initial_checkpoint_path, what)
      frozen_by = [
        binding
        for binding, frozen in (
          ("train.trainable_parameters", optimizer.trainable is not None),
          ("train.gradual_unfreezing_steps", optimizer.unfreeze_every is not None),
        )
        if frozen
      ]
      start = partial_restore.restore_start(
        initial_checkpoint_path,
        abstract.params,
        state.params,
        config,
        dtype=initial_checkpoint_dtype,
        abstract_opt_state=abstract.opt_state,
        frozen_by=frozen_by,
        vocabulary=model.output_vocabulary,
      )
      state = state.replace(params=start.params)
      if start.opt_state is not None:
        step = jax.device_put(jnp.asarray(start.step, jnp.int32), shardings.step)
        state = state.replace(step=step, opt_state=start.opt_state)
    elif restore_config is not None:
      logging.warning("train.restore_config is ignored: train.initial_checkpoint_path is not set")
  if restored is not None and restored.aux_state is not None:
    state = state.replace(aux_state=restored.aux_state)  # kept by the model across resumes
  else:  # the model makes it at the start (a frozen teacher restores its own checkpoint)
    state = state.replace(aux_state=model.start_aux_state(abstract.aux_state, state.params))
  restored_step = None if restored is None else restored.step
  return _Setup(state, shardings, rng, model.network_config, partitioner, elapsed_s, restored_step)


def _fetch_and_check(
  pending: Sequence[tuple[int, Mapping[str, jax.Array]]], last_saved: int | None
) -> list[dict[str, float]]:
  """Fetches pending step metrics; raises at the first non-finite step."""
  fetched = jax.device_get([m for _, m in pending])
  for (step, _), metrics in zip(pending, fetched):
    bad = [k for k in ("loss", "grad_norm") if k in metrics and not np.isfinite(metrics[k])]
    if bad:
      values = ", ".join(f"{k}={metrics[k]}" for k in bad)
      saved = (
        f"the last checkpoint (step {last_saved}) is intact"
        if last_saved is not None
        else "no checkpoint was written"
      )
      raise NonFiniteLossError(
        f"Non-finite {values} at step {step} (the update producing step {step}); "
        f"stopping without saving, {saved}."
      )
  return [{k: float(v) for k, v in m.items()} for m in fetched]


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
  """Whether every element of every leaf is finite (checked before each save)."""
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def _mean_metrics(metrics: Sequence[Mapping[str, float]]) -> dict[str, float]:
  """Interval means; the learning rate of the last step."""
  keys = ("loss", "accuracy", "grad_norm", "z_loss", "cross_ent_loss", "distill_kl") + (
    "electra_mlm",
    "electra_rtd",
    "electra_clm",
    "rtd_accuracy",
    "replaced_fraction",
  )
  keys += tuple(sorted(k for k in metrics[-1] if k.startswith("distill_kl_")))  # per teacher
  summary = {k: float(np.mean([m[k] for m in metrics])) for k in keys if k in metrics[-1]}
  if "learning_rate" in metrics[-1]:
    summary["learning_rate"] = metrics[-1]["learning_rate"]
  return summary


def evaluate(eval_step: Any, params: Any, batches: Iterator[pipeline.Batch]) -> dict[str, float]:
  """Mean eval loss/accuracy over `batches`, each batch weighted by its target tokens.

  With a per-token loss (LOSS_NORMALIZING_FACTOR = 'NUM_REAL_TARGET_TOKENS', the
  gin/runs default) this is the loss per target token of the whole eval set;
  all-padding batches carry no weight.
  """
  results = jax.device_get([eval_step(params, batch) for batch in batches])
  results = [r for r in results if r["num_tokens"] > 0]  # padding batches: loss 0/0
  if not results:
    raise ValueError("The evaluation split produced no target tokens.")
  weights = np.array([r["num_tokens"] for r in results], np.float64)
  summary = {
    k: float(np.average([r[k] for r in results], weights=weights)) for k in ("loss", "accuracy")
  }
  summary["num_tokens"] = float(weights.sum())
  return summary


def write_operative_config(model_dir: str) -> None:
  """Writes the operative gin config to MODEL_DIR/config.gin (process 0)."""
  if jax.process_index() == 0:
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, CONFIG_FILE), "w", encoding="utf-8") as f:
      f.write(gin.operative_config_str())


class _Loop:
  """Runs steps and decides when to log, check, save and evaluate."""

  def __init__(
    self,
    model: base_model.BaseModel,
    optimizer: optimizers.Optimizer,
    setup: _Setup,
    ckpt: train_checkpointer.TrainCheckpointer,
    train_iter: pipeline.TrainIterator,
    model_dir: str,
    total_steps: int,
    dataset_cfg: pipeline.DatasetConfig,
    num_microbatches: int,
    log_period: int,
  ):
    self.setup, self.ckpt, self.train_iter = setup, ckpt, train_iter
    self.total_steps, self.log_period = total_steps, log_period
    self.model = model
    self.train_step = trainer.make_train_step(
      model, optimizer, setup.partitioner, setup.shardings, num_microbatches
    )
    self.logger = metrics_logging.MetricsLogger(model_dir, total_steps)
    lengths = pipeline.model_feature_lengths(dataset_cfg)
    # A decoder-only model's inputs are inside its decoder_target_tokens.
    inputs, targets = lengths.get("encoder_input_tokens", 0), lengths["decoder_target_tokens"]
    tokens = dataset_cfg.batch_size * (inputs + targets)
    peaks = throughput.device_peak_flops(dtype=model.network_config.dtype)
    logging.info("Peak FLOP/s per device for MFU: %s", peaks.describe())
    self.throughput = throughput.Throughput(
      rows_per_step=dataset_cfg.batch_size,
      tokens_per_step=tokens,
      flops_per_step=model.train_flops_per_step(dataset_cfg.batch_size, inputs, targets),
      num_devices=setup.partitioner.mesh.devices.size,
      peak_flops_per_device=peaks.flops,
      measured_peak_flops_per_device=peaks.measured_flops,
    )
    self.eval: tuple[pipeline.DatasetConfig, int, int, Any] | None = None
    # (period, fn(params, step) -> scalars): seqio evaluation, see `eval_lib`.
    self.infer_eval: tuple[int, Any] | None = None
    self.last_saved = ckpt.latest_step()
    self.vocabulary = checkpoints.vocabulary_fingerprint(model.output_vocabulary)
    self.train_data = train_checks.train_data_meta(dataset_cfg)
    self.tokens_per_step = tokens
    self.started = time.time() - setup.elapsed_s  # the run's start, across resumes
    self.early_stopping: early_stopping.EarlyStopping | None = None
    self.model_dir = model_dir
    self.stopped_early = False

  def progress(self, step: int) -> dict[str, float]:
    """Wall seconds since the run started (resumes included) and token slots trained on."""
    return {
      "elapsed_s": time.time() - self.started,
      "tokens_seen": float(step * self.tokens_per_step),
    }

  def enable_early_stopping(self, stopping: early_stopping.EarlyStopping) -> None:
    """Tracks `stopping.metric` at every evaluation, continuing MODEL_DIR/best.json."""
    stopping.restore(self.model_dir, self.setup.restored_step)
    self.ckpt.protect(stopping.best_step)
    self.early_stopping = stopping
    self.stopped_early = stopping.should_stop  # a restarted run that had stopped early

  def enable_eval(self, cfg: pipeline.DatasetConfig, period: int, steps: int) -> None:
    """Evaluates every `period` steps (and at the end) on `steps` batches of `cfg`."""
    eval_step = trainer.make_eval_step(
      self.model, self.setup.partitioner, self.setup.shardings.params
    )
    self.eval = (cfg, period, steps, eval_step)

  def _save(self, state: trainer.TrainState, step: int) -> None:
    if not bool(_all_finite(state.params)):
      raise NonFiniteLossError(
        f"Non-finite parameters after step {step}; stopping without saving, the last "
        f"checkpoint (step {self.last_saved}) is intact."
      )
    meta = {
      "rng": [int(x) for x in np.asarray(jax.device_get(self.setup.rng)).ravel()],
      "data_batches_consumed": self.train_iter.batches_consumed,
      checkpoints.MODEL_CONFIG_KEY: dataclasses.asdict(self.setup.model_config),
      checkpoints.VOCABULARY_KEY: self.vocabulary,
      train_checks.TRAIN_DATA_KEY: self.train_data,
      ELAPSED_KEY: time.time() - self.started,
    }
    aux_state = state.aux_state if self.model.checkpoint_aux_state else None
    if self.ckpt.save(step, state.params, state.opt_state, meta, self.train_iter, aux_state):
      self.last_saved = step

  def _maybe_eval(self, state: trainer.TrainState, step: int) -> dict[str, float]:
    if self.eval is None:
      return {}
    cfg, period, steps, eval_step = self.eval
    if step % period and step != self.total_steps:
      return {}
    batches = pipeline.eval_batches(cfg, self.setup.partitioner.batch_sharding, steps)
    results = evaluate(eval_step, state.params, batches)
    self.logger.write("eval", step, {**results, **self.progress(step)})
    return results

  def _maybe_infer_eval(self, state: trainer.TrainState, step: int) -> dict[str, float]:
    if self.infer_eval is None:
      return {}
    period, evaluate_fn = self.infer_eval
    if step % period and step != self.total_steps:
      return {}
    results = evaluate_fn(state.params, step)
    self.logger.write("eval", step, {**results, **self.progress(step)})
    return results

  def _track_best(self, state: trainer.TrainState, step: int, results: dict[str, float]) -> None:
    """Keeps the best step's checkpoint; decides whether to stop early."""
    stopping = self.early_stopping
    if stopping is None or not results:
      return
    if stopping.update(step, results):
      if self.last_saved != step:
        self._save(state, step)
      self.ckpt.protect(step)
      logging.info("New best %s = %.4g at step %d.", stopping.metric, stopping.best_value, step)
    stopping.save(self.model_dir)
    if stopping.should_stop:
      self.stopped_early = True
      logging.info(
        "Stopping early at step %d: %s has not improved for %d evaluations (best %.4g at step %d).",
        step,
        stopping.metric,
        stopping.patience,
        stopping.best_value,
        stopping.best_step,
      )

  def run(self, stop: StopRequest) -> trainer.TrainState:
    """Trains from the state's step to `total_steps` or until `stop`."""
    state = self.setup.state
    step = int(jax.device_get(state.step))
    pending: list[tuple[int, Mapping[str, jax.Array]]] = []
    window: list[dict[str, float]] = []
    clock: tuple[int, float] | None = None
    while step < self.total_steps and not stop and not self.stopped_early:
      stop.step = step + 1
      state, metrics = self.train_step(state, next(self.train_iter), self.setup.rng)
      step += 1
      if pending:  # one step queued behind the running one: a stop waits for no more
        jax.block_until_ready(pending[-1][1])
      pending.append((step, metrics))
      if clock is None:  # the first step includes compilation: time from its end
        jax.block_until_ready(metrics)
        clock = (step, time.time())
        self.logger.start_clock(step)
      log = step % self.log_period == 0 or step == self.total_steps
      save = self.ckpt.should_save(step)
      if log or save or stop:
        window += _fetch_and_check(pending, self.last_saved)
        pending = []
      if log:
        scalars = _mean_metrics(window)
        if step > clock[0]:
          scalars.update(self.throughput.rates(step - clock[0], time.time() - clock[1]))
        self.logger.write("train", step, {**scalars, **self.progress(step)})
        window, clock = [], (step, time.time())
      if save:
        self._save(state, step)
      results = {**self._maybe_eval(state, step), **self._maybe_infer_eval(state, step)}
      self._track_best(state, step, results)
      if results or save:  # keep save/eval time out of rates
        clock = (step, time.time())
    if pending:
      _fetch_and_check(pending, self.last_saved)
    if step != self.last_saved and step > 0:
      self._save(state, step)
    self.ckpt.wait()  # the line below promises a complete checkpoint on disk
    saved = (
      f"checkpoint {self.ckpt.directory}/{self.last_saved}"
      if self.last_saved is not None
      else "no checkpoint"
    )
    if stop:
      logging.warning("Stopped by %s at step %d; %s.", stop.signal_name, step, saved)
    else:
      logging.info("Training finished at step %d; %s.", step, saved)
    return state

  def release_input(self) -> None:
    """Drops the training iterator on a daemon thread instead of waiting for its teardown.

    Deleting a tf.data iterator joins its autotuning thread, and TensorFlow
    (2.21, `Model::OptimizeLoop`) can miss the cancellation when that thread
    wakes up at the same moment: it then sleeps out its optimisation period,
    up to 60 s, and a finished or stopped run sat that long after its last
    line before exiting. The teardown waits without the GIL, so neither the
    rest of the process nor its exit waits for it. Call it once the iterator's
    position is saved: `TrainCheckpointer.save` writes it before returning.
    """
    doomed = [self.train_iter]
    del self.train_iter
    threading.Thread(target=doomed.clear, name="release-train-iterator", daemon=True).start()


@gin.configurable(denylist=["stop"])  # pyright: ignore[reportCallIssue]  # gin is untyped
def train(
  *,
  model_dir: str = GIN_REQUIRED,
  total_steps: int = GIN_REQUIRED,
  train_dataset_cfg: pipeline.DatasetConfig = GIN_REQUIRED,
  optimizer: optimizers.Optimizer = GIN_REQUIRED,
  model: base_model.BaseModel | None = None,
  eval_dataset_cfg: pipeline.DatasetConfig | None = None,
  eval_period: int = 0,
  eval_steps: int = 10,
  infer_eval_period: int = 0,
  log_period: int = 10,
  random_seed: int = 0,
  num_microbatches: int = 1,
  partitioner: partitioning.Partitioner | None = None,
  initial_checkpoint_path: str | None = None,
  initial_checkpoint_dtype: str | None = None,
  restore_config: partial_restore.RestoreConfig | None = None,
  trainable_parameters: Sequence[str] | None = None,
  gradual_unfreezing_steps: int | None = None,
  data_checkpoint_mode: str = "iterator",
  early_stopping: early_stopping.EarlyStopping | None = None,
  final_eval_dataset_cfg: pipeline.DatasetConfig | None = None,
  final_eval_decode: Any = None,
  stop: StopRequest | None = None,
) -> trainer.TrainState:
  """Trains until `total_steps`, resuming from MODEL_DIR when it has a checkpoint.

  Args:
    model_dir: MODEL_DIR: checkpoints, metrics, config.gin.
    total_steps: the step to train to (a resumed run continues up to it).
    train_dataset_cfg: training data (global batch size included).
    optimizer: an `optimizers.Optimizer`.
    model: the model; default `models.build_model()`.
    eval_dataset_cfg: validation data for periodic eval loss; None disables.
    eval_period: evaluate every this many steps and at the end (0: never).
    eval_steps: batches per evaluation.
    infer_eval_period: seqio evaluation (decoded predictions and the tasks'
      metrics, `eval_lib.training_evaluator`) of `eval_dataset_cfg` every
      this many steps and at the end (0: never).
    log_period: write metrics every this many steps.
    random_seed: parameter init and dropout seed of a fresh run (a resumed run
      uses the RNG saved in its checkpoint).
    num_microbatches: gradient accumulation slices per step.
    partitioner: mesh and logical-axis rules; default `partitioning.Partitioner()`
      (gin: `Partitioner.num_partitions`, `Partitioner.fsdp`).
    initial_checkpoint_path: fine-tune start: checkpoint root or step dir whose
      `params` are loaded when MODEL_DIR has no checkpoint yet.
    initial_checkpoint_dtype: cast the loaded params to this dtype (default:
      the model's param dtype).
    restore_config: how the initial checkpoint is restored
      (`partial_restore.RestoreConfig`: assignment map, fallback to fresh init,
      optimizer state and step); default `RestoreConfig()` with its gin bindings.
    trainable_parameters: regular expressions over parameter paths
      ('encoder/layers_0/mlp/wi_0/kernel'; `re.fullmatch`) that train; the others are
      frozen (no optimizer state, bitwise unchanged). None trains everything.
    gradual_unfreezing_steps: unfreeze one more encoder and decoder block, from the
      top, every this many steps (`optimizers.Optimizer.with_gradual_unfreezing`);
      None: off.
    data_checkpoint_mode: 'iterator' or 'skip' (see `t5x_lite.data.pipeline`).
    early_stopping: stop when a metric of the periodic evaluations stops
      improving, keeping the best step's checkpoint (`t5x_lite.training.early_stopping`);
      None trains to `total_steps`.
    final_eval_dataset_cfg: once training ends (not when stopped by a signal),
      seqio evaluation of this data (e.g. the test split) with the best step's
      params (the last step's without `early_stopping`), logged as split 'final'
      in metrics.jsonl and written to MODEL_DIR/final_metrics.json; None: none.
    final_eval_decode: decoding of the final evaluation (a
      `model_runner.DecodeConfig`, e.g. beam search); default: `DecodeConfig()`.
    stop: stop flag (tests); default: SIGTERM/SIGINT handlers.

  Returns:
    The final TrainState.
  """
  train_checks.check_counts(
    total_steps=(total_steps, "TRAIN_STEPS", 0),
    eval_period=(eval_period, "EVAL_PERIOD", 0),
    eval_steps=(eval_steps, "EVAL_STEPS", 1),
    infer_eval_period=(infer_eval_period, "train.infer_eval_period", 0),
    log_period=(log_period, "train.log_period", 1),
    random_seed=(random_seed, "RANDOM_SEED", None),
    num_microbatches=(num_microbatches, "train.num_microbatches", 1),
  )
  if early_stopping is not None and infer_eval_period <= 0 and eval_period <= 0:
    raise ConfigError(
      "train.early_stopping needs periodic evaluations: set train.infer_eval_period (task "
      "metrics) or train.eval_period (loss)."
    )
  model = model or models.build_model()
  train_dataset_cfg = pipeline.for_model(
    train_dataset_cfg, model.network_config, task_ids=model.train_task_ids
  )
  if eval_dataset_cfg is not None:
    eval_dataset_cfg = pipeline.for_model(eval_dataset_cfg, model.network_config)
  partitioner = partitioner or partitioning.Partitioner()
  train_checks.check_batch_size(train_dataset_cfg, partitioner)
  primary = jax.process_index() == 0  # process 0 writes the logs
  train_checks.check_outputs(model_dir, metrics_logging.SPLITS if primary else ())
  optimizer = optimizer.with_trainable(trainable_parameters).with_gradual_unfreezing(
    gradual_unfreezing_steps
  )
  trainable, total = optimizers.trainable_counts(
    partitioner.abstract_params(model.init_params)[0], trainable_parameters
  )
  logging.info("trainable parameters: %d of %d", trainable, total)
  stop = StopRequest() if stop is None else stop
  with contextlib.ExitStack() as stack:
    stack.enter_context(stop.installed())
    lock = model_dir_lock.ModelDirLock(model_dir)
    model_dir_lock.acquire_for_job(lock)  # before orbax looks at MODEL_DIR
    stack.callback(lock.release)
    ckpt = train_checkpointer.TrainCheckpointer(model_dir)
    stack.callback(ckpt.close)
    train_checks.check_start(initial_checkpoint_path, resuming=bool(ckpt.all_steps()))
    if primary:  # every host reads the same first examples: report once
      pipeline.log_truncation(train_dataset_cfg)  # warns when examples exceed the feature lengths
    train_iter = pipeline.train_iterator(
      train_dataset_cfg, partitioner.batch_sharding, data_checkpoint_mode
    )
    setup = _setup_state(
      model,
      optimizer,
      ckpt,
      train_iter,
      partitioner,
      random_seed=random_seed,
      initial_checkpoint_path=initial_checkpoint_path,
      initial_checkpoint_dtype=initial_checkpoint_dtype,
      restore_config=restore_config,
      check_meta=functools.partial(
        train_checks.check_resume, model_dir, cfg=train_dataset_cfg, total_steps=total_steps
      ),
    )
    if primary:  # steps a killed run logged after its last checkpoint are logged again
      start = int(jax.device_get(setup.state.step))
      metrics_rewind.rewind_logs(model_dir, start, metrics_logging.SPLITS)
    loop = _Loop(
      model,
      optimizer,
      setup,
      ckpt,
      train_iter,
      model_dir,
      total_steps,
      train_dataset_cfg,
      num_microbatches,
      log_period,
    )
    if eval_dataset_cfg is not None and eval_period > 0:
      loop.enable_eval(eval_dataset_cfg, eval_period, eval_steps)
    if infer_eval_period > 0:
      loop.infer_eval = (
        infer_eval_period,
        eval_lib.training_evaluator(
          model, partitioner, setup.shardings.params, eval_dataset_cfg, model_dir
        ),
      )
    write_operative_config(model_dir)
    if early_stopping is not None:
      loop.enable_early_stopping(early_stopping)
    del train_iter  # `loop` holds the only reference, which `release_input` hands off
    stack.callback(loop.release_input)
    stack.callback(loop.logger.close)
    state = loop.run(stop)
    if final_eval_dataset_cfg is not None and not stop:
      _final_evaluation(loop, state, final_eval_dataset_cfg, final_eval_decode)
    return state


def _final_evaluation(
  loop: _Loop, state: trainer.TrainState, dataset_cfg: pipeline.DatasetConfig, decode: Any
) -> dict[str, float]:
  """Evaluates the best step (else the last) on `dataset_cfg`; logs split 'final'."""
  step = int(jax.device_get(state.step))
  best = loop.early_stopping.best_step if loop.early_stopping is not None else None
  params = state.params
  if best is not None and best != step:
    target = jax.tree.map(
      lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
      state.params,
      loop.setup.shardings.params,
    )
    params = checkpoints.restore_params(loop.ckpt.directory, target, step=best)
    step = best
  evaluate_fn = eval_lib.training_evaluator(
    loop.model,
    loop.setup.partitioner,
    loop.setup.shardings.params,
    None,
    loop.model_dir,
    dataset_cfg=pipeline.for_model(dataset_cfg, loop.setup.model_config),
    decode=decode,
    log_subdir="final_eval",
  )
  results = evaluate_fn(params, step)
  loop.logger.write("final", step, results)
  if jax.process_index() == 0:
    record = {"step": step, "split": dataset_cfg.split, **results}
    with open(os.path.join(loop.model_dir, FINAL_METRICS_FILE), "w", encoding="utf-8") as f:
      json.dump(record, f, indent=1)
  return results
