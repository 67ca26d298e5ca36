"""Tests for t5x_lite.data.pipeline: sharded global batches, determinism, exact resume, eval."""

import dataclasses
import functools
import logging
import os
import re
import sys

import gin
import jax
import numpy as np
import pytest
import seqio
import tensorflow as tf
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from t5x_lite.data import pipeline, preprocessors
from t5x_lite.core.errors import ConfigError

TASK = "data_test_bytes"
NUM_TRAIN, NUM_VALIDATION = 120, 11


def _source(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
  del shuffle_files, seed
  n = NUM_TRAIN if split == "train" else NUM_VALIDATION
  texts = [f"{split} example {i} " + "x" * (i % 7) for i in range(n)]
  return tf.data.Dataset.from_tensor_slices(
    {"inputs": texts, "targets": [t.upper() for t in texts]}
  )


# Records with columns 'sentence' and 'lbl' (not 'label'); sentence i has 10 * i bytes.
NUM_SENTENCES = 8


def _sentences(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
  del split, shuffle_files, seed
  return tf.data.Dataset.from_tensor_slices(
    {
      "sentence": ["x" * (10 * i) for i in range(NUM_SENTENCES)],
      "lbl": ["yes" * i for i in range(NUM_SENTENCES)],
    }
  )


def _select(dataset: tf.data.Dataset, key: str) -> tf.data.Dataset:
  return dataset.map(lambda x: {"inputs": x["sentence"], "targets": x[key]})


_vocab = seqio.ByteVocabulary()
_FEATURES = {"inputs": seqio.Feature(_vocab), "targets": seqio.Feature(_vocab)}
# name: preprocessors over _sentences.
_SENTENCE_TASKS = {
  "data_test_pairs": preprocessors.supervised_preprocessors(functools.partial(_select, key="lbl")),
  "data_test_text_to_text": preprocessors.supervised_preprocessors(
    functools.partial(preprocessors.text_to_text, prefix="s", feature_names=("sentence",))
  ),
  "data_test_own_preprocessor": [functools.partial(_select, key="label")],
}
if TASK not in seqio.TaskRegistry.names():
  seqio.TaskRegistry.add(
    TASK,
    source=seqio.FunctionDataSource(_source, splits=["train", "validation"]),
    preprocessors=[seqio.preprocessors.tokenize, seqio.preprocessors.append_eos],
    output_features=_FEATURES,
  )
  for _name, _preprocessors in _SENTENCE_TASKS.items():
    seqio.TaskRegistry.add(
      _name,
      source=seqio.FunctionDataSource(_sentences, splits=["train"]),
      preprocessors=_preprocessors,
      output_features=_FEATURES,
    )
  seqio.MixtureRegistry.add("data_test_mix", [TASK, "data_test_text_to_text"], default_rate=1.0)


@pytest.fixture(scope="module")
def sharding() -> NamedSharding:
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
  return NamedSharding(mesh, PartitionSpec("data"))


def _config(**overrides) -> pipeline.DatasetConfig:
  config = pipeline.DatasetConfig(
    mixture_or_task_name=TASK,
    task_feature_lengths={"inputs": 64, "targets": 64},
    batch_size=8,
    seed=7,
  )
  return dataclasses.replace(config, **overrides)


def _as_numpy(batch: pipeline.Batch) -> dict[str, np.ndarray]:
  return {k: np.asarray(v) for k, v in batch.items()}


def _take(iterator, n: int) -> list[dict[str, np.ndarray]]:
  return [_as_numpy(next(iterator)) for _ in range(n)]


def _assert_same(a: list[dict], b: list[dict]) -> None:
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_train_batches_are_global_and_sharded_over_data(sharding):
  batch = next(pipeline.train_iterator(_config(), sharding))
  expected = {
    "encoder_input_tokens",
    "encoder_segment_ids",
    "encoder_positions",
    "decoder_input_tokens",
    "decoder_target_tokens",
    "decoder_loss_weights",
    "decoder_segment_ids",
    "decoder_positions",
  }
  assert set(batch) == expected
  for value in batch.values():
    assert value.shape == (8, 64)
    assert value.sharding.is_equivalent_to(sharding, 2)
  # Packing puts more than one example into some rows.
  assert np.asarray(batch["encoder_segment_ids"]).max() > 1


def test_model_input_shapes_follow_feature_converter():
  shapes = pipeline.model_input_shapes(_config(pack=False))
  assert shapes == {
    "encoder_input_tokens": (8, 64),
    "decoder_input_tokens": (8, 64),
    "decoder_target_tokens": (8, 64),
    "decoder_loss_weights": (8, 64),
  }


def test_same_seed_same_batches_other_seed_other_batches(sharding):
  first = _take(pipeline.train_iterator(_config(), sharding), 3)
  _assert_same(first, _take(pipeline.train_iterator(_config(), sharding), 3))
  other = _take(pipeline.train_iterator(_config(seed=8), sharding), 3)
  assert not all(
    np.array_equal(a["encoder_input_tokens"], b["encoder_input_tokens"])
    for a, b in zip(first, other)
  )


@pytest.mark.parametrize("mode", pipeline.CHECKPOINT_MODES)
def test_restored_iterator_continues_exactly(sharding, tmp_path, mode):
  reference = pipeline.train_iterator(_config(), sharding, mode)
  _take(reference, 4)
  path = str(tmp_path / "process_0-of-1")
  reference.save_state(path)
  expected = _take(reference, 3)

  resumed = pipeline.train_iterator(_config(), sharding, mode)
  resumed.restore_state(path)
  assert resumed.batches_consumed == 4
  _assert_same(expected, _take(resumed, 3))
  assert resumed.batches_consumed == 7


def test_unknown_checkpoint_mode_is_rejected(sharding):
  with pytest.raises(ValueError, match="checkpoint_mode"):
    pipeline.train_iterator(_config(), sharding, "rewind")


def test_eval_batches_fixed_count_unshuffled_zero_padded(sharding):
  config = _config(split="validation", pack=False)
  batches = [_as_numpy(b) for b in pipeline.eval_batches(config, sharding, 3)]
  assert len(batches) == 3
  rows = [int(b["decoder_target_tokens"].any(axis=1).sum()) for b in batches]
  assert rows == [8, NUM_VALIDATION - 8, 0]  # 11 examples: full, partial, padding
  again = [_as_numpy(b) for b in pipeline.eval_batches(config, sharding, 3)]
  _assert_same(batches, again)
  first_input = seqio.ByteVocabulary().decode(
    [int(t) for t in batches[0]["encoder_input_tokens"][0] if t > 1]
  )
  assert first_input.startswith("validation example 0 ")


def test_training_data_without_examples_is_one_line(sharding):
  empty = pipeline.TrainIterator(
    lambda: tf.data.Dataset.range(0).map(lambda i: {"x": i}).repeat(), sharding, name="Task t"
  )
  with pytest.raises(ConfigError, match="^Task t holds no examples: there is nothing to train on"):
    next(empty)


def test_batch_size_must_divide_over_processes(monkeypatch):
  monkeypatch.setattr(jax, "process_count", lambda: 3)
  with pytest.raises(ValueError, match="not divisible"):
    pipeline.per_host_batch_size(8)


def test_unknown_name_lists_closest_registered_names():
  with pytest.raises(ConfigError) as e:
    pipeline.get_mixture_or_task("data_test_byte")
  assert str(e.value).startswith(
    "No seqio task or mixture named 'data_test_byte' (closest: data_test_bytes"
  )
  assert "tools/show_task.py --list" in str(e.value)
  with pytest.raises(ConfigError, match="'data_test_mixture' \\(closest: data_test_mix"):
    _config(mixture_or_task_name="data_test_mixture")
  assert isinstance(pipeline.get_mixture_or_task("data_test_mix"), seqio.Mixture)


@pytest.mark.parametrize(
  "name, preprocessor",
  [
    ("data_test_text_to_text", "text_to_text"),
    ("data_test_own_preprocessor", "_select"),
  ],
)
def test_missing_feature_names_task_feature_and_columns(sharding, name, preprocessor):
  expected = (
    f"Task {name}: preprocessor {preprocessor} asks for feature 'label', "
    "but the source has columns ['sentence', 'lbl']"
  )
  with pytest.raises(ConfigError) as e:
    next(pipeline.train_iterator(_config(mixture_or_task_name=name), sharding))
  assert str(e.value) == expected
  with pytest.raises(ConfigError) as e:
    pipeline.truncation_report(_config(mixture_or_task_name=name))
  assert str(e.value) == expected


def test_missing_feature_in_a_mixture_names_the_task(sharding):
  config = _config(mixture_or_task_name="data_test_mix", split="train")
  with pytest.raises(ConfigError, match="^Task data_test_text_to_text: preprocessor text_to_text"):
    next(pipeline.eval_batches(config, sharding, 1))


def test_truncation_report_counts_untrimmed_lengths(caplog):
  # Inputs of 10 * i bytes + EOS against 35 tokens: i = 4..7 are cut; targets 3 * i + 1 vs 16.
  config = _config(
    mixture_or_task_name="data_test_pairs", task_feature_lengths={"inputs": 35, "targets": 16}
  )
  with caplog.at_level(logging.WARNING):
    report = pipeline.log_truncation(config)
  inputs, targets = report["data_test_pairs"]["inputs"], report["data_test_pairs"]["targets"]
  assert (inputs.num_examples, inputs.num_truncated) == (NUM_SENTENCES, 4)
  assert (targets.num_examples, targets.num_truncated) == (NUM_SENTENCES, 2)
  assert (
    "data_test_pairs: 4 of 8 examples (50.0%) have inputs longer than 35 tokens and are truncated"
  ) in caplog.text
  assert "data_test_pairs: 2 of 8 examples (25.0%) have targets" in caplog.text
  sample = pipeline.truncation_report(config, num_examples=5)["data_test_pairs"]["inputs"]
  assert (sample.num_examples, sample.num_truncated) == (5, 1)


def test_data_benchmark_times_the_training_pipeline(monkeypatch):
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))
  import data_benchmark  # tools/data_benchmark.py

  built, host_dataset = [], pipeline.host_dataset

  def recorded(config, **kwargs):
    built.append((config, kwargs))
    return host_dataset(config, **kwargs)

  monkeypatch.setattr(pipeline, "host_dataset", recorded)
  lengths = {"inputs": 64, "targets": 64}
  result = data_benchmark.measure_pipeline(TASK, lengths, batch_size=4, num_batches=3)
  ((config, kwargs),) = built
  assert kwargs == {"num_epochs": None}
  assert (config.shuffle, config.pack, config.batch_size) == (True, True, 4)
  # Examples of 17-23 bytes + EOS packed into rows of 64: several per row.
  assert result["examples_per_s"] > result["rows_per_s"] > 0
  assert 0.5 < result["input_fill"] <= 1 and 0.5 < result["target_fill"] <= 1


