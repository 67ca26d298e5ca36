"""T5 objectives and text-to-text formatting as seqio preprocessors.

Unsupervised objectives read a stream of token ids under 'targets' (after
`seqio.preprocessors.tokenize`), concatenate documents, cut the stream into
segments sized for the requested `sequence_length`, and corrupt each segment:

* `span_corruption`: T5's objective; 15% of tokens in spans of mean length 3,
  each span replaced by one sentinel counting down from the top of the
  vocabulary (vocab_size - 1, vocab_size - 2, ...). Targets list each
  sentinel followed by the tokens it replaced.
* `iid_denoising`: BERT-style; 15% of tokens selected i.i.d., of which 80%
  become the mask token (the top sentinel), 10% a random token, 10% stay;
  the targets are the original tokens.
* `prefix_lm`: split at a uniformly random point; the prefix is the input
  and the rest the target.

All randomness is stateless and driven by the seeds seqio passes through
`seqio.map_over_dataset(num_seeds=...)`, so a pipeline built with
`seqio.get_dataset(..., seed=S)` is reproducible. Every output ends with EOS.

The formatters that name record fields (`text_to_text`, `prefixed_pair`,
`translate`, the text feature of `unsupervised_preprocessors`) check those
names against the dataset's features when the pipeline is built and raise
`MissingFeatureError` (one line naming the feature and the features there
are) instead of a KeyError deep in a tf.data trace.
"""

import functools
from collections.abc import Mapping, Sequence
from typing import Optional

import seqio
import tensorflow as tf

from t5x_lite import vocab
from t5x_lite.errors import ConfigError

# Ids below this are pad (0), eos (1) and unk (2); random replacement tokens
# are drawn from [FIRST_REGULAR_ID, vocab_size - extra_ids).
FIRST_REGULAR_ID = 3


class MissingFeatureError(ConfigError):
  """A preprocessor names a feature that its input records do not have.

  Attributes:
    preprocessor: the preprocessor's name, e.g. 'text_to_text'.
    feature: the missing feature.
    available: the features the records have, in order.
  """

  def __init__(self, preprocessor: str, feature: str, available: Sequence[str]):
    self.preprocessor, self.feature, self.available = preprocessor, feature, list(available)
    super().__init__(
      f"preprocessor {preprocessor} asks for feature {feature!r}, but its input has "
      f"features {self.available}"
    )


def require_features(dataset: tf.data.Dataset, names: Sequence[str], preprocessor: str) -> None:
  """Checks that `dataset`'s records have every feature in `names`.

  Args:
    dataset: a dataset of feature dicts.
    names: features the preprocessor reads.
    preprocessor: its name, for the message.

  Raises:
    MissingFeatureError: for the first name the records lack.
  """
  available = list(dataset.element_spec)
  for name in names:
    if name not in available:
      raise MissingFeatureError(preprocessor, name, available)


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


def _as_seed(seed) -> tf.Tensor:
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
  order = tf.argsort(tf.random.stateless_uniform([num_items - 1], seed))  # [num_items - 1]
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
  seed = _as_seed(seed)
  float_length = tf.cast(length, tf.float32)
  num_noise = tf.cast(tf.round(float_length * noise_density), tf.int32)
  num_noise = tf.clip_by_value(num_noise, 1, length - 1)
  num_spans = tf.cast(tf.round(tf.cast(num_noise, tf.float32) / mean_noise_span_length), tf.int32)
  num_spans = tf.clip_by_value(num_spans, 1, tf.minimum(num_noise, length - num_noise))
  seeds = tf.random.experimental.stateless_split(seed, 2)  # [2, 2]
  noise_lengths = _random_segmentation(num_noise, num_spans, seeds[0])  # [num_spans]
  clean_lengths = _random_segmentation(length - num_noise, num_spans, seeds[1])  # [num_spans]
  span_lengths = tf.reshape(
    tf.stack([clean_lengths, noise_lengths], axis=1), [-1]
  )  # [2 * num_spans]
  span_is_noise = tf.tile([False, True], [num_spans])  # [2 * num_spans]
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
  span_start = span_mask & ~previous
  sentinels = vocab_size - tf.cumsum(tf.cast(span_start, tokens.dtype))  # [length]
  replaced = tf.where(span_start, sentinels, tokens)
  return tf.boolean_mask(replaced, ~(span_mask & previous))


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
  seeds = tf.random.experimental.stateless_split(_as_seed(seed), 3)  # [3, 2]
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
    return tf.RaggedTensor.from_row_lengths(flat, lengths)  # [rows, None]

  ds = dataset.map(lambda x: x[key], num_parallel_calls=tf.data.AUTOTUNE)
  ds = ds.ragged_batch(docs_per_batch).map(split, num_parallel_calls=tf.data.AUTOTUNE)
  ds = ds.unbatch().filter(lambda t: tf.size(t) >= 2)
  return ds.map(lambda t: {key: t})


