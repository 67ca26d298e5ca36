"""Paths as users give them: made absolute, named in messages, checked as output dirs.

`absolute_path` makes a user's relative path absolute against the working
directory (orbax needs absolute paths; URLs such as gs:// are kept), `shown` names
a path in messages as the user wrote it and as resolved, `not_a_directory`
explains why a path cannot be used as an output directory.
"""

from __future__ import annotations

import os

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
