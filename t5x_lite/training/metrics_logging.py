"""Where training metrics go: TensorBoard, MODEL_DIR/metrics.jsonl, the console.

Only process 0 writes files; every process logs its console line. Layout:

  MODEL_DIR/train/events.*     TensorBoard scalars of training steps (clu)
  MODEL_DIR/eval/events.*      TensorBoard scalars of periodic evaluation
  MODEL_DIR/final/events.*     the final evaluation (of the best step, e.g. on test)
  MODEL_DIR/metrics.jsonl      one JSON object per written step:
                               {"step": 20, "split": "train", "time": <unix s>,
                                "elapsed_s": <s since the run began>,
                                "tokens_seen": <token slots trained on>,
                                "loss": ..., "accuracy": ..., ...}

Values are floats; `tools/plot_metrics.py MODEL_DIR` plots the JSONL file.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping

import jax
from absl import logging
from clu import metric_writers

METRICS_FILE = "metrics.jsonl"
# 'final': the end-of-training evaluation of the best step (train.final_eval_dataset_cfg).
SPLITS = ("train", "eval", "final")


def format_duration(seconds: float) -> str:
  """'1h02m', '4m05s' or '12s'."""
  seconds = max(0, int(round(seconds)))
  hours, rest = divmod(seconds, 3600)
  minutes, secs = divmod(rest, 60)
  if hours:
    return f"{hours}h{minutes:02d}m"
  if minutes:
    return f"{minutes}m{secs:02d}s"
  return f"{secs}s"


def progress_line(
  split: str,
  step: int,
  total_steps: int,
  scalars: Mapping[str, float],
  eta_seconds: float | None,
) -> str:
  """One readable console line for a set of metrics."""
  parts = [f"{split} step {step}/{total_steps}"]
  formats = {
    "loss": "loss {:.4f}",
    "accuracy": "acc {:.3f}",
    "learning_rate": "lr {:.2e}",
    "grad_norm": "|g| {:.3f}",
    "throughput/tokens_per_sec_per_device": "{:,.0f} tok/s/dev",
    "throughput/mfu": "MFU {:.1%}",
    "throughput/mfu_measured_matmul": "{:.1%} of the measured matmul",
  }
  parts += [fmt.format(scalars[k]) for k, fmt in formats.items() if k in scalars]
  if eta_seconds is not None:
    parts.append(f"ETA {format_duration(eta_seconds)}")
  return " | ".join(parts)


class MetricsLogger:
  """Writes scalar metrics to TensorBoard, metrics.jsonl and the console."""

  def __init__(self, model_dir: str, total_steps: int):
    """Opens the writers (files on process 0 only).

    Args:
      model_dir: MODEL_DIR.
      total_steps: the run's final step, for progress and ETA.
    """
    self.total_steps = total_steps
    self._primary = jax.process_index() == 0
    self._writers: dict[str, metric_writers.MetricWriter] = {}
    self._jsonl = None
    self._start: tuple[int, float] | None = None
    self._model_dir = model_dir
    if self._primary:
      os.makedirs(model_dir, exist_ok=True)
      self._jsonl = open(os.path.join(model_dir, METRICS_FILE), "a", encoding="utf-8")

  def start_clock(self, step: int) -> None:
    """Marks the step from which the ETA is extrapolated (after compilation)."""
    self._start = (step, time.time())

  def _eta(self, step: int) -> float | None:
    if self._start is None or step <= self._start[0]:
      return None
    first, began = self._start
    return (time.time() - began) / (step - first) * (self.total_steps - step)

  def write(self, split: str, step: int, scalars: Mapping[str, float]) -> None:
    """Writes one step's scalars everywhere.

    Args:
      split: 'train' or 'eval'.
      step: training step the metrics belong to.
      scalars: metric name -> Python float.
    """
    if split not in SPLITS:
      raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    scalars = {k: float(v) for k, v in scalars.items()}
    logging.info(
      "%s",
      progress_line(
        split, step, self.total_steps, scalars, self._eta(step) if split == "train" else None
      ),
    )
    if not self._primary:
      return
    if split not in self._writers:  # opened on first use: most runs write no 'final'
      self._writers[split] = metric_writers.AsyncMultiWriter(
        [metric_writers.SummaryWriter(os.path.join(self._model_dir, split))]
      )
    self._writers[split].write_scalars(step, scalars)
    record = {"step": step, "split": split, "time": time.time()}
    record.update({k: (v if math.isfinite(v) else str(v)) for k, v in scalars.items()})
    assert self._jsonl is not None  # opened on the primary process
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()

  def flush(self) -> None:
    """Flushes TensorBoard writers (the JSONL file is flushed per line)."""
    for writer in self._writers.values():
      writer.flush()

  def close(self) -> None:
    """Flushes and closes all writers."""
    for writer in self._writers.values():
      writer.close()
    self._writers = {}
    if self._jsonl is not None:
      self._jsonl.close()
      self._jsonl = None
