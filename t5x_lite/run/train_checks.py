"""What `train()` checks before it does any work, each failure one line.

* `check_outputs`: MODEL_DIR and its TensorBoard directories can be written (a
  read-only directory, or a file in the way, fails here, not after the restore).
* `check_batch_size`: the global batch divides over the mesh's data axis.
* `check_start`: a new run's fine-tuning start (`train.initial_checkpoint_path`)
  exists, so a task recipe run before its pre-training stops before any work.
* `check_resume`: a resumed MODEL_DIR is continued with the data it was trained on
  (task or mixture, batch size, feature lengths, packing: `train_data_meta`, stored
  in every checkpoint's `train_meta`) and to a step at or after the one it reached.
  A changed value is named with its gin binding, what the checkpoint has and what
  was asked, and the two ways on: a new MODEL_DIR, or a fine-tuning start from this
  checkpoint. Checkpoints written before `train_data_meta` existed resume unchecked.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from t5x_lite.checkpoint import checkpoints
from t5x_lite.core.errors import CheckpointNotFoundError, ConfigError, WriteError
from t5x_lite.core.paths import not_writable, shown
from t5x_lite.data import pipeline
from t5x_lite.training import partitioning

# Key of `train_data_meta` inside a checkpoint's `train_meta` item.
TRAIN_DATA_KEY = "train_data"
# DatasetConfig field -> the gin binding a user sets it with (gin/runs/pretrain.gin).
_BINDINGS = {
  "mixture_or_task_name": "MIXTURE_OR_TASK_NAME",
  "batch_size": "BATCH_SIZE",
  "task_feature_lengths": "TASK_FEATURE_LENGTHS",
  "pack": "train/DatasetConfig.pack",
}


def check_outputs(model_dir: str, tensorboard_dirs: Sequence[str]) -> None:
  """Raises `WriteError` unless MODEL_DIR and its TensorBoard directories are writable.

  Args:
    model_dir: MODEL_DIR as given.
    tensorboard_dirs: names of the TensorBoard directories inside it.
  """
  problem = not_writable("MODEL_DIR", model_dir)
  for name in tensorboard_dirs:  # those not there yet are made in MODEL_DIR when written
    path = os.path.join(model_dir, name)
    if not problem and os.path.lexists(path):
      problem = not_writable("TensorBoard directory", path)
  if problem:
    raise WriteError(problem)


def check_counts(**counts: tuple[object, str, int | None]) -> None:
  """Raises `ConfigError` naming the binding for a count that is not a whole number (at or
  above its least value, where it has one).

  Args:
    **counts: {train argument: (value, gin binding a user sets it with, least value or
      None)}, e.g. `total_steps=(total_steps, 'TRAIN_STEPS', 0)`.
  """
  for name, (value, binding, least) in counts.items():
    if isinstance(value, int) and not isinstance(value, bool):
      if least is None or value >= least:
        continue
    kind = "an integer" if least is None else f"an integer of at least {least}"
    raise ConfigError(f"{binding} (train.{name}) must be {kind}, got {value!r}")


def check_batch_size(cfg: pipeline.DatasetConfig, partitioner: partitioning.Partitioner) -> None:
  """Raises `ConfigError` unless BATCH_SIZE divides over the mesh's data axis."""
  if cfg.batch_size % partitioner.data_size:
    raise ConfigError(
      f"BATCH_SIZE {cfg.batch_size} (train/DatasetConfig.batch_size) does not divide over "
      f"the mesh's data axis of {partitioner.data_size} devices; use a multiple of "
      f"{partitioner.data_size}."
    )


def check_start(initial_checkpoint_path: str | None, *, resuming: bool) -> None:
  """Raises `CheckpointNotFoundError` naming the binding when a new run's start is missing.

  Args:
    initial_checkpoint_path: `train.initial_checkpoint_path` (None: random weights).
    resuming: MODEL_DIR has steps, so the start is not read.
  """
  if not initial_checkpoint_path or resuming:
    return
  try:
    checkpoints.check_exists(initial_checkpoint_path)
  except CheckpointNotFoundError as e:
    raise CheckpointNotFoundError(
      f"train.initial_checkpoint_path: {e}. Train that checkpoint first, or start from "
      "random weights with --gin.train.initial_checkpoint_path=None"
    ) from e


def train_data_meta(cfg: pipeline.DatasetConfig) -> dict[str, Any]:
  """What a resumed run must read the same way; stored in `train_meta`."""
  return {
    "mixture_or_task_name": cfg.mixture_or_task_name,
    "batch_size": cfg.batch_size,
    "task_feature_lengths": dict(cfg.task_feature_lengths),
    "pack": cfg.pack,
    "task_ids": list(cfg.task_ids),
  }


def check_resume(
  model_dir: str,
  step: int,
  meta: Mapping[str, Any],
  cfg: pipeline.DatasetConfig,
  total_steps: int,
) -> None:
  """Raises `ConfigError` when resuming `step` of MODEL_DIR with this config cannot work.

  Args:
    model_dir: MODEL_DIR as given.
    step: the step being restored.
    meta: its `train_meta`.
    cfg: this run's training data.
    total_steps: TRAIN_STEPS.
  """
  where = f"MODEL_DIR {shown(model_dir)} (step {step})"
  saved = meta.get(TRAIN_DATA_KEY)
  if saved is not None:
    asked = train_data_meta(cfg)
    for field, binding in _BINDINGS.items():
      if field in saved and saved[field] != asked[field]:
        raise ConfigError(
          f"{binding} is {asked[field]!r}, but {where} was trained with {saved[field]!r}; "
          "a resumed run must read the data it was trained on. Keep "
          f"{binding}={saved[field]!r} to resume, or start a new MODEL_DIR: from scratch, "
          f"or from this checkpoint with --gin_file=runs/finetune.gin "
          f"--gin.INITIAL_CHECKPOINT_PATH={model_dir} (the fine-tuning route)."
        )
    # Older runs saved no task ids; their batches carried none.
    if saved.get("task_ids", []) != asked["task_ids"]:
      raise ConfigError(
        f"The batches' task ids (the model's train_task_ids: the tasks that "
        f"build_multi_teacher_distillation_model.teacher_tasks names) are "
        f"{asked['task_ids']}, but {where} was trained with {saved.get('task_ids', [])}; a "
        "resumed run must read the data it was trained on. Name the same tasks to resume, "
        "or start a new MODEL_DIR."
      )
  if total_steps < step:
    raise ConfigError(
      f"TRAIN_STEPS {total_steps} is below step {step}, which {where} has already reached "
      f"(TRAIN_STEPS is the step training ends at): set TRAIN_STEPS above {step} to train "
      "on, or give a new MODEL_DIR to train another model."
    )
