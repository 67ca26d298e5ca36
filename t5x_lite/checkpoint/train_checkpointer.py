"""Training checkpoints under MODEL_DIR: periodic async saves, resume, corrupt steps.

`TrainCheckpointer` saves and restores the items of a training step (layout in
`t5x_lite.checkpoint.checkpoints`): `params`, `opt_state`, `train_meta` (step, RNG, data
position, model config) and `data_iterator` (one file set per host, written by
`_IteratorHandler`). Restores go straight into the target shardings and are
checked against them first (`checkpoints.restore_item`). A save that fails writing
(a full disk) removes what it wrote and raises one `WriteError` line
(`t5x_lite.checkpoint.save_failure`). Gin: `TrainCheckpointer.save_period`, `.keep`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import gin
import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from t5x_lite.checkpoint import save_failure
from t5x_lite.checkpoint.manifest import newest_intact, verify_files, write_file_manifest
from t5x_lite.checkpoint.checkpoints import (
  AUX_STATE,
  DATA_ITERATOR,
  OPT_STATE,
  PARAMS,
  TRAIN_META,
  restore_item,
)
from t5x_lite.core.errors import CheckpointError, ConfigError
from t5x_lite.core.paths import absolute_path, not_a_directory


class CheckpointableIterator(Protocol):
  """An input iterator whose position can be saved and restored per host."""

  def save_state(self, path: str) -> None:
    """Writes the iterator position to files starting with `path`."""

  def restore_state(self, path: str) -> None:
    """Moves the iterator to the position saved under `path`."""


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


@dataclasses.dataclass
class _ProtectedSteps:
  """An orbax preservation policy keeping the steps in `steps` (e.g. the best one)."""

  steps: set[int] = dataclasses.field(default_factory=set)

  def should_preserve(self, checkpoints: Any, *, context: Any) -> list[bool]:
    """Preserves exactly the checkpoints whose step is protected."""
    del context
    return [info.step in self.steps for info in checkpoints]


# (step, its train_meta) -> None; raises when the run cannot resume that step.
MetaCheck = Callable[[int, dict[str, Any]], None]


@dataclasses.dataclass(frozen=True)
class Restored:
  """What a training restore returns."""

  step: int
  params: Any
  opt_state: Any
  meta: dict[str, Any]
  aux_state: Any = None  # None: not asked for, or the step has none


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
    self._protected = _ProtectedSteps()
    options = ocp.CheckpointManagerOptions(
      preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(
        [ocp.checkpoint_managers.LatestN(keep), self._protected]
      ),
      enable_async_checkpointing=async_save,
      cleanup_tmp_directories=True,
    )
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for item in (PARAMS, OPT_STATE, AUX_STATE):
      registry.add(item, ocp.args.StandardSave, ocp.StandardCheckpointHandler)
      registry.add(item, ocp.args.StandardRestore, ocp.StandardCheckpointHandler)
    registry.add(TRAIN_META, ocp.args.JsonSave, ocp.JsonCheckpointHandler)
    registry.add(TRAIN_META, ocp.args.JsonRestore, ocp.JsonCheckpointHandler)
    registry.add(DATA_ITERATOR, IteratorSave, _IteratorHandler)
    registry.add(DATA_ITERATOR, IteratorRestore, _IteratorHandler)
    self._manager = ocp.CheckpointManager(
      self.directory, options=options, handler_registry=registry
    )
    # orbax removes a killed run's unfinished temporary directories in a thread of its
    # own and waits for it only before a save; waiting here leaves no such thread
    # running when a run stops before its first save (a bad data file) and the
    # interpreter shuts down under it ("cannot schedule new futures after shutdown").
    await_cleanup = getattr(self._manager, "_maybe_await_cleanup_tmp_directory", None)
    if await_cleanup is not None:
      await_cleanup()
    self._unmanifested: int | None = None
    self._corrupt: list[int] = []  # found by `restore_latest`, not yet moved aside
    self._failed = False  # a save failed: nothing more is written or waited for
    self._watch = contextlib.ExitStack()  # closed by `close`
    self._failure_log = self._watch.enter_context(save_failure.watching())

  def protect(self, step: int | None) -> None:
    """Keeps `step` (once saved) out of the keep-last-K rotation; None protects nothing.

    One step is protected at a time (the run's best step, `t5x_lite.early_stopping`);
    the previously protected one rotates out as usual.
    """
    self._protected.steps = set() if step is None else {step}

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
    aux_state: Any = None,
  ) -> bool:
    """Starts saving one step; returns False if the step already exists.

    Args:
      step: the number of completed training steps.
      params: plain params tree.
      opt_state: optax state.
      meta: JSON-serialisable dict (rng, data position, config, ...);
        `step` is added.
      iterator: the training input iterator, saved per host.
      aux_state: the model's auxiliary state, saved when given (not None).

    Raises:
      WriteError: this save, or the one before it, failed writing (a full disk).
    """
    if self._corrupt:
      self._set_aside_corrupt()
    if step in self._manager.all_steps():
      return False
    self._finish_pending()
    with self._reporting_failure(step):
      self._start_save(step, params, opt_state, meta, iterator, aux_state)
    self._unmanifested = step
    return True

  def _start_save(
    self,
    step: int,
    params: Any,
    opt_state: Any,
    meta: Mapping[str, Any],
    iterator: CheckpointableIterator | None,
    aux_state: Any = None,
  ) -> None:
    items = {
      PARAMS: ocp.args.StandardSave(params),
      OPT_STATE: ocp.args.StandardSave(opt_state),
      TRAIN_META: ocp.args.JsonSave({**meta, "step": step}),
    }
    if iterator is not None:
      items[DATA_ITERATOR] = IteratorSave(iterator)
    if aux_state is not None:
      items[AUX_STATE] = ocp.args.StandardSave(aux_state)
    self._manager.save(step, args=ocp.args.Composite(**items), force=True)

  @contextlib.contextmanager
  def _reporting_failure(self, step: int) -> Iterator[None]:
    """Turns a failed write of `step` into `save_failure`'s one-line WriteError."""
    try:
      yield
      if self._failure_log.reason:  # logged by orbax's threads but not raised
        raise RuntimeError(f"orbax logged a failed write: {self._failure_log.reason}")
    except Exception as e:
      reason = save_failure.write_failure(e)
      if reason is None:
        raise
      self._failed = True
      with contextlib.suppress(Exception):  # writes in flight end before their files go
        self._manager.close()
      removed = save_failure.remove_partial(self.directory, step) if _primary() else []
      committed = sorted(
        int(p.name) for p in self.directory.iterdir() if p.name.isdigit() and int(p.name) != step
      )
      raise save_failure.failed_save_error(self.directory, step, reason, committed, removed) from e

  def restore(
    self,
    step: int,
    abstract_params: Any,
    abstract_opt_state: Any,
    iterator: CheckpointableIterator | None = None,
    check_meta: MetaCheck | None = None,
    abstract_aux_state: Any = None,
  ) -> Restored:
    """Restores a training step into the shardings of the abstract trees.

    Args:
      step: committed step to restore.
      abstract_params: params tree of `jax.ShapeDtypeStruct` with shardings.
      abstract_opt_state: optax state tree of the same kind.
      iterator: the input iterator to move to the saved position.
      check_meta: called with the step and its `train_meta` before anything
        else is restored; raises when this run cannot resume it.
      abstract_aux_state: the auxiliary state's tree of the same kind, restored when
        given and the step has one (else `Restored.aux_state` is None).

    Raises:
      CheckpointMismatchError: the step holds a different model/optimizer.
      CorruptCheckpointError: naming a damaged file.
    """
    step_dir = self.directory / str(step)
    verify_files(step_dir, checksums=self._verify_checksums)
    meta = dict(self._restore_items(step, {TRAIN_META: ocp.args.JsonRestore()})[TRAIN_META])
    if check_meta is not None:
      check_meta(step, meta)
    params = restore_item(step_dir / PARAMS, abstract_params, PARAMS)
    opt_state = restore_item(step_dir / OPT_STATE, abstract_opt_state, OPT_STATE)
    aux_state = None
    if abstract_aux_state is not None and (step_dir / AUX_STATE).exists():
      aux_state = restore_item(step_dir / AUX_STATE, abstract_aux_state, AUX_STATE)
    if iterator is not None:
      self._restore_items(step, {DATA_ITERATOR: IteratorRestore(iterator)})
    logging.info("Restored training checkpoint %s", step_dir)
    return Restored(step=step, params=params, opt_state=opt_state, meta=meta, aux_state=aux_state)

  def _restore_items(self, step: int, items: Mapping[str, ocp.args.CheckpointArgs]) -> Any:
    """Orbax's restore of some items of `step`; its errors name the step directory."""
    try:
      return self._manager.restore(step, args=ocp.args.Composite(**items))
    except CheckpointError:
      raise
    except Exception as e:  # JSON / tf.data errors: name the step directory
      raise CheckpointError(f"Cannot restore {self.directory / str(step)}: {e}") from e

  def restore_latest(
    self,
    abstract_params: Any,
    abstract_opt_state: Any,
    iterator: CheckpointableIterator | None = None,
    check_meta: MetaCheck | None = None,
    abstract_aux_state: Any = None,
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
      lambda s: self.restore(
        s, abstract_params, abstract_opt_state, iterator, check_meta, abstract_aux_state
      ),
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
    step, self._unmanifested = self._unmanifested, None
    if self._failed:
      return
    if step is None:
      self._manager.wait_until_finished()
      return
    with self._reporting_failure(step):
      self._manager.wait_until_finished()
      if _primary() and (self.directory / str(step)).is_dir():  # else: already rotated out
        write_file_manifest(self.directory / str(step))

  def wait(self) -> None:
    """Blocks until every started save is committed and verified-writable."""
    self._finish_pending()

  def close(self) -> None:
    """Finishes pending saves and releases orbax resources.

    After a failed save (already reported) the manager is closed already.
    """
    try:
      if not self._failed:
        self._finish_pending()
        self._manager.close()
    finally:
      self._watch.close()


def _primary() -> bool:
  return jax.process_index() == 0
