"""Packing without AutoGraph gives seqio's packed rows bit for bit: the packing function
on random examples (zeros inside, empty and overlong features, one to three features),
and the feature converters built on it against seqio's own."""

import numpy as np
import pytest
import seqio
import tensorflow as tf

from t5x_lite.data import autograph_rules, packing

autograph_rules.install()  # as the entry points: t5x_lite's functions traced as written


def _random_examples(seed: int, keys: tuple[str, ...], count: int, longest: int):
  """`count` examples of random ids in [0, 6) (zeros inside, as padding to drop) and
  random lengths in [0, longest] per feature."""
  rng = np.random.default_rng(seed)
  examples = [
    {k: rng.integers(0, 6, rng.integers(0, longest + 1)).astype(np.int32) for k in keys}
    for _ in range(count)
  ]
  signature = {k: tf.TensorSpec([None], tf.int32) for k in keys}
  return tf.data.Dataset.from_generator(lambda: iter(examples), output_signature=signature)


def _rows(dataset: tf.data.Dataset) -> list[dict[str, np.ndarray]]:
  return list(dataset.as_numpy_iterator())


def _assert_same_rows(ours: tf.data.Dataset, seqios: tf.data.Dataset) -> int:
  expected, actual = _rows(seqios), _rows(ours)
  assert len(actual) == len(expected)
  for row, (a, e) in enumerate(zip(actual, expected)):
    assert set(a) == set(e)
    for k in e:
      np.testing.assert_array_equal(a[k], e[k], err_msg=f"row {row}, {k}")
      assert a[k].dtype == e[k].dtype, k
  return len(expected)


@pytest.mark.parametrize(
  "seed, lengths, count, longest",
  [
    (0, {"inputs": 8, "targets": 4}, 50, 10),  # overlong examples are cut
    (1, {"targets": 16}, 40, 5),  # many examples per row
    (2, {"inputs": 5, "targets": 7, "task_ids": 7}, 60, 8),  # three features
    (3, {"inputs": 3, "targets": 3}, 7, 3),  # fewer examples than a padded batch
    (4, {"inputs": 12, "targets": 2}, 130, 14),  # several padded batches
  ],
)
def test_packed_rows_are_seqios(seed, lengths, count, longest):
  examples = _random_examples(seed, tuple(lengths), count, longest)
  rows = _assert_same_rows(
    packing.trim_and_pack_dataset(examples, lengths),
    seqio.utils.trim_and_pack_dataset(examples, lengths),
  )
  assert rows >= 1
  spec = packing.trim_and_pack_dataset(examples, lengths).element_spec
  assert {k: v.shape.as_list() for k, v in spec.items()} == {
    k + suffix: [n] for k, n in lengths.items() for suffix in ("", "_segment_ids", "_positions")
  }


def _text_examples(seed: int, with_inputs: bool, count: int = 45) -> tf.data.Dataset:
  rng = np.random.default_rng(seed)
  keys = ("inputs", "targets") if with_inputs else ("targets",)
  examples = [
    {k: rng.integers(2, 50, rng.integers(1, 9)).astype(np.int32) for k in keys}
    for _ in range(count)
  ]
  signature = {k: tf.TensorSpec([None], tf.int32) for k in keys}
  return tf.data.Dataset.from_generator(lambda: iter(examples), output_signature=signature)


@pytest.mark.parametrize(
  "ours, theirs, lengths",
  [
    (packing.EncDecFeatureConverter, seqio.EncDecFeatureConverter, {"inputs": 12, "targets": 8}),
    (packing.DecoderFeatureConverter, seqio.DecoderFeatureConverter, {"targets": 16}),
    (
      packing.DecoderFeatureConverter,
      seqio.DecoderFeatureConverter,
      {"inputs": 10, "targets": 10},
    ),
  ],
  ids=["encoder_decoder", "lm", "prefix_lm"],
)
@pytest.mark.parametrize("pack", [True, False])
def test_converters_give_seqios_model_features(ours, theirs, lengths, pack):
  examples = _text_examples(len(lengths), "inputs" in lengths)
  _assert_same_rows(ours(pack=pack)(examples, lengths), theirs(pack=pack)(examples, lengths))


def test_bad_features_are_refused_as_seqio_refuses_them():
  examples = _random_examples(0, ("targets",), 3, 3)
  with pytest.raises(ValueError, match="Feature 'inputs' not found"):
    packing.trim_and_pack_dataset(examples, {"inputs": 4})
  matrix = tf.data.Dataset.from_tensors({"targets": tf.ones([2, 2], tf.int32)})
  with pytest.raises(ValueError, match="must be one-dimensional"):
    packing.trim_and_pack_dataset(matrix, {"targets": 4})
