"""Tests for t5x_lite.preprocessors: T5 objectives and text-to-text formatting."""

import numpy as np
import pytest
import seqio
import tensorflow as tf

from t5x_lite import preprocessors
from t5x_lite.errors import ConfigError

VOCAB_SIZE = 1000  # Sentinels count down from 999; regular tokens stay below 800.
EOS = 1
FEATURES = {
  "inputs": seqio.Feature(seqio.PassThroughVocabulary(VOCAB_SIZE, eos_id=EOS)),
  "targets": seqio.Feature(seqio.PassThroughVocabulary(VOCAB_SIZE, eos_id=EOS)),
}


def _documents(num_docs: int, seed: int = 0) -> list[np.ndarray]:
  rng = np.random.default_rng(seed)
  return [
    rng.integers(3, 800, size=rng.integers(50, 900)).astype(np.int32) for _ in range(num_docs)
  ]


def _token_dataset(docs: list[np.ndarray]) -> tf.data.Dataset:
  return tf.data.Dataset.from_generator(
    lambda: ({"targets": d} for d in docs),
    output_signature={"targets": tf.TensorSpec([None], tf.int32)},
  )


def _run(preprocessor, docs, lengths, seed=7):
  with seqio.utils.map_seed_manager(seed):
    ds = preprocessor(_token_dataset(docs), sequence_length=lengths, output_features=FEATURES)
  return list(ds.as_numpy_iterator())


def _reconstruct(inputs: np.ndarray, targets: np.ndarray) -> list[int]:
  """Undoes span corruption: each input sentinel -> the target tokens after it."""
  fills, current = {}, None
  for t in targets[:-1]:
    if t >= 800:
      current = fills.setdefault(int(t), [])
    else:
      current.append(int(t))
  out = []
  for t in inputs[:-1]:
    out.extend(fills[int(t)] if t >= 800 else [int(t)])
  return out


def test_random_spans_helper_matches_t5():
  assert preprocessors.random_spans_helper(512) == (568, 114)
  assert preprocessors.corrupted_lengths(568) == (512, 114)
  assert preprocessors.corrupted_lengths(569)[0] > 512
  raw, targets = preprocessors.random_spans_helper(128)
  assert preprocessors.corrupted_lengths(raw) == (128, targets) and targets <= 32


def test_span_corruption_statistics_and_reconstruction():
  docs = _documents(120)
  examples = _run(preprocessors.span_corruption, docs, {"inputs": 512, "targets": 114})
  noise = total = 0
  span_lengths, rebuilt = [], []
  for ex in examples:
    inputs, targets = ex["inputs"], ex["targets"]
    assert inputs[-1] == EOS and targets[-1] == EOS
    assert len(inputs) <= 512 and len(targets) <= 114
    sentinels = [int(t) for t in inputs if t >= 800]
    assert sentinels == list(range(VOCAB_SIZE - 1, VOCAB_SIZE - 1 - len(sentinels), -1))
    assert [int(t) for t in targets if t >= 800] == sentinels
    original = _reconstruct(inputs, targets)
    rebuilt.extend(original)
    noise += len(targets) - 1 - len(sentinels)
    total += len(original)
    boundaries = [i for i, t in enumerate(targets) if t >= 800] + [len(targets) - 1]
    span_lengths.extend(np.diff(boundaries) - 1)
  assert rebuilt == np.concatenate(docs).tolist()
  full = [ex for ex in examples if len(ex["inputs"]) == 512]
  assert len(full) >= len(examples) - 2
  assert abs(noise / total - 0.15) < 0.02
  assert abs(np.mean(span_lengths) - 3.0) < 0.3
  assert np.std(span_lengths) > 0.5  # spans have random lengths, not all 3
  assert min(span_lengths) >= 1


def test_span_corruption_depends_on_seed_only():
  docs = _documents(6)
  lengths = {"inputs": 128, "targets": 32}
  a = _run(preprocessors.span_corruption, docs, lengths, seed=1)
  b = _run(preprocessors.span_corruption, docs, lengths, seed=1)
  c = _run(preprocessors.span_corruption, docs, lengths, seed=2)
  assert all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, b))
  assert any(not np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, c))
  masks = {tuple(x["targets"][:4]) for x in a}
  assert len(masks) > 1  # different examples get different noise


@pytest.mark.parametrize("density", [0.15, 1.0])
def test_iid_mask_proportions(density):
  tokens = tf.constant(np.random.default_rng(0).integers(3, 800, 200_000), tf.int32)
  out = preprocessors.iid_mask_tokens(
    tokens, (3, 4), mask_id=999, num_regular_ids=800, noise_density=density
  ).numpy()
  tokens = tokens.numpy()
  masked = np.mean(out == 999)
  replaced = np.mean((out != tokens) & (out != 999))
  assert abs(masked - 0.8 * density) < 0.01
  assert abs(replaced - 0.1 * density) < 0.005
  if density == 1.0:
    assert abs(np.mean(out == tokens) - 0.1) < 0.005
  assert out[out != 999].min() >= 3 and out[out != 999].max() < 800


def test_iid_denoising_targets_are_original():
  docs = _documents(5)
  examples = _run(preprocessors.iid_denoising, docs, {"inputs": 64, "targets": 64})
  assert (
    np.concatenate([ex["targets"][:-1] for ex in examples]).tolist()
    == np.concatenate(docs).tolist()
  )
  for ex in examples:
    assert len(ex["inputs"]) == len(ex["targets"]) <= 64
    assert ex["inputs"][-1] == EOS
  corrupted = np.mean(np.concatenate([ex["inputs"] != ex["targets"] for ex in examples]))
  assert 0.10 < corrupted < 0.17


def test_prefix_lm_splits_at_random_points():
  docs = _documents(8)
  lengths = {"inputs": 96, "targets": 48}
  examples = _run(preprocessors.prefix_lm, docs, lengths)
  joined = np.concatenate(
    [np.concatenate([ex["inputs"][:-1], ex["targets"][:-1]]) for ex in examples]
  )
  assert joined.tolist() == np.concatenate(docs).tolist()
  for ex in examples:
    assert 2 <= len(ex["inputs"]) <= 96 and 2 <= len(ex["targets"]) <= 48
    assert ex["inputs"][-1] == EOS and ex["targets"][-1] == EOS
  assert len({len(ex["inputs"]) for ex in examples}) > 3


def test_concat_and_split():
  docs = [np.arange(3, 13, dtype=np.int32), np.arange(20, 27, dtype=np.int32)]
  segments = [
    x["targets"].tolist()
    for x in preprocessors.concat_and_split(_token_dataset(docs), 6).as_numpy_iterator()
  ]
  assert segments == [[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 20, 21], [22, 23, 24, 25, 26]]


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
    preprocessors.unsupervised_preprocessors("span_corruption")[0](ds)


def test_bad_lengths_and_objectives_are_config_errors():
  with pytest.raises(ConfigError, match=r"TASK_FEATURE_LENGTHS\['inputs'\]\) of at least 3, got 2"):
    preprocessors.random_spans_helper(2)
  with pytest.raises(ConfigError, match="Unknown objective 'mlm'"):
    preprocessors.unsupervised_preprocessors("mlm")
