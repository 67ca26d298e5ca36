"""seqio evaluation of checkpoints (`python -m t5x_lite.eval`) and inside training.

The metrics come from `task_evaluator.TaskEvaluator` (seqio's prediction and scoring
metrics; `nll_per_token` for tasks without metric fns).

`evaluate_checkpoints` evaluates one checkpoint step or every step of a MODEL_DIR
and writes, under EVAL_OUTPUT_DIR:

  metrics_step_<N>.json              {"step", "checkpoint", "run", "metrics": {task: {..}}}
                                     written last: its presence marks step N done
  inferences/<task>-step_<N>.jsonl   per example: inputs, targets, output (decoded
                                     text), prediction / target (postprocessed), score
  <task>/events.out.tfevents.*       TensorBoard scalars `eval/<metric>` (seqio's logger)

Steps whose JSON file exists are skipped, so re-running over a growing MODEL_DIR
only evaluates new checkpoints. The file records the run (task, split, lengths,
number of examples, decoding); a different run in the same EVAL_OUTPUT_DIR is
refused instead of silently skipped. Corrupt steps of a MODEL_DIR (files that do
not match their files.json) are skipped with a warning naming the bad file; a
corrupt step directory given as CHECKPOINT_PATH is an error. Relative paths are
relative to the working directory. With `watch` (gin WATCH) it keeps polling a
MODEL_DIR, which need not exist yet, and evaluates each step once orbax has
committed it, until FINAL_STEP is evaluated or no step came for WATCH_TIMEOUT_S.

`training_evaluator` builds the same evaluation for the train loop (gin knob
`train.infer_eval_period`): metrics come back as `{"<task>/<metric>": value}`
for the loop's TensorBoard / metrics.jsonl streams; inferences go to
MODEL_DIR/inference_eval/.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

import gin
import jax
import numpy as np
import orbax.checkpoint as ocp
import seqio
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from t5x_lite import base_model, models
from t5x_lite.data import pipeline
from t5x_lite.checkpoint import checkpoints, stored_vocabulary
from t5x_lite.training import partitioning
from t5x_lite.run import model_runner
from t5x_lite.run.task_evaluator import (
  INFERENCES_DIR,
  Metrics,
  PredictionsJsonlLogger,
  TaskEvaluator,
)
from t5x_lite.core.errors import (
  CheckpointError,
  CheckpointNotFoundError,
  ConfigError,
  CorruptCheckpointError,
  WriteError,
)
from t5x_lite.core.paths import absolute_path, not_a_directory, not_writable
from t5x_lite.core.types import GIN_REQUIRED, PyTree

STEP_FILE = "metrics_step_{step}.json"


def _run_description(
  cfg: pipeline.DatasetConfig, num_examples: int | None, decode: model_runner.DecodeConfig
) -> dict[str, Any]:
  """What a step's metrics depend on besides the checkpoint (JSON-normalised)."""
  lengths = cfg.task_feature_lengths
  run = {
    "mixture_or_task_name": cfg.mixture_or_task_name,
    "split": cfg.split,
    "task_feature_lengths": None if lengths is None else dict(lengths),
    "num_examples": num_examples,
    "decode": dataclasses.asdict(decode),
  }
  return json.loads(json.dumps(run))


def _evaluated_steps(output_dir: str, run: Mapping[str, Any]) -> list[int]:
  """Steps with a metrics file in `output_dir`; raises if one was written by another run."""
  if not os.path.isdir(output_dir):
    return []
  pattern = re.compile(STEP_FILE.format(step=r"(\d+)").replace(".", r"\.") + "$")
  steps = []
  for name in sorted(os.listdir(output_dir)):
    if not (match := pattern.match(name)):
      continue
    path = os.path.join(output_dir, name)
    with open(path, encoding="utf-8") as f:
      previous = json.load(f).get("run")
    if previous != run:
      changed = sorted(
        k for k in set(run) | set(previous or {}) if (previous or {}).get(k) != run.get(k)
      )
      raise ConfigError(
        f"{path} was written by a different evaluation (differs in "
        f"{changed}); use another EVAL_OUTPUT_DIR."
      )
    steps.append(int(match.group(1)))
    logging.info("Step %s already evaluated (%s); skipping.", match.group(1), path)
  return sorted(steps)


