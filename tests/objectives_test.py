"""Tests for t5x_lite.data.objectives and t5x_lite.data.noise.

The T5 paper's unsupervised objectives.
"""

import gin
import numpy as np
import pytest
import seqio
import span_sentinels
import tensorflow as tf

from t5x_lite.data import noise, objectives
from t5x_lite.core.errors import ConfigError

pytestmark = pytest.mark.usefixtures("clean_gin")

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
  """Undoes span corruption of an example whose sentinels are ids 800 and up."""
  return span_sentinels.put_back(inputs[:-1], targets[:-1], 800)


def test_random_spans_helper_matches_t5():
  assert noise.random_spans_helper(512) == (568, 114)
  assert noise.corrupted_lengths(568) == (512, 114)
  assert noise.corrupted_lengths(569)[0] > 512
  raw, targets = noise.random_spans_helper(128)
  assert noise.corrupted_lengths(raw) == (128, targets) and targets <= 32


def test_span_corruption_statistics_and_reconstruction():
  docs = _documents(120)
  examples = _run(objectives.span_corruption, docs, {"inputs": 512, "targets": 114})
  num_noise = total = 0
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
    num_noise += len(targets) - 1 - len(sentinels)
    total += len(original)
    boundaries = [i for i, t in enumerate(targets) if t >= 800] + [len(targets) - 1]
    span_lengths.extend(np.diff(boundaries) - 1)
  assert rebuilt == np.concatenate(docs).tolist()
  full = [ex for ex in examples if len(ex["inputs"]) == 512]
  assert len(full) >= len(examples) - 2
  assert abs(num_noise / total - 0.15) < 0.02
  assert abs(np.mean(span_lengths) - 3.0) < 0.3
  assert np.std(span_lengths) > 0.5  # spans have random lengths, not all 3
  assert min(span_lengths) >= 1


def test_span_corruption_depends_on_seed_only():
  docs = _documents(6)
  lengths = {"inputs": 128, "targets": 32}
  a = _run(objectives.span_corruption, docs, lengths, seed=1)
  b = _run(objectives.span_corruption, docs, lengths, seed=1)
  c = _run(objectives.span_corruption, docs, lengths, seed=2)
  assert all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, b))
  assert any(not np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, c))
  masks = {tuple(x["targets"][:4]) for x in a}
  assert len(masks) > 1  # different examples get different noise