def test_steps_for_epochs_counts_rows_of_one_pass():
  unpacked = pipeline.steps_for_epochs(
    2,
    mixture_or_task_name=TASK,
    task_feature_lengths={"inputs": 64, "targets": 64},
    batch_size=8,
    pack=False,
  )
  assert unpacked == 2 * NUM_TRAIN // 8  # one row per example without packing
  # Examples of about 20-30 bytes: two or more share a packed 64-token row.
  packed = pipeline.steps_for_epochs(
    2, mixture_or_task_name=TASK, task_feature_lengths={"inputs": 64, "targets": 64}, batch_size=8
  )
  assert packed < unpacked / 1.5
  rows = pipeline._pass_count(
    TASK, (("inputs", 64), ("targets", 64)), "train", True, "encoder_decoder"
  ).rows
  assert packed == round(2 * rows / 8)
  half = pipeline.steps_for_epochs(
    0.5, mixture_or_task_name=TASK, task_feature_lengths={"inputs": 64, "targets": 64}, batch_size=8
  )
  assert half == max(1, round(0.5 * rows / 8))
  # A budget caps a long run and leaves a short one as counted.
  lengths = {"inputs": 64, "targets": 64}
  capped = pipeline.steps_for_epochs(
    2, mixture_or_task_name=TASK, task_feature_lengths=lengths, batch_size=8, max_steps=packed - 1
  )
  assert capped == packed - 1
  uncapped = pipeline.steps_for_epochs(
    2, mixture_or_task_name=TASK, task_feature_lengths=lengths, batch_size=8, max_steps=packed
  )
  assert uncapped == packed


