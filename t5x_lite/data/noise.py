"""Noise for the unsupervised objectives (`t5x_lite.data.objectives`): span arithmetic,
random span and i.i.d. masks, sentinel replacement, and cutting token streams into
segments. All randomness is stateless (tf.random.stateless_*), driven by the seeds seqio
passes to its map functions.
"""

import tensorflow as tf

from t5x_lite.core.errors import ConfigError

# Ids below this are pad (0), eos (1) and unk (2); random replacement tokens
# are drawn from [FIRST_REGULAR_ID, vocab_size - extra_ids).
FIRST_REGULAR_ID = 3


# ----------------------------------------------------------- span arithmetic


def corrupted_lengths(
  tokens_length: int,
  noise_density: float = 0.15,
  mean_noise_span_length: float = 3.0,
) -> tuple[int, int]:
  """Lengths of (inputs, targets) after span-corrupting `tokens_length` tokens.

  Counts one sentinel per span on each side and one EOS at the end of each.
  Uses the same rounding as `random_spans_noise_mask`.

  Args:
    tokens_length: raw tokens in the segment.
    noise_density: fraction of tokens to corrupt.
    mean_noise_span_length: mean corrupted span length.

  Returns:
    (inputs_length, targets_length).
  """
  num_noise = min(max(int(round(tokens_length * noise_density)), 1), tokens_length - 1)
  num_spans = max(int(round(num_noise / mean_noise_span_length)), 1)
  num_nonnoise = tokens_length - num_noise
  return num_nonnoise + num_spans + 1, num_noise + num_spans + 1


def random_spans_helper(
  inputs_length: int = 512,
  noise_density: float = 0.15,
  mean_noise_span_length: float = 3.0,
) -> tuple[int, int]:
  """Raw segment length whose span corruption fills `inputs_length`.

  Finds the largest raw length whose corrupted inputs (with sentinels and
  EOS) fit in `inputs_length`; e.g. 512 -> (568, 114).

  Args:
    inputs_length: desired length of the corrupted inputs, EOS included.
    noise_density: fraction of tokens to corrupt.
    mean_noise_span_length: mean corrupted span length.

  Returns:
    (raw tokens per segment, resulting targets length).
  """
  if inputs_length < 3:
    raise ConfigError(
      f"Span corruption needs an inputs length (TASK_FEATURE_LENGTHS['inputs']) of at "
      f"least 3, got {inputs_length}."
    )
  tokens_length = inputs_length
  while (
    corrupted_lengths(tokens_length + 1, noise_density, mean_noise_span_length)[0] <= inputs_length
  ):
    tokens_length += 1
  _, targets_length = corrupted_lengths(tokens_length, noise_density, mean_noise_span_length)
  return tokens_length, targets_length


# ------------------------------------------------------------- random masks


def as_seed(seed) -> tf.Tensor:
  """Normalizes a seqio seed (tensor [2] or pair of scalars) to int64 [2]."""
  return tf.cast(tf.convert_to_tensor(seed), tf.int64)


def _random_segmentation(
  num_items: tf.Tensor, num_segments: tf.Tensor, seed: tf.Tensor
) -> tf.Tensor:
  """Splits `num_items` into `num_segments` random non-empty parts.

  Args:
    num_items: scalar int32 >= num_segments.
    num_segments: scalar int32 >= 1.
    seed: int64 [2] stateless seed.

  Returns:
    int32 [num_segments] lengths summing to `num_items`.
  """
  # Mark num_segments - 1 of the positions 1..num_items-1 as segment starts.
  starts = tf.concat(
    [tf.ones([num_segments - 1], tf.int32), tf.zeros([num_items - num_segments], tf.int32)],
    axis=0,
  )
  # [num_items - 1]. (TensorFlow's stubs take a shape of ints only, not of scalar tensors.)
  order = tf.argsort(tf.random.stateless_uniform([num_items - 1], seed))  # pyright: ignore[reportArgumentType]
  starts = tf.gather(starts, order)
  segment_ids = tf.cumsum(tf.pad(starts, [[1, 0]]))  # [num_items]
  return tf.math.unsorted_segment_sum(tf.ones_like(segment_ids), segment_ids, num_segments)


