"""Tests of the training loop (in process) and the real entry point (subprocess).

In-process tests train a tiny model on tasks registered here (byte vocabulary,
no downloads). Subprocess tests run `python -m t5x_lite.train` on the offline
`quickstart` mixture with tiny lengths and check what a user relies on:
resuming exactly, SIGTERM, kill -9.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from xla_flags import xla_flags
import seqio
import tensorflow as tf
from flax import traverse_util

from t5x_lite import models
from t5x_lite.core import console, gin_config
from t5x_lite.nn import network
from t5x_lite.data import pipeline, vocab
from t5x_lite.checkpoint import checkpoints, train_checkpointer
from t5x_lite.training import optimizers, partitioning
from t5x_lite.run import train_lib
from t5x_lite.core.errors import CheckpointNotFoundError, ConfigError
from text_tasks import VOCAB, register_text_task
from tiny_models import tiny_checkpoint_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXED_TASK = "train_test_fixed_pair"
TEXT_TASK = "train_test_text"


def _fixed_source(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
  del split, shuffle_files, seed
  return tf.data.Dataset.from_tensors(
    {"inputs": "translate: the cat sat on the mat", "targets": "die Katze sass auf der Matte"}
  )


def _text_source(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
  del shuffle_files, seed
  texts = [f"{split} line {i}: " + "abc" * (i % 5) for i in range(64)]
  return tf.data.Dataset.from_tensor_slices({"inputs": texts, "targets": texts})


register_text_task(FIXED_TASK, _fixed_source, ["train", "validation"])
register_text_task(TEXT_TASK, _text_source, ["train", "validation"])
pytestmark = pytest.mark.usefixtures("clean_gin")


def _model(**overrides) -> models.EncoderDecoderModel:
  module = network.Transformer(tiny_checkpoint_config(**overrides))
  return models.EncoderDecoderModel(
    module, VOCAB, VOCAB, loss_normalizing_factor="NUM_REAL_TARGET_TOKENS"
  )


def _dataset(task: str = TEXT_TASK, **overrides) -> pipeline.DatasetConfig:
  fields = dict(
    mixture_or_task_name=task,
    task_feature_lengths={"inputs": 48, "targets": 48},
    batch_size=8,
    pack=False,
  )
  fields.update(overrides)
  return pipeline.DatasetConfig(**fields)


def _train(model_dir, steps: int, **kwargs):
  kwargs.setdefault("model", _model())
  kwargs.setdefault("optimizer", optimizers.adafactor(learning_rate=0.01))
  kwargs.setdefault("train_dataset_cfg", _dataset())
  kwargs.setdefault("log_period", 1)
  return train_lib.train(model_dir=str(model_dir), total_steps=steps, **kwargs)


def _records(model_dir, split: str = "train") -> list[dict]:
  with open(os.path.join(model_dir, "metrics.jsonl")) as f:
    return [r for r in map(json.loads, f) if r["split"] == split]


# ---------------------------------------------------------------- in process


def test_loss_on_a_repeated_batch_falls_by_more_than_half(tmp_path):
  _train(
    tmp_path,
    30,
    train_dataset_cfg=_dataset(FIXED_TASK),
    optimizer=optimizers.adafactor(learning_rate=0.05),
    # One validation example, three batches: two are all padding.
    eval_dataset_cfg=_dataset(FIXED_TASK, split="validation"),
    eval_period=30,
    eval_steps=3,
  )
  losses = [r["loss"] for r in _records(tmp_path)]
  assert len(losses) == 30
  assert losses[-1] < 0.5 * losses[0], losses
  [evaluation] = _records(tmp_path, "eval")
  assert evaluation["step"] == 30 and evaluation["loss"] < 0.5 * losses[0], evaluation
  record = _records(tmp_path)[-1]
  for key in (
    "accuracy",
    "learning_rate",
    "grad_norm",
    "throughput/tokens_per_sec_per_device",
    "throughput/seqs_per_sec_per_device",
    "throughput/mfu",
  ):
    assert np.isfinite(record[key]), key
  assert record["learning_rate"] == pytest.approx(0.05)
  assert os.path.exists(tmp_path / "30" / "params")


def test_non_finite_loss_names_step_and_keeps_last_checkpoint(tmp_path):
  gin.bind_parameter("TrainCheckpointer.save_period", 2)
  explode_after_4 = lambda step: jnp.where(step < 4, 1e-3, 1e30)  # noqa: E731
  with pytest.raises(train_lib.NonFiniteLossError, match=r"at step (\d+)") as e:
    _train(tmp_path, 20, optimizer=optimizers.adamw(learning_rate=explode_after_4))
  bad_step = int(re.search(r"at step (\d+)", str(e.value)).group(1))
  saved = train_checkpointer.TrainCheckpointer(tmp_path)
  latest = saved.latest_step()
  saved.close()
  assert latest == 4 and bad_step == 6
  assert f"last checkpoint (step {latest}) is intact" in str(e.value)
  params = checkpoints.restore_params(tmp_path, _abstract_params(_model()))
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))


def test_train_returns_without_waiting_for_the_iterator_teardown(tmp_path, monkeypatch):
  # Deleting a tf.data iterator can block for up to a minute (`_Loop.release_input`);
  # this one blocks for 10 s and records the thread that deletes it.
  deleted_on = []

  def slow_del(iterator: pipeline.TrainIterator) -> None:
    del iterator
    deleted_on.append(threading.current_thread())
    time.sleep(10)

  monkeypatch.setattr(pipeline.TrainIterator, "__del__", slow_del, raising=False)
  _train(tmp_path, 1)
  deadline = time.monotonic() + 10
  while not deleted_on and time.monotonic() < deadline:
    time.sleep(0.05)
  assert deleted_on and threading.main_thread() not in deleted_on, deleted_on


def _abstract_params(model: models.EncoderDecoderModel):
  """Unboxed abstract params on one device (restore target)."""
  partitioner = partitioning.Partitioner(devices=jax.devices()[:1])
  return partitioner.abstract_params(model.init_params)[0]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  """A 2-step run of a tied-logits (T5 1.0 style) tiny model on a data=4 x model=2 mesh."""
  gin.clear_config()
  model_dir = tmp_path_factory.mktemp("pretrained")
  partitioner = partitioning.Partitioner(num_partitions=2)
  _train(model_dir, 2, model=_model(logits_via_embedding=True), partitioner=partitioner)
  return model_dir


def test_model_dir_of_a_different_model_lists_paths_and_shapes(pretrained):
  with pytest.raises(checkpoints.CheckpointMismatchError) as e:
    _train(pretrained, 3, model=_model(logits_via_embedding=True, emb_dim=48))
  assert "shape mismatch: token_embedder/embedding checkpoint (320, 32) vs model (320, 48)" in str(
    e.value
  )
  assert "missing in checkpoint" not in str(e.value)


def test_finetune_restores_params_only_and_names_missing_parameter(pretrained, tmp_path):
  with pytest.raises(
    checkpoints.CheckpointMismatchError,
    match=r"missing in checkpoint: decoder/logits_dense/kernel \(32, 320\)",
  ):
    _train(tmp_path / "untied", 3, initial_checkpoint_path=str(pretrained))
  tied = _model(logits_via_embedding=True)
  state = _train(
    tmp_path / "ft",
    1,
    model=tied,
    initial_checkpoint_path=str(pretrained),
    optimizer=optimizers.adafactor(learning_rate=0.0),
  )
  assert int(state.step) == 1  # step, optimizer and data restart: only params are loaded
  # Saved on a data=4 x model=2 mesh, restored into this run's data=8 shardings.
  mesh = state.params["token_embedder"]["embedding"].sharding.mesh
  assert dict(mesh.shape) == {"data": 8, "model": 1}
  expected = checkpoints.restore_params(pretrained, _abstract_params(tied))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), expected)


def test_a_missing_start_checkpoint_names_the_binding_and_the_way_out(tmp_path):
  with pytest.raises(CheckpointNotFoundError) as e:
    _train(tmp_path / "ft", 1, initial_checkpoint_path=str(tmp_path / "not_pretrained"))
  assert str(e.value).splitlines()[0] == (  # gin adds a line naming the configurable
    f"train.initial_checkpoint_path: No checkpoint at {tmp_path}/not_pretrained: it does not "
    "exist. Train that checkpoint first, or start from random weights with "
    "--gin.train.initial_checkpoint_path=None"
  )
  assert not (tmp_path / "ft").exists() or not any((tmp_path / "ft").glob("[0-9]*"))


def test_a_checkpoint_is_used_only_with_the_vocabulary_it_was_trained_with(pretrained, tmp_path):
  # The data are bytes; the model's output vocabulary is what the checkpoint records.
  offline = vocab.offline_vocabulary_path()
  trained_with = seqio.SentencePieceVocabulary(offline, extra_ids=100)
  module = network.Transformer(tiny_checkpoint_config())
  _train(tmp_path / "run", 1, model=models.EncoderDecoderModel(module, trained_with, trained_with))
  step_dir = tmp_path / "run" / "1"
  checkpoints.check_vocabulary(step_dir, trained_with)
  moved = tmp_path / "moved.model"
  moved.write_bytes(open(offline, "rb").read())
  checkpoints.check_vocabulary(step_dir, seqio.SentencePieceVocabulary(str(moved), extra_ids=100))
  checkpoints.check_vocabulary(pretrained / "2", trained_with)  # no fingerprint: not checked
  other = seqio.SentencePieceVocabulary(offline, extra_ids=50)
  expected = (
    rf"was trained with the vocabulary {re.escape(offline)} \(100 extra ids\), but this run's "
    rf"vocabulary is {re.escape(offline)} \(50 extra ids\); bind "
    rf"--gin.get_vocabulary.sentencepiece_model_file=\"'{re.escape(offline)}'\""
  )
  with pytest.raises(ConfigError, match=expected):
    checkpoints.check_vocabulary(step_dir, other)
  with pytest.raises(ConfigError, match=expected):  # nothing is trained or saved
    _train(
      tmp_path / "ft",
      1,
      model=models.EncoderDecoderModel(module, other, other),
      initial_checkpoint_path=str(tmp_path / "run"),
    )
  assert not (tmp_path / "ft" / "1").exists()


def _adapters_gin_patterns() -> list[str]:
  """train.trainable_parameters of gin/runs/adapters.gin."""
  gin_config.parse_gin(["runs/adapters.gin"], [])
  try:
    return list(gin.query_parameter("train.trainable_parameters"))
  finally:
    gin.clear_config()


@pytest.mark.parametrize(
  "scan_layers,num_adapters,num_norms", [(False, 6, 10), (True, 4, 7)], ids=["loop", "scan"]
)
def test_adapters_gin_trains_exactly_the_adapters_and_layer_norms(
  scan_layers, num_adapters, num_norms
):
  patterns = _adapters_gin_patterns()
  config = tiny_checkpoint_config(adapter_dim=8, num_decoder_layers=2, scan_layers=scan_layers)
  params = jax.eval_shape(lambda: nn.meta.unbox(network.init_params(config, jax.random.PRNGKey(0))))
  paths = [optimizers.param_path(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
  chosen = {p for p in paths if optimizers.is_trainable(p, patterns)}
  adapters = {p for p in paths if p.split("/")[-3:-2] == ["adapter"]}
  norms = {p for p in paths if p.split("/")[-1] == "scale"}
  # 1 encoder + 2 decoder layers: 2 + 3 norms per layer (or per stacked layers), 2 final.
  assert len(adapters) == num_adapters and len(norms) == num_norms
  assert chosen == adapters | norms


def _adafactor_step_rms(gin_files: list[str]) -> float:
  """RMS of Adafactor's first update (learning rate 1e-2) to a zero [64, 256] kernel, an
  adapter's freshly initialised `wo`, with these gin files parsed."""
  gin_config.parse_gin(gin_files, [])
  try:
    optimizer = optimizers.adafactor(learning_rate=1e-2)
  finally:
    gin.clear_config()
  params = {"wo": jnp.zeros((64, 256))}
  tx = optimizer.with_param_axes({"wo": ("mlp", "embed")}).tx
  updates, _ = tx.update({"wo": jnp.ones((64, 256))}, tx.init(params), params)
  return float(jnp.sqrt(jnp.mean(jnp.square(updates["wo"]))))


