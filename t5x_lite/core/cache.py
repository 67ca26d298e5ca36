"""The t5x_lite cache directory and race-safe writes into it.

Derived artifacts that are expensive to rebuild (the offline vocabulary, the
extracted CPython corpus) are cached here. Several processes may build the
same artifact at once (pytest-xdist workers, data-loading hosts): they
serialize on a lock file next to it, and each file appears atomically.
"""

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Optional

import gin

CACHE_ENV = "T5X_LITE_CACHE"
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "t5x_lite")


@gin.configurable
def cache_dir(path: Optional[str] = None) -> str:
  """Returns the cache directory (gin: `cache_dir.path`).

  Args:
    path: explicit directory; wins over the environment variable.

  Returns:
    `path`, else $T5X_LITE_CACHE, else ~/.cache/t5x_lite, as an absolute path.
  """
  chosen = path or os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR
  return os.path.abspath(os.path.expanduser(chosen))


def atomic_write(path: str, data: bytes) -> None:
  """Writes `data` to `path` via a temporary file and an atomic rename."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp_")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
    os.chmod(tmp, 0o644)  # mkstemp creates 0600; cached files are shareable.
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


@contextlib.contextmanager
def file_lock(lock_path: str) -> Iterator[None]:
  """Holds an exclusive POSIX lock on `lock_path`, blocking until acquired."""
  os.makedirs(os.path.dirname(os.path.abspath(lock_path)), exist_ok=True)
  with open(lock_path, "a") as lock_file:
    fcntl.flock(lock_file, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(lock_file, fcntl.LOCK_UN)


def build_once(path: str, build: Callable[[], bytes]) -> str:
  """Returns `path`, first writing `build()` to it if it does not exist yet.

  Safe across processes: one builds under `path + '.lock'`, the rest wait and
  then find the finished file.

  Args:
    path: the cached file.
    build: produces the file's bytes.

  Returns:
    `path`.
  """
  if os.path.exists(path):
    return path
  with file_lock(path + ".lock"):
    if not os.path.exists(path):
      atomic_write(path, build())
  return path


@contextlib.contextmanager
def locked_json(path: str) -> Iterator[dict]:
  """The JSON object in `path` ({} where it is missing or unreadable), held under
  `path + '.lock'` for the block; written back atomically if the block changed it."""
  with file_lock(path + ".lock"):
    try:
      with open(path, encoding="utf-8") as f:
        known = json.load(f)
    except (OSError, ValueError):
      known = {}
    before = dict(known)
    yield known
    if known != before:
      atomic_write(path, json.dumps(known, indent=1).encode())
