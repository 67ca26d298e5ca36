"""Training to where a validation metric stops improving, and the final evaluation.

In-process runs of `train_lib.train` on a tiny byte-vocabulary task whose metric
function is scripted (it returns a given sequence of values, one per evaluation),
so when training must stop, and which step is best, are known in advance.
"""

import dataclasses
import itertools
import json
import os

import gin
import numpy as np
import pytest
import seqio
import tensorflow as tf

from t5x_lite.run import eval_lib, model_runner, train_lib
from t5x_lite.training import early_stopping
from t5x_lite.core.errors import ConfigError
from text_tasks import VOCAB
from train_test import _dataset, _records, _train

pytestmark = pytest.mark.usefixtures("clean_gin")

SCRIPTED_TASK = "early_stopping_test_scripted"
EXACT_TASK = "early_stopping_test_exact_match"
_SCRIPT: list[float] = []  # values the scripted metric returns, one per evaluation


def _source(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
  del shuffle_files, seed
  texts = [f"{split} {i} " + "xy" * (i % 4) for i in range(24)]
  return tf.data.Dataset.from_tensor_slices({"inputs": texts, "targets": texts})


def _scripted_metric(targets, predictions) -> dict[str, float]:
  del targets, predictions
  return {"score": _SCRIPT.pop(0)}


def _exact_match(targets, predictions) -> dict[str, float]:
  return {"exact": 100.0 * float(np.mean([t == p for t, p in zip(targets, predictions)]))}


for _name, _metric in ((SCRIPTED_TASK, _scripted_metric), (EXACT_TASK, _exact_match)):
  if _name not in seqio.TaskRegistry.names():
    seqio.TaskRegistry.add(
      _name,
      source=seqio.FunctionDataSource(_source, splits=["train", "validation", "test"]),
      preprocessors=[seqio.preprocessors.tokenize, seqio.preprocessors.append_eos],
      output_features={"inputs": seqio.Feature(VOCAB), "targets": seqio.Feature(VOCAB)},
      metric_fns=[_metric],
    )


def _decode_cfg() -> model_runner.DecodeConfig:
  return model_runner.DecodeConfig(max_decode_len=8)


def _scripted_train(model_dir, steps: int, script: list[float], **kwargs):
  _SCRIPT[:] = script
  kwargs.setdefault(
    "early_stopping", early_stopping.EarlyStopping(metric=f"{SCRIPTED_TASK}/score", patience=2)
  )
  return _train(
    model_dir,
    steps,
    train_dataset_cfg=_dataset(SCRIPTED_TASK),
    eval_dataset_cfg=_dataset(SCRIPTED_TASK, split="validation", batch_size=8),
    infer_eval_period=2,
    **kwargs,
  )


def test_history_gives_best_step_and_stop():
  stopping = early_stopping.EarlyStopping(metric="t/m", mode="max", patience=2, min_delta=0.5)
  assert stopping.update(2, {"t/m": 1.0})
  assert not stopping.update(4, {"t/m": 1.4})  # within min_delta
  assert not stopping.should_stop
  assert stopping.update(6, {"t/m": 2.0})
  assert not stopping.update(8, {"t/m": float("nan")})
  assert not stopping.update(10, {"t/m": 1.0})
  assert stopping.should_stop and stopping.best_step == 6 and stopping.best_value == 2.0
  lower = early_stopping.EarlyStopping(metric="t/loss", mode="min", patience=0)
  assert lower.update(1, {"t/loss": 3.0}) and lower.update(2, {"t/loss": 2.0})
  assert not lower.update(3, {"t/loss": 2.5}) and not lower.should_stop  # patience 0: never


def test_bad_settings_and_unknown_metric_are_config_errors():
  with pytest.raises(ConfigError, match="EarlyStopping.mode"):
    early_stopping.EarlyStopping(metric="t/m", mode="maximum")
  with pytest.raises(ConfigError, match="EarlyStopping.patience"):
    early_stopping.EarlyStopping(metric="t/m", patience=-1)
  stopping = early_stopping.EarlyStopping(metric="t/bleu")
  with pytest.raises(ConfigError, match=r"'t/bleu' is not among .*'t/rouge1'"):
    stopping.update(1, {"t/rouge1": 3.0})


def test_restore_keeps_the_history_up_to_the_restored_step(tmp_path):
  stopping = early_stopping.EarlyStopping(metric="t/m", patience=3)
  for step, value in ((2, 1.0), (4, 3.0), (6, 2.0), (8, 2.5)):
    stopping.update(step, {"t/m": value})
  stopping.save(str(tmp_path))
  resumed = early_stopping.EarlyStopping(metric="t/m", patience=3)
  resumed.restore(str(tmp_path), restored_step=6)
  assert resumed.history == [(2, 1.0), (4, 3.0), (6, 2.0)]
  other = early_stopping.EarlyStopping(metric="t/other", patience=3)
  other.restore(str(tmp_path), restored_step=8)
  assert other.history == []


def test_training_stops_early_and_keeps_and_final_evaluates_the_best_step(tmp_path):
  gin.bind_parameter("build_model.vocabulary", VOCAB)  # eval builds the model as the CLI does
  gin.bind_parameter("TrainCheckpointer.save_period", 100)
  gin.bind_parameter("TrainCheckpointer.keep", 1)
  final_cfg = _dataset(EXACT_TASK, split="test", batch_size=8)
  # Evaluations at steps 2, 4, 6, 8: the best is step 4, two more without gain stop it.
  _scripted_train(
    tmp_path,
    40,
    [1.0, 5.0, 4.0, 5.0],
    final_eval_dataset_cfg=final_cfg,
    final_eval_decode=_decode_cfg(),
  )
  best = json.loads((tmp_path / "best.json").read_text())
  assert best["best_step"] == 4 and best["best_value"] == 5.0 and best["evals_since_best"] == 2
  assert [h[0] for h in best["history"]] == [2, 4, 6, 8]
  # Stopped at step 8 (last checkpoint), and step 4 survived keep=1 as the best step.
  assert sorted(int(p) for p in os.listdir(tmp_path) if p.isdigit()) == [4, 8]
  assert max(r["step"] for r in _records(tmp_path)) == 8
  final = json.loads((tmp_path / train_lib.FINAL_METRICS_FILE).read_text())
  assert final["step"] == 4 and final["split"] == "test"
  [logged] = _records(tmp_path, "final")
  assert logged["step"] == 4 and logged[f"{EXACT_TASK}/exact"] == final[f"{EXACT_TASK}/exact"]
  assert os.path.isfile(tmp_path / "final_eval" / "inferences" / f"{EXACT_TASK}-step_4.jsonl")
  # The final score equals evaluating the kept best checkpoint afresh.
  again = eval_lib.evaluate_checkpoints(
    checkpoint_path=str(tmp_path / "4"),
    output_dir=str(tmp_path / "eval_again"),
    dataset_cfg=final_cfg,
    decode=_decode_cfg(),
    num_examples=None,
    watch=False,
    final_step=None,
    timeout_s=0,
    poll_s=0,
  )
  assert again[4][EXACT_TASK]["exact"] == pytest.approx(final[f"{EXACT_TASK}/exact"])


def test_restarting_a_run_that_stopped_early_trains_no_further(tmp_path):
  _scripted_train(tmp_path, 40, [3.0, 2.0, 1.0])
  assert max(r["step"] for r in _records(tmp_path)) == 6
  _scripted_train(tmp_path, 40, [])  # no evaluation may run: the script is empty
  assert max(r["step"] for r in _records(tmp_path)) == 6


def test_a_resumed_run_continues_the_count(tmp_path):
  _scripted_train(tmp_path, 4, [1.0, 0.5])  # ends at step 4, one evaluation without gain
  _scripted_train(tmp_path, 40, [0.5, 0.5])  # steps 6 and 8 make patience 2... from 4's count
  best = json.loads((tmp_path / "best.json").read_text())
  assert best["best_step"] == 2 and [h[0] for h in best["history"]] == [2, 4, 6]
  assert max(r["step"] for r in _records(tmp_path)) == 6


def test_records_carry_elapsed_time_and_tokens_seen(tmp_path):
  _train(tmp_path, 4, eval_dataset_cfg=_dataset(split="validation"), eval_period=2, eval_steps=1)
  train_records, eval_records = _records(tmp_path), _records(tmp_path, "eval")
  slots = 8 * (48 + 48)  # batch x (inputs + targets)
  assert [r["tokens_seen"] for r in train_records] == [slots * s for s in (1, 2, 3, 4)]
  assert [r["tokens_seen"] for r in eval_records] == [slots * 2, slots * 4]
  elapsed = [r["elapsed_s"] for r in train_records]
  assert all(b >= a > 0 for a, b in itertools.pairwise(elapsed))
  # A resumed run continues the clock from its checkpoint instead of restarting it.
  _train(tmp_path, 6)
  resumed = _records(tmp_path)[4:]
  assert resumed[0]["step"] == 5 and resumed[0]["elapsed_s"] > elapsed[-1]


def test_early_stopping_without_periodic_evaluation_is_a_config_error(tmp_path):
  with pytest.raises(ConfigError, match="train.infer_eval_period"):
    _train(tmp_path, 2, early_stopping=early_stopping.EarlyStopping(metric="t/m"))


def test_logged_metric_equals_evaluating_the_checkpoint(tmp_path):
  """The metric logged during training is what `eval` computes on that checkpoint."""
  cfg = _dataset(EXACT_TASK, split="validation", batch_size=8)
  gin.bind_parameter("training_evaluator.decode", _decode_cfg())
  gin.bind_parameter("build_model.vocabulary", VOCAB)
  _train(
    tmp_path,
    6,
    train_dataset_cfg=_dataset(EXACT_TASK),
    eval_dataset_cfg=cfg,
    infer_eval_period=6,
  )
  [logged] = _records(tmp_path, "eval")
  evaluated = eval_lib.evaluate_checkpoints(
    checkpoint_path=str(tmp_path / "6"),
    output_dir=str(tmp_path / "eval"),
    dataset_cfg=dataclasses.replace(cfg, pack=False, shuffle=False),
    decode=_decode_cfg(),
    num_examples=None,
    watch=False,
    final_step=None,
    timeout_s=0,
    poll_s=0,
  )
  assert evaluated[6][EXACT_TASK]["exact"] == pytest.approx(logged[f"{EXACT_TASK}/exact"])
