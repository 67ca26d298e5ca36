"""Plots MODEL_DIR/metrics.jsonl (written by training) to a PNG.

  python tools/plot_metrics.py MODEL_DIR [--out FILE.png] [--metrics loss,accuracy]

One panel per metric, train and eval curves together. When a run was resumed
and repeated some steps, the last record of a (split, step) wins. Paths are
relative to the working directory; the PNG's directory is created if needed. A
bad input is reported as one `ERROR: <message>` line with exit status 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (backend must be chosen first)

from t5x_lite.core import errors  # noqa: E402

METRICS_FILE = "metrics.jsonl"  # t5x_lite.training.metrics_logging.METRICS_FILE
DEFAULT_METRICS = (
  "loss",
  "accuracy",
  "learning_rate",
  "grad_norm",
  "throughput/tokens_per_sec_per_device",
  "throughput/mfu",
)
Series = dict[str, dict[str, dict[int, float]]]  # split -> metric -> step -> value


def read_metrics(path: str) -> Series:
  """Reads metrics.jsonl into split -> metric -> {step: value} (finite only)."""
  series: Series = {}
  with open(path, encoding="utf-8") as f:
    for line_number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
        split, step = record.pop("split"), int(record.pop("step"))
      except (json.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError):
        # A run killed mid-write leaves a partial last line; skip it.
        print(f"{path}:{line_number}: skipping unparsable line")
        continue
      record.pop("time", None)
      for name, value in record.items():
        if isinstance(value, (int, float)) and math.isfinite(value):
          series.setdefault(split, {}).setdefault(name, {})[step] = float(value)
  return series


def plot(series: Series, metrics: Sequence[str], out: str, title: str) -> list[str]:
  """Draws one panel per metric present; returns the metrics drawn."""
  present = [m for m in metrics if any(m in by_metric for by_metric in series.values())]
  if not present:
    raise ValueError(f"None of {list(metrics)} found in the metrics file.")
  columns = min(3, len(present))
  rows = math.ceil(len(present) / columns)
  figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.5 * rows), squeeze=False)
  for axis, metric in zip(axes.flat, present):
    for split, by_metric in sorted(series.items(), reverse=True):
      if metric in by_metric:
        steps = sorted(by_metric[metric])
        axis.plot(
          steps,
          [by_metric[metric][s] for s in steps],
          label=split,
          marker="o" if split == "eval" else None,
          markersize=3,
        )
    axis.set_title(metric)
    axis.set_xlabel("step")
    axis.grid(alpha=0.3)
    axis.legend()
    if metric == "learning_rate" or metric.endswith("loss"):
      axis.set_yscale("log")
  for axis in list(axes.flat)[len(present) :]:
    axis.set_visible(False)
  figure.suptitle(title)
  figure.tight_layout()
  figure.savefig(out, dpi=100)
  plt.close(figure)
  return present


def main(argv: Sequence[str] | None = None) -> None:
  """Command-line entry point; a bad input exits with one `ERROR:` line."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("model_dir", help="training MODEL_DIR containing metrics.jsonl")
  parser.add_argument("--out", help="PNG to write (default MODEL_DIR/metrics.png)")
  parser.add_argument(
    "--metrics", default=",".join(DEFAULT_METRICS), help="comma-separated metric names"
  )
  args = parser.parse_args(argv)
  model_dir = os.path.abspath(args.model_dir)
  path = os.path.join(model_dir, METRICS_FILE)
  out = os.path.abspath(args.out or os.path.join(model_dir, "metrics.png"))
  if not os.path.isfile(path):
    errors.fail(f"{path} not found: is {args.model_dir} a training MODEL_DIR?")
  try:
    os.makedirs(os.path.dirname(out), exist_ok=True)
    drawn = plot(read_metrics(path), args.metrics.split(","), out, model_dir)
  except (OSError, ValueError) as e:
    errors.fail(str(e))
  print(f"Wrote {out} ({', '.join(drawn)})")


if __name__ == "__main__":
  main()
