"""Thin orbax layer: training checkpoints, fine-tuning restores, integrity checks.

Layout (a checkpoint ROOT is an orbax `CheckpointManager` directory; relative
paths are taken relative to the working directory):

  <root>/<step>/params/         StandardSave of the plain (unboxed) params dict
  <root>/<step>/opt_state/      StandardSave of the optax state (training only)
  <root>/<step>/train_meta/     JsonSave: step, rng, data position, model config
  <root>/<step>/data_iterator/  one file set per host: the input pipeline position
  <root>/<step>/config/         JsonSave of the T5Config fields (HF converter only)
  <root>/<step>/files.json      size and CRC32 of every file of the step

`files.json` is written once a step is fully committed. Before a restore every
listed file is checked, so a truncated or corrupt file fails with an error that
names it instead of an opaque tensorstore message, and nothing is restored from
a damaged step. Older steps are never touched by a failed restore. Given a
root, restores fall back to the newest intact step (warning about the corrupt
newer ones); given one step directory, a corrupt step is an error.

Restores go straight into the target shardings: callers pass an abstract tree
of `jax.ShapeDtypeStruct`s carrying `sharding`, and the on-disk tree is first
compared against it so a different model fails with the list of paths whose
shapes differ instead of a silent re-initialisation.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, Protocol

import gin
import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from t5x_lite.checkpoint_manifest import (
  CheckpointError,
  CheckpointNotFoundError,
  CorruptCheckpointError,
  absolute_path,
  newest_intact,
  not_a_directory,
  shown,
  verify_files,
  write_file_manifest,
)
from t5x_lite.errors import ConfigError

PARAMS = "params"
OPT_STATE = "opt_state"
TRAIN_META = "train_meta"
DATA_ITERATOR = "data_iterator"
CONFIG = "config"
# Key of the T5Config fields inside the `train_meta` item.
MODEL_CONFIG_KEY = "model_config"


class CheckpointMismatchError(CheckpointError):
  """The checkpoint's tree does not match the model being restored into."""


class CheckpointableIterator(Protocol):
  """An input iterator whose position can be saved and restored per host."""

  def save_state(self, path: str) -> None:
    """Writes the iterator position to files starting with `path`."""

  def restore_state(self, path: str) -> None:
    """Moves the iterator to the position saved under `path`."""


# ----------------------------------------------------------------------------
# Tree comparison.


def _key_str(key: Any) -> str:
  """Renders one pytree key (dict key, attribute, or index) as a path part."""
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def flat_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
  """Maps 'a/b/c' paths to leaf shapes for arrays, abstract arrays or metadata.

  Args:
    tree: a pytree whose leaves have a `.shape` (jax/numpy arrays,
      `jax.ShapeDtypeStruct`, orbax `ArrayMetadata`).

  Returns:
    Dict from slash-joined path to shape tuple; `None` leaves are skipped.
  """
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {
    "/".join(_key_str(k) for k in path): tuple(leaf.shape)
    for path, leaf in leaves
    if leaf is not None
  }


def check_tree_matches(
  saved: Mapping[str, tuple[int, ...]],
  target: Mapping[str, tuple[int, ...]],
  *,
  what: str,
  location: str,
) -> None:
  """Raises `CheckpointMismatchError` unless both trees have equal paths/shapes.

  Args:
    saved: path -> shape of the tree on disk.
    target: path -> shape of the tree the caller restores into.
    what: item name for the message, e.g. 'params'.
    location: checkpoint directory for the message.

  Raises:
    CheckpointMismatchError: listing missing, unexpected and reshaped paths.
  """
  missing = sorted(set(target) - set(saved))
  unexpected = sorted(set(saved) - set(target))
  reshaped = sorted(p for p in set(saved) & set(target) if tuple(saved[p]) != tuple(target[p]))
  if not (missing or unexpected or reshaped):
    return
  lines = [f"The {what} in checkpoint {location} do not match the model:"]
  lines += [f"  missing in checkpoint: {p} {target[p]}" for p in missing]
  lines += [f"  unexpected in checkpoint: {p} {saved[p]}" for p in unexpected]
  lines += [f"  shape mismatch: {p} checkpoint {saved[p]} vs model {target[p]}" for p in reshaped]
  raise CheckpointMismatchError("\n".join(lines))


