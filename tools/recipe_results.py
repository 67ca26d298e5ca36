r"""Tables of finished recipe runs, from what training wrote to their MODEL_DIRs.

  python tools/recipe_results.py runs/recipes/multi30k runs/recipes/sst2 ...
  python tools/recipe_results.py --groups \
      "sst2 pre-trained=runs/recipes/sst2_s0,runs/recipes/sst2_s1" \
      "sst2 scratch=runs/recipes/sst2_scratch_s0,runs/recipes/sst2_scratch_s1"
  python tools/recipe_results.py --paired runs/recipes/multi30k_scratch runs/recipes/multi30k

Without --groups: one markdown row per MODEL_DIR with the metric that picked the
best step (best.json), that step's value on the split that chose it (validation, or
the recipe's SELECTION_SPLIT, read from the run's config.gin), the final evaluation of
the best step (final_metrics.json), the minutes to the best step and in all
(metrics.jsonl's `elapsed_s`), and the token slots trained on. With --groups:
one row per label, the mean and standard error (sample standard deviation over
sqrt(n)) of the validation and final values over its runs, e.g. two seeds (a
directory may be a pattern, 'label=runs/recipes/sst2_s*'), then for each pair of
groups of one metric the difference of their means and how many standard errors of
the difference (the square root of the summed squared standard errors) it is. With
--paired A B: whether run B's final score differs from run A's beyond the noise of
sampling the test examples (a paired bootstrap over the examples both runs decoded in
their final evaluation: the difference, its 95% interval and two-sided p-value). It
says nothing about the spread between seeds, which only more seeds measure. A
run directory without these files is reported in one `ERROR:` line.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from sacrebleu.metrics import BLEU

from t5x_lite.core import errors
from t5x_lite.data import task_metrics


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


_SELECTION_BINDING = "infer_eval/DatasetConfig.split"


def selection_split(model_dir: str) -> str:
  """The split whose metric chose the best step: `infer_eval/DatasetConfig.split` in the
  run's config.gin (through its macro, e.g. SELECTION_SPLIT), else 'validation'."""
  try:
    with open(os.path.join(model_dir, "config.gin"), encoding="utf-8") as f:
      bindings = dict(
        (name.strip(), value.strip())
        for name, sep, value in (line.partition("=") for line in f)
        if sep and not name.lstrip().startswith("#")
      )
  except FileNotFoundError:
    return "validation"
  value = bindings.get(_SELECTION_BINDING, "'validation'")
  if value.startswith("%"):
    value = bindings.get(value[1:], "'validation'")
  return value.strip("'\"")


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
    "selection_split": selection_split(model_dir),
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
    "| run | metric | best step (of last) | best (split that chose it) | final (split) "
    "| minutes to best | minutes |",
    "|---|---|---|---|---|---|---|",
  ]
  for s in summaries:
    rows.append(
      f"| {s['run']} | {s['metric']} | {s['best_step']} ({s['last_step']}) | "
      f"{_fmt(s['validation'])} ({s['selection_split']}) | "
      f"{_fmt(s['final'])} ({s['final_split']}) | "
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
    "| runs | n | metric | best (split that chose it) | final (split) | minutes |",
    "|---|---|---|---|---|---|",
  ]
  for label, summaries in groups:
    validation = mean_and_error([s["validation"] for s in summaries])
    final = mean_and_error([s["final"] for s in summaries if s["final"] is not None] or [math.nan])
    minutes = statistics.fmean(s["minutes"] for s in summaries)
    rows.append(
      f"| {label} | {len(summaries)} | {summaries[0]['metric']} | "
      f"{_fmt(validation[0])} ± {_fmt(validation[1])} ({summaries[0]['selection_split']}) | "
      f"{_fmt(final[0])} ± {_fmt(final[1])} ({summaries[0]['final_split']}) | {_fmt(minutes)} |"
    )
  return "\n".join(rows)


def _difference(a: tuple[float, float], b: tuple[float, float]) -> str:
  """`a` - `b` of two (mean, standard error) pairs, and how many standard errors of the
  difference (sqrt(se_a**2 + se_b**2)) it is: the difference alone where a group of one
  run has no standard error, '-' where a group has no value."""
  difference, error = a[0] - b[0], math.hypot(a[1], b[1])
  if math.isnan(difference):
    return "-"
  if math.isnan(error):
    return f"{difference:+.1f}"
  if error == 0:
    return f"{difference:+.1f}, no spread"
  return f"{difference:+.1f}, {abs(difference) / error:.1f} SE"