def _append_eos(tokens: tf.Tensor, eos_id: int) -> tf.Tensor:
  return tf.concat([tokens, tf.cast([eos_id], tokens.dtype)], axis=0)


def _targets_vocabulary(output_features: Mapping[str, seqio.Feature]) -> seqio.Vocabulary:
  return output_features["targets"].vocabulary


# -------------------------------------------------------------- objectives


@seqio.map_over_dataset(num_seeds=1)
def _span_corrupt(
  x, seed, vocab_size: int, eos_id: int, noise_density: float, mean_noise_span_length: float
):
  tokens = x["targets"]
  mask = random_spans_noise_mask(tf.size(tokens), seed, noise_density, mean_noise_span_length)
  return {
    "inputs": _append_eos(replace_spans_with_sentinels(tokens, mask, vocab_size), eos_id),
    "targets": _append_eos(replace_spans_with_sentinels(tokens, ~mask, vocab_size), eos_id),
  }


def span_corruption(
  dataset: tf.data.Dataset,
  sequence_length: Mapping[str, int],
  output_features: Mapping[str, seqio.Feature],
  noise_density: float = 0.15,
  mean_noise_span_length: float = 3.0,
) -> tf.data.Dataset:
  """T5 span corruption over the token stream under 'targets'.

  Segments hold `random_spans_helper(sequence_length['inputs'])[0]` raw
  tokens, so corrupted inputs fill the inputs length (568 raw -> 512 inputs,
  114 targets).

  Args:
    dataset: tokenized examples with 'targets'.
    sequence_length: needs 'inputs'.
    output_features: the task's features (the 'targets' vocabulary gives the
      sentinels and EOS).
    noise_density: fraction of tokens corrupted.
    mean_noise_span_length: mean span length.

  Returns:
    A dataset of {'inputs', 'targets'} int32 token sequences ending in EOS.
  """
  vocabulary = _targets_vocabulary(output_features)
  raw_length, _ = random_spans_helper(
    sequence_length["inputs"], noise_density, mean_noise_span_length
  )
  ds = concat_and_split(dataset, raw_length)
  return _span_corrupt(
    ds,
    vocab_size=vocabulary.vocab_size,
    eos_id=vocabulary.eos_id,
    noise_density=noise_density,
    mean_noise_span_length=mean_noise_span_length,
  )


@seqio.map_over_dataset(num_seeds=1)
def _iid_corrupt(x, seed, mask_id: int, num_regular_ids: int, eos_id: int, noise_density: float):
  tokens = x["targets"]
  corrupted = iid_mask_tokens(tokens, seed, mask_id, num_regular_ids, noise_density)
  return {"inputs": _append_eos(corrupted, eos_id), "targets": _append_eos(tokens, eos_id)}


def iid_denoising(
  dataset: tf.data.Dataset,
  sequence_length: Mapping[str, int],
  output_features: Mapping[str, seqio.Feature],
  noise_density: float = 0.15,
) -> tf.data.Dataset:
  """BERT-style i.i.d. masking; targets are the uncorrupted segment.

  Segments hold sequence_length['inputs'] - 1 tokens (plus EOS); set the
  targets length to the inputs length to keep the targets whole. The mask
  token is the top sentinel (vocab_size - 1).

  Args:
    dataset: tokenized examples with 'targets'.
    sequence_length: needs 'inputs'.
    output_features: the task's features ('targets' vocabulary).
    noise_density: fraction of tokens selected for corruption.

  Returns:
    A dataset of {'inputs', 'targets'} ending in EOS.
  """
  vocabulary = _targets_vocabulary(output_features)
  ds = concat_and_split(dataset, sequence_length["inputs"] - 1)
  return _iid_corrupt(
    ds,
    mask_id=vocabulary.vocab_size - 1,
    num_regular_ids=vocabulary.vocab_size - vocabulary.extra_ids,
    eos_id=vocabulary.eos_id,
    noise_density=noise_density,
  )


