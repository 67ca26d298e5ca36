"""Tests of what training checks before any work (faults_test.py runs them through the
entry point)."""

import os

import numpy as np
import pytest

from t5x_lite.core import paths
from t5x_lite.core.errors import CheckpointNotFoundError, ConfigError, WriteError
from t5x_lite.data import pipeline
from t5x_lite.run import train_checks
from t5x_lite.training import partitioning
from text_tasks import register_text_task

TASK = register_text_task(
  "train_checks_test", lambda split, shuffle_files, seed=None: None, ["train"]
)
# Where nobody, root included, may create a file or a directory (sysfs).
UNWRITABLE = "/sys/kernel"


def _cfg(**overrides) -> pipeline.DatasetConfig:
  fields = dict(
    mixture_or_task_name=TASK, task_feature_lengths={"inputs": 8, "targets": 8}, batch_size=8
  )
  return pipeline.DatasetConfig(**{**fields, **overrides})


def test_not_writable_names_the_directory_and_the_reason(tmp_path):
  assert paths.not_writable("MODEL_DIR", tmp_path / "new" / "run") is None
  assert os.listdir(tmp_path / "new" / "run") == []  # created, probe removed
  assert paths.not_writable("MODEL_DIR", UNWRITABLE) == (
    f"MODEL_DIR {UNWRITABLE} is not writable: cannot create a file in it (Permission denied)"
  )
  assert paths.not_writable("MODEL_DIR", f"{UNWRITABLE}/run").startswith(
    f"MODEL_DIR {UNWRITABLE}/run is not writable: cannot create it ("
  )


def test_check_outputs_covers_the_tensorboard_directories(tmp_path):
  model_dir = tmp_path / "run"
  train_checks.check_outputs(str(model_dir), ("train", "eval"))
  assert os.listdir(model_dir) == []  # made; its TensorBoard directories are made when used
  (model_dir / "eval").write_text("")
  with pytest.raises(WriteError, match=f"TensorBoard directory {model_dir}/eval is a file"):
    train_checks.check_outputs(str(model_dir), ("train", "eval"))


@pytest.mark.parametrize("batch_size", [0, -8, 2.5])
def test_a_batch_size_below_one_names_the_binding(batch_size):
  with pytest.raises(
    ConfigError, match=f"gin BATCH_SIZE\\) must be a positive integer, got {batch_size}"
  ):
    _cfg(batch_size=batch_size)


@pytest.mark.parametrize(
  "lengths", ["abc", {"inputs": 0, "targets": 8}, {"inputs": 8.0}, {1: 8}, {"inputs": True}]
)
def test_feature_lengths_that_are_not_names_to_positive_integers_name_the_binding(lengths):
  _cfg(task_feature_lengths=None)  # evaluation: the lengths come from the data
  _cfg(task_feature_lengths={"targets": np.int64(160)})
  with pytest.raises(ConfigError) as e:
    _cfg(task_feature_lengths=lengths)
  assert str(e.value).splitlines()[0] == (  # then gin's "In call to configurable" note
    "DatasetConfig.task_feature_lengths (gin TASK_FEATURE_LENGTHS) must map feature names "
    f"to positive integers, e.g. {{'inputs': 512, 'targets': 114}}; got {lengths!r}"
  )


def test_resuming_with_other_data_names_binding_checkpoint_and_request():
  meta = {train_checks.TRAIN_DATA_KEY: train_checks.train_data_meta(_cfg())}
  train_checks.check_resume("runs/x", 40, meta, _cfg(), total_steps=100)
  with pytest.raises(ConfigError) as raised:
    train_checks.check_resume("runs/x", 40, meta, _cfg(batch_size=16), total_steps=100)
  message = str(raised.value)
  assert message.startswith("BATCH_SIZE is 16, but MODEL_DIR runs/x (")
  assert "(step 40) was trained with 8" in message
  assert "--gin.INITIAL_CHECKPOINT_PATH=runs/x" in message
  lengths = _cfg(task_feature_lengths={"inputs": 16, "targets": 8})
  with pytest.raises(ConfigError, match="TASK_FEATURE_LENGTHS is .'inputs': 16"):
    train_checks.check_resume("runs/x", 40, meta, lengths, total_steps=100)
  # A checkpoint from before train_data was recorded resumes unchecked.
  train_checks.check_resume("runs/x", 40, {}, _cfg(batch_size=16), total_steps=100)


def test_train_steps_below_the_restored_step_is_an_error():
  train_checks.check_resume("runs/x", 40, {}, _cfg(), total_steps=40)  # nothing to do: fine
  with pytest.raises(ConfigError, match="TRAIN_STEPS 30 is below step 40, which MODEL_DIR"):
    train_checks.check_resume("runs/x", 40, {}, _cfg(), total_steps=30)


@pytest.mark.parametrize(
  "value, least, needle",
  [
    ("abc", 0, "TRAIN_STEPS (train.total_steps) must be an integer of at least 0, got 'abc'"),
    (-1, 0, "TRAIN_STEPS (train.total_steps) must be an integer of at least 0, got -1"),
    (2.5, 0, "must be an integer of at least 0, got 2.5"),
    (True, 0, "must be an integer of at least 0, got True"),
    ("7", None, "TRAIN_STEPS (train.total_steps) must be an integer, got '7'"),
  ],
)
def test_a_count_that_is_not_a_whole_number_names_the_binding(value, least, needle):
  train_checks.check_counts(total_steps=(0, "TRAIN_STEPS", 0), random_seed=(-3, "SEED", None))
  with pytest.raises(ConfigError) as e:
    train_checks.check_counts(total_steps=(value, "TRAIN_STEPS", least))
  assert needle in str(e.value)


def test_a_batch_that_does_not_divide_over_the_data_axis_names_both():
  partitioner = partitioning.Partitioner()  # 8 devices (tests/conftest.py)
  with pytest.raises(ConfigError, match="BATCH_SIZE 12 .* data axis of 8 devices; use a multiple"):
    train_checks.check_batch_size(_cfg(batch_size=12), partitioner)
  train_checks.check_batch_size(_cfg(batch_size=16), partitioner)


def test_a_new_runs_missing_start_is_named_and_a_resumed_run_does_not_read_it(tmp_path):
  missing = str(tmp_path / "pretrained")
  with pytest.raises(CheckpointNotFoundError, match=r"^train\.initial_checkpoint_path: No check"):
    train_checks.check_start(missing, resuming=False)
  train_checks.check_start(missing, resuming=True)  # a resume never reads the start
  train_checks.check_start(None, resuming=False)  # random weights
  (tmp_path / "pretrained" / "7" / "params").mkdir(parents=True)
  train_checks.check_start(missing, resuming=False)
