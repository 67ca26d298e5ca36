"""Tests for tools/plot_metrics.py and t5x_lite.training.metrics_logging."""

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from t5x_lite.training import metrics_logging

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
import plot_metrics  # noqa: E402


def _write_run(model_dir) -> None:
  logger = metrics_logging.MetricsLogger(str(model_dir), total_steps=30)
  for step in range(1, 31):
    logger.write("train", step, {"loss": 10.0 / step, "accuracy": step / 30, "learning_rate": 0.01})
  logger.write("eval", 30, {"loss": 0.5})
  logger.close()


def test_logger_writes_jsonl_and_tensorboard(tmp_path):
  _write_run(tmp_path)
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert len(lines) == 31
  first, last = json.loads(lines[0]), json.loads(lines[-1])
  assert first["step"] == 1 and first["split"] == "train" and first["loss"] == 10.0
  assert last == {"step": 30, "split": "eval", "time": last["time"], "loss": 0.5}
  for split in ("train", "eval"):
    assert any(name.startswith("events.") for name in os.listdir(tmp_path / split))


def test_non_finite_values_survive_as_strings(tmp_path):
  logger = metrics_logging.MetricsLogger(str(tmp_path), total_steps=1)
  logger.write("train", 1, {"loss": float("nan")})
  logger.close()
  assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == "nan"


def test_progress_line_has_step_loss_and_eta():
  line = metrics_logging.progress_line(
    "train", 12, 100, {"loss": 2.5, "throughput/mfu": 0.123}, eta_seconds=125
  )
  assert line == "train step 12/100 | loss 2.5000 | MFU 12.3% | ETA 2m05s"
  with_second = {"throughput/mfu": 0.123, "throughput/mfu_measured_matmul": 0.2}
  line = metrics_logging.progress_line("train", 12, 100, with_second, eta_seconds=None)
  assert line == "train step 12/100 | MFU 12.3% | 20.0% of the measured matmul"


def _panels(svg_path) -> dict[str, ET.Element]:
  root = ET.parse(svg_path).getroot()
  groups = root.iter("{http://www.w3.org/2000/svg}g")
  return {g.get("data-metric"): g for g in groups if g.get("data-metric")}


def _series(panel: ET.Element) -> dict[str, list[tuple[float, float]]]:
  """split -> the pixel coordinates of its points."""
  return {
    g.get("data-split"): [tuple(map(float, p.split(","))) for p in g.get("data-points").split()]
    for g in panel.iter("{http://www.w3.org/2000/svg}g")
    if g.get("data-split")
  }


def test_plot_tool_writes_an_svg_of_every_metric(tmp_path):
  _write_run(tmp_path)
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 31, "split": "tr')  # a run killed mid-line
  result = subprocess.run(
    [sys.executable, os.path.join(REPO, "tools", "plot_metrics.py"), str(tmp_path)],
    capture_output=True,
    text=True,
    check=True,
  )
  assert "loss, accuracy, learning_rate" in result.stdout
  panels = _panels(tmp_path / "metrics.svg")
  assert list(panels) == ["loss", "accuracy", "learning_rate"]
  assert [panels[m].get("data-scale") for m in panels] == ["log", "linear", "log"]
  loss = _series(panels["loss"])
  assert len(loss["train"]) == 30 and len(loss["eval"]) == 1
  xs, ys = zip(*loss["train"])
  assert list(xs) == sorted(xs) and list(ys) == sorted(ys)  # steps rightwards, loss falls
  # Log scale: 10/step halves from step 1 to 2 as from 10 to 20, the same pixel distance.
  assert ys[1] - ys[0] == pytest.approx(ys[19] - ys[9], abs=0.2)
  accuracy = _series(panels["accuracy"])["train"]
  gaps = [b[1] - a[1] for a, b in zip(accuracy, accuracy[1:])]
  assert max(gaps) == pytest.approx(min(gaps), abs=0.2) and gaps[0] < 0  # linear, rising


def test_ticks_are_round_values_within_the_range():
  assert plot_metrics.nice_ticks(0.0, 1.0) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
  assert plot_metrics.nice_ticks(3.1, 38.4) == [10.0, 20.0, 30.0]
  assert plot_metrics.nice_ticks(-0.3, 0.7) == [-0.2, 0.0, 0.2, 0.4, 0.6]
  assert plot_metrics.log_ticks(2e-4, 0.05) == [0.001, 0.01]
  assert plot_metrics.log_ticks(0.9, 7.5) == [1.0, 2.0, 5.0]
  assert plot_metrics.log_ticks(1.1, 1.9) == plot_metrics.nice_ticks(1.1, 1.9)
  # A constant float32 learning rate of 0.01, padded a decade either way: all three decades.
  assert plot_metrics.log_ticks(10**-3.0000000087, 10**-1.0000000087) == [0.001, 0.01, 0.1]