def random_spans_noise_mask(
  length: tf.Tensor,
  seed,
  noise_density: float = 0.15,
  mean_noise_span_length: float = 3.0,
) -> tf.Tensor:
  """Boolean mask of noise spans: alternating clean/noise, starting clean.

  round(length * noise_density) tokens (at least 1, at most length - 1) are
  noise, in round(num_noise / mean_noise_span_length) spans (at least 1).

  Args:
    length: scalar int32 >= 2, tokens in the segment.
    seed: stateless seed (int [2]).
    noise_density: fraction of noise tokens.
    mean_noise_span_length: mean noise span length.

  Returns:
    bool [length], True at noise positions.
  """
  length = tf.cast(length, tf.int32)
  seed = as_seed(seed)
  float_length = tf.cast(length, tf.float32)
  num_noise = tf.cast(tf.round(float_length * noise_density), tf.int32)
  num_noise = tf.clip_by_value(num_noise, 1, length - 1)
  num_spans = tf.cast(tf.round(tf.cast(num_noise, tf.float32) / mean_noise_span_length), tf.int32)
  num_spans = tf.clip_by_value(num_spans, 1, tf.minimum(num_noise, length - num_noise))
  seeds = tf.random.split(seed, 2)  # [2, 2]
  noise_lengths = _random_segmentation(num_noise, num_spans, seeds[0])  # [num_spans]
  clean_lengths = _random_segmentation(length - num_noise, num_spans, seeds[1])  # [num_spans]
  span_lengths = tf.reshape(
    tf.stack([clean_lengths, noise_lengths], axis=1), [-1]
  )  # [2 * num_spans]
  # [2 * num_spans]. (TensorFlow's stubs take neither a list of bools nor of tensors here.)
  span_is_noise = tf.tile([False, True], [num_spans])  # pyright: ignore[reportArgumentType]
  return tf.repeat(span_is_noise, span_lengths)


def replace_spans_with_sentinels(
  tokens: tf.Tensor, span_mask: tf.Tensor, vocab_size: int
) -> tf.Tensor:
  """Replaces each masked span by one sentinel and drops the rest of it.

  The k-th masked span (k = 0, 1, ...) becomes `vocab_size - 1 - k`.

  Args:
    tokens: int32 [length].
    span_mask: bool [length].
    vocab_size: vocabulary size including extra ids.

  Returns:
    int32 [length - masked tokens + masked spans].
  """
  previous = tf.pad(span_mask[:-1], [[1, 0]])  # [length]
  span_start = span_mask & tf.logical_not(previous)
  sentinels = vocab_size - tf.cumsum(tf.cast(span_start, tokens.dtype))  # [length]
  replaced = tf.where(span_start, sentinels, tokens)
  return tf.boolean_mask(replaced, tf.logical_not(span_mask & previous))


def iid_mask_tokens(
  tokens: tf.Tensor,
  seed,
  mask_id: int,
  num_regular_ids: int,
  noise_density: float = 0.15,
  mask_fraction: float = 0.8,
  random_fraction: float = 0.1,
) -> tf.Tensor:
  """BERT-style corruption: selected tokens -> mask / random token / unchanged.

  Args:
    tokens: int32 [length].
    seed: stateless seed (int [2]).
    mask_id: id that replaces masked tokens.
    num_regular_ids: random tokens are drawn from [FIRST_REGULAR_ID, num_regular_ids).
    noise_density: probability that a token is selected.
    mask_fraction: of the selected tokens, fraction replaced by `mask_id`.
    random_fraction: of the selected tokens, fraction replaced by a random id.

  Returns:
    int32 [length], the corrupted tokens.
  """
  seeds = tf.random.split(as_seed(seed), 3)  # [3, 2]
  length = tf.size(tokens)
  selected = tf.random.stateless_uniform([length], seeds[0]) < noise_density
  action = tf.random.stateless_uniform([length], seeds[1])
  random_ids = tf.random.stateless_uniform(
    [length], seeds[2], minval=FIRST_REGULAR_ID, maxval=num_regular_ids, dtype=tf.int32
  )
  corrupted = tf.where(
    selected & (action < mask_fraction + random_fraction),
    tf.cast(random_ids, tokens.dtype),
    tokens,
  )
  return tf.where(selected & (action < mask_fraction), tf.cast(mask_id, tokens.dtype), corrupted)


# ------------------------------------------------------ segmenting streams


def concat_and_split(
  dataset: tf.data.Dataset, segment_length: int, key: str = "targets", docs_per_batch: int = 128
) -> tf.data.Dataset:
  """Concatenates the token lists under `key` and cuts segments of a fixed length.

  Documents are concatenated in dataset order (no separator), `docs_per_batch`
  at a time; the last segment of each batch may be shorter. Segments of fewer
  than 2 tokens are dropped.

  Args:
    dataset: examples with int token ids under `key`.
    segment_length: tokens per segment.
    key: feature holding the tokens; the output has only this feature.
    docs_per_batch: documents concatenated together.

  Returns:
    A dataset of {key: int32 [<= segment_length]}.
  """

  def split(tokens: tf.RaggedTensor) -> tf.RaggedTensor:
    flat = tokens.flat_values  # [total_tokens]
    total = tf.size(flat, out_type=tf.int64)
    num_rows = (total + segment_length - 1) // segment_length
    lengths = tf.minimum(total - tf.range(num_rows) * segment_length, segment_length)  # [rows]
    # [rows, None]. (from_row_lengths is missing from TensorFlow's stubs.)
    return tf.RaggedTensor.from_row_lengths(flat, lengths)  # pyright: ignore[reportAttributeAccessIssue]

  ds = dataset.map(lambda x: x[key], num_parallel_calls=tf.data.AUTOTUNE)
  ds = ds.ragged_batch(docs_per_batch).map(split, num_parallel_calls=tf.data.AUTOTUNE)
  ds = ds.unbatch().filter(lambda t: tf.size(t) >= 2)
  return ds.map(lambda t: {key: t})
