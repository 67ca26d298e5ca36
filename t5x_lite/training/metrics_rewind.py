"""Rewinds MODEL_DIR's logs to the step a run starts from, so each step is logged once.

A run killed after its last checkpoint (SIGKILL, a lost host) has logged steps that
the restarted run computes and logs again. Before the restarted run writes anything,
`rewind_logs` drops what was logged after its start step from

* MODEL_DIR/metrics.jsonl, rewritten through a temporary file and an atomic rename,
  so a reader (tools/plot_metrics.py, pandas) sees the old file or the new one;
* the TensorBoard event files of MODEL_DIR/train and MODEL_DIR/eval, each rewritten
  the same way without the events of later steps (a record cut short by the kill is
  dropped too).

Only process 0 writes logs, so only it rewinds them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import tensorflow as tf
from absl import logging

from t5x_lite.training import metrics_logging


def _replace(path: str, lines: Sequence[bytes] | None, records: Sequence[bytes] | None) -> None:
  """Atomically replaces `path` by text `lines` or by TFRecord `records`."""
  temporary = path + ".rewind.tmp"
  if lines is not None:
    with open(temporary, "wb") as f:
      f.writelines(lines)
      f.flush()
      os.fsync(f.fileno())
  else:
    assert records is not None  # one of the two
    with tf.io.TFRecordWriter(temporary) as writer:
      for record in records:
        writer.write(record)
  os.replace(temporary, path)


def rewind_metrics_jsonl(path: str, step: int) -> int:
  """Drops the records of steps after `step` from a metrics.jsonl; returns how many.

  A last line cut short by a kill is dropped too; other lines are kept byte for byte.
  """
  if not os.path.exists(path):
    return 0
  with open(path, "rb") as f:
    lines = f.readlines()
  kept = []
  for line in lines:
    try:
      record_step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
      continue  # a line the kill cut short
    if record_step <= step:
      kept.append(line if line.endswith(b"\n") else line + b"\n")
  if len(kept) != len(lines):
    _replace(path, kept, None)
  return len(lines) - len(kept)


def rewind_event_file(path: str, step: int) -> int:
  """Drops the events of steps after `step` from a TensorBoard event file; returns how many."""
  kept, dropped = [], 0
  try:
    for record in tf.data.TFRecordDataset(path):
      raw = record.numpy()
      if tf.compat.v1.Event.FromString(raw).step <= step:
        kept.append(raw)
      else:
        dropped += 1
  except tf.errors.DataLossError:  # a last record cut short by the kill
    dropped += 1
  if dropped:
    _replace(path, None, kept)
  return dropped


def rewind_logs(model_dir: str, step: int, tensorboard_dirs: Sequence[str]) -> None:
  """Drops what MODEL_DIR's logs hold after `step` (see the module docstring).

  Args:
    model_dir: MODEL_DIR.
    step: the step the run starts from (the restored one, or 0).
    tensorboard_dirs: the TensorBoard directories inside MODEL_DIR.
  """
  dropped = rewind_metrics_jsonl(os.path.join(model_dir, metrics_logging.METRICS_FILE), step)
  for name in tensorboard_dirs:
    directory = os.path.join(model_dir, name)
    if os.path.isdir(directory):
      for entry in sorted(os.listdir(directory)):
        if entry.startswith("events.out.tfevents.") and not entry.endswith(".tmp"):
          dropped += rewind_event_file(os.path.join(directory, entry), step)
  if dropped:
    logging.warning(
      "Dropped %d records logged after step %d by an earlier run of %s (metrics.jsonl and "
      "TensorBoard): this run logs those steps again.",
      dropped,
      step,
      model_dir,
    )