def test_a_loss_with_zeros_leaves_them_out_and_only_zeros_is_linear(tmp_path):
  series = {"train": {"loss": {1: 0.0, 2: 1.0, 3: 0.5}, "lr_zero": {1: 0.0}}}
  plot_metrics.plot(series, ["loss"], str(tmp_path / "a.svg"), "t")
  panel = _panels(tmp_path / "a.svg")["loss"]
  assert panel.get("data-scale") == "log" and len(_series(panel)["train"]) == 2
  series = {"train": {"learning_rate": {1: 0.009999999776, 2: 0.009999999776}}}
  plot_metrics.plot(series, ["learning_rate"], str(tmp_path / "lr.svg"), "t")
  labels = [t.text for t in ET.parse(tmp_path / "lr.svg").iter("{http://www.w3.org/2000/svg}text")]
  assert {"0.001", "0.01", "0.1"} <= set(labels)
  series = {"train": {"loss": {1: 0.0, 2: 0.0}}}
  plot_metrics.plot(series, ["loss"], str(tmp_path / "b.svg"), "t <&> run")
  assert _panels(tmp_path / "b.svg")["loss"].get("data-scale") == "linear"
  assert "t &lt;&amp;&gt; run" in (tmp_path / "b.svg").read_text()


def test_repeated_steps_keep_the_last_value(tmp_path):
  _write_run(tmp_path)
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write(json.dumps({"step": 30, "split": "train", "loss": 42.0}) + "\n")
  series = plot_metrics.read_metrics(str(tmp_path / "metrics.jsonl"))
  assert series["train"]["loss"][30] == 42.0
  assert series["eval"]["loss"] == {30: 0.5}


def test_plot_without_known_metrics_fails(tmp_path):
  _write_run(tmp_path)
  with pytest.raises(ValueError, match="None of"):
    plot_metrics.plot(
      plot_metrics.read_metrics(str(tmp_path / "metrics.jsonl")),
      ["bleu"],
      str(tmp_path / "x.svg"),
      "t",
    )


def test_relative_paths_and_bad_inputs(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  _write_run(tmp_path / "run")
  plot_metrics.main(["run", "--out", "plots/metrics.svg"])
  assert f"Wrote {tmp_path}/plots/metrics.svg (loss" in capsys.readouterr().out
  assert (tmp_path / "plots" / "metrics.svg").exists()
  for argv, message in [
    (["nope"], f"ERROR: {tmp_path}/nope/metrics.jsonl not found: is nope a training MODEL_DIR?"),
    (["run", "--metrics", "bleu"], "ERROR: None of ['bleu'] found in the metrics file."),
    (["run", "--out", "m.png"], "ERROR: --out m.png: plot_metrics writes SVG; name a .svg file."),
  ]:
    with pytest.raises(SystemExit) as exit_:
      plot_metrics.main(argv)
    assert exit_.value.code == 1 and capsys.readouterr().err == message + "\n"


def _write_timed_run(model_dir) -> None:
  logger = metrics_logging.MetricsLogger(str(model_dir), total_steps=20)
  for step in range(1, 21):
    placed = {"elapsed_s": 30.0 * step, "tokens_seen": 100.0 * step}
    logger.write("train", step, {"loss": 10.0 / step, **placed})
    if step % 10 == 0:
      logger.write("eval", step, {"loss": 0.5, "task_a/bleu": step / 2, **placed})
  logger.write("final", 10, {"task_a/bleu": 4.0})
  logger.close()


def test_task_metrics_against_minutes_and_tokens(tmp_path):
  _write_timed_run(tmp_path)
  series = plot_metrics.read_metrics(str(tmp_path / "metrics.jsonl"))
  assert plot_metrics.task_metrics(series) == ["task_a/bleu"]
  assert plot_metrics.positions(series, "eval", [10, 20], "minutes") == [5.0, 10.0]
  assert plot_metrics.positions(series, "eval", [10, 20], "tokens") == [1000.0, 2000.0]
  # The final record is placed at its step's wall time, taken from that step's records.
  assert plot_metrics.positions(series, "final", [10], "minutes") == [5.0]
  drawn = plot_metrics.plot(
    series, ["loss", "task_a/bleu"], str(tmp_path / "m.svg"), "t", "minutes"
  )
  assert drawn == ["loss", "task_a/bleu"]
  bleu = _series(_panels(tmp_path / "m.svg")["task_a/bleu"])
  assert len(bleu["eval"]) == 2 and len(bleu["final"]) == 1
  assert bleu["final"][0][0] == bleu["eval"][0][0]  # at step 10's minutes


def test_minutes_of_records_without_elapsed_time_is_an_error(tmp_path):
  _write_run(tmp_path)
  series = plot_metrics.read_metrics(str(tmp_path / "metrics.jsonl"))
  with pytest.raises(ValueError, match="--x minutes: the train records have no elapsed_s"):
    plot_metrics.plot(series, ["loss"], str(tmp_path / "m.svg"), "t", "minutes")