def test_a_pass_counts_examples_and_the_share_of_each_row_they_fill():
  unpacked = pipeline._pass_count(
    TASK, (("inputs", 64), ("targets", 64)), "train", False, "encoder_decoder"
  )
  # Byte tokens: each text's bytes and its EOS, in rows of 64.
  tokens = sum(len(f"train example {i} " + "x" * (i % 7)) + 1 for i in range(NUM_TRAIN))
  assert unpacked.rows == unpacked.examples == NUM_TRAIN
  share = tokens / (NUM_TRAIN * 64)
  assert unpacked.fill == pytest.approx({"inputs": share, "targets": share})
  decoder_only = pipeline._pass_count(
    TASK, (("inputs", 64), ("targets", 64)), "train", True, "decoder_only"
  )
  assert decoder_only.examples == NUM_TRAIN and set(decoder_only.fill) == {"targets"}
  assert decoder_only.packing_hint({"inputs": 64, "targets": 64}) == ""


def test_the_packing_hint_names_a_targets_length_that_packs_more():
  # Targets as long as the inputs (about 21 bytes) in 32 slots: one example a row, where
  # 128 input slots could hold about six.
  cramped = pipeline._pass_count(
    TASK, (("inputs", 128), ("targets", 32)), "train", True, "encoder_decoder"
  )
  assert cramped.rows == cramped.examples == NUM_TRAIN
  hint = cramped.packing_hint({"inputs": 128, "targets": 32})
  found = re.search(
    r"packs 1\.0 examples a row where the inputs could hold ([\d.]+): "
    r"TASK_FEATURE_LENGTHS 'targets': (\d+) would pack",
    hint,
  )
  assert found and 5 < float(found[1]) < 7, hint
  roomy = pipeline._pass_count(
    TASK, (("inputs", 128), ("targets", int(found[2]))), "train", True, "encoder_decoder"
  )
  assert roomy.examples == NUM_TRAIN and roomy.rows < NUM_TRAIN / 3  # the advice works
  assert roomy.packing_hint({"inputs": 128, "targets": int(found[2])}) == ""