# ----------------------------------------------------------------------------
# Params-only checkpoints (fine-tuning, HF conversion).


def is_step_dir(path: epath.PathLike) -> bool:
  """Whether `path` is one step directory (it holds `params/`), not a checkpoint root."""
  return (absolute_path(path) / PARAMS).is_dir()


def root_steps(root: epath.PathLike) -> list[int]:
  """The numbered step directories holding `params/` of a checkpoint root, ascending.

  Raises:
    CheckpointNotFoundError: naming `root` (as given and absolute) when it does
      not exist or holds no step.
  """
  path = absolute_path(root)
  steps = (
    sorted(int(p.name) for p in path.iterdir() if p.name.isdigit() and (p / PARAMS).is_dir())
    if path.is_dir()
    else []
  )
  if not steps:
    why = (
      "expected a step directory with params/ or a MODEL_DIR with numbered step directories"
      if path.exists()
      else "it does not exist"
    )
    raise CheckpointNotFoundError(f"No checkpoint at {shown(root)}: {why}")
  return steps


def resolve_step_dir(
  path: epath.PathLike, step: int | None = None, *, verify_checksums: bool = True
) -> epath.Path:
  """Returns the verified, absolute step directory of a checkpoint root or step directory.

  Args:
    path: a checkpoint root (`<root>` with `<step>/` subdirectories) or one
      step directory (containing `params/`).
    step: step to pick from a root; None means the newest intact one: newer
      corrupt steps are skipped with a warning naming the bad file.
    verify_checksums: also compare CRC32s (sizes are always compared).

  Raises:
    CheckpointNotFoundError: if no checkpoint or no such step is found.
    CorruptCheckpointError: if the step directory given, the step asked for,
      or every step of the root is corrupt.
  """
  directory = absolute_path(path)
  if is_step_dir(directory):
    verify_files(directory, checksums=verify_checksums)
    return directory
  steps = root_steps(path)
  if step is None:
    step, _ = newest_intact(
      directory,
      steps,
      lambda s: verify_files(directory / str(s), checksums=verify_checksums),
    )
  elif step not in steps:
    raise CheckpointNotFoundError(f"Step {step} not in {shown(path)} (have {steps})")
  else:
    verify_files(directory / str(step), checksums=verify_checksums)
  return directory / str(step)


def _cast_abstract(target: Any, dtype: str | None) -> Any:
  """Overrides the dtype of every abstract leaf when `dtype` is given."""
  if dtype is None:
    return target
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, np.dtype(dtype), sharding=x.sharding),
    target,
  )


def _saved_shapes(item_dir: epath.Path) -> dict[str, tuple[int, ...]]:
  """Path -> shape of a StandardSave item, read from its metadata only."""
  if not item_dir.is_dir():
    raise CorruptCheckpointError(f"Checkpoint item missing: {item_dir}")
  try:
    with ocp.StandardCheckpointer() as checkpointer:
      return flat_shapes(checkpointer.metadata(item_dir).item_metadata.tree)
  except Exception as e:  # orbax raises several types for unreadable metadata
    raise CorruptCheckpointError(f"Cannot read metadata of {item_dir}: {e}") from e


def _restore_item(item_dir: epath.Path, target: Any, what: str) -> Any:
  """Validates an item's tree against `target` and restores it into it."""
  check_tree_matches(
    _saved_shapes(item_dir),
    flat_shapes(target),
    what=what,
    location=os.fspath(item_dir),
  )
  try:
    with ocp.StandardCheckpointer() as checkpointer:
      return checkpointer.restore(item_dir, target)
  except Exception as e:  # tensorstore errors name the file in their message
    raise CheckpointError(f"Cannot restore {item_dir}: {e}") from e


