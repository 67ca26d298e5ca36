"""tools/recipe_results.py: tables from what recipe runs wrote to their MODEL_DIRs."""

import json
import math
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
import recipe_results  # noqa: E402


def _write_run(model_dir, best_value: float, final_value: float) -> None:
  os.makedirs(model_dir)
  metric = "task_a/accuracy"
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
  assert "| pre | 2 | task_a/accuracy | 81.0 ± 1.0 | 79.0 ± 1.0 (test) | 3.0 |" in table


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
