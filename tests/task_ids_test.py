"""Task ids in the batch: every target token carries the id of the task its example came
from, packed or not, through nested mixtures, while the mixture samples, shuffles and
packs exactly as it does without them; task ids of tasks outside the mixture are one
clear line."""

import dataclasses

import numpy as np
import pytest
import seqio
import tensorflow as tf

from t5x_lite.core import errors
from t5x_lite.data import pipeline
from text_tasks import VOCAB, register_text_task

LETTERS = "abc"
TASKS = {letter: f"task_ids_test_{letter}" for letter in LETTERS}
SUBMIXTURE, MIXTURE = "task_ids_test_bc", "task_ids_test_mix"
LENGTHS = {"inputs": 16, "targets": 12}


def _source_of(letter: str):
  def source(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
    del split, shuffle_files, seed
    inputs = [f"{letter} {i}" for i in range(40)]
    targets = [letter * (1 + i % 7) for i in range(40)]  # one letter per task
    return tf.data.Dataset.from_tensor_slices({"inputs": inputs, "targets": targets})

  return source


for _letter, _name in TASKS.items():
  register_text_task(_name, _source_of(_letter), ["train"])
if MIXTURE not in seqio.MixtureRegistry.names():
  seqio.MixtureRegistry.add(SUBMIXTURE, [(TASKS["b"], 1.0), (TASKS["c"], 3.0)])
  seqio.MixtureRegistry.add(MIXTURE, [(TASKS["a"], 2.0), (SUBMIXTURE, 2.0)])


def _batches(config: pipeline.DatasetConfig, count: int = 6) -> list[dict[str, np.ndarray]]:
  dataset = pipeline.host_dataset(config, num_epochs=None)
  return list(dataset.take(count).as_numpy_iterator())


@pytest.mark.parametrize("pack", [True, False])
def test_each_target_token_carries_its_tasks_id_and_nothing_else_changes(pack):
  plain = pipeline.DatasetConfig(MIXTURE, LENGTHS, batch_size=4, pack=pack, seed=3)
  # b first: ids follow the order given, not the mixture's; c has no id (0).
  tagged = dataclasses.replace(plain, task_ids=(TASKS["b"], TASKS["a"]))
  expected_id = {VOCAB.encode(letter)[0]: i for letter, i in (("b", 1), ("a", 2), ("c", 0))}
  lengths = pipeline.model_feature_lengths(tagged)
  assert lengths[pipeline.DECODER_TASK_IDS] == LENGTHS["targets"]
  assert pipeline.DECODER_TASK_IDS not in pipeline.model_feature_lengths(plain)
  seen = set()
  for before, after in zip(_batches(plain), _batches(tagged), strict=True):
    assert set(after) == set(before) | {pipeline.DECODER_TASK_IDS}
    for name, value in before.items():
      np.testing.assert_array_equal(after[name], value, err_msg=name)
    ids = after[pipeline.DECODER_TASK_IDS]  # [batch, targets length]
    targets = after["decoder_target_tokens"]
    segments = after["decoder_segment_ids"] if pack else (targets > 0).astype(np.int32)
    np.testing.assert_array_equal(ids[targets == 0], 0)
    for row in range(targets.shape[0]):
      for segment in set(segments[row][segments[row] > 0]):
        tokens = targets[row][segments[row] == segment]
        letter = tokens[0]  # the example's letter (its EOS carries the same id)
        np.testing.assert_array_equal(ids[row][segments[row] == segment], expected_id[letter])
        seen.add(int(expected_id[letter]))
  assert seen == {0, 1, 2}  # all three tasks were sampled
  if pack:
    assert any(after["decoder_segment_ids"].max() > 1 for after in _batches(tagged))


def test_a_single_task_is_all_id_one():
  config = pipeline.DatasetConfig(TASKS["a"], LENGTHS, batch_size=4, task_ids=(TASKS["a"],))
  for batch in _batches(config, 3):
    real = batch["decoder_target_tokens"] > 0
    np.testing.assert_array_equal(batch[pipeline.DECODER_TASK_IDS], real.astype(np.int32))


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(task_ids=("task_ids_test_z",)), r"task 'task_ids_test_z', which is not in the "),
    (dict(task_ids=(TASKS["a"], TASKS["a"])), "name a task twice"),
    (dict(task_ids=(TASKS["a"],), architecture="decoder_only"), "need an encoder-decoder"),
  ],
)
def test_task_ids_outside_the_mixture_are_one_line_errors(kwargs, message):
  with pytest.raises(errors.ConfigError, match=message) as e:
    pipeline.DatasetConfig(MIXTURE, LENGTHS, batch_size=4, **kwargs)
  lines = [line for line in str(e.value).splitlines() if "In call to configurable" not in line]
  assert len(lines) == 1, str(e.value)  # gin's "In call to" line is dropped by the CLI
