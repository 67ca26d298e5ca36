"""A checkpoint save that failed writing (full disk, file-size limit, read-only disk).

`write_failure` finds the operating system's reason in what orbax, tensorstore or
TensorFlow raised (they wrap it in messages of their own); anything else is a bug
and keeps its traceback. `remove_partial` deletes what the failed save wrote (orbax
writes a step into `<step>.orbax-checkpoint-tmp*` and renames it only once complete,
so committed steps are never touched), and `failed_save_error` says it all in one line:
the step and its path, the reason, the space a step needs, and the step left intact.

While saves run in the background, `watching()` keeps the failure from reaching the
console as tracebacks before that line: orbax logs a failed write from its threads
(`FailureLog` drops those records and keeps the reason, in case orbax does not raise
it), and tensorstore's writes still in flight when orbax abandons the step report
"Event loop is closed" as unraisable exceptions, which it drops too.
"""

from __future__ import annotations

import contextlib
import errno
import logging as std_logging
import os
import resource
import shutil
import sys
import traceback
from collections.abc import Iterator, Sequence

from absl import logging
from etils import epath

from t5x_lite.checkpoint.manifest import FILE_MANIFEST
from t5x_lite.core.errors import WriteError

_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EIO)
# "No space left on device", "File too large", ...: how the wrapped messages say it.
_WRITE_REASONS = tuple(os.strerror(code) for code in _WRITE_ERRNOS)


def _reason_in(text: str) -> str | None:
  return next((reason for reason in _WRITE_REASONS if reason in text), None)


def write_failure(error: BaseException) -> str | None:
  """The OS reason in `error` or the errors it was raised from; None if it is another error."""
  seen: set[int] = set()
  current: BaseException | None = error
  while current is not None and id(current) not in seen:
    seen.add(id(current))
    if isinstance(current, OSError) and current.errno in _WRITE_ERRNOS:
      return os.strerror(current.errno)
    if reason := _reason_in(str(current)):
      return reason
    current = current.__cause__ or current.__context__
  return None


class FailureLog(std_logging.Filter):
  """Drops orbax's error records of a failed write; `reason` keeps the first one's."""

  def __init__(self):
    super().__init__()
    self.reason: str | None = None

  def filter(self, record: std_logging.LogRecord) -> bool:
    if record.levelno < std_logging.ERROR or "orbax" not in record.pathname:
      return True
    text = record.getMessage()
    if record.exc_info:
      text += "".join(traceback.format_exception(*record.exc_info))
    reason = _reason_in(text)
    if reason is None:
      return True
    self.reason = self.reason or reason
    return False


def _abandoned_write(unraisable: sys.UnraisableHookArgs) -> bool:
  value = getattr(unraisable, "exc_value", None)
  return isinstance(value, RuntimeError) and str(value) == "Event loop is closed"


_hook_users = 0
_previous_hook = sys.unraisablehook


def _drop_abandoned_writes(unraisable: sys.UnraisableHookArgs) -> None:
  if not _abandoned_write(unraisable):
    _previous_hook(unraisable)


@contextlib.contextmanager
def watching() -> Iterator[FailureLog]:
  """Within: orbax's failed-write records and abandoned-write noise are dropped (see above).

  Yields:
    The `FailureLog` on absl's handler, whose `reason` names a failed write.
  """
  global _hook_users, _previous_hook
  log = FailureLog()
  handler = logging.get_absl_handler()
  handler.addFilter(log)
  if _hook_users == 0:
    _previous_hook, sys.unraisablehook = sys.unraisablehook, _drop_abandoned_writes
  _hook_users += 1
  try:
    yield log
  finally:
    _hook_users -= 1
    if _hook_users == 0 and sys.unraisablehook is _drop_abandoned_writes:
      sys.unraisablehook = _previous_hook
    handler.removeFilter(log)


def remove_partial(directory: epath.Path, step: int) -> list[str]:
  """Deletes the temporary directories of a failed save of `step`; returns their names."""
  removed = []
  for path in sorted(directory.glob(f"{step}.orbax-checkpoint-tmp*")):
    shutil.rmtree(os.fspath(path), ignore_errors=True)
    removed.append(path.name)
  manifest = directory / str(step) / (FILE_MANIFEST + ".tmp")
  if manifest.exists():  # the manifest of a committed step that could not be written
    manifest.unlink()
    removed.append(os.fspath(manifest.relative_to(directory)))
  return removed


def _size(num_bytes: float) -> str:
  for unit in ("bytes", "KiB", "MiB", "GiB"):
    if num_bytes < 1024 or unit == "GiB":
      return f"{num_bytes:.0f} {unit}" if unit == "bytes" else f"{num_bytes:.1f} {unit}"
    num_bytes /= 1024
  raise AssertionError("unreachable")


def _space(directory: epath.Path, reason: str, committed: int | None) -> str:
  """What is known about the space a step needs and what there is."""
  notes = []
  if committed is not None:
    step_dir = os.fspath(directory / str(committed))
    size = sum(
      os.path.getsize(os.path.join(parent, name))
      for parent, _, names in os.walk(step_dir)
      for name in names
    )
    notes.append(f"a step takes {_size(size)}, as step {committed} does")
  if reason == os.strerror(errno.EFBIG):
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
      notes.append(f"the file size limit (ulimit -f) is {_size(limit)}")
  try:
    notes.append(f"{_size(shutil.disk_usage(os.fspath(directory)).free)} free on its disk")
  except OSError:
    pass
  return f" ({'; '.join(notes)})" if notes else ""


def failed_save_error(
  directory: epath.Path, step: int, reason: str, committed: Sequence[int], removed: Sequence[str]
) -> WriteError:
  """The one-line error of a save of `step` that failed for `reason`.

  Args:
    directory: the checkpoint root.
    step: the step being saved.
    reason: `write_failure`'s reason.
    committed: the committed steps left, ascending.
    removed: what `remove_partial` deleted.
  """
  last = committed[-1] if committed else None
  kept = (
    f"the last committed step {last} is intact ({directory / str(last)})"
    if last is not None
    else "no step had been committed before"
  )
  cleaned = f"removed its partial files ({', '.join(removed)}); " if removed else ""
  return WriteError(
    f"Saving checkpoint step {step} to {directory / str(step)} failed: {reason}"
    f"{_space(directory, reason, last)}; {cleaned}{kept}. Free space (or raise the limit) "
    "and restart the same command to resume from there."
  )
