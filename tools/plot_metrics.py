"""Plots MODEL_DIR/metrics.jsonl (written by training) to an SVG.

  python tools/plot_metrics.py MODEL_DIR [--out FILE.svg] [--metrics loss,accuracy]
      [--x step|minutes|tokens]

One panel per metric, train and eval curves together; the tasks' own metrics of
the periodic evaluation (e.g. `local_multi30k_ende/bleu`) and of the final
evaluation are drawn as well. `--x minutes` draws each metric against the run's
wall time (`elapsed_s`, which counts every attempt of a resumed run), `--x tokens`
against the token slots trained on (`tokens_seen`): time-to-quality curves.
When a run was resumed and repeated some steps, the last record of a (split,
step) wins. Paths are relative to the working directory; the SVG's directory is
created if needed. A bad input is reported as one `ERROR: <message>` line with exit
status 1.

The SVG is written directly (no plotting library): matplotlib, once installed, is
imported by every process that imports TensorFlow (Keras reaches for pyplot), which
would slow the start of every training, evaluation and inference process. Losses
and the learning rate are drawn on a log scale (their non-positive values left out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Sequence
from xml.sax.saxutils import escape, quoteattr

from t5x_lite.core import errors

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


# Layout of the SVG, in pixels: one panel per metric, at most COLUMNS per row.
COLUMNS = 3
PANEL_WIDTH, PANEL_HEIGHT = 500, 350
TITLE_HEIGHT = 40
# The plot area inside a panel: margins for the panel title, tick labels and x label.
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 40, 50
# Colour, marker and line of each split (other splits take the spare colours in turn).
STYLES = {
  "train": ("#1f77b4", None, True),
  "eval": ("#ff7f0e", "circle", True),
  "final": ("#2ca02c", "star", False),
}
# Drawing order: train, then eval (and any other split), then the final record on top.
_DRAW_ORDER = {"train": 0, "eval": 1, "final": 2}
SPARE_COLORS = ("#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def log_scaled(metric: str) -> bool:
  """Whether `metric` is drawn on a log scale (losses and the learning rate)."""
  return metric == "learning_rate" or metric.endswith("loss")


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
  """About `count` round values (1, 2, 2.5 or 5 times a power of ten apart) in [low, high]."""
  if not high > low:
    return [low]
  raw = (high - low) / count
  magnitude = 10.0 ** math.floor(math.log10(raw))
  step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
  first = math.ceil(low / step - 1e-9)
  ticks = []
  while (first + len(ticks)) * step <= high + step * 1e-9:
    ticks.append(round((first + len(ticks)) * step, 12))
  return ticks


def log_ticks(low: float, high: float) -> list[float]:
  """Tick values for a log axis over [low, high] > 0: powers of ten where there are
  two or more, else 1, 2 and 5 times them, else round values placed logarithmically."""
  decades = range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
  for multiples in ((1,), (1, 2, 5)):
    ticks = [
      m * 10.0**d
      for d in decades
      for m in multiples
      if low * (1 - 1e-6) <= m * 10.0**d <= high * (1 + 1e-6)  # 10**log10(x) may miss x
    ]
    if len(ticks) >= 2:
      return ticks[:: max(1, math.ceil(len(ticks) / 8))]
  return nice_ticks(low, high)


def padded_range(values: Sequence[float]) -> tuple[float, float]:
  """[min, max] of `values` widened by 5% on each side (a single value by 1 either way)."""
  low, high = min(values), max(values)
  if high == low:
    return low - 1.0, high + 1.0
  pad = 0.05 * (high - low)
  return low - pad, high + pad


def _label(value: float) -> str:
  return f"{value:.6g}"  # 32000 rather than 3.2e+04; 1e-05 stays short


def _marker(kind: str, x: float, y: float, color: str) -> str:
  if kind == "circle":
    return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>'
  points = []  # a five-pointed star, outer radius 8
  for i in range(10):
    radius = 8.0 if i % 2 == 0 else 3.4
    angle = math.pi / 2 - i * math.pi / 5
    points.append(f"{x + radius * math.cos(angle):.1f},{y - radius * math.sin(angle):.1f}")
  return f'<polygon points="{" ".join(points)}" fill="{color}"/>'


def _panel(
  metric: str,
  curves: Sequence[tuple[str, list[float], list[float]]],
  x_label: str,
  left: float,
  top: float,
) -> list[str]:
  """The SVG elements of one metric's panel whose top-left corner is (left, top).

  `curves` holds (split, xs, ys) per split, in drawing order.
  """
  log = log_scaled(metric) and any(y > 0 for _, _, ys in curves for y in ys)
  if log:  # as matplotlib does, a log axis leaves the non-positive values out
    curves = [
      (split, [x for x, y in zip(xs, ys) if y > 0], [math.log10(y) for y in ys if y > 0])
      for split, xs, ys in curves
    ]
  all_x = [x for _, xs, _ in curves for x in xs]
  all_y = [y for _, _, ys in curves for y in ys]
  x_low, x_high = padded_range(all_x)
  y_low, y_high = padded_range(all_y)
  area_left, area_top = left + LEFT, top + TOP
  width, height = PANEL_WIDTH - LEFT - RIGHT, PANEL_HEIGHT - TOP - BOTTOM

  def px(x: float) -> float:
    return area_left + (x - x_low) / (x_high - x_low) * width

  def py(y: float) -> float:
    return area_top + (y_high - y) / (y_high - y_low) * height

  scale = "log" if log else "linear"
  out = [f'<g class="panel" data-metric={quoteattr(metric)} data-scale="{scale}">']
  out.append(
    f'<text x="{area_left + width / 2:.1f}" y="{top + TOP - 12:.1f}" font-size="15" '
    f'text-anchor="middle">{escape(metric)}</text>'
  )
  y_ticks = (
    [math.log10(t) for t in log_ticks(10**y_low, 10**y_high)] if log else nice_ticks(y_low, y_high)
  )
  for tick in nice_ticks(x_low, x_high):
    out.append(
      f'<line x1="{px(tick):.1f}" y1="{area_top}" x2="{px(tick):.1f}" y2="{area_top + height}" '
      'stroke="#000" stroke-opacity="0.1"/>'
    )
    out.append(
      f'<text x="{px(tick):.1f}" y="{area_top + height + 16}" font-size="11" '
      f'text-anchor="middle">{_label(tick)}</text>'
    )
  for tick in y_ticks:  # within [y_low, y_high]: nice_ticks and log_ticks keep to it
    out.append(
      f'<line x1="{area_left}" y1="{py(tick):.1f}" x2="{area_left + width}" y2="{py(tick):.1f}" '
      'stroke="#000" stroke-opacity="0.1"/>'
    )
    out.append(
      f'<text x="{area_left - 6}" y="{py(tick) + 4:.1f}" font-size="11" '
      f'text-anchor="end">{_label(10**tick if log else tick)}</text>'
    )
  out.append(
    f'<rect x="{area_left}" y="{area_top}" width="{width}" height="{height}" fill="none" '
    'stroke="#000"/>'
  )
  out.append(
    f'<text x="{area_left + width / 2:.1f}" y="{area_top + height + 38}" font-size="12" '
    f'text-anchor="middle">{escape(x_label)}</text>'
  )
  spare = iter(SPARE_COLORS * len(curves))
  legend, drawn = [], []
  for split, xs, ys in curves:
    color, marker, line = STYLES.get(split, (next(spare), "circle", True))
    points = [(px(x), py(y)) for x, y in zip(xs, ys)]
    text = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
    out.append(f'<g class="series" data-split={quoteattr(split)} data-points="{text}">')
    if line and len(xs) > 1:
      out.append(f'<polyline points="{text}" fill="none" stroke="{color}" stroke-width="1.5"/>')
    if marker:
      out.extend(_marker(marker, x, y, color) for x, y in points)
    out.append("</g>")
    legend.append((split, color, marker, line))
    drawn.extend(points)
  # The legend in the inside corner that covers the fewest points (as matplotlib's "best").
  box_width = 44 + 7 * max(len(split) for split, *_ in legend)
  box_height = 8 + 18 * len(legend)
  corners = [
    (area_left + width - box_width - 6, area_top + 6),
    (area_left + 6, area_top + 6),
    (area_left + width - box_width - 6, area_top + height - box_height - 6),
    (area_left + 6, area_top + height - box_height - 6),
  ]

  def covered(corner: tuple[float, float]) -> int:
    left, top = corner
    return sum(left <= x <= left + box_width and top <= y <= top + box_height for x, y in drawn)

  box_left, box_top = min(corners, key=covered)
  out.append(
    f'<rect class="legend" x="{box_left:.1f}" y="{box_top:.1f}" width="{box_width}" '
    f'height="{box_height}" fill="#fff" fill-opacity="0.8" stroke="#ccc"/>'
  )
  for i, (split, color, marker, line) in enumerate(legend):
    x, y = box_left + 8, box_top + 13 + 18 * i
    if line:
      out.append(
        f'<line x1="{x:.1f}" y1="{y:.1f}" x2="{x + 24:.1f}" y2="{y:.1f}" stroke="{color}" '
        'stroke-width="1.5"/>'
      )
    if marker:
      out.append(_marker(marker, x + 12, y, color))
    out.append(f'<text x="{x + 30:.1f}" y="{y + 4:.1f}" font-size="12">{escape(split)}</text>')
  out.append("</g>")
  return out


def plot(
  series: Series, metrics: Sequence[str], out: str, title: str, x: str = "step"
) -> list[str]:
  """Writes one panel per metric present to the SVG `out`; returns the metrics drawn.

  Raises:
    ValueError: none of `metrics` is in `series`, or (`x` other than 'step') the
      records have no `elapsed_s` / `tokens_seen` (written by older versions).
  """
  present = [m for m in metrics if any(m in by_metric for by_metric in series.values())]
  if not present:
    raise ValueError(f"None of {list(metrics)} found in the metrics file.")
  columns = min(COLUMNS, len(present))
  rows = math.ceil(len(present) / columns)
  width, height = PANEL_WIDTH * columns, TITLE_HEIGHT + PANEL_HEIGHT * rows
  body = [
    f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
    f'viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Arial, sans-serif">',
    f'<rect width="{width}" height="{height}" fill="#fff"/>',
    f'<text x="{width / 2}" y="26" font-size="16" text-anchor="middle">{escape(title)}</text>',
  ]
  for index, metric in enumerate(present):
    curves = []
    for split, by_metric in sorted(series.items(), key=lambda item: _DRAW_ORDER.get(item[0], 1)):
      if metric in by_metric:
        steps = sorted(by_metric[metric])
        xs = positions(series, split, steps, x)
        if xs is None:
          raise ValueError(
            f"--x {x}: the {split} records have no {X_AXES[x][1]} (written by an older "
            "t5x_lite); plot them with --x step."
          )
        curves.append((split, xs, [by_metric[metric][s] for s in steps]))
    row, column = divmod(index, columns)
    body.extend(
      _panel(metric, curves, X_AXES[x][0], column * PANEL_WIDTH, TITLE_HEIGHT + row * PANEL_HEIGHT)
    )
  body.append("</svg>")
  with open(out, "w", encoding="utf-8") as f:
    f.write("\n".join(body) + "\n")
  return present


def main(argv: Sequence[str] | None = None) -> None:
  """Command-line entry point; a bad input exits with one `ERROR:` line."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("model_dir", help="training MODEL_DIR containing metrics.jsonl")
  parser.add_argument("--out", help="SVG to write (default MODEL_DIR/metrics.svg)")
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
  out = os.path.abspath(args.out or os.path.join(model_dir, "metrics.svg"))
  if not os.path.isfile(path):
    errors.fail(f"{path} not found: is {args.model_dir} a training MODEL_DIR?")
  if not out.endswith(".svg"):
    errors.fail(f"--out {args.out}: plot_metrics writes SVG; name a .svg file.")
  try:
    os.makedirs(os.path.dirname(out), exist_ok=True)
    series = read_metrics(path)
    metrics = args.metrics.split(",") if args.metrics else [*DEFAULT_METRICS, *task_metrics(series)]
    drawn = plot(series, metrics, out, os.path.normpath(args.model_dir), args.x)
  except (OSError, ValueError) as e:
    errors.fail(str(e))
  print(f"Wrote {out} ({', '.join(drawn)})")


if __name__ == "__main__":
  main()