def test_steps_for_epochs_rejects_bad_numbers_and_names():
  lengths = {"inputs": 64, "targets": 64}
  with pytest.raises(ConfigError, match="^steps_for_epochs's epochs must be > 0, got 0.\n"):
    pipeline.steps_for_epochs(
      0, mixture_or_task_name=TASK, task_feature_lengths=lengths, batch_size=8
    )
  with pytest.raises(ConfigError, match="steps_for_epochs's batch_size must be > 0, got -8"):
    pipeline.steps_for_epochs(
      1, mixture_or_task_name=TASK, task_feature_lengths=lengths, batch_size=-8
    )
  with pytest.raises(ConfigError, match="closest"):
    pipeline.steps_for_epochs(
      1, mixture_or_task_name="data_test_byts", task_feature_lengths=lengths, batch_size=8
    )
  with pytest.raises(ConfigError, match="max_steps must be > 0 or None, got 0"):
    pipeline.steps_for_epochs(
      1, mixture_or_task_name=TASK, task_feature_lengths=lengths, batch_size=8, max_steps=0
    )


@gin.configurable
def data_test_lengths(train: int, eval_every: int) -> tuple[int, int]:
  """A consumer of two step counts, as train() consumes TRAIN_STEPS and EVAL_PERIOD."""
  return train, eval_every


def test_steps_for_epochs_errors_name_the_gin_binding_a_user_edits():
  """As gin/recipes/new_task.gin binds it: scoped calls reading macros and unscoped ones."""

  def error_for(bindings: str) -> str:
    gin.clear_config()
    gin.parse_config(
      f"""
      EPOCHS = 2
      BATCH_SIZE = 8
      data_test_lengths.train = @train_length/steps_for_epochs()
      data_test_lengths.eval_every = @eval_every/steps_for_epochs()
      train_length/steps_for_epochs.epochs = %EPOCHS
      eval_every/steps_for_epochs.epochs = 1
      steps_for_epochs.mixture_or_task_name = '{TASK}'
      steps_for_epochs.task_feature_lengths = {{'inputs': 64, 'targets': 64}}
      steps_for_epochs.batch_size = %BATCH_SIZE
      {bindings}
      """
    )
    with pytest.raises(ConfigError) as error:
      data_test_lengths()
    return str(error.value).splitlines()[0]

  try:
    assert error_for("EPOCHS = 0") == (
      "gin binding train_length/steps_for_epochs.epochs (= %EPOCHS) must be > 0, got 0."
    )
    assert error_for("eval_every/steps_for_epochs.epochs = -1").startswith(
      "gin binding eval_every/steps_for_epochs.epochs must be > 0, got -1."
    )
    assert error_for("BATCH_SIZE = 0").startswith(
      "gin binding steps_for_epochs.batch_size (= %BATCH_SIZE) must be > 0, got 0."
    )
    assert error_for("train_length/steps_for_epochs.max_steps = 0").startswith(
      "gin binding train_length/steps_for_epochs.max_steps must be > 0 or None, got 0."
    )
  finally:
    gin.clear_config()
