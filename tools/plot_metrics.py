"""Plots MODEL_DIR/metrics.jsonl (written by training) to a PNG.

  python tools/plot_metrics.py MODEL_DIR [--out FILE.png] [--metrics loss,accuracy]
      [--x step|minutes|tokens]

One panel per metric, train and eval curves together; the tasks' own metrics of
the periodic evaluation (e.g. `local_multi30k_ende/bleu`) and of the final
evaluation are drawn as well. `--x minutes` draws each metric against the run's
wall time (`elapsed_s`, which counts every attempt of a resumed run), `--x tokens`
against the token slots trained on (`tokens_seen`): time-to-quality curves.
When a run was resumed and repeated some steps, the last record of a (split,
step) wins. Paths are
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
# --x: the axis label and the record field that gives it (None: the step itself).
X_AXES = {
  "step": ("step", None),
  "minutes": ("minutes", "elapsed_s"),
  "tokens": ("token slots", "tokens_seen"),
}


def read_metrics(path: str) -> Series:
  """Reads metrics.jsonl into split -> metric -> {step: value} (finite only).

  `elapsed_s` and `tokens_seen` are kept as metrics of their split, so a step's
  wall time and tokens can be looked up (`positions`).
  """
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


def task_metrics(series: Series) -> list[str]:
  """The tasks' own metrics ('<task>/<metric>') of the eval and final records."""
  names = {
    name
    for split in ("eval", "final")
    for name in series.get(split, {})
    if "/" in name and not name.startswith("throughput/")
  }
  return sorted(names)


def positions(series: Series, split: str, steps: Sequence[int], x: str) -> list[float] | None:
  """The x coordinates of `steps` of `split` (None if a step lacks the needed field)."""
  _, field = X_AXES[x]
  if field is None:
    return [float(s) for s in steps]
  # A step's own record first; a final record (of the best step) takes its step's
  # place from the eval or train record of that step.
  known = {}
  for source in ("train", "eval", split):
    known.update(series.get(source, {}).get(field, {}))
  if any(s not in known for s in steps):
    return None
  scale = 1 / 60 if x == "minutes" else 1.0
  return [known[s] * scale for s in steps]


def plot(
  series: Series, metrics: Sequence[str], out: str, title: str, x: str = "step"
) -> list[str]:
  """Draws one panel per metric present; returns the metrics drawn.

  Raises:
    ValueError: none of `metrics` is in `series`, or (`x` other than 'step') the
      records have no `elapsed_s` / `tokens_seen` (written by older versions).
  """
  present = [m for m in metrics if any(m in by_metric for by_metric in series.values())]
  if not present:
    raise ValueError(f"None of {list(metrics)} found in the metrics file.")
  columns = min(3, len(present))
  rows = math.ceil(len(present) / columns)
  figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.5 * rows), squeeze=False)
  markers = {"train": None, "eval": "o", "final": "*"}
  for axis, metric in zip(axes.flat, present):
    for split, by_metric in sorted(series.items(), reverse=True):
      if metric in by_metric:
        steps = sorted(by_metric[metric])
        xs = positions(series, split, steps, x)
        if xs is None:
          raise ValueError(
            f"--x {x}: the {split} records have no {X_AXES[x][1]} (written by an older "
            "t5x_lite); plot them with --x step."
          )
        axis.plot(
          xs,
          [by_metric[metric][s] for s in steps],
          label=split,
          marker=markers.get(split),
          markersize=10 if split == "final" else 3,
          linestyle="none" if split == "final" else "-",
        )
    axis.set_title(metric)
    axis.set_xlabel(X_AXES[x][0])
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
    "--metrics",
    default=None,
    help="comma-separated metric names (default: loss, accuracy, learning rate, gradient "
    "norm, throughput and every task metric)",
  )
  parser.add_argument("--x", choices=sorted(X_AXES), default="step", help="the horizontal axis")
  args = parser.parse_args(argv)
  model_dir = os.path.abspath(args.model_dir)
  path = os.path.join(model_dir, METRICS_FILE)
  out = os.path.abspath(args.out or os.path.join(model_dir, "metrics.png"))
  if not os.path.isfile(path):
    errors.fail(f"{path} not found: is {args.model_dir} a training MODEL_DIR?")
  try:
    os.makedirs(os.path.dirname(out), exist_ok=True)
    series = read_metrics(path)
    metrics = args.metrics.split(",") if args.metrics else [*DEFAULT_METRICS, *task_metrics(series)]
    drawn = plot(series, metrics, out, model_dir, args.x)
  except (OSError, ValueError) as e:
    errors.fail(str(e))
  print(f"Wrote {out} ({', '.join(drawn)})")


if __name__ == "__main__":
  main()
