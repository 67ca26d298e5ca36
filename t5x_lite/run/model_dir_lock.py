"""One training run per MODEL_DIR: a lock file naming its holder, taken at start.

`train()` holds `ModelDirLock(MODEL_DIR)` for the whole run. The lock is the file
MODEL_DIR/train.lock, held with `flock` and holding one JSON object: host, pid, start
time and process count of the holder. A second run on the same MODEL_DIR is refused
at start with one line naming the holder (`ModelDirLockedError`); the lock is
released (the file removed) when the run ends, by an error or a signal too.

A stale lock, left by a run that was killed (SIGKILL, a crash, a lost host), never
blocks a restart; it is taken over with a warning naming the run that held it:
* on the same host: the kernel drops a dead process's `flock`, so a lock nobody holds
  is stale (also when the old pid was reused by another process);
* from another host: `flock` is not shared across hosts by every file system, so
  the holder refreshes the file's modification time every `HEARTBEAT_S`; a lock from
  another host is stale once that is older than `stale_after_s`.

A job is the processes of one `jax.distributed` run (one coordinator). Only its
process 0 takes the lock, so the job's other processes never refuse each other; they
learn process 0's outcome (`acquire_for_job`) and stop with it, so a second job
started on a locked MODEL_DIR stops whole, each of its processes with the same line.

URL paths (gs://...) are not locked: their file systems have neither `flock` nor
exclusive creation through tf.io.gfile.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import socket
import threading
import time
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from t5x_lite.core.errors import UserError, WriteError
from t5x_lite.core.paths import absolute_path, shown

LOCK_FILE = "train.lock"
# How often the holder refreshes the lock file's modification time.
HEARTBEAT_S = 60.0


class ModelDirLockedError(UserError, RuntimeError):
  """Another training run holds MODEL_DIR."""


@dataclasses.dataclass(frozen=True)
class Holder:
  """Who holds a lock: what the lock file says."""

  host: str
  pid: int
  started: float  # unix time
  process_count: int = 1

  @classmethod
  def this_process(cls) -> Holder:
    """The calling process."""
    return cls(socket.gethostname(), os.getpid(), time.time(), jax.process_count())

  def __str__(self) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(self.started))
    job = f", process 0 of {self.process_count}" if self.process_count > 1 else ""
    return f"host {self.host}, pid {self.pid}{job}, started {started}"


def _read_holder(fd: int) -> Holder | None:
  """The holder a lock file names; None when it is empty or not (yet) complete."""
  try:
    text = os.pread(fd, 4096, 0).decode("utf-8")
    fields = json.loads(text)
    names = [f.name for f in dataclasses.fields(Holder)]
    return Holder(**{name: fields[name] for name in names if name in fields})
  except (ValueError, KeyError, TypeError):
    return None


class ModelDirLock:
  """The lock of one MODEL_DIR (see the module docstring); a context manager.

  Args:
    model_dir: MODEL_DIR as the user gave it.
    stale_after_s: a lock from another host is stale once its file was not
      refreshed for this long.
  """

  def __init__(self, model_dir: str, stale_after_s: float = 10 * HEARTBEAT_S):
    self.model_dir = model_dir
    self.path = os.path.join(os.fspath(absolute_path(model_dir)), LOCK_FILE)
    self.stale_after_s = stale_after_s
    self._fd: int | None = None
    self._stop = threading.Event()
    self._heartbeat: threading.Thread | None = None

  def acquire(self) -> None:
    """Takes the lock, or raises `ModelDirLockedError` naming its holder.

    Raises:
      ModelDirLockedError: a live run holds MODEL_DIR.
      WriteError: the lock file cannot be created.
    """
    if "://" in self.path:
      logging.info("MODEL_DIR %s is a URL: not locked against a second run.", self.model_dir)
      return
    while self._fd is None:
      fd = self._open()
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        holder = _wait_for_holder(fd)
        os.close(fd)
        raise self._refusal(holder, "") from None
      if not self._is_current(fd):  # released and removed while we waited: retry
        os.close(fd)
        continue
      try:
        self._take(fd, _read_holder(fd))
      except BaseException:
        os.close(fd)
        raise
      self._fd = fd
    self._heartbeat = threading.Thread(
      target=self._beat, args=(self._fd,), name="model-dir-lock", daemon=True
    )
    self._heartbeat.start()

  def release(self) -> None:
    """Removes the lock file, then drops the lock (a no-op when not held)."""
    if self._fd is None:
      return
    self._stop.set()
    if self._heartbeat is not None:
      self._heartbeat.join()
    try:
      if self._is_current(self._fd):
        os.unlink(self.path)
    finally:
      os.close(self._fd)  # closing drops the flock
      self._fd = None

  def __enter__(self) -> ModelDirLock:
    self.acquire()
    return self

  def __exit__(self, *exc_info: Any) -> None:
    self.release()

  def _open(self) -> int:
    try:
      os.makedirs(os.path.dirname(self.path), exist_ok=True)
      return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
      raise WriteError(
        f"Cannot create the lock file {self.path} of MODEL_DIR {shown(self.model_dir)}: "
        f"{e.strerror}"
      ) from e

  def _is_current(self, fd: int) -> bool:
    """Whether `fd` is still the file at `self.path` (a releasing holder removes it)."""
    try:
      on_disk = os.stat(self.path)
    except FileNotFoundError:
      return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (on_disk.st_dev, on_disk.st_ino)

  def _take(self, fd: int, previous: Holder | None) -> None:
    """With the flock held: refuses a live holder on another host, else writes ours."""
    me = Holder.this_process()
    if previous is not None:
      if previous.host != me.host:
        age = time.time() - os.fstat(fd).st_mtime
        if age < self.stale_after_s:
          raise self._refusal(
            previous,
            f" (it refreshed the lock {age:.0f} s ago; a lock not refreshed for "
            f"{self.stale_after_s:.0f} s is taken over)",
          )
        why = f"not refreshed for {age:.0f} s"
      else:
        why = "no such process on this host"
      logging.warning(
        "MODEL_DIR lock %s is stale (%s; %s): taking it over.", self.path, previous, why
      )
    text = json.dumps(dataclasses.asdict(me)).encode("utf-8")
    os.ftruncate(fd, 0)
    os.pwrite(fd, text, 0)
    os.fsync(fd)

  def _refusal(self, holder: Holder | None, detail: str) -> ModelDirLockedError:
    who = f"another training run ({holder})" if holder else "another training run"
    return ModelDirLockedError(
      f"MODEL_DIR {shown(self.model_dir)} is in use by {who}{detail}; lock file {self.path}. "
      "Wait for that run to end or stop it, or give this run another MODEL_DIR."
    )

  def _beat(self, fd: int) -> None:
    """Refreshes the lock file's (open as `fd`) modification time until released."""
    while not self._stop.wait(HEARTBEAT_S):
      try:
        os.utime(fd)
      except OSError as e:  # a full or lost disk: the run itself reports it
        if e.errno not in (errno.ENOSPC, errno.EIO, errno.EROFS):
          logging.warning("Cannot refresh the lock file %s: %s", self.path, e.strerror)


def _wait_for_holder(fd: int, timeout_s: float = 2.0) -> Holder | None:
  """The holder of a held lock, waiting briefly for one that is still writing it."""
  deadline = time.monotonic() + timeout_s
  while (holder := _read_holder(fd)) is None and time.monotonic() < deadline:
    time.sleep(0.05)
  return holder


def acquire_for_job(lock: ModelDirLock) -> None:
  """`lock.acquire()` on process 0; every process of the job raises if it failed.

  Raises:
    ModelDirLockedError: on process 0 naming the holder; on the others saying that
      process 0 was refused.
  """
  refused: UserError | None = None
  if jax.process_index() == 0:
    try:
      lock.acquire()
    except UserError as e:
      refused = e
  if jax.process_count() > 1:
    ok = multihost_utils.broadcast_one_to_all(np.int32(refused is None))
    if not ok and refused is None:
      refused = ModelDirLockedError(
        f"MODEL_DIR {shown(lock.model_dir)} could not be locked by process 0 of this job "
        "(its log names the run holding it)."
      )
  if refused is not None:
    raise refused