def _write_step(
  output_dir: str,
  step: int,
  step_dir: Any,
  run: Mapping[str, Any],
  metrics: Metrics,
  seconds: float,
) -> str:
  """Writes metrics_step_<step>.json atomically; returns its path."""
  path = os.path.join(output_dir, STEP_FILE.format(step=step))
  record = {
    "step": step,
    "checkpoint": os.fspath(step_dir),
    "run": run,
    "metrics": metrics,
    "seconds": seconds,
  }
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    json.dump(record, f, indent=1, sort_keys=True)
  os.replace(path + ".tmp", path)
  return path


def _build_evaluator(
  step_dir: epath.Path,
  output_dir: str,
  dataset_cfg: pipeline.DatasetConfig,
  decode: model_runner.DecodeConfig,
  num_examples: int | None,
) -> tuple[PyTree, TaskEvaluator]:
  """(abstract params, evaluator) of the model `step_dir` stores, logging to `output_dir`."""
  os.makedirs(output_dir, exist_ok=True)
  stored_vocabulary.adopt(step_dir)  # the vocabulary it was trained with, unless gin binds one
  model = models.build_model(checkpoints.model_config(step_dir))
  checkpoints.check_vocabulary(step_dir, model.output_vocabulary)
  partitioner = partitioning.Partitioner()
  abstract, shardings = partitioner.abstract_params(model.init_params)
  runner = model_runner.ModelRunner(model, partitioner, shardings, decode, dataset_cfg.batch_size)
  dataset_cfg = pipeline.for_model(dataset_cfg, model.network_config)
  loggers = (seqio.TensorBoardLogger, PredictionsJsonlLogger) if jax.process_index() == 0 else ()
  evaluator = TaskEvaluator(
    runner, dataset_cfg, num_examples=num_examples, log_dir=output_dir, logger_cls=loggers
  )
  return abstract, evaluator


def _step_evaluator(
  output_dir: str,
  run: Mapping[str, Any],
  dataset_cfg: pipeline.DatasetConfig,
  decode: model_runner.DecodeConfig,
  num_examples: int | None,
  config_dir: epath.Path | None = None,
) -> Callable[[int, epath.Path], Metrics | None]:
  """fn(step, step_dir): restores, evaluates and records one verified step.

  The model is built once, at the first call, from the config `config_dir` stores
  (None: that call's step). fn returns None, with a warning, for a step deleted
  before it was restored (rotated out by a running training's keep).
  """
  abstract, evaluator = None, None

  def evaluate(step: int, step_dir: epath.Path) -> Metrics | None:
    nonlocal abstract, evaluator
    if evaluator is None:
      abstract, evaluator = _build_evaluator(
        config_dir or step_dir, output_dir, dataset_cfg, decode, num_examples
      )
    start = time.perf_counter()
    try:  # find_steps verified the step
      params = checkpoints.restore_params(step_dir, abstract, verify_checksums=False)
    except CheckpointError:
      if step_dir.exists():
        raise
      logging.warning("Step %d (%s) was deleted before it was restored; skipped.", step, step_dir)
      return None
    metrics = evaluator.evaluate(params, step)
    if jax.process_index() == 0:
      seconds = time.perf_counter() - start
      logging.info("Wrote %s", _write_step(output_dir, step, step_dir, run, metrics, seconds))
    return metrics

  return evaluate


def _next_ready_step(checkpoint_path: str, exclude: Collection[int]) -> int:
  """The oldest intact, fully written step not in `exclude`; -1 while there is none.

  A missing or empty CHECKPOINT_PATH (training not started yet) has none. Steps
  orbax has not finalized (a write in progress where renames are not atomic) wait
  for a later poll; files.json, written after the commit, is not waited for.
  Corrupt steps are skipped (`find_steps` warns at each poll).
  """
  try:
    steps = checkpoints.find_steps(checkpoint_path, step="all", exclude=exclude)
  except (CheckpointNotFoundError, CorruptCheckpointError) as e:
    level = logging.WARNING if isinstance(e, CorruptCheckpointError) else logging.INFO
    logging.log_every_n_seconds(level, "No checkpoint step to evaluate yet: %s", 600, e)
    return -1
  return next((step for step, step_dir in steps if ocp.step.is_path_finalized(step_dir)), -1)


