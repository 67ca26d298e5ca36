"""Paths as users give them: made absolute, named in messages, checked as output dirs.

`absolute_path` makes a user's relative path absolute against the working
directory (orbax needs absolute paths; URLs such as gs:// are kept), `shown` names
a path in messages as the user wrote it and as resolved, `not_a_directory`
explains why a path cannot be used as an output directory, `not_writable` also
why one cannot be written (checked before a run does any work).
"""

from __future__ import annotations

import os
import tempfile

from etils import epath


def absolute_path(path: epath.PathLike) -> epath.Path:
  """`path` made absolute against the working directory; URLs (gs://...) as given."""
  text = os.fspath(path)
  return epath.Path(text if "://" in text else os.path.abspath(text))


def shown(given: epath.PathLike) -> str:
  """How messages name a user's path: as given, and resolved when that differs."""
  resolved = os.fspath(absolute_path(given))
  return resolved if os.fspath(given) == resolved else f"{os.fspath(given)} ({resolved})"


def not_a_directory(name: str, given: epath.PathLike) -> str | None:
  """Why `given` cannot be (created as) directory `name`, or None if it can.

  Args:
    name: what the directory is, e.g. 'MODEL_DIR'.
    given: the path as the user gave it.

  Returns:
    A message naming the path when it, or its nearest existing parent, is not a
    directory; None otherwise (URLs are not checked).
  """
  path = absolute_path(given)
  if "://" in os.fspath(path):
    return None
  existing = path
  while not existing.exists() and existing.parent != existing:
    existing = existing.parent
  if existing.is_dir():
    return None
  if existing == path:
    return f"{name} {shown(given)} is a file, not a directory"
  return f"{name} {shown(given)} cannot be created: {existing} is a file, not a directory"


def not_writable(name: str, given: epath.PathLike) -> str | None:
  """Why directory `name` cannot be written, or None if it can (then it exists).

  Creates the directory if needed, then a file in it, which it removes: permission
  bits, read-only mounts and a file in the way all show, for root too.

  Args:
    name: what the directory is, e.g. 'MODEL_DIR'.
    given: the path as the user gave it.

  Returns:
    A message naming the path and the operating system's reason; None also for
    URLs, which are not checked.
  """
  if problem := not_a_directory(name, given):
    return problem
  path = os.fspath(absolute_path(given))
  if "://" in path:
    return None
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    return f"{name} {shown(given)} is not writable: cannot create it ({e.strerror})"
  try:
    fd, probe = tempfile.mkstemp(prefix=".write_check_", dir=path)
  except OSError as e:
    return f"{name} {shown(given)} is not writable: cannot create a file in it ({e.strerror})"
  os.close(fd)
  os.unlink(probe)
  return None
