r"""Tables of finished recipe runs, from what training wrote to their MODEL_DIRs.

  python tools/recipe_results.py runs/recipes/multi30k runs/recipes/sst2 ...
  python tools/recipe_results.py --groups \
      "sst2 pre-trained=runs/recipes/sst2_s0,runs/recipes/sst2_s1" \
      "sst2 scratch=runs/recipes/sst2_scratch_s0,runs/recipes/sst2_scratch_s1"

Without --groups: one markdown row per MODEL_DIR with the metric that picked the
best step (best.json), that step's validation value, the final evaluation of the
best step (final_metrics.json), the minutes to the best step and in all
(metrics.jsonl's `elapsed_s`), and the token slots trained on. With --groups:
one row per label, the mean and standard error (sample standard deviation over
sqrt(n)) of the validation and final values over its runs, e.g. two seeds. A
run directory without these files is reported in one `ERROR:` line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from collections.abc import Sequence
from typing import Any

from t5x_lite.core import errors


def _read_json(path: str) -> dict[str, Any]:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except FileNotFoundError:
    raise ValueError(f"{path} not found: is it a finished recipe run's MODEL_DIR?") from None


def _elapsed_by_step(model_dir: str) -> dict[int, float]:
  """The latest `elapsed_s` logged at each step (a resumed run's records win)."""
  elapsed: dict[int, float] = {}
  with open(os.path.join(model_dir, "metrics.jsonl"), encoding="utf-8") as f:
    for line in f:
      try:
        record = json.loads(line)
      except json.JSONDecodeError:  # a run killed mid-line
        continue
      if "elapsed_s" in record:
        elapsed[int(record["step"])] = float(record["elapsed_s"])
  return elapsed


def run_summary(model_dir: str) -> dict[str, Any]:
  """What one finished run reached: metric, best step, values, minutes, tokens."""
  best = _read_json(os.path.join(model_dir, "best.json"))
  final = _read_json(os.path.join(model_dir, "final_metrics.json"))
  elapsed = _elapsed_by_step(model_dir)
  metric, step = best["metric"], best["best_step"]
  task = metric.split("/", 1)[0]
  final_values = {k: v for k, v in final.items() if k.startswith(f"{task}/")}
  return {
    "run": model_dir,
    "metric": metric,
    "best_step": step,
    "validation": best["best_value"],
    "final": final_values.get(metric),
    "final_all": final_values,
    "final_split": final.get("split"),
    "minutes_to_best": elapsed.get(step, math.nan) / 60,
    "minutes": max(elapsed.values(), default=math.nan) / 60,
    "last_step": max(elapsed, default=0),
  }


def _fmt(value: float | None, digits: int = 1) -> str:
  return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def runs_table(summaries: Sequence[dict[str, Any]]) -> str:
  """One markdown row per run."""
  rows = [
    "| run | metric | best step (of last) | validation | final (split) "
    "| minutes to best | minutes |",
    "|---|---|---|---|---|---|---|",
  ]
  for s in summaries:
    rows.append(
      f"| {s['run']} | {s['metric']} | {s['best_step']} ({s['last_step']}) | "
      f"{_fmt(s['validation'])} | {_fmt(s['final'])} ({s['final_split']}) | "
      f"{_fmt(s['minutes_to_best'])} | {_fmt(s['minutes'])} |"
    )
  return "\n".join(rows)


def mean_and_error(values: Sequence[float]) -> tuple[float, float]:
  """Mean and standard error (sample standard deviation / sqrt(n); nan for one value)."""
  mean = statistics.fmean(values)
  if len(values) < 2:
    return mean, math.nan
  return mean, statistics.stdev(values) / math.sqrt(len(values))


def groups_table(groups: Sequence[tuple[str, Sequence[dict[str, Any]]]]) -> str:
  """One markdown row per labelled group of runs: mean +- standard error."""
  rows = [
    "| runs | n | metric | validation | final (split) | minutes |",
    "|---|---|---|---|---|---|",
  ]
  for label, summaries in groups:
    validation = mean_and_error([s["validation"] for s in summaries])
    final = mean_and_error([s["final"] for s in summaries if s["final"] is not None] or [math.nan])
    minutes = statistics.fmean(s["minutes"] for s in summaries)
    rows.append(
      f"| {label} | {len(summaries)} | {summaries[0]['metric']} | "
      f"{_fmt(validation[0])} ± {_fmt(validation[1])} | "
      f"{_fmt(final[0])} ± {_fmt(final[1])} ({summaries[0]['final_split']}) | {_fmt(minutes)} |"
    )
  return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> None:
  """Command-line entry point; a bad input exits with one `ERROR:` line."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("model_dirs", nargs="*", help="finished recipe MODEL_DIRs")
  parser.add_argument(
    "--groups", nargs="*", default=[], help="'label=dir1,dir2,...': mean and standard error"
  )
  args = parser.parse_args(argv)
  if not args.model_dirs and not args.groups:
    errors.fail("Give MODEL_DIRs or --groups 'label=dir1,dir2'.")
  try:
    if args.model_dirs:
      print(runs_table([run_summary(d) for d in args.model_dirs]))
    if args.groups:
      parsed = []
      for group in args.groups:
        label, sep, dirs = group.partition("=")
        if not sep or not dirs:
          raise ValueError(f"--groups {group!r}: expected 'label=dir1,dir2,...'.")
        parsed.append((label, [run_summary(d) for d in dirs.split(",")]))
      print(groups_table(parsed))
  except (OSError, ValueError, KeyError) as e:
    errors.fail(str(e))


if __name__ == "__main__":
  main()