def differences_table(groups: Sequence[tuple[str, Sequence[dict[str, Any]]]]) -> str:
  """One markdown row per pair of groups of the same metric, in the order given: the
  difference of their means, validation and final, each with how many standard errors
  of the difference it is. A difference beyond about two is beyond the noise the seeds
  show."""
  rows = [
    "| groups | best, difference (split that chose it) | final, difference (split) |",
    "|---|---|---|",
  ]
  stats = []
  for label, summaries in groups:
    finals = [s["final"] for s in summaries if s["final"] is not None]
    stats.append(
      (
        label,
        mean_and_error([s["validation"] for s in summaries]),
        mean_and_error(finals or [math.nan]),
        summaries[0],
      )
    )
  for i, (label_a, validation_a, final_a, first) in enumerate(stats):
    for label_b, validation_b, final_b, other in stats[i + 1 :]:
      if other["metric"] != first["metric"]:
        continue
      rows.append(
        f"| {label_a} - {label_b} | {_difference(validation_a, validation_b)} "
        f"({first['selection_split']}) | {_difference(final_a, final_b)} "
        f"({first['final_split']}) |"
      )
  return "\n".join(rows)


def final_inferences(model_dir: str) -> tuple[str, list[dict[str, Any]]]:
  """(metric name, decoded examples) of a run's final evaluation: the records of
  `final_eval/inferences/<task>-step_<step>.jsonl`, in the task's order."""
  metric = _read_json(os.path.join(model_dir, "best.json"))["metric"]
  step = _read_json(os.path.join(model_dir, "final_metrics.json"))["step"]
  task = metric.split("/", 1)[0]
  path = os.path.join(model_dir, "final_eval", "inferences", f"{task}-step_{step}.jsonl")
  try:
    with open(path, encoding="utf-8") as f:
      return metric, [json.loads(line) for line in f if line.strip()]
  except FileNotFoundError:
    raise ValueError(f"{path} not found: the run's final evaluation decoded nothing") from None


def _bleu_of_rows(
  targets: Sequence[str], predictions: Sequence[str]
) -> Callable[[np.ndarray], float]:
  """Corpus BLEU of any multiset of the examples (sacrebleu's defaults, as
  `task_metrics.bleu`), from each example's n-gram counts summed."""
  bleu = BLEU()
  # [examples, 10]: hypothesis length, reference length, matches and totals of 1..4-grams.
  stats = np.array(bleu._extract_corpus_statistics(list(predictions), [list(targets)]))

  def score(counts: np.ndarray) -> float:  # counts: [examples], times each is drawn
    sys_len, ref_len, *rest = [int(x) for x in np.rint(counts @ stats)]
    return BLEU.compute_bleu(rest[:4], rest[4:], sys_len, ref_len).score

  return score


def _scorer(
  metric: str, targets: Sequence[Any], predictions: Sequence[Any]
) -> Callable[[np.ndarray], float]:
  """The task metric `metric` of a resampled test set, as a function of how many times
  each example is drawn ([examples] counts)."""
  name = metric.split("/", 1)[1]
  if name == "bleu":
    return _bleu_of_rows(targets, predictions)
  if name == "accuracy":
    per_example = 100.0 * (np.array(targets) == np.array(predictions))
  elif name in task_metrics.ROUGE_TYPES:
    per_example = task_metrics.rouge_per_example(targets, predictions)[name]
  else:
    raise ValueError(f"{metric}: the paired bootstrap knows bleu, accuracy and ROUGE only")
  return lambda counts: float(counts @ per_example / counts.sum())