@seqio.map_over_dataset(num_seeds=1)
def _split_prefix(x, seed, max_inputs: int, max_targets: int, eos_id: int):
  tokens = x["targets"]
  length = tf.size(tokens)
  low = tf.maximum(1, length - max_targets)
  high = tf.minimum(length - 1, max_inputs)
  split = tf.random.stateless_uniform(
    [], _as_seed(seed), minval=low, maxval=high + 1, dtype=tf.int32
  )
  return {
    "inputs": _append_eos(tokens[:split], eos_id),
    "targets": _append_eos(tokens[split:], eos_id),
  }


def prefix_lm(
  dataset: tf.data.Dataset,
  sequence_length: Mapping[str, int],
  output_features: Mapping[str, seqio.Feature],
) -> tf.data.Dataset:
  """Prefix LM: inputs are a random-length prefix, targets the continuation.

  Segments hold max(inputs, targets) - 1 tokens; the split point is uniform
  over the points where both parts fit their lengths (with EOS), so no
  token is trimmed. With equal lengths this is T5's prefix LM (split
  anywhere); with targets shorter than inputs the split falls in the last
  `targets - 1` tokens.

  Args:
    dataset: tokenized examples with 'targets'.
    sequence_length: needs 'inputs' and 'targets'.
    output_features: the task's features ('targets' vocabulary).

  Returns:
    A dataset of {'inputs', 'targets'} ending in EOS.
  """
  vocabulary = _targets_vocabulary(output_features)
  max_inputs, max_targets = sequence_length["inputs"] - 1, sequence_length["targets"] - 1
  ds = concat_and_split(dataset, max(max_inputs, max_targets))
  return _split_prefix(ds, max_inputs=max_inputs, max_targets=max_targets, eos_id=vocabulary.eos_id)


# ------------------------------------------------------ text-to-text format


def _label_text(
  label: tf.Tensor, label_names: Optional[Sequence[str] | Mapping[str, str]]
) -> tf.Tensor:
  """Label -> target string: int index into names, string via mapping, float 0.2-rounded."""
  if label.dtype == tf.string:
    if not label_names:
      return label
    text = tf.constant("<unk>")
    for raw, name in label_names.items():
      text = tf.where(tf.equal(tf.strings.strip(label), raw), tf.constant(name), text)
    return text
  if label.dtype.is_floating:
    return tf.strings.as_string(tf.round(tf.cast(label, tf.float32) * 5) / 5, precision=1)
  names = tf.constant(list(label_names))
  index = tf.cast(label, tf.int32)
  valid = (index >= 0) & (index < len(label_names))
  return tf.where(
    valid, tf.gather(names, tf.clip_by_value(index, 0, len(label_names) - 1)), "<unk>"
  )


def text_to_text(
  dataset: tf.data.Dataset,
  prefix: str,
  feature_names: Sequence[str],
  label_key: Optional[str] = "label",
  label_names: Optional[Sequence[str] | Mapping[str, str]] = None,
) -> tf.data.Dataset:
  """Formats records as T5 text-to-text, e.g. `sst2 sentence: ...` -> `positive`.

  inputs = "<prefix> <name1>: <value1> <name2>: <value2> ...". targets come
  from `x[label_key]`: an int label indexes `label_names` (-1 or out of range
  -> "<unk>"), a string label is mapped through the `label_names` dict (or
  kept as is without one), a float label is rounded to 0.2 and printed with
  one decimal (STS-B). With `label_key=None`, targets are absent.

  Args:
    dataset: records with the fields `feature_names` and `label_key`.
    prefix: task prefix, e.g. "sst2".
    feature_names: record fields to put in the inputs, in order.
    label_key: field holding the label.
    label_names: class names (int labels) or {raw label: name} (string labels).

  Returns:
    A dataset of {'inputs': string, 'targets': string} (+ 'idx' if the
    records have one).

  Raises:
    MissingFeatureError: if the records lack a field named here.
  """
  require_features(dataset, [*feature_names, *([label_key] if label_key else [])], "text_to_text")
  return _format_text_to_text(
    dataset,
    prefix=prefix,
    feature_names=feature_names,
    label_key=label_key,
    label_names=label_names,
  )