def _watch(
  checkpoint_path: str,
  done: Collection[int],
  evaluate: Callable[[int, epath.Path], Metrics | None],
  final_step: int | None,
  timeout_s: float,
  poll_s: float,
) -> dict[int, Metrics]:
  """Evaluates steps as they appear until `final_step` is evaluated or `timeout_s` passes.

  Process 0 picks the next step and broadcasts it (-1: none yet, -2: timed out), so
  every host evaluates the same steps in the same order.
  """
  if checkpoints.is_step_dir(checkpoint_path):
    raise ConfigError(f"WATCH=True needs a MODEL_DIR, got the step directory {checkpoint_path}.")
  root, done, evaluated, since = absolute_path(checkpoint_path), set(done), {}, time.monotonic()
  logging.info("Watching %s for new checkpoint steps (final step %s).", root, final_step)
  while final_step is None or max(done, default=-1) < final_step:
    step = _next_ready_step(checkpoint_path, done) if jax.process_index() == 0 else -1
    step = -2 if step == -1 and time.monotonic() - since > timeout_s else step
    step = int(multihost_utils.broadcast_one_to_all(np.int64(step)))
    if step == -2:
      logging.info("No new checkpoint step in %s for %g s; stopping.", root, timeout_s)
      return evaluated
    if step == -1:
      time.sleep(poll_s)
      continue
    if (metrics := evaluate(step, root / str(step))) is not None:
      evaluated[step] = metrics
    done.add(step)
    since = time.monotonic()
  logging.info("Evaluated step %d, at or after the final step %d; stopping.", max(done), final_step)
  return evaluated


def _check_output_dir(output_dir: str, mixture_or_task_name: str) -> None:
  """Raises WriteError unless EVAL_OUTPUT_DIR and the directories it has that we write
  into (predictions, each task's TensorBoard directory) can be written."""
  if problem := not_a_directory("EVAL_OUTPUT_DIR", output_dir):
    raise ConfigError(problem)
  tasks = seqio.get_subtasks(pipeline.get_mixture_or_task(mixture_or_task_name))
  problem = not_writable("EVAL_OUTPUT_DIR", output_dir)
  for name in [INFERENCES_DIR, *(task.name for task in tasks)]:
    path = os.path.join(output_dir, name)
    if not problem and os.path.lexists(path):
      problem = not_writable(f"EVAL_OUTPUT_DIR's {name} directory", path)
  if problem:
    raise WriteError(problem)


@gin.configurable
def evaluate_checkpoints(
  *,
  checkpoint_path: str = GIN_REQUIRED,
  output_dir: str = GIN_REQUIRED,
  dataset_cfg: pipeline.DatasetConfig = GIN_REQUIRED,
  decode: model_runner.DecodeConfig,
  num_examples: int | None,
  watch: bool,
  final_step: int | None,
  timeout_s: float,
  poll_s: float,
) -> dict[int, Metrics]:
  """Evaluates every not yet evaluated checkpoint step (see the module docstring).

  The model is `models.build_model` of the newest step's stored config (with
  `watch`, the first evaluated step's), overridden by `T5Config.*` gin bindings
  (`checkpoints.model_config`); the mesh is the gin-configured Partitioner.

  Args:
    checkpoint_path: one step directory, or a checkpoint root (MODEL_DIR): all its
      intact steps.
    output_dir: EVAL_OUTPUT_DIR.
    dataset_cfg: task/mixture, split, task_feature_lengths, batch_size, seed.
    decode: decoding options for prediction metrics.
    num_examples: at most this many examples per task (None: the whole split).
    watch: keep polling the MODEL_DIR (which need not exist yet) and evaluate each
      new step once it is written, oldest first.
    final_step: with `watch`, stop once a step at or after it is evaluated (None:
      only the timeout stops).
    timeout_s: with `watch`, stop when no step was ready to evaluate for this long.
    poll_s: with `watch`, seconds between looks at the MODEL_DIR.

  Every argument is bound in gin/runs/eval.gin.

  Returns:
    {step: {task: {metric: value}}} of the steps evaluated by this call.

  Raises:
    CheckpointNotFoundError: naming a checkpoint path that does not exist or holds
      none (not with `watch`).
    CorruptCheckpointError: the step directory given, or every step to evaluate of a
      MODEL_DIR, is corrupt (not with `watch`: corrupt steps are skipped).
    ConfigError: EVAL_OUTPUT_DIR is a file or holds results of a different
      evaluation, or `watch` is given a step directory.
    WriteError: EVAL_OUTPUT_DIR, or a directory in it that evaluation writes, cannot
      be written (checked before any work).
  """
  _check_output_dir(output_dir, dataset_cfg.mixture_or_task_name)
  output_dir = os.fspath(absolute_path(output_dir))
  run = _run_description(dataset_cfg, num_examples, decode)
  done = _evaluated_steps(output_dir, run)
  options = (output_dir, run, dataset_cfg, decode, num_examples)
  if watch:
    return _watch(checkpoint_path, done, _step_evaluator(*options), final_step, timeout_s, poll_s)
  pending = checkpoints.find_steps(checkpoint_path, step="all", exclude=done)
  if not pending:
    logging.info(
      "Every checkpoint step of %s is already evaluated in %s (steps %s).",
      checkpoint_path,
      output_dir,
      done,
    )
    return {}
  evaluate = _step_evaluator(*options, config_dir=pending[-1][1])
  evaluated = {step: evaluate(step, step_dir) for step, step_dir in pending}
  return {step: metrics for step, metrics in evaluated.items() if metrics is not None}