def paired_bootstrap(
  metric: str,
  a: Sequence[dict[str, Any]],
  b: Sequence[dict[str, Any]],
  samples: int = 1000,
  seed: int = 0,
) -> dict[str, float]:
  """Paired bootstrap (Koehn, 2004) of `metric` between two runs' decodings of the same
  examples: resample the examples with replacement `samples` times, score both runs on
  each resample.

  Returns:
    a, b: the scores on the whole set; difference: b - a; low, high: the 2.5th and 97.5th
    percentiles of the resampled differences; p_value: two-sided, the share of resamples
    whose difference has the other sign than `difference`, doubled (at most 1).
  """
  if samples < 1:
    raise ValueError(f"--samples={samples}: must be at least 1")
  if [r["inputs"] for r in a] != [r["inputs"] for r in b]:
    raise ValueError("the two runs' final evaluations decoded different examples")
  targets = [r["target"] for r in a]
  score_a = _scorer(metric, targets, [r["prediction"] for r in a])
  score_b = _scorer(metric, targets, [r["prediction"] for r in b])
  everything = np.ones(len(a))
  observed = score_b(everything) - score_a(everything)
  rng = np.random.default_rng(seed)
  differences = []
  for _ in range(samples):
    counts = np.bincount(rng.integers(0, len(a), len(a)), minlength=len(a)).astype(np.float64)
    differences.append(score_b(counts) - score_a(counts))
  diffs = np.array(differences)
  other_side = np.mean(diffs <= 0) if observed > 0 else np.mean(diffs >= 0)
  return {
    "a": score_a(everything),
    "b": score_b(everything),
    "difference": observed,
    "low": float(np.percentile(diffs, 2.5)),
    "high": float(np.percentile(diffs, 97.5)),
    "p_value": float(min(1.0, 2 * other_side)),
  }


def paired_line(dir_a: str, dir_b: str, samples: int = 1000) -> str:
  """One line: run B against run A on their final evaluation, with the bootstrap."""
  metric_a, rows_a = final_inferences(dir_a)
  metric_b, rows_b = final_inferences(dir_b)
  if metric_a != metric_b:
    raise ValueError(f"{dir_a} is scored by {metric_a}, {dir_b} by {metric_b}")
  r = paired_bootstrap(metric_a, rows_a, rows_b, samples)
  return (
    f"{metric_a} on {len(rows_a)} examples: {dir_b} {r['b']:.2f} against {dir_a} "
    f"{r['a']:.2f}: difference {r['difference']:+.2f}, 95% interval "
    f"[{r['low']:+.2f}, {r['high']:+.2f}], p = {r['p_value']:.3f} "
    f"(paired bootstrap over the examples, {samples} resamples; not seed variance)"
  )


def _expanded(patterns: Sequence[str], group: str) -> list[str]:
  """The run directories of a --groups entry: each pattern with a wildcard (`*`, `?`,
  `[...]`) expanded in sorted order, as the shell would (it cannot inside quotes)."""
  dirs = []
  for pattern in patterns:
    if not any(c in pattern for c in "*?["):
      dirs.append(pattern)
      continue
    matches = sorted(glob.glob(pattern))
    if not matches:
      raise ValueError(f"--groups {group!r}: {pattern!r} matches no directory.")
    dirs += matches
  return dirs


def main(argv: Sequence[str] | None = None) -> None:
  """Command-line entry point; a bad input exits with one `ERROR:` line."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("model_dirs", nargs="*", help="finished recipe MODEL_DIRs")
  parser.add_argument(
    "--groups",
    nargs="*",
    default=[],
    help="'label=dir1,dir2,...' (or 'label=runs/x_s*'): mean and standard error",
  )
  parser.add_argument(
    "--paired",
    nargs=2,
    metavar=("RUN_A", "RUN_B"),
    help="paired bootstrap of RUN_B's final score against RUN_A's",
  )
  parser.add_argument("--samples", type=int, default=1000, help="bootstrap resamples")
  args = parser.parse_args(argv)
  if not args.model_dirs and not args.groups and not args.paired:
    errors.fail("Give MODEL_DIRs, --groups 'label=dir1,dir2' or --paired RUN_A RUN_B.")
  try:
    if args.paired:
      print(paired_line(*args.paired, samples=args.samples))
    if args.model_dirs:
      print(runs_table([run_summary(d) for d in args.model_dirs]))
    if args.groups:
      parsed = []
      for group in args.groups:
        label, sep, dirs = group.partition("=")
        if not sep or not dirs:
          raise ValueError(f"--groups {group!r}: expected 'label=dir1,dir2,...'.")
        parsed.append((label, [run_summary(d) for d in _expanded(dirs.split(","), group)]))
      print(groups_table(parsed))
      differences = differences_table(parsed)
      if differences.count("\n") > 1:
        print()
        print(differences)
  except (OSError, ValueError, KeyError) as e:
    errors.fail(str(e))


if __name__ == "__main__":
  main()
