"""Tests of checkpoint evaluation (t5x_lite.run.eval_lib) and the eval entry point.

The entry-point test trains a tiny model with the real train entry (offline
`quickstart` mixture, two checkpoints) and evaluates it with `python -m
t5x_lite.eval`. In-process tests use tasks registered here (byte vocabulary) and
a stub runner whose outputs are known, so the metric numbers are exact.
"""

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time

import flax.linen as nn
import gin
import jax
import numpy as np
import pytest
import seqio
import tensorflow as tf
from etils import epath

from t5x_lite import models
from t5x_lite.nn import network
from t5x_lite.data import pipeline, task_metrics
from t5x_lite.checkpoint import checkpoints, train_checkpointer
from t5x_lite.training import optimizers, partitioning
from t5x_lite.run import eval_lib, infer_lib, model_runner, task_evaluator, train_lib
from t5x_lite.checkpoint.manifest import FILE_MANIFEST
from t5x_lite.core.errors import CheckpointError, ConfigError, CorruptCheckpointError
from tiny_models import tiny_checkpoint_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = seqio.ByteVocabulary()
LABELED_TASK = "eval_test_labeled"  # accuracy (predictions) + mean_score (scores)
PLAIN_TASK = "eval_test_no_metrics"  # no metric fns: loss only
MIXTURE = "eval_test_mixture"
LENGTHS = {"inputs": 16, "targets": 8}
NUM_EXAMPLES = 12


