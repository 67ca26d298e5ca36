"""seqio's packing, written as the TF graph AutoGraph would make of it, and the feature
converters that use it.

`seqio.utils.trim_and_pack_dataset` packs each padded batch of examples with a Python
`for` loop over `tf.range` and an `if` on a tensor, which only AutoGraph can trace: it
parses and rewrites that function at the start of every process that packs (every
training and most evaluations), most of a second of CPU each time. `trim_and_pack_dataset`
here is the same algorithm with the loop and the branch written as `tf.while_loop` and
`tf.cond`, so `autograph_rules` can leave it as written. It gives the same rows, feature
for feature and bit for bit (tests/packing_test.py compares the two on random data); the
converters below are seqio's with only their packing swapped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import seqio
import tensorflow as tf

_PACKED_SUFFIXES = ("_segment_ids", "_positions")


def _base_key(key: str) -> str:
  """'targets' of 'targets', 'targets_positions' and 'targets_segment_ids'."""
  for suffix in _PACKED_SUFFIXES:
    if key.endswith(suffix):
      return key[: -len(suffix)]
  return key


def trim_and_pack_dataset(
  dataset: tf.data.Dataset, feature_lengths: Mapping[str, int]
) -> tf.data.Dataset:
  """`seqio.utils.trim_and_pack_dataset(dataset, feature_lengths)` without AutoGraph.

  Examples are cut to their feature lengths, their zeros dropped as padding, and laid
  one after another into rows of those lengths; a new row starts when any feature of
  the next example does not fit. Each packed feature `k` gains `k_segment_ids`
  (1, 2, ... per example in the row, 0 on padding) and `k_positions`. Features not in
  `feature_lengths` are dropped.

  Args:
    dataset: examples of rank-1 int features.
    feature_lengths: {feature: packed length}.

  Returns:
    The packed rows, each feature [length].

  Raises:
    ValueError: a feature of `feature_lengths` missing from the dataset, or not rank 1.
  """
  element_spec = dataset.element_spec  # {feature: TensorSpec}
  assert isinstance(element_spec, Mapping), "packing needs examples that are dicts"
  for k in feature_lengths:
    if k not in element_spec:
      raise ValueError(
        f"Feature '{k}' not found in dataset. Available keys are {list(element_spec.keys())}"
      )
    spec = element_spec[k]
    if not isinstance(spec, tf.TensorSpec) or not spec.shape.is_compatible_with([None]):
      raise ValueError(f"Features to be packed must be one-dimensional. '{k}' is not.")
  lengths = dict(feature_lengths)
  dataset = dataset.map(
    lambda x: {k: x[k][:n] for k, n in lengths.items()}, num_parallel_calls=tf.data.AUTOTUNE
  )
  # As seqio: batches of as many examples as the longest feature length, packed together.
  batch_size = max(lengths.values())
  dataset = dataset.padded_batch(batch_size, padded_shapes={k: [-1] for k in lengths})
  dataset = dataset.map(_pack_batch_fn(lengths), num_parallel_calls=tf.data.AUTOTUNE).unbatch()

  def set_shapes(x: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
    for k, v in x.items():
      v.set_shape([lengths[_base_key(k)]])
    return x

  return dataset.map(set_shapes, num_parallel_calls=tf.data.AUTOTUNE)


def _pack_batch_fn(lengths: Mapping[str, int]):
  """The function that packs one padded batch {k: [batch, max length]} into rows."""
  keys = list(lengths)
  keys_etc = [k + suffix for k in keys for suffix in ("", "_positions")]

  def empty() -> dict[str, tf.Tensor]:
    return {k: tf.zeros([0], tf.int32) for k in keys_etc}

  def write(partial: dict[str, tf.Tensor], outputs: dict[str, tf.TensorArray]):
    """Appends the partial row, padded to its lengths, to `outputs`; a new empty row."""
    written = {
      k: outputs[k].write(
        outputs[k].size(), tf.pad(partial[k], [[0, lengths[_base_key(k)] - tf.size(partial[k])]])
      )
      for k in keys_etc
    }
    return empty(), written

  def pack_batch(x: Mapping[str, tf.Tensor]) -> dict[str, tf.Tensor]:
    batch_size = tf.shape(x[keys[0]])[0]
    outputs = {
      k: tf.TensorArray(tf.int32, size=0, dynamic_size=True, element_shape=[lengths[_base_key(k)]])
      for k in keys_etc
    }

    def body(i, partial, outputs):
      example = {}
      for k in keys:
        value = tf.cast(x[k][i], tf.int32)  # [max length], zero-padded
        example[k] = value[: tf.reduce_sum(tf.cast(tf.not_equal(value, 0), tf.int32))]
      fits = tf.constant(True)
      for k in keys:
        fits = tf.logical_and(fits, tf.size(partial[k]) + tf.size(example[k]) <= lengths[k])
      partial, outputs = tf.cond(fits, lambda: (partial, outputs), lambda: write(partial, outputs))
      extended = {}
      for k in keys:
        sequence = example[k][: lengths[k]]
        extended[k] = tf.concat([partial[k], sequence], 0)
        positions = tf.range(tf.size(sequence), dtype=tf.int32)
        extended[k + "_positions"] = tf.concat([partial[k + "_positions"], positions], 0)
      return i + 1, extended, outputs

    _, partial, outputs = tf.while_loop(
      lambda i, partial, outputs: i < batch_size,
      body,
      (tf.constant(0), empty(), outputs),
      shape_invariants=(
        tf.TensorShape([]),
        {k: tf.TensorShape([None]) for k in keys_etc},
        {k: tf.TensorShape(None) for k in keys_etc},  # pyright: ignore[reportArgumentType]
      ),
    )
    _, outputs = write(partial, outputs)
    packed = {k: outputs[k].stack() for k in keys_etc}  # each [rows, length]
    for k in keys:
      starts = tf.cast(tf.equal(packed[k + "_positions"], 0), tf.int32)
      packed[k + "_segment_ids"] = tf.cumsum(starts, axis=1) * tf.cast(
        tf.not_equal(packed[k], 0), tf.int32
      )
    return packed

  return pack_batch


class PackingWithoutAutoGraph:
  """Mixin for a seqio `FeatureConverter`: packs with `trim_and_pack_dataset` above."""

  pack: bool  # the converter's
  _use_custom_packing_ops: bool

  def _pack_or_pad(self, ds: tf.data.Dataset, packed_lengths: Mapping[str, int]):
    if self.pack and not self._use_custom_packing_ops:
      return trim_and_pack_dataset(ds, packed_lengths)
    return super()._pack_or_pad(ds, packed_lengths)  # pyright: ignore[reportAttributeAccessIssue]


class EncDecFeatureConverter(PackingWithoutAutoGraph, seqio.EncDecFeatureConverter):
  """`seqio.EncDecFeatureConverter`, packing without AutoGraph."""


class _PrefixLMFeatureConverter(PackingWithoutAutoGraph, seqio.PrefixLMFeatureConverter):
  pass


class _LMFeatureConverter(PackingWithoutAutoGraph, seqio.LMFeatureConverter):
  pass


class DecoderFeatureConverter(seqio.DecoderFeatureConverter):
  """`seqio.DecoderFeatureConverter`, whose prefix-LM and LM converters pack without
  AutoGraph (its prefix-suffix LM converter, which t5x_lite does not use, is seqio's)."""

  def __init__(
    self,
    loss_on_targets_only: bool = True,
    pack: bool = True,
    use_custom_packing_ops: bool = False,
    apply_length_check: bool = True,
    bos_id: int = 0,
    passthrough_features: Mapping[str, seqio.FeatureConverter.FeatureSpec] | None = None,
  ):
    shared: dict[str, Any] = dict(
      pack=pack,
      use_custom_packing_ops=use_custom_packing_ops,
      apply_length_check=apply_length_check,
      bos_id=bos_id,
    )
    prefix_lm = dict(
      loss_on_targets_only=loss_on_targets_only, passthrough_features=passthrough_features
    )
    super().__init__(**prefix_lm, **shared)
    self.prefixlm_feature_converter = _PrefixLMFeatureConverter(**prefix_lm, **shared)
    self.strictlm_feature_converter = _LMFeatureConverter(**shared)