def restore_params(
  path: epath.PathLike,
  target: Any,
  *,
  step: int | None = None,
  dtype: str | None = None,
  verify_checksums: bool = True,
) -> Any:
  """Restores only the `params` item of a checkpoint (fine-tuning start).

  Args:
    path: checkpoint root or step directory (training run or HF conversion);
      relative paths are relative to the working directory.
    target: abstract params tree (`jax.ShapeDtypeStruct` with shardings),
      plain (unboxed) and without a 'params' wrapper.
    step: step to restore from a root; None means the newest intact one
      (`resolve_step_dir`).
    dtype: optional dtype every parameter is cast to on restore; by default
      each parameter gets the dtype of its `target` leaf.
    verify_checksums: compare CRC32s from files.json before restoring.

  Returns:
    The params tree, sharded like `target`.

  Raises:
    CheckpointNotFoundError: naming a path that holds no checkpoint.
    CheckpointMismatchError: listing missing/unexpected/reshaped parameters.
    CorruptCheckpointError: naming a damaged file.
  """
  step_dir = resolve_step_dir(path, step, verify_checksums=verify_checksums)
  logging.info("Restoring params from %s", step_dir)
  return _restore_item(step_dir / PARAMS, _cast_abstract(target, dtype), PARAMS)


def write_params_checkpoint(
  root: epath.PathLike,
  params: Any,
  *,
  step: int = 0,
  config: Mapping[str, Any] | None = None,
) -> epath.Path:
  """Writes a params-only checkpoint root (the HF converter's layout).

  Args:
    root: checkpoint root to create.
    params: plain params tree (arrays).
    step: step number of the written checkpoint.
    config: optional JSON-serialisable model config, item `config`.

  Returns:
    The step directory written.

  Raises:
    CheckpointError: if `root` or a parent of it is a file, or `root` already
      has the step.
  """
  if problem := not_a_directory("Checkpoint directory", root):
    raise CheckpointError(problem)
  if (absolute_path(root) / str(step)).exists():
    raise CheckpointError(
      f"Checkpoint directory {shown(root)} already has step {step}; write to a new directory"
    )
  items = {PARAMS: ocp.args.StandardSave(params)}
  if config is not None:
    items[CONFIG] = ocp.args.JsonSave(dict(config))
  with ocp.CheckpointManager(
    absolute_path(root),
    options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False),
  ) as manager:
    manager.save(step, args=ocp.args.Composite(**items), force=True)
  step_dir = absolute_path(root) / str(step)
  if jax.process_index() == 0:
    write_file_manifest(step_dir)
  return step_dir


# ----------------------------------------------------------------------------
# The data-iterator item.


class _IteratorHandler(ocp.CheckpointHandler):
  """Saves/restores a `CheckpointableIterator`, one file set per host."""

  def _path(self, directory: epath.Path) -> str:
    name = f"process_{jax.process_index()}-of-{jax.process_count()}"
    return os.fspath(directory / name)

  def save(self, directory: epath.Path, args: IteratorSave) -> None:
    """Writes this host's iterator state under `directory`."""
    args.iterator.save_state(self._path(directory))

  def restore(self, directory: epath.Path, args: IteratorRestore) -> Any:
    """Moves `args.iterator` to this host's saved position; returns it."""
    path = self._path(directory)
    if not any(directory.glob(os.path.basename(path) + "*")):
      raise CheckpointError(
        f"No data-iterator state for this host at {path}; was the checkpoint "
        "written with a different number of processes?"
      )
    args.iterator.restore_state(path)
    return args.iterator

  def metadata(self, directory: epath.Path) -> None:
    """No metadata: the state files are opaque."""
    return None

  def finalize(self, directory: epath.Path) -> None:
    """Nothing to finalize: every host wrote complete files in `save`."""
    return None

  def close(self) -> None:
    """No resources held."""
    return None


@ocp.args.register_with_handler(_IteratorHandler, for_save=True)
@dataclasses.dataclass
class IteratorSave(ocp.args.CheckpointArgs):
  """Save args for the data-iterator item."""

  iterator: CheckpointableIterator


@ocp.args.register_with_handler(_IteratorHandler, for_restore=True)
@dataclasses.dataclass
class IteratorRestore(ocp.args.CheckpointArgs):
  """Restore args for the data-iterator item."""

  iterator: CheckpointableIterator