@seqio.map_over_dataset
def _format_text_to_text(
  x: Mapping[str, tf.Tensor],
  prefix: str,
  feature_names: Sequence[str],
  label_key: Optional[str],
  label_names: Optional[Sequence[str] | Mapping[str, str]],
) -> dict[str, tf.Tensor]:
  """One record of `text_to_text`."""
  parts = [tf.constant(prefix)] if prefix else []
  for name in feature_names:
    parts += [tf.constant(f"{name}:"), x[name]]
  out = {"inputs": tf.strings.reduce_join(tf.stack(parts), separator=" ")}
  if label_key is not None:
    out["targets"] = _label_text(x[label_key], label_names)
  if "idx" in x:
    out["idx"] = x["idx"]
  return out


def prefixed_pair(
  dataset: tf.data.Dataset, prefix: str, source_key: str, target_key: str
) -> tf.data.Dataset:
  """{'inputs': prefix + x[source_key], 'targets': x[target_key]} (translation, summaries).

  Raises:
    MissingFeatureError: if the records lack `source_key` or `target_key`.
  """
  require_features(dataset, (source_key, target_key), "prefixed_pair")
  return _join_pair(dataset, prefix=prefix, source_key=source_key, target_key=target_key)


@seqio.map_over_dataset
def _join_pair(
  x: Mapping[str, tf.Tensor], prefix: str, source_key: str, target_key: str
) -> dict[str, tf.Tensor]:
  """One record of `prefixed_pair`."""
  return {"inputs": tf.strings.join([prefix, x[source_key]]), "targets": x[target_key]}


def translate(
  dataset: tf.data.Dataset,
  source_language: str,
  target_language: str,
  source_key: str,
  target_key: str,
) -> tf.data.Dataset:
  """T5 translation format: "translate English to German: <source>" -> target.

  Raises:
    MissingFeatureError: if the records lack `source_key` or `target_key`.
  """
  require_features(dataset, (source_key, target_key), "translate")
  prefix = f"translate {source_language} to {target_language}: "
  return _join_pair(dataset, prefix=prefix, source_key=source_key, target_key=target_key)


UNSUPERVISED_OBJECTIVES = {
  "span_corruption": span_corruption,
  "iid_denoising": iid_denoising,
  "prefix_lm": prefix_lm,
}


def unsupervised_preprocessors(objective: str, text_key: str = "text") -> list:
  """The seqio preprocessor list for a text corpus under `text_key`.

  Args:
    objective: a key of `UNSUPERVISED_OBJECTIVES`.
    text_key: raw feature holding the text.

  Returns:
    [text_as_targets, tokenize, objective].

  Raises:
    ConfigError: for an unknown objective.
  """
  if objective not in UNSUPERVISED_OBJECTIVES:
    raise ConfigError(
      f"Unknown objective {objective!r}; choose from {sorted(UNSUPERVISED_OBJECTIVES)}."
    )
  return [
    functools.partial(text_as_targets, text_key=text_key),
    seqio.preprocessors.tokenize,
    UNSUPERVISED_OBJECTIVES[objective],
  ]


def text_as_targets(dataset: tf.data.Dataset, text_key: str = "text") -> tf.data.Dataset:
  """{'targets': x[text_key]}: the text an unsupervised objective reads.

  Raises:
    MissingFeatureError: if the records lack `text_key`.
  """
  require_features(dataset, (text_key,), "text_as_targets")
  return dataset.map(lambda x: {"targets": x[text_key]}, num_parallel_calls=tf.data.AUTOTUNE)


def text_to_text_features(
  vocabulary: Optional[seqio.Vocabulary] = None,
) -> dict[str, seqio.Feature]:
  """Output features 'inputs' and 'targets', both with EOS.

  Args:
    vocabulary: defaults to `t5x_lite.vocab.default_vocabulary()` (the gin
      configured vocabulary, resolved when used).

  Returns:
    {'inputs': Feature, 'targets': Feature}.
  """
  vocabulary = vocabulary or vocab.default_vocabulary()
  return {
    "inputs": seqio.Feature(vocabulary=vocabulary, add_eos=True),
    "targets": seqio.Feature(vocabulary=vocabulary, add_eos=True),
  }


def supervised_preprocessors(formatter) -> list:
  """[formatter, tokenize, append EOS after trimming] for text-to-text records."""
  return [formatter, seqio.preprocessors.tokenize, seqio.preprocessors.append_eos_after_trim]