@pytest.mark.parametrize("density", [0.15, 1.0])
def test_iid_mask_proportions(density):
  tokens = tf.constant(np.random.default_rng(0).integers(3, 800, 200_000), tf.int32)
  out = noise.iid_mask_tokens(
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
  examples = _run(objectives.iid_denoising, docs, {"inputs": 64, "targets": 64})
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
  examples = _run(objectives.prefix_lm, docs, lengths)
  joined = np.concatenate(
    [np.concatenate([ex["inputs"][:-1], ex["targets"][:-1]]) for ex in examples]
  )
  assert joined.tolist() == np.concatenate(docs).tolist()
  for ex in examples:
    assert 2 <= len(ex["inputs"]) <= 96 and 2 <= len(ex["targets"]) <= 48
    assert ex["inputs"][-1] == EOS and ex["targets"][-1] == EOS
  assert len({len(ex["inputs"]) for ex in examples}) > 3


def test_lm_targets_are_the_text_in_full_segments():
  docs = _documents(8)
  examples = _run(objectives.lm, docs, {"targets": 64})
  assert all(set(ex) == {"targets"} and ex["targets"][-1] == EOS for ex in examples)
  assert _stream(examples, "targets").tolist() == np.concatenate(docs).tolist()
  # Segments are full (63 tokens + EOS) except the last of each concatenated batch.
  assert sum(len(ex["targets"]) == 64 for ex in examples) >= len(examples) - 1
  features = objectives.objective_features("lm", seqio.PassThroughVocabulary(900, eos_id=1))
  assert set(features) == {"targets"}
  assert set(objectives.objective_features("prefix_lm", features["targets"].vocabulary)) == {
    "inputs",
    "targets",
  }


def test_concat_and_split():
  docs = [np.arange(3, 13, dtype=np.int32), np.arange(20, 27, dtype=np.int32)]
  segments = [
    x["targets"].tolist()
    for x in noise.concat_and_split(_token_dataset(docs), 6).as_numpy_iterator()
  ]
  assert segments == [[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 20, 21], [22, 23, 24, 25, 26]]


def _stream(examples, key: str) -> np.ndarray:
  """The examples' `key` tokens without their EOS, concatenated."""
  return np.concatenate([ex[key][:-1] for ex in examples])


@pytest.mark.parametrize(
  "objective,mask_fraction,random_fraction",
  [("bert_style", 0.9, 0.1), ("iid_denoising", 0.8, 0.1), ("mass_style", 1.0, 0.0)],
)
def test_masking_objectives_corrupt_as_defined(objective, mask_fraction, random_fraction):
  docs = _documents(150)
  examples = _run(objectives.UNSUPERVISED_OBJECTIVES[objective], docs, {"inputs": 512})
  targets, inputs = _stream(examples, "targets"), _stream(examples, "inputs")
  assert targets.tolist() == np.concatenate(docs).tolist()  # targets: the original text
  assert all(len(ex["inputs"]) == len(ex["targets"]) <= 512 for ex in examples)
  masked = np.mean(inputs == VOCAB_SIZE - 1)
  replaced = np.mean((inputs != targets) & (inputs != VOCAB_SIZE - 1))
  assert abs(masked - 0.15 * mask_fraction) < 0.006, masked
  # A random token equal to the original (1 in 797) counts as kept.
  assert abs(replaced - 0.15 * random_fraction) < 0.004, replaced
  assert inputs.min() >= noise.FIRST_REGULAR_ID


def test_deshuffling_inputs_are_the_targets_in_another_order():
  docs = _documents(20)
  examples = _run(objectives.deshuffling, docs, {"inputs": 128})
  assert _stream(examples, "targets").tolist() == np.concatenate(docs).tolist()
  for ex in examples:
    assert sorted(ex["inputs"][:-1]) == sorted(ex["targets"][:-1]) and ex["inputs"][-1] == EOS
  assert np.mean(_stream(examples, "inputs") == _stream(examples, "targets")) < 0.05


@pytest.mark.parametrize("density", [0.15, 0.5])
def test_iid_replace_spans_reconstructs_and_corrupts_at_the_rate(density):
  docs = _documents(60)
  with gin.unlock_config():
    gin.bind_parameter("objectives.iid_replace_spans.noise_density", density)
  examples = _run(objectives.iid_replace_spans, docs, {"inputs": 256})
  rebuilt, corrupted = [], 0
  for ex in examples:
    sentinels = [int(t) for t in ex["inputs"] if t >= 800]
    assert sentinels == list(range(VOCAB_SIZE - 1, VOCAB_SIZE - 1 - len(sentinels), -1))
    original = _reconstruct(ex["inputs"], ex["targets"])
    rebuilt.extend(original)
    corrupted += sum(1 for t in ex["targets"][:-1] if t < 800)
    assert len(ex["inputs"]) <= 256
  assert rebuilt == np.concatenate(docs).tolist()
  assert abs(corrupted / len(rebuilt) - density) < 0.01


def test_iid_drop_tokens_splits_each_segment_into_kept_and_dropped():
  docs = _documents(60)
  examples = _run(objectives.iid_drop_tokens, docs, {"inputs": 256})
  kept = dropped = 0
  for ex, segment in zip(examples, _segments(docs, 255)):
    inputs, targets = ex["inputs"][:-1].tolist(), ex["targets"][:-1].tolist()
    assert _is_subsequence(inputs, segment) and _is_subsequence(targets, segment)
    assert sorted(inputs + targets) == sorted(segment)
    kept, dropped = kept + len(inputs), dropped + len(targets)
  assert abs(dropped / (kept + dropped) - 0.15) < 0.01


def _segments(docs, length: int) -> list[list[int]]:
  """`concat_and_split`'s segments (documents in batches of 128)."""
  stream = np.concatenate(docs).tolist()
  return [stream[i : i + length] for i in range(0, len(stream), length)]


def _is_subsequence(part: list[int], whole: list[int]) -> bool:
  it = iter(whole)
  return all(t in it for t in part)


def test_span_corruption_rate_and_span_length_are_gin_knobs():
  docs = _documents(120)
  with gin.unlock_config():
    gin.bind_parameter("objectives.span_corruption.noise_density", 0.5)
    gin.bind_parameter("objectives.span_corruption.mean_noise_span_length", 10.0)
  (preprocessor,) = objectives.unsupervised_preprocessors("span_corruption")[2:]
  examples = _run(preprocessor, docs, {"inputs": 512, "targets": 512})
  num_noise = total = 0
  spans = []
  for ex in examples:
    original = _reconstruct(ex["inputs"], ex["targets"])
    num_spans = sum(1 for t in ex["targets"] if t >= 800)
    num_noise += len(ex["targets"]) - 1 - num_spans
    total += len(original)
    spans.append(num_spans)
    assert len(ex["inputs"]) <= 512
  assert abs(num_noise / total - 0.5) < 0.02
  assert abs(num_noise / sum(spans) - 10.0) < 1.0


def test_bad_lengths_and_objectives_are_config_errors():
  with pytest.raises(ConfigError, match=r"TASK_FEATURE_LENGTHS\['inputs'\]\) of at least 3, got 2"):
    noise.random_spans_helper(2)
  with pytest.raises(ConfigError, match="Unknown objective 'mlm'"):
    objectives.unsupervised_preprocessors("mlm")


def test_electra_text_gives_the_uncorrupted_segments_as_inputs_and_targets():
  docs = _documents(20)
  examples = _run(objectives.electra_text, docs, {"inputs": 128, "targets": 128})
  for ex in examples:
    assert ex["inputs"].tolist() == ex["targets"].tolist()
    assert ex["inputs"][-1] == EOS and len(ex["inputs"]) <= 128
  assert _stream(examples, "targets").tolist() == np.concatenate(docs).tolist()