def _labeled(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
  del split, shuffle_files, seed
  words = ["yes" if i % 3 else "no" for i in range(NUM_EXAMPLES)]
  return tf.data.Dataset.from_tensor_slices(
    {"inputs": [f"q{i}: {w}?" for i, w in enumerate(words)], "targets": words}
  )


def mean_score(targets, scores):
  """A score metric: the mean target log-likelihood."""
  del targets
  return {"mean_score": float(np.mean(scores))}


def _features() -> dict[str, seqio.Feature]:
  return {"inputs": seqio.Feature(VOCAB), "targets": seqio.Feature(VOCAB)}


_PREPROCESSORS = [seqio.preprocessors.tokenize, seqio.preprocessors.append_eos_after_trim]
if LABELED_TASK not in seqio.TaskRegistry.names():
  seqio.TaskRegistry.add(
    LABELED_TASK,
    source=seqio.FunctionDataSource(_labeled, splits=["validation"]),
    preprocessors=_PREPROCESSORS,
    output_features=_features(),
    metric_fns=[task_metrics.accuracy, mean_score],
  )
  seqio.TaskRegistry.add(
    PLAIN_TASK,
    source=seqio.FunctionDataSource(_labeled, splits=["validation"]),
    preprocessors=_PREPROCESSORS,
    output_features=_features(),
    metric_fns=[],
  )
  seqio.MixtureRegistry.add(MIXTURE, [LABELED_TASK, PLAIN_TASK], default_rate=1.0)


@pytest.fixture(autouse=True)
def _clean_gin():
  gin.clear_config()
  gin.bind_parameter("build_model.vocabulary", VOCAB)  # eval and infer build their model
  yield
  gin.clear_config()


class StubRunner:
  """Predicts the targets themselves; scores each row -(its number of target tokens)."""

  batch_size = 8

  def __init__(self):
    self.rows_predicted = 0

  def predict(self, params, batch):
    del params
    self.rows_predicted += len(batch["decoder_target_tokens"])
    return batch["decoder_target_tokens"], np.zeros(len(batch["decoder_target_tokens"]))

  def score(self, params, batch):
    del params
    return -(batch["decoder_target_tokens"] > 0).sum(axis=1).astype(np.float32)


def _dataset_cfg(name: str = MIXTURE, **overrides) -> pipeline.DatasetConfig:
  fields = dict(
    mixture_or_task_name=name,
    task_feature_lengths=LENGTHS,
    batch_size=8,
    split="validation",
    shuffle=False,
    pack=False,
  )
  fields.update(overrides)
  return pipeline.DatasetConfig(**fields)


def test_metrics_of_predictions_scores_and_loss_only_task(tmp_path, caplog):
  runner = StubRunner()
  evaluator = task_evaluator.TaskEvaluator(
    runner,
    _dataset_cfg(),
    log_dir=str(tmp_path),
    logger_cls=(task_evaluator.PredictionsJsonlLogger,),
  )
  assert "task eval_test_no_metrics has no metric functions" in caplog.text
  results = evaluator.evaluate(params=None, step=7)
  targets = [len(w) + 1 for w in ["yes" if i % 3 else "no" for i in range(NUM_EXAMPLES)]]
  assert results[LABELED_TASK]["accuracy"] == 100.0
  assert results[LABELED_TASK]["mean_score"] == pytest.approx(-np.mean(targets))
  # Loss only: sum of -scores over target tokens = 1 per token.
  assert results[PLAIN_TASK] == {"nll_per_token": 1.0, "num_examples": float(NUM_EXAMPLES)}
  assert runner.rows_predicted == NUM_EXAMPLES
  with open(tmp_path / "inferences" / f"{LABELED_TASK}-step_7.jsonl") as f:
    lines = [json.loads(line) for line in f]
  assert len(lines) == NUM_EXAMPLES
  assert lines[1] == {
    "inputs": "q1: yes?",
    "targets": "yes",
    "target": "yes",
    "output": "yes",
    "prediction": "yes",
    "score": -4.0,
  }


@pytest.mark.parametrize(
  "inputs_length,fit",
  [
    (16, ""),
    (8, "; inputs at the given length may have been truncated"),
  ],
  ids=["longer", "shorter"],
)
def test_lengths_are_one_line_of_ours_instead_of_seqios_warning(
  tmp_path, caplog, inputs_length, fit
):
  """seqio's multi-line advice on the given lengths becomes one line naming the lengths
  that fit the split ("q10: yes?" + EOS: 10 input tokens; "yes" + EOS: 4)."""
  given = {"inputs": inputs_length, "targets": 8}
  with caplog.at_level(logging.INFO, logger="absl"):
    task_evaluator.TaskEvaluator(
      StubRunner(), _dataset_cfg(LABELED_TASK, task_feature_lengths=given), log_dir=str(tmp_path)
    )
  assert "Given sequence lengths" not in caplog.text
  expected = (
    f"Evaluating {LABELED_TASK} (validation): {NUM_EXAMPLES} examples of at most "
    f"{min(10, inputs_length)} input and 4 target tokens; TASK_FEATURE_LENGTHS="
    f"{{'inputs': {min(10, inputs_length)}, 'targets': 4}} would fit them all (given: {given})"
    f"{fit}."
  )
  assert [r.getMessage() for r in caplog.records if "Evaluating" in r.getMessage()] == [expected]


_tiny_config = tiny_checkpoint_config


def _write_checkpoint(root, steps) -> models.EncoderDecoderModel:
  """Params-only checkpoints of a random tiny model (different seed per step)."""
  config = _tiny_config()
  model = models.build_model(config)
  stored = {
    k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()
  }
  for step in steps:
    params = nn.meta.unbox(model.init_params(jax.random.PRNGKey(step)))
    checkpoints.write_params_checkpoint(root, params, step=step, config=stored)
  return model


def _evaluate(ckpt, out, **overrides):
  kwargs = dict(
    checkpoint_path=str(ckpt),
    output_dir=str(out),
    dataset_cfg=_dataset_cfg(LABELED_TASK),
    decode=model_runner.DecodeConfig(),
    num_examples=None,
    watch=False,
    final_step=None,
    timeout_s=0.0,
    poll_s=0.0,
  )
  kwargs.update(overrides)
  return eval_lib.evaluate_checkpoints(**kwargs)


def test_real_model_scores_match_score_batch_and_steps_are_skipped(tmp_path):
  gin.bind_parameter("Partitioner.num_partitions", 2)  # data=4 x model=2
  model = _write_checkpoint(tmp_path / "ckpt", steps=[3, 5])
  results = _evaluate(tmp_path / "ckpt", tmp_path / "out")
  assert list(results) == [3, 5]
  params = checkpoints.restore_params(
    tmp_path / "ckpt" / "5",
    partitioning.Partitioner().abstract_params(model.init_params)[0],
  )
  batch = next(
    pipeline.eval_batches(
      _dataset_cfg(LABELED_TASK, batch_size=NUM_EXAMPLES),
      jax.sharding.SingleDeviceSharding(jax.devices()[0]),
      1,
    )
  )
  batch = {k: np.asarray(v) for k, v in batch.items()}
  expected = float(np.mean(model.score_batch(jax.device_get(params), batch)))
  assert results[5][LABELED_TASK]["mean_score"] == pytest.approx(expected, rel=1e-5)
  assert results[3][LABELED_TASK]["mean_score"] != results[5][LABELED_TASK]["mean_score"]
  written = json.loads((tmp_path / "out" / "metrics_step_5.json").read_text())
  assert written["metrics"] == results[5] and written["step"] == 5
  assert os.listdir(tmp_path / "out" / LABELED_TASK)  # TensorBoard events

  assert _evaluate(tmp_path / "ckpt", tmp_path / "out") == {}  # both steps skipped
  with pytest.raises(ValueError, match=r"different evaluation \(differs in \['split'\]\)"):
    _evaluate(
      tmp_path / "ckpt", tmp_path / "out", dataset_cfg=_dataset_cfg(LABELED_TASK, split="train")
    )


def test_batches_go_longest_input_first_each_cut_to_its_bucket():
  tokens = np.zeros([5, 64], np.int32)  # rows of 5, 40, 17, 0 and 33 tokens
  for row, length in enumerate([5, 40, 17, 0, 33]):
    tokens[row, :length] = 7
  order, widths = task_evaluator.by_input_length({"encoder_input_tokens": tokens}, 2)
  assert order.tolist() == [1, 4, 2, 0, 3]
  assert widths == [64, 32, 16]  # buckets of 40, 17 and 0 (at least 16, at most 64)
  decoder_only = {"decoder_input_tokens": tokens}
  order, widths = task_evaluator.by_input_length(decoder_only, 2)
  assert order.tolist() == [0, 1, 2, 3, 4] and widths == [None, None, None]


VARIED_TASK = "eval_test_varied_lengths"  # inputs of 3 to 60 bytes


def _varied(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
  del split, shuffle_files, seed
  inputs = ["x" * (3 + (i * 37) % 58) for i in range(20)]
  return tf.data.Dataset.from_tensor_slices({"inputs": inputs, "targets": ["ab"] * 20})


if VARIED_TASK not in seqio.TaskRegistry.names():
  seqio.TaskRegistry.add(
    VARIED_TASK,
    source=seqio.FunctionDataSource(_varied, splits=["validation"]),
    preprocessors=_PREPROCESSORS,
    output_features=_features(),
    metric_fns=[task_metrics.accuracy, mean_score],
  )


def test_length_sorted_batches_predict_and_score_as_full_width_batches_in_order():
  model = models.build_model(_tiny_config())
  partitioner = partitioning.Partitioner()
  _, shardings = partitioner.abstract_params(model.init_params)
  params = jax.device_put(nn.meta.unbox(model.init_params(jax.random.PRNGKey(1))), shardings)
  runner = model_runner.ModelRunner(model, partitioner, shardings, model_runner.DecodeConfig(), 8)
  cfg = _dataset_cfg(VARIED_TASK, task_feature_lengths={"inputs": 64, "targets": 8})
  evaluator = task_evaluator.TaskEvaluator(runner, cfg)
  ds = evaluator.seqio.cached_model_datasets[VARIED_TASK]
  widths = [b["encoder_input_tokens"].shape[1] for _, b in evaluator._batches(ds, "test")]
  # 20 rows of 4 to 61 tokens (EOS included): 8 of 37-61, 8 of 15-36, 4 of 4-11.
  assert widths == [64, 64, 16]

  predicted = dict(evaluator._predict(params, ds))
  scored = dict(evaluator._score(params, ds))
  expected_tokens, expected_scores = {}, {}
  for indices, batch in ds.batch(8).as_numpy_iterator():  # dataset order, full width
    tokens, _ = runner.predict(params, batch)
    expected_tokens.update(zip(indices.tolist(), tokens))
    expected_scores.update(zip(indices.tolist(), runner.score(params, batch).tolist()))
  assert sorted(predicted) == sorted(expected_tokens) == list(range(20))
  for i in range(20):
    np.testing.assert_array_equal(predicted[i], expected_tokens[i])
    assert scored[i] == pytest.approx(expected_scores[i], rel=1e-5, abs=1e-5)


def test_missing_checkpoint_path_is_named(tmp_path):
  with pytest.raises(CheckpointError, match=f"No checkpoint at {tmp_path}/nope: it does not exist"):
    _evaluate(tmp_path / "nope", tmp_path / "out")
  (tmp_path / "empty").mkdir()
  with pytest.raises(
    CheckpointError,
    match=f"No checkpoint at {tmp_path}/empty: expected a step "
    "directory with params/ or a MODEL_DIR",
  ):
    _evaluate(tmp_path / "empty", tmp_path / "out")


def test_relative_checkpoint_and_output_paths(tmp_path, monkeypatch):
  _write_checkpoint(tmp_path / "ckpt", steps=[3])
  monkeypatch.chdir(tmp_path)
  results = _evaluate("./ckpt", "out")
  assert list(results) == [3]
  written = json.loads((tmp_path / "out" / "metrics_step_3.json").read_text())
  assert written["checkpoint"] == str(tmp_path / "ckpt" / "3")
  (tmp_path / "file").write_text("")
  with pytest.raises(ConfigError, match=f"EVAL_OUTPUT_DIR file \\({tmp_path}/file\\) is a file"):
    _evaluate("ckpt", "file")


def test_corrupt_latest_step_is_skipped_by_eval_and_infer_and_redone_by_training(tmp_path, caplog):
  gin.bind_parameter("TrainCheckpointer.save_period", 2)
  model_dir, lengths = tmp_path / "model", {"inputs": 16, "targets": 4}
  _train_tiny(model_dir, total_steps=4)
  manifest = json.loads((model_dir / "4" / FILE_MANIFEST).read_text())
  victim = model_dir / "4" / sorted(n for n in manifest if n.startswith("params/"))[0]
  victim.write_bytes(victim.read_bytes()[:-1])  # truncated
  corrupt = {p: p.read_bytes() for p in (model_dir / "4").rglob("*") if p.is_file()}

  assert list(_evaluate(model_dir, tmp_path / "eval")) == [2]
  assert (
    f"CORRUPT CHECKPOINT STEP 4 skipped (step 4: Checkpoint file truncated or altered: {victim}"
    in caplog.text
  )
  assert not (tmp_path / "eval" / "metrics_step_4.json").exists()
  with pytest.raises(CorruptCheckpointError, match=str(victim)):  # a step asked for explicitly
    _evaluate(model_dir / "4", tmp_path / "eval4")
  caplog.clear()
  with caplog.at_level(logging.INFO, logger="absl"):
    infer_lib.infer(
      checkpoint_path=str(model_dir),
      output_file=str(tmp_path / "out.jsonl"),
      task_feature_lengths=lengths,
      input_file=None,
      mixture_or_task_name=LABELED_TASK,
      split="validation",
      batch_size=8,
      mode="predict",
      decode=model_runner.DecodeConfig(),
    )
  assert f"using step 2 of {model_dir} instead" in caplog.text
  assert f"with step 2 of {model_dir}" in caplog.text
  assert {p: p.read_bytes() for p in (model_dir / "4").rglob("*") if p.is_file()} == corrupt

  caplog.clear()
  with caplog.at_level(logging.INFO, logger="absl"):
    _train_tiny(model_dir, total_steps=6)
  assert f"using step 2 of {model_dir} instead" in caplog.text
  assert f"Resuming from {model_dir}/2" in caplog.text
  moved = model_dir / "4.corrupt"
  assert {moved / p.relative_to(model_dir / "4"): b for p, b in corrupt.items()} == {
    p: p.read_bytes() for p in moved.rglob("*") if p.is_file()
  }
  ckpt = train_checkpointer.TrainCheckpointer(model_dir)
  assert ckpt.all_steps() == [2, 4, 6]
  ckpt.close()
  assert list(_evaluate(model_dir, tmp_path / "eval")) == [4, 6]  # the redone step 4 is intact


def test_watch_evaluates_steps_as_training_writes_them_until_the_final_step(
  tmp_path, monkeypatch, caplog
):
  """Each sleep of the watch loop stands for training writing more of MODEL_DIR."""
  model_dir = tmp_path / "model"  # does not exist yet: training has not started
  unfinalized = {"5"}  # orbax has not committed step 5 (where renames are not atomic)
  finalized = eval_lib.ocp.step.is_path_finalized
  monkeypatch.setattr(
    eval_lib.ocp.step,
    "is_path_finalized",
    lambda path, **kw: epath.Path(path).name not in unfinalized and finalized(path, **kw),
  )

  def training_writes_more(step):  # step 1: before any checkpoint, the model dir is created
    if step == 1:
      _write_checkpoint(model_dir, steps=[3])
      (model_dir / "5.orbax-checkpoint-tmp-1" / checkpoints.PARAMS).mkdir(parents=True)
    elif step == 2:
      _write_checkpoint(model_dir, steps=[5])
      (model_dir / "5" / FILE_MANIFEST).unlink()  # committed, manifest not written yet
    elif step == 3:
      unfinalized.clear()
      _write_checkpoint(model_dir, steps=[7])  # after the final step: never evaluated

  polls, sleep, poll_s = [], time.sleep, 0.0123  # time.sleep is global: others sleep too

  def fake_sleep(seconds):
    if seconds != poll_s:
      return sleep(seconds)
    polls.append(seconds)
    training_writes_more(len(polls))

  monkeypatch.setattr(time, "sleep", fake_sleep)
  with caplog.at_level(logging.INFO, logger="absl"):
    results = _evaluate(
      model_dir, tmp_path / "eval", watch=True, final_step=5, timeout_s=600, poll_s=poll_s
    )
  assert list(results) == [3, 5] and len(polls) == 3
  written = sorted(p.name for p in (tmp_path / "eval").glob("metrics_step_*"))
  assert written == ["metrics_step_3.json", "metrics_step_5.json"]
  assert "Evaluated step 5, at or after the final step 5; stopping." in caplog.text
  assert results[3][LABELED_TASK]["mean_score"] != results[5][LABELED_TASK]["mean_score"]


def test_watch_stops_after_the_timeout_and_at_an_evaluated_final_step(
  tmp_path, monkeypatch, caplog
):
  _write_checkpoint(tmp_path / "model", steps=[3])
  with caplog.at_level(logging.INFO, logger="absl"):
    results = _evaluate(
      tmp_path / "model", tmp_path / "eval", watch=True, timeout_s=0.2, poll_s=0.05
    )
  assert list(results) == [3]
  assert f"No new checkpoint step in {tmp_path}/model for 0.2 s; stopping." in caplog.text
  monkeypatch.setattr(time, "sleep", lambda s: pytest.fail("waited"))
  assert _evaluate(tmp_path / "model", tmp_path / "eval", watch=True, final_step=3) == {}
  with pytest.raises(ConfigError, match="WATCH=True needs a MODEL_DIR, got the step directory"):
    _evaluate(tmp_path / "model" / "3", tmp_path / "eval", watch=True)


def _train_tiny(model_dir, total_steps: int, **kwargs) -> None:
  module = network.Transformer(_tiny_config())
  model = models.EncoderDecoderModel(
    module, VOCAB, VOCAB, loss_normalizing_factor="NUM_REAL_TARGET_TOKENS"
  )
  train_lib.train(
    model_dir=str(model_dir),
    total_steps=total_steps,
    model=model,
    optimizer=optimizers.adafactor(learning_rate=0.01),
    train_dataset_cfg=_dataset_cfg(LABELED_TASK, split="validation", pack=True),
    **kwargs,
  )


def test_periodic_evaluation_inside_training(tmp_path):
  gin.bind_parameter("training_evaluator.num_examples", 8)
  _train_tiny(
    tmp_path,
    total_steps=4,
    eval_dataset_cfg=_dataset_cfg(MIXTURE),
    infer_eval_period=2,
    log_period=2,
  )
  with open(tmp_path / "metrics.jsonl") as f:
    evals = [r for r in map(json.loads, f) if f"{LABELED_TASK}/accuracy" in r]
  assert [r["step"] for r in evals] == [2, 4]
  assert all(r["split"] == "eval" and np.isfinite(r[f"{PLAIN_TASK}/nll_per_token"]) for r in evals)
  assert (tmp_path / "inference_eval" / "inferences" / f"{LABELED_TASK}-step_4.jsonl").exists()


# ---------------------------------------------------------------- entry point

_TRAIN = [
  "--gin_file=quickstart.gin",
  "--gin.BATCH_SIZE=8",
  "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
  "--gin.TRAIN_STEPS=2",
  "--gin.TrainCheckpointer.save_period=1",
  "--gin.EVAL_PERIOD=0",
]


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
  result = subprocess.run(
    [sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True, timeout=600
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def _eval_args(checkpoint_path, output_dir) -> list[str]:
  return [
    "--gin_file=runs/eval.gin",
    f"--gin.CHECKPOINT_PATH={checkpoint_path}",
    f"--gin.EVAL_OUTPUT_DIR={output_dir}",
    "--gin.MIXTURE_OR_TASK_NAME=cpython_code_to_docstring",
    "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
    "--gin.BATCH_SIZE=8",
    "--gin.NUM_EXAMPLES=8",
  ]


@pytest.mark.slow
def test_eval_entry_on_trained_checkpoints_then_skips_evaluated_steps(tmp_path):
  model_dir, out = tmp_path / "model", tmp_path / "eval"
  _run("t5x_lite.train", *_TRAIN, f"--gin.MODEL_DIR={model_dir}")
  _run("t5x_lite.eval", *_eval_args(model_dir / "1", out))
  first = json.loads((out / "metrics_step_1.json").read_text())
  assert set(first["metrics"]["cpython_code_to_docstring"]) == {"rouge1", "rouge2", "rougeLsum"}
  with open(out / "inferences" / "cpython_code_to_docstring-step_1.jsonl") as f:
    assert len(f.readlines()) == 8
  assert os.listdir(out / "cpython_code_to_docstring")

  second = _run("t5x_lite.eval", *_eval_args(model_dir, out))
  assert "Step 1 already evaluated" in second.stderr
  assert json.loads((out / "metrics_step_1.json").read_text()) == first
  assert json.loads((out / "metrics_step_2.json").read_text())["step"] == 2
