"""tools/recipe_results.py: tables from what recipe runs wrote to their MODEL_DIRs."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from t5x_lite.data import task_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
import recipe_results  # noqa: E402


def _write_run(
  model_dir, best_value: float, final_value: float, metric: str = "task_a/accuracy"
) -> None:
  os.makedirs(model_dir)
  with open(os.path.join(model_dir, "best.json"), "w") as f:
    json.dump({"metric": metric, "mode": "max", "best_step": 20, "best_value": best_value}, f)
  with open(os.path.join(model_dir, "final_metrics.json"), "w") as f:
    json.dump({"step": 20, "split": "test", metric: final_value, "task_a/f1": 1.0}, f)
  with open(os.path.join(model_dir, "metrics.jsonl"), "w") as f:
    for step in (10, 20, 30):
      f.write(json.dumps({"step": step, "split": "train", "elapsed_s": 6.0 * step}) + "\n")
    f.write('{"step": 40, "split": "tr')  # a run killed mid-line


def test_run_summary_reads_best_final_and_minutes(tmp_path):
  _write_run(tmp_path / "a", 80.0, 78.0)
  summary = recipe_results.run_summary(str(tmp_path / "a"))
  assert summary["best_step"] == 20 and summary["validation"] == 80.0 and summary["final"] == 78.0
  assert summary["minutes_to_best"] == 2.0 and summary["minutes"] == 3.0
  assert summary["last_step"] == 30 and summary["final_split"] == "test"


def test_groups_give_mean_and_standard_error(tmp_path):
  _write_run(tmp_path / "a", 80.0, 78.0)
  _write_run(tmp_path / "b", 82.0, 80.0)
  mean, error = recipe_results.mean_and_error([78.0, 80.0])
  assert mean == 79.0 and error == pytest.approx(1.0)
  assert math.isnan(recipe_results.mean_and_error([1.0])[1])
  table = recipe_results.groups_table(
    [("pre", [recipe_results.run_summary(str(tmp_path / d)) for d in "ab"])]
  )
  assert (
    "| pre | 2 | task_a/accuracy | 81.0 ± 1.0 (validation) | 79.0 ± 1.0 (test) | 3.0 |" in table
  )


def test_groups_of_one_metric_give_each_pairs_difference_in_standard_errors(tmp_path):
  for name, best, final in (("a0", 80, 78), ("a1", 82, 80), ("b0", 77, 74), ("b1", 79, 74)):
    _write_run(tmp_path / name, best, final)
  _write_run(tmp_path / "other", 50.0, 50.0, metric="task_b/accuracy")
  summary = recipe_results.run_summary
  groups = [
    ("a", [summary(str(tmp_path / "a0")), summary(str(tmp_path / "a1"))]),  # 81 ± 1, 79 ± 1
    ("b", [summary(str(tmp_path / "b0")), summary(str(tmp_path / "b1"))]),  # 78 ± 1, 74 ± 0
    ("one run", [summary(str(tmp_path / "a0"))]),  # 80, 78: no standard error
    ("other task", [summary(str(tmp_path / "other"))]),
  ]
  table = recipe_results.differences_table(groups).splitlines()
  # 3 / sqrt(1 + 1) = 2.1 standard errors; 5 / sqrt(1 + 0) = 5.0.
  assert table[2] == "| a - b | +3.0, 2.1 SE (validation) | +5.0, 5.0 SE (test) |"
  assert table[3] == "| a - one run | +1.0 (validation) | +1.0 (test) |"
  assert table[4] == "| b - one run | -2.0 (validation) | -4.0 (test) |"
  assert len(table) == 5  # the other task's group is compared with none
  tool = [sys.executable, os.path.join(REPO, "tools", "recipe_results.py"), "--groups"]
  # A pattern stands for the directories it matches (a0, a1), as the shell would expand it.
  groups = [
    f"x={tmp_path / 'a0'},{tmp_path / 'a1'}",
    f"y={tmp_path / 'a?'}",
    f"z={tmp_path / 'b*'}",
  ]
  result = subprocess.run(tool + groups, capture_output=True, text=True)
  assert result.returncode == 0, result.stderr
  assert "| y | 2 | task_a/accuracy | 81.0 ± 1.0 (validation) |" in result.stdout
  assert "| x - y | +0.0, 0.0 SE (validation) | +0.0, 0.0 SE (test) |" in result.stdout
  assert "| x - z | +3.0, 2.1 SE (validation) | +5.0, 5.0 SE (test) |" in result.stdout
  result = subprocess.run(tool + [f"w={tmp_path / 'c*'}"], capture_output=True, text=True)
  assert result.returncode == 1
  assert result.stderr.strip() == (
    f"ERROR: --groups 'w={tmp_path}/c*': '{tmp_path}/c*' matches no directory."
  )


def test_the_split_that_chose_the_best_step_is_read_from_the_runs_config(tmp_path):
  _write_run(tmp_path / "a", 80.0, 78.0)
  assert recipe_results.selection_split(str(tmp_path / "a")) == "validation"  # no config.gin
  (tmp_path / "a" / "config.gin").write_text(
    "# Macros:\nSELECTION_SPLIT = 'train[90%:]'\n"
    "infer_eval/DatasetConfig.split = %SELECTION_SPLIT\n"
  )
  table = recipe_results.runs_table([recipe_results.run_summary(str(tmp_path / "a"))])
  assert "| 20 (30) | 80.0 (train[90%:]) | 78.0 (test) |" in table
  (tmp_path / "a" / "config.gin").write_text("infer_eval/DatasetConfig.split = 'validation'\n")
  assert recipe_results.selection_split(str(tmp_path / "a")) == "validation"


def test_a_directory_that_is_not_a_finished_run_is_one_error_line(tmp_path):
  result = subprocess.run(
    [sys.executable, os.path.join(REPO, "tools", "recipe_results.py"), str(tmp_path)],
    capture_output=True,
    text=True,
  )
  assert result.returncode == 1
  assert result.stderr.strip().splitlines() == [
    f"ERROR: {tmp_path}/best.json not found: is it a finished recipe run's MODEL_DIR?"
  ]


def _write_decodings(model_dir, metric: str, rows: list[tuple[str, object, object]]) -> None:
  """A finished run whose final evaluation decoded `rows` of (inputs, target, prediction)."""
  task = metric.split("/")[0]
  os.makedirs(os.path.join(model_dir, "final_eval", "inferences"))
  with open(os.path.join(model_dir, "best.json"), "w") as f:
    json.dump({"metric": metric, "mode": "max", "best_step": 7, "best_value": 1.0}, f)
  with open(os.path.join(model_dir, "final_metrics.json"), "w") as f:
    json.dump({"step": 7, "split": "test", metric: 0.0}, f)
  path = os.path.join(model_dir, "final_eval", "inferences", f"{task}-step_7.jsonl")
  with open(path, "w") as f:
    for inputs, target, prediction in rows:
      f.write(json.dumps({"inputs": inputs, "target": target, "prediction": prediction}) + "\n")


SENTENCES = [
  ("Ein Mann fährt Fahrrad.", "Ein Mann fährt ein Fahrrad."),
  ("Zwei Hunde spielen im Schnee.", "Zwei Hunde spielen im Schnee."),
  ("Eine Frau liest ein Buch am Strand.", "Eine Frau liest am Strand."),
  ("Kinder laufen über eine grüne Wiese.", "Kinder rennen über die Wiese."),
  ("Ein Koch schneidet Gemüse in der Küche.", "Ein Koch schneidet Gemüse."),
]


def test_the_bootstrap_scores_the_whole_set_as_the_task_metrics_do():
  targets = [t for t, _ in SENTENCES]
  predictions = [p for _, p in SENTENCES]
  bleu = recipe_results._scorer("t/bleu", targets, predictions)
  assert bleu(np.ones(len(targets))) == pytest.approx(
    task_metrics.bleu(targets, predictions)["bleu"], abs=1e-9
  )
  # Drawing an example twice is scoring a corpus that holds it twice.
  twice = [targets[0], *targets], [predictions[0], *predictions]
  assert bleu(np.array([2.0, 1, 1, 1, 1])) == pytest.approx(task_metrics.bleu(*twice)["bleu"])
  rouge = recipe_results._scorer("t/rougeLsum", targets, predictions)
  assert rouge(np.ones(len(targets))) == pytest.approx(
    task_metrics.rouge(targets, predictions)["rougeLsum"]
  )
  with pytest.raises(ValueError, match="t/f1: the paired bootstrap knows"):
    recipe_results._scorer("t/f1", [1], [1])


def test_paired_bootstrap_of_equal_and_of_clearly_different_runs():
  rows = [{"inputs": str(i), "target": i % 2, "prediction": i % 2} for i in range(40)]
  wrong = [{**r, "prediction": 1 - r["target"]} for r in rows]
  same = recipe_results.paired_bootstrap("t/accuracy", rows, rows, samples=200)
  assert same == {
    "a": 100.0,
    "b": 100.0,
    "difference": 0.0,
    "low": 0.0,
    "high": 0.0,
    "p_value": 1.0,
  }
  worse = recipe_results.paired_bootstrap("t/accuracy", rows, wrong, samples=200)
  assert worse["difference"] == -100.0 and worse["high"] == -100.0 and worse["p_value"] == 0.0
  # Half the examples flipped: the difference is -50 and the interval holds it.
  half = rows[:20] + wrong[20:]
  r = recipe_results.paired_bootstrap("t/accuracy", rows, half, samples=500)
  assert r["difference"] == -50.0 and r["low"] < -50.0 < r["high"] < 0 and r["p_value"] == 0.0
  # One flip in 40 is within the noise of sampling 40 examples.
  one = recipe_results.paired_bootstrap("t/accuracy", rows, wrong[:1] + rows[1:], samples=500)
  assert one["difference"] == -2.5 and one["p_value"] > 0.2


def test_paired_runs_through_the_command_line(tmp_path):
  rows_a = [(f"s{i}", t, p) for i, (t, p) in enumerate(SENTENCES)]
  rows_b = [(f"s{i}", t, t) for i, (t, _) in enumerate(SENTENCES)]
  _write_decodings(tmp_path / "a", "t/bleu", rows_a)
  _write_decodings(tmp_path / "b", "t/bleu", rows_b)
  _write_decodings(tmp_path / "c", "t/bleu", rows_b[::-1])
  tool = os.path.join(REPO, "tools", "recipe_results.py")
  ok = subprocess.run(
    [sys.executable, tool, "--paired", str(tmp_path / "a"), str(tmp_path / "b")],
    capture_output=True,
    text=True,
  )
  assert ok.returncode == 0, ok.stderr
  assert f"t/bleu on 5 examples: {tmp_path}/b 100.00 against {tmp_path}/a" in ok.stdout
  bad = subprocess.run(
    [sys.executable, tool, "--paired", str(tmp_path / "a"), str(tmp_path / "c")],
    capture_output=True,
    text=True,
  )
  assert bad.returncode == 1
  assert bad.stderr.strip().splitlines() == [
    "ERROR: the two runs' final evaluations decoded different examples"
  ]
  none = subprocess.run(
    [sys.executable, tool, "--paired", str(tmp_path / "a"), str(tmp_path / "b"), "--samples=0"],
    capture_output=True,
    text=True,
  )
  assert none.returncode == 1
  assert none.stderr.strip().splitlines() == ["ERROR: --samples=0: must be at least 1"]