# ------------------------------------------------------------------ during training


@gin.configurable(  # pyright: ignore[reportCallIssue]  # gin is untyped
  denylist=[
    "model",
    "partitioner",
    "param_shardings",
    "eval_dataset_cfg",
    "model_dir",
    "log_subdir",
  ]
)
def training_evaluator(
  model: base_model.BaseModel,
  partitioner: partitioning.Partitioner,
  param_shardings: PyTree,
  eval_dataset_cfg: pipeline.DatasetConfig | None,
  model_dir: str,
  *,
  dataset_cfg: pipeline.DatasetConfig | None = None,
  decode: model_runner.DecodeConfig | None = None,
  num_examples: int | None = None,
  log_subdir: str = "inference_eval",
) -> Callable[[PyTree, int], dict[str, float]]:
  """seqio evaluation for the train loop, data read and cached once.

  Args:
    model: the model being trained.
    partitioner: the training mesh and rules.
    param_shardings: shardings of the training state's params.
    eval_dataset_cfg: the loop's eval data (the mixture's validation split); used
      unshuffled and unpacked unless `dataset_cfg` is given.
    model_dir: MODEL_DIR; inferences go to MODEL_DIR/<log_subdir>/.
    dataset_cfg: gin override of the evaluated data.
    decode: decoding options (default `DecodeConfig()`, gin-configured).
    num_examples: at most this many examples per task (gin; None: whole split).
    log_subdir: folder of MODEL_DIR for the inferences (the final evaluation's
      differs from the periodic one's, so a step evaluated by both keeps both).

  Returns:
    fn(params, step) -> {"<task>/<metric>": value}.

  Raises:
    ConfigError: without any data to evaluate.
  """
  cfg = dataset_cfg
  if cfg is None:
    if eval_dataset_cfg is None:
      raise ConfigError(
        "train.infer_eval_period needs train.eval_dataset_cfg or training_evaluator.dataset_cfg."
      )
    cfg = dataclasses.replace(eval_dataset_cfg, shuffle=False, pack=False)
  cfg = pipeline.for_model(cfg, model.network_config)
  runner = model_runner.ModelRunner(
    model, partitioner, param_shardings, decode or model_runner.DecodeConfig(), cfg.batch_size
  )
  evaluator = TaskEvaluator(
    runner,
    cfg,
    num_examples=num_examples,
    log_dir=os.path.join(model_dir, log_subdir),
    logger_cls=(PredictionsJsonlLogger,),
  )

  def run(params: PyTree, step: int) -> dict[str, float]:
    results = evaluator.evaluate(params, step)
    return {f"{task}/{k}": v for task, metrics in results.items() for k, v in metrics.items()}

  return run