def test_adapters_gin_takes_full_steps_on_the_zero_initialised_adapter_kernels():
  # Scaled by the parameter's RMS (floored at 1e-3), the zero kernel would move 1e-5 per
  # step, and adapters stayed the identity for a whole fine-tuning (docs/finetune_sst2.md).
  assert _adafactor_step_rms([]) == pytest.approx(1e-5, rel=1e-3)
  assert _adafactor_step_rms(["runs/adapters.gin"]) == pytest.approx(1e-2, rel=1e-3)


def test_adapter_finetuning_from_a_checkpoint_without_adapters(pretrained, tmp_path):
  patterns = _adapters_gin_patterns()  # clears gin: before the binding below
  gin.bind_parameter("TrainCheckpointer.save_period", 1)
  model = _model(logits_via_embedding=True, adapter_dim=8)
  state = _train(
    tmp_path, 2, model=model, initial_checkpoint_path=str(pretrained), trainable_parameters=patterns
  )
  params = traverse_util.flatten_dict(jax.device_get(state.params), sep="/")
  step_1 = traverse_util.flatten_dict(
    checkpoints.restore_params(tmp_path / "1", _abstract_params(model)), sep="/"
  )
  start = checkpoints.restore_params(
    pretrained, _abstract_params(_model(logits_via_embedding=True))
  )
  for path, value in traverse_util.flatten_dict(start, sep="/").items():
    if path.endswith("_norm/scale"):
      assert not np.array_equal(params[path], value), path  # layer norms train
    else:
      np.testing.assert_array_equal(params[path], value, err_msg=path)  # frozen: bitwise
  adapters = sorted(p for p in params if "/adapter/" in p)
  assert len(adapters) == 4
  for path in adapters:
    assert np.abs(params[path]).max() > 0, path
    # wo starts at zero, so wi's first gradient is zero: both move by step 2.
    assert not np.array_equal(params[path], step_1[path]), path


