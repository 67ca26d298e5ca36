"""AutoGraph calls t5x_lite's and seqio's preprocessing as written, converts the rest,
and the pipeline's batches are the same either way."""

import numpy as np
import seqio
import tensorflow as tf
from tensorflow.python.autograph.core import config as autograph_config
from tensorflow.python.autograph.impl import conversion

from t5x_lite.data import autograph_rules, noise

autograph_rules.install()  # what the entry points do at start-up


def _branchy(x):
  if tf.reduce_sum(x) > 0:  # Python control flow on a tensor: AutoGraph's to rewrite
    return x + 1
  return x - 1


def test_preprocessing_modules_run_as_written_and_others_are_converted():
  assert conversion.is_allowlisted(noise.random_spans_noise_mask)
  assert conversion.is_allowlisted(seqio.preprocessors.tokenize)
  assert not conversion.is_allowlisted(seqio.utils.trim_and_pack_dataset)  # loops on tensors
  assert not conversion.is_allowlisted(_branchy)
  # A task module's own function with Python branches still traces (converted).
  out = tf.data.Dataset.from_tensor_slices([[1, 2], [-3, -4]]).map(_branchy)
  assert [list(x) for x in out.as_numpy_iterator()] == [[2, 3], [-4, -5]]


def test_install_is_idempotent():
  before = len(autograph_config.CONVERSION_RULES)
  autograph_rules.install()
  assert len(autograph_config.CONVERSION_RULES) == before


def test_packed_batches_equal_fully_converted_ones():
  def packed():
    ds = tf.data.Dataset.from_tensor_slices(
      {
        "inputs": tf.ragged.constant([[3, 4, 5], [6], [7, 8]]),
        "targets": tf.ragged.constant([[9], [10, 11], [12]]),
      }
    ).map(lambda x: {k: v.to_tensor() if hasattr(v, "to_tensor") else v for k, v in x.items()})
    ds = seqio.utils.trim_and_pack_dataset(ds, {"inputs": 6, "targets": 4})
    converter = seqio.EncDecFeatureConverter(pack=True)
    ds = converter(ds, {"inputs": 6, "targets": 4})
    return list(ds.as_numpy_iterator())

  as_written = packed()
  saved = autograph_config.CONVERSION_RULES
  autograph_config.CONVERSION_RULES = tuple(
    r for r in saved if getattr(r, "_prefix", None) not in autograph_rules.AS_WRITTEN
  )
  try:
    converted = packed()
  finally:
    autograph_config.CONVERSION_RULES = saved
  assert len(as_written) == len(converted) > 0
  for a, b in zip(as_written, converted):
    assert a.keys() == b.keys()
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
