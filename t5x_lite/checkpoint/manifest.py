"""The integrity manifest of checkpoint steps (files.json) and skipping corrupt steps.

Orbax commits a step atomically but does not detect a file truncated
or corrupted afterwards (disk full, partial copy, bit rot); tensorstore then
fails with messages that do not always name the file, or silently reads a stale
duplicate. `write_file_manifest` records every file of a committed step in
files.json; `verify_files` checks them before a restore and names the first bad
file. `newest_intact` and `intact_steps` skip corrupt steps of a checkpoint
root with a warning naming the bad file and leave them as they are (training
moves them aside before it saves, see `train_checkpointer.TrainCheckpointer`).
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable, Sequence
from typing import TypeVar

from absl import logging
from etils import epath

from t5x_lite.core.errors import CorruptCheckpointError

FILE_MANIFEST = "files.json"
_CRC_CHUNK_BYTES = 1 << 24
_T = TypeVar("_T")


def _crc32(path: epath.Path) -> int:
  """CRC32 of a file, streamed in chunks."""
  crc = 0
  with path.open("rb") as f:
    while chunk := f.read(_CRC_CHUNK_BYTES):
      crc = zlib.crc32(chunk, crc)
  return crc


def _step_files(step_dir: epath.Path) -> list[epath.Path]:
  """All regular files under a step directory except the manifest."""
  files, pending = [], [step_dir]
  while pending:
    for child in pending.pop().iterdir():
      if child.is_dir():
        pending.append(child)
      elif child.name != FILE_MANIFEST:
        files.append(child)
  return sorted(files)


def write_file_manifest(step_dir: epath.PathLike) -> None:
  """Records size and CRC32 of every file of a committed step in files.json."""
  step_dir = epath.Path(step_dir)
  entries = {
    os.fspath(p.relative_to(step_dir)): {
      "size": p.stat().length,
      "crc32": _crc32(p),
    }
    for p in _step_files(step_dir)
  }
  tmp = step_dir / (FILE_MANIFEST + ".tmp")
  tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
  tmp.rename(step_dir / FILE_MANIFEST)


def verify_files(step_dir: epath.PathLike, *, checksums: bool = True) -> bool:
  """Checks a step's files against its files.json.

  Args:
    step_dir: `<root>/<step>` directory.
    checksums: also compare CRC32s (sizes are always compared).

  Returns:
    True if verified, False if the step has no manifest (nothing to check).

  Raises:
    CorruptCheckpointError: naming the first missing, truncated or corrupt file.
  """
  step_dir = epath.Path(step_dir)
  manifest = step_dir / FILE_MANIFEST
  if not manifest.exists():
    return False
  for rel, want in sorted(json.loads(manifest.read_text()).items()):
    path = step_dir / rel
    if not path.exists():
      raise CorruptCheckpointError(f"Checkpoint file missing: {path}")
    size = path.stat().length
    if size != want["size"]:
      raise CorruptCheckpointError(
        f"Checkpoint file truncated or altered: {path} has {size} bytes, "
        f"{want['size']} were written."
      )
    if checksums and _crc32(path) != want["crc32"]:
      raise CorruptCheckpointError(f"Checkpoint file corrupt (CRC32 mismatch): {path}")
  return True


Corrupt = Sequence[tuple[int, CorruptCheckpointError]]


def _details(corrupt: Corrupt) -> str:
  """'step N: <error naming the bad file>; ...' of corrupt steps."""
  return "; ".join(f"step {step}: {str(error).rstrip('.')}" for step, error in corrupt)


def _warn_skipped(corrupt: Corrupt, instead: str) -> None:
  """One loud warning naming every corrupt step, its bad file and what is used instead."""
  logging.warning(
    "CORRUPT CHECKPOINT STEP%s %s skipped (%s); %s. The corrupt files are left as they are.",
    "S" if len(corrupt) > 1 else "",
    ", ".join(str(step) for step, _ in corrupt),
    _details(corrupt),
    instead,
  )


def _none_intact(root: epath.Path, corrupt: Corrupt) -> CorruptCheckpointError:
  """The error when every step of `root` is corrupt, naming each bad file."""
  return CorruptCheckpointError(f"No intact checkpoint step in {root}: {_details(corrupt)}")


def newest_intact(
  root: epath.Path, steps: Sequence[int], load: Callable[[int], _T]
) -> tuple[int, _T]:
  """Loads the newest step whose `load` raises no `CorruptCheckpointError`.

  Args:
    root: the checkpoint root (for messages).
    steps: its step numbers.
    load: step -> result; raises `CorruptCheckpointError` for a corrupt step
      (e.g. `verify_files` of the step directory, or a full restore).

  Returns:
    (step, load(step)) of the newest intact step; skipped corrupt newer steps
    are named in one warning.

  Raises:
    CorruptCheckpointError: if every step is corrupt, naming each bad file.
  """
  corrupt = []
  for step in sorted(steps, reverse=True):
    try:
      result = load(step)
    except CorruptCheckpointError as e:
      corrupt.append((step, e))
      continue
    if corrupt:
      _warn_skipped(corrupt, f"using step {step} of {root} instead")
    return step, result
  raise _none_intact(root, corrupt)


def intact_steps(
  root: epath.Path, steps: Sequence[tuple[int, epath.Path]], *, checksums: bool = True
) -> list[tuple[int, epath.Path]]:
  """The (step, step directory) pairs whose files verify (`verify_files`).

  Args:
    root: the checkpoint root (for messages).
    steps: (step, step directory) pairs of `root`.
    checksums: also compare CRC32s.

  Returns:
    The intact pairs, in the given order; skipped corrupt ones are named in
    one warning.

  Raises:
    CorruptCheckpointError: if every step is corrupt, naming each bad file.
  """
  intact, corrupt = [], []
  for step, step_dir in steps:
    try:
      verify_files(step_dir, checksums=checksums)
    except CorruptCheckpointError as e:
      corrupt.append((step, e))
      continue
    intact.append((step, step_dir))
  if not intact and corrupt:
    raise _none_intact(root, corrupt)
  if corrupt:
    _warn_skipped(corrupt, f"using steps {[step for step, _ in intact]} of {root}")
  return intact