# ---------------------------------------------------------------- subprocess

_TINY_RUN = [
  "--gin_file=quickstart.gin",
  "--gin.BATCH_SIZE=8",
  "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
  "--gin.train.log_period=1",
  "--gin.TrainCheckpointer.save_period=5",
  "--gin.EVAL_STEPS=1",
]


def _command(model_dir, steps: int, *extra: str) -> list[str]:
  return [
    sys.executable,
    "-m",
    "t5x_lite.train",
    *_TINY_RUN,
    f"--gin.MODEL_DIR={model_dir}",
    f"--gin.TRAIN_STEPS={steps}",
    *extra,
  ]


# Two devices: sharded saves and restores, at a quarter of the 8-device compile cost.
# The test session's log level is left out, and where the entry point itself would
# choose the CPU (`t5x_lite.core.console`) its JAX_PLATFORMS too: runs show what users see.
_ENV = {
  k: v
  for k, v in os.environ.items()
  if k != "TF_CPP_MIN_LOG_LEVEL" and (k != "JAX_PLATFORMS" or console.has_accelerator())
}
_ENV["XLA_FLAGS"] = xla_flags(devices=2)
# Start-up and data-pipeline lines of TensorFlow, CUDA, libtpu, JAX and seqio that a
# CPU run must not print.
_NOISE = (
  "absl::InitializeLog",
  "cudart_stub.cc",
  "oneDNN custom operations",
  "cuInit",
  "TPU_ACCELERATOR_TYPE",
  "TPU_WORKER_HOSTNAMES",
  "Unable to initialize backend",
  "cache_dataset_ops.cc",
  "not cached so using number of input examples",
  "uncached FunctionDataset",
)