# ----------------------------------------------------------------------------
# Training checkpoints.


@dataclasses.dataclass(frozen=True)
class Restored:
  """What a training restore returns."""

  step: int
  params: Any
  opt_state: Any
  meta: dict[str, Any]


@gin.configurable
class TrainCheckpointer:
  """Periodic, asynchronous training checkpoints under MODEL_DIR.

  Orbax writes steps asynchronously (the device->host copy blocks, the file
  writes do not), keeps the latest `keep`, and commits each step atomically,
  so a `kill -9` loses at most the steps since the last committed save.

  Corrupt steps: `restore_latest` falls back past corrupt newer steps to the
  newest intact one, leaving them as they are. Training then redoes their
  steps, so before its first save the corrupt steps are moved aside to
  `<step>.corrupt` (files unchanged, with a warning naming both paths): the
  redone steps are saved under their own numbers, orbax sees a consistent
  history and never rotates out an intact step in favour of a corrupt one.
  """

  def __init__(
    self,
    directory: epath.PathLike,
    *,
    save_period: int = 1000,
    keep: int | None = 3,
    async_save: bool = True,
    verify_checksums: bool = True,
  ):
    """Opens (and creates) the checkpoint root.

    Args:
      directory: checkpoint root, usually MODEL_DIR; relative paths are
        relative to the working directory.
      save_period: save every this many steps (plus a final save).
      keep: number of most recent steps to keep; None keeps all.
      async_save: write files in a background thread.
      verify_checksums: compare CRC32s of every file before restoring
        (sizes are always compared).

    Raises:
      CheckpointError: if MODEL_DIR or a parent of it is a file.
    """
    if save_period <= 0:
      raise ConfigError(f"TrainCheckpointer.save_period must be positive, got {save_period}")
    if problem := not_a_directory("MODEL_DIR", directory):
      raise CheckpointError(problem)
    self.directory = absolute_path(directory)
    self.save_period = save_period
    self._verify_checksums = verify_checksums
    options = ocp.CheckpointManagerOptions(
      preservation_policy=ocp.checkpoint_managers.LatestN(keep),
      enable_async_checkpointing=async_save,
      cleanup_tmp_directories=True,
    )
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for item in (PARAMS, OPT_STATE):
      registry.add(item, ocp.args.StandardSave, ocp.StandardCheckpointHandler)
      registry.add(item, ocp.args.StandardRestore, ocp.StandardCheckpointHandler)
    registry.add(TRAIN_META, ocp.args.JsonSave, ocp.JsonCheckpointHandler)
    registry.add(TRAIN_META, ocp.args.JsonRestore, ocp.JsonCheckpointHandler)
    registry.add(DATA_ITERATOR, IteratorSave, _IteratorHandler)
    registry.add(DATA_ITERATOR, IteratorRestore, _IteratorHandler)
    self._manager = ocp.CheckpointManager(
      self.directory, options=options, handler_registry=registry
    )
    self._unmanifested: int | None = None
    self._corrupt: list[int] = []  # found by `restore_latest`, not yet moved aside

  def latest_step(self) -> int | None:
    """The newest committed step not found corrupt by `restore_latest`, or None."""
    steps = [s for s in self._manager.all_steps() if s not in self._corrupt]
    return max(steps, default=None)

  def all_steps(self) -> list[int]:
    """All committed steps, ascending."""
    return sorted(self._manager.all_steps())

  def should_save(self, step: int) -> bool:
    """Whether `step` is a periodic save step."""
    return step % self.save_period == 0

  def save(
    self,
    step: int,
    params: Any,
    opt_state: Any,
    meta: Mapping[str, Any],
    iterator: CheckpointableIterator | None = None,
  ) -> bool:
    """Starts saving one step; returns False if the step already exists.

    Args:
      step: the number of completed training steps.
      params: plain params tree.
      opt_state: optax state.
      meta: JSON-serialisable dict (rng, data position, config, ...);
        `step` is added.
      iterator: the training input iterator, saved per host.
    """
    if self._corrupt:
      self._set_aside_corrupt()
    if step in self._manager.all_steps():
      return False
    self._finish_pending()
    items = {
      PARAMS: ocp.args.StandardSave(params),
      OPT_STATE: ocp.args.StandardSave(opt_state),
      TRAIN_META: ocp.args.JsonSave({**meta, "step": step}),
    }
    if iterator is not None:
      items[DATA_ITERATOR] = IteratorSave(iterator)
    self._manager.save(step, args=ocp.args.Composite(**items), force=True)
    self._unmanifested = step
    return True

  def restore(
    self,
    step: int,
    abstract_params: Any,
    abstract_opt_state: Any,
    iterator: CheckpointableIterator | None = None,
  ) -> Restored:
    """Restores a training step into the shardings of the abstract trees.

    Args:
      step: committed step to restore.
      abstract_params: params tree of `jax.ShapeDtypeStruct` with shardings.
      abstract_opt_state: optax state tree of the same kind.
      iterator: the input iterator to move to the saved position.

    Raises:
      CheckpointMismatchError: the step holds a different model/optimizer.
      CorruptCheckpointError: naming a damaged file.
    """
    step_dir = self.directory / str(step)
    verify_files(step_dir, checksums=self._verify_checksums)
    params = _restore_item(step_dir / PARAMS, abstract_params, PARAMS)
    opt_state = _restore_item(step_dir / OPT_STATE, abstract_opt_state, OPT_STATE)
    items = {TRAIN_META: ocp.args.JsonRestore()}
    if iterator is not None:
      items[DATA_ITERATOR] = IteratorRestore(iterator)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    except CheckpointError:
      raise
    except Exception as e:  # JSON / tf.data errors: name the step directory
      raise CheckpointError(f"Cannot restore {step_dir}: {e}") from e
    logging.info("Restored training checkpoint %s", step_dir)
    return Restored(step=step, params=params, opt_state=opt_state, meta=dict(restored[TRAIN_META]))

  def restore_latest(
    self,
    abstract_params: Any,
    abstract_opt_state: Any,
    iterator: CheckpointableIterator | None = None,
  ) -> Restored | None:
    """Restores the newest intact step (see `restore`); None without any step.

    A step that fails verification (or whose restore raises
    `CorruptCheckpointError`) is skipped for the next older one, with a
    warning naming the bad step, its file and the step used instead; the
    skipped steps are moved aside before the next `save` (see the class).

    Raises:
      CheckpointMismatchError: the newest intact step holds a different model.
      CorruptCheckpointError: every step is corrupt, naming each bad file.
    """
    steps = self.all_steps()
    if not steps:
      return None
    step, restored = newest_intact(
      self.directory,
      steps,
      lambda s: self.restore(s, abstract_params, abstract_opt_state, iterator),
    )
    self._corrupt = [s for s in steps if s > step]
    return restored

  def _set_aside_corrupt(self) -> None:
    """Moves the corrupt steps found by `restore_latest` to `<step>.corrupt`."""
    if jax.process_index() == 0:
      for step in self._corrupt:
        source = self.directory / str(step)
        target = self.directory / f"{step}.corrupt"
        n = 1
        while target.exists():  # a step corrupted again after an earlier move
          n += 1
          target = self.directory / f"{step}.corrupt.{n}"
        source.rename(target)
        logging.warning(
          "Moved corrupt checkpoint step %s to %s (files unchanged) before saving the "
          "steps training redoes; delete it once inspected.",
          source,
          target,
        )
    ocp.multihost.sync_global_processes("t5x_lite_set_aside_corrupt_steps")
    self._manager.reload()
    self._corrupt = []

  def _finish_pending(self) -> None:
    """Waits for the running save and writes its files.json."""
    self._manager.wait_until_finished()
    step, self._unmanifested = self._unmanifested, None
    if step is None or jax.process_index() != 0:
      return
    if (self.directory / str(step)).is_dir():  # else: already rotated out
      write_file_manifest(self.directory / str(step))

  def wait(self) -> None:
    """Blocks until every started save is committed and verified-writable."""
    self._finish_pending()

  def close(self) -> None:
    """Finishes pending saves and releases orbax resources."""
    self._finish_pending()
    self._manager.close()
