"""Tests for t5x_lite.mixing: temperature rates and the sampling they produce."""

import collections

import gin
import pytest
import seqio
import tensorflow as tf

from t5x_lite import mixing

SIZES = {"mix_test_small": 100, "mix_test_medium": 900, "mix_test_large": 40_000}
FEATURES = {"targets": seqio.Feature(seqio.PassThroughVocabulary(10), add_eos=False)}


def _register(name: str, size, task_id: int) -> seqio.Task:
  def dataset_fn(split, shuffle_files, seed=None):
    del split, shuffle_files, seed
    return tf.data.Dataset.from_tensors({"targets": tf.constant([task_id], tf.int32)}).repeat(64)

  seqio.TaskRegistry.remove(name)
  num_examples = {"train": size} if size is not None else None
  return seqio.TaskRegistry.add(
    name,
    source=seqio.FunctionDataSource(dataset_fn, splits=["train"], num_input_examples=num_examples),
    output_features=FEATURES,
    preprocessors=[],
  )


@pytest.fixture(name="mixture")
def fixture_mixture():
  for task_id, (name, size) in enumerate(SIZES.items()):
    _register(name, size, task_id)
  seqio.MixtureRegistry.remove("mix_test")
  mixture = seqio.MixtureRegistry.add("mix_test", list(SIZES), default_rate=mixing.temperature_rate)
  with gin.unlock_config():
    gin.bind_parameter("temperature_rate.temperature", 2.0)
    gin.bind_parameter("temperature_rate.maximum", 10_000)
  yield mixture
  gin.clear_config()
  seqio.MixtureRegistry.remove("mix_test")
  for name in SIZES:
    seqio.TaskRegistry.remove(name)


def test_rates_follow_formula(mixture):
  unnormalized = {name: min(size, 10_000) ** 0.5 for name, size in SIZES.items()}
  total = sum(unnormalized.values())
  rates = mixing.normalized_rates(mixture)
  assert rates == pytest.approx({name: r / total for name, r in unnormalized.items()}, rel=1e-6)


def test_sampling_frequencies_match_rates(mixture):
  num_draws = 12_000
  ds = mixture.get_dataset(None, split="train", shuffle=False, seed=3, num_epochs=None)
  counts = collections.Counter(
    int(ex["targets"][0]) for ex in ds.take(num_draws).as_numpy_iterator()
  )
  rates = mixing.normalized_rates(mixture)
  for task_id, name in enumerate(SIZES):
    assert abs(counts[task_id] / num_draws - rates[name]) < 0.02, (name, counts)


def test_temperature_one_is_examples_proportional(mixture):
  with gin.unlock_config():
    gin.bind_parameter("temperature_rate.temperature", 1.0)
    gin.bind_parameter("temperature_rate.maximum", None)
  rates = mixing.normalized_rates(mixture)
  assert rates["mix_test_large"] == pytest.approx(40_000 / 41_000)


def test_unknown_size_is_an_error():
  task = _register("mix_test_unsized", None, 0)
  try:
    with pytest.raises(ValueError, match="mix_test_unsized"):
      mixing.temperature_rate(task)
  finally:
    seqio.TaskRegistry.remove("mix_test_unsized")
