"""Tests for t5x_lite.data.preprocessors: text-to-text formatting and its feature checks."""

import pytest
import tensorflow as tf

from t5x_lite.data import objectives, preprocessors


def _format(record, **kwargs):
  ds = tf.data.Dataset.from_tensors(record)
  return next(preprocessors.text_to_text(ds, **kwargs).as_numpy_iterator())


def test_text_to_text_formats():
  ex = _format(
    {"sentence": "it is great", "label": 1, "idx": 3},
    prefix="sst2",
    feature_names=("sentence",),
    label_names=("negative", "positive"),
  )
  assert ex == {"inputs": b"sst2 sentence: it is great", "targets": b"positive", "idx": 3}
  ex = _format(
    {"sentence1": "a", "sentence2": "b", "label": -1},
    prefix="rte",
    feature_names=("sentence1", "sentence2"),
    label_names=("entailment", "not_entailment"),
  )
  assert ex["inputs"] == b"rte sentence1: a sentence2: b" and ex["targets"] == b"<unk>"
  ex = _format(
    {"sentence1": "a", "sentence2": "b", "label": 3.84},
    prefix="stsb",
    feature_names=("sentence1", "sentence2"),
  )
  assert ex["targets"] == b"3.8"
  ex = _format(
    {"sentence": "meh", "label": "0"},
    prefix="sst2",
    feature_names=("sentence",),
    label_names={"0": "negative", "1": "positive"},
  )
  assert ex["targets"] == b"negative"


def test_translate_prefix():
  ds = tf.data.Dataset.from_tensors({"en": "A dog.", "de": "Ein Hund."})
  ex = next(preprocessors.translate(ds, "English", "German", "en", "de").as_numpy_iterator())
  assert ex == {"inputs": b"translate English to German: A dog.", "targets": b"Ein Hund."}


def test_formatters_name_a_missing_feature_and_the_features_there_are():
  ds = tf.data.Dataset.from_tensors({"sentence": "good", "lbl": "1"})
  with pytest.raises(preprocessors.MissingFeatureError) as e:
    preprocessors.text_to_text(ds, prefix="sst2", feature_names=("sentence",))
  assert str(e.value) == (
    "preprocessor text_to_text asks for feature 'label', but its input has features "
    "['sentence', 'lbl']"
  )
  assert (e.value.feature, e.value.available) == ("label", ["sentence", "lbl"])
  with pytest.raises(preprocessors.MissingFeatureError, match="translate asks for feature 'de'"):
    preprocessors.translate(ds, "English", "German", "sentence", "de")
  with pytest.raises(preprocessors.MissingFeatureError, match="prefixed_pair asks for .* 'src'"):
    preprocessors.prefixed_pair(ds, "summarize: ", "src", "sentence")
  with pytest.raises(preprocessors.MissingFeatureError, match="text_as_targets asks for .* 'text'"):
    objectives.unsupervised_preprocessors("span_corruption")[0](ds)