def _run(model_dir, steps: int, *extra: str) -> tuple[str, float]:
  """Runs the entry point to the end.

  Returns:
    Its output (stderr and stdout together) and the seconds from its last line to
    its exit.
  """
  process = subprocess.Popen(
    _command(model_dir, steps, *extra),
    cwd=REPO,
    env=_ENV,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  watchdog = threading.Timer(900, process.kill)
  watchdog.start()
  lines, last_line = [], time.monotonic()
  for line in process.stdout:
    lines.append(line)
    last_line = time.monotonic()
  returncode = process.wait()
  exit_seconds = time.monotonic() - last_line
  watchdog.cancel()
  output = "".join(lines)
  assert returncode == 0, output[-3000:]
  return output, exit_seconds


def _start(model_dir, log_path) -> tuple[subprocess.Popen, object]:
  log = open(log_path, "w")
  process = subprocess.Popen(
    _command(model_dir, 100_000, "--gin.EVAL_PERIOD=0"),
    cwd=REPO,
    env=_ENV,
    stdout=log,
    stderr=subprocess.STDOUT,
  )
  return process, log


def _wait_for(predicate, process: subprocess.Popen, log_path, timeout: float = 900) -> None:
  deadline = time.time() + timeout
  while not predicate():
    assert process.poll() is None, open(log_path).read()[-3000:]
    assert time.time() < deadline, "timed out"
    time.sleep(0.2)


def _params_of(step_dir) -> dict:
  with ocp.StandardCheckpointer() as ckptr:
    return jax.tree.map(np.asarray, ckptr.restore(os.path.join(step_dir, "params")))


@pytest.mark.slow
def test_entry_point_trains_and_resumes_exactly(tmp_path):
  whole, split = tmp_path / "whole", tmp_path / "split"
  output, exit_seconds = _run(whole, 10, "--gin.EVAL_PERIOD=10")
  assert "train step 10/10" in output and "eval step 10/10" in output
  assert [noise for noise in _NOISE if noise in output] == [], output
  # The start-up choices are said, not made silently (`console.quiet_startup`).
  assert "Start-up: TF_CPP_MIN_LOG_LEVEL=2" in output, output
  assert output.rstrip().endswith(f"Training finished at step 10; checkpoint {whole}/10."), output
  assert exit_seconds < 15, exit_seconds  # tf.data's teardown is not waited for
  assert sorted(os.listdir(whole)) == ["10", "5", "config.gin", "eval", "metrics.jsonl", "train"]
  assert "TRAIN_STEPS = 10" in (whole / "config.gin").read_text()
  assert [r["step"] for r in _records(whole, "eval")] == [10]

  _run(split, 5, "--gin.EVAL_PERIOD=0")
  resumed, _ = _run(split, 10, "--gin.EVAL_PERIOD=0")
  assert f"Resuming from {split}/5" in resumed
  first, second = _records(whole), _records(split)
  assert [r["step"] for r in second] == list(range(1, 11))
  for a, b in zip(first, second):  # same batches and params give the same losses
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"], (a, b)
  jax.tree.map(np.testing.assert_array_equal, _params_of(whole / "10"), _params_of(split / "10"))


@pytest.mark.slow
def test_kill_9_then_resume_then_sigterm(tmp_path):
  model_dir = tmp_path / "run"
  # kill -9: at most the steps since the last committed save are lost.
  process, log = _start(model_dir, tmp_path / "killed.log")
  _wait_for(lambda: (model_dir / "10").exists(), process, tmp_path / "killed.log")
  process.kill()
  process.wait()
  log.close()
  saved = train_checkpointer.TrainCheckpointer(model_dir)
  latest = saved.latest_step()
  saved.close()
  assert latest >= 10

  # The restart resumes from it; SIGTERM then finishes the step, saves it, exits 0.
  resumed_log = tmp_path / "resumed.log"
  process, log = _start(model_dir, resumed_log)
  _wait_for(lambda: resumed_log.read_text().count("train step") >= 3, process, resumed_log)
  process.send_signal(signal.SIGTERM)
  _wait_for(lambda: "Stopped by SIGTERM" in resumed_log.read_text(), process, resumed_log)
  stopped = time.monotonic()
  assert process.wait(timeout=600) == 0
  assert time.monotonic() - stopped < 15  # exits right after the save
  log.close()
  output = resumed_log.read_text()
  assert f"Resuming from {model_dir}/{latest}" in output
  assert f"train step {latest + 1}/" in output  # continues right after the checkpoint
  stopped_at = _records(model_dir)[-1]["step"]
  assert f"Stopped by SIGTERM at step {stopped_at}; checkpoint {model_dir}/{stopped_at}." in output
  # The warning names the step it stops at (the loop runs at most one step ahead).
  received = int(re.search(r"Received SIGTERM during step (\d+): finishing it", output).group(1))
  assert stopped_at in (received, received + 1), (received, stopped_at)
  assert f"then saving step {received} and exiting" in output
  assert stopped_at >= latest + 3
  saved = train_checkpointer.TrainCheckpointer(model_dir)
  assert saved.latest_step() == stopped_at
  saved.close()
