"""The T5 paper's unsupervised objectives (section 3.3) as seqio preprocessors.

Each objective reads a stream of token ids under 'targets' (after
`seqio.preprocessors.tokenize`), concatenates documents, cuts the stream into
segments sized for the requested `sequence_length`, and corrupts each segment.
"Corrupted" tokens are chosen at rate `noise_density` (the paper's corruption
rate: 10/15/25/50%); the sentinels count down from the top of the vocabulary
(vocab_size - 1, vocab_size - 2, ...); the mask token is the top sentinel.

  objective          inputs                                 targets
  span_corruption    spans of mean length                   each sentinel, then the
                     `mean_noise_span_length` (2/3/5/10)    tokens it replaced
                     -> one sentinel each                   (T5's "random spans")
  iid_replace_spans  i.i.d. tokens; each run of them        the same as span_corruption
                     -> one sentinel
  iid_drop_tokens    i.i.d. tokens dropped                  the dropped tokens
  bert_style         i.i.d. tokens: 90% -> mask,            the original segment
                     10% -> a random token (the paper's)
  iid_denoising      BERT's own: 80% mask, 10% random,      the original segment
                     10% unchanged
  mass_style         i.i.d. tokens -> mask                  the original segment
  deshuffling        the segment's tokens shuffled          the original segment
  prefix_lm          a random-length prefix                 the continuation
  lm                 none (a decoder-only language model)   the segment

The corruption rate and span length are gin knobs of each objective, e.g.
`objectives.span_corruption.noise_density = 0.5` and
`objectives.span_corruption.mean_noise_span_length = 10.0`; seqio calls the
objectives while building the dataset, after gin is parsed, so a binding applies to
every task registered with the objective.

All randomness is stateless and driven by the seeds seqio passes through
`seqio.map_over_dataset(num_seeds=1)` (`preprocessors.map_over_dataset_with_seed`), so a
pipeline built with `seqio.get_dataset(..., seed=S)` is reproducible. Every output ends
with EOS.
"""

import functools
from collections.abc import Mapping

import gin
import seqio
import tensorflow as tf

from t5x_lite.core.errors import ConfigError
from t5x_lite.data.noise import (
  as_seed,
  concat_and_split,
  iid_mask_tokens,
  random_spans_helper,
  random_spans_noise_mask,
  replace_spans_with_sentinels,
)
from t5x_lite.data import preprocessors
from t5x_lite.data.preprocessors import Feature, map_over_dataset_with_seed, require_features


def _append_eos(tokens: tf.Tensor, eos_id: int) -> tf.Tensor:
  return tf.concat([tokens, tf.cast([eos_id], tokens.dtype)], axis=0)


def _targets_vocabulary(output_features: Mapping[str, Feature]) -> seqio.Vocabulary:
  return output_features["targets"].vocabulary


# -------------------------------------------------------------- objectives


@map_over_dataset_with_seed
def _span_corrupt(
  x, seed, vocab_size: int, eos_id: int, noise_density: float, mean_noise_span_length: float
):
  tokens = x["targets"]
  mask = random_spans_noise_mask(tf.size(tokens), seed, noise_density, mean_noise_span_length)
  return {
    "inputs": _append_eos(replace_spans_with_sentinels(tokens, mask, vocab_size), eos_id),
    "targets": _append_eos(
      replace_spans_with_sentinels(tokens, tf.logical_not(mask), vocab_size), eos_id
    ),
  }


@gin.configurable
def span_corruption(
  dataset: tf.data.Dataset,
  sequence_length: Mapping[str, int],
  output_features: Mapping[str, Feature],
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


@map_over_dataset_with_seed
def _iid_corrupt(
  x,
  seed,
  mask_id: int,
  num_regular_ids: int,
  eos_id: int,
  noise_density: float,
  mask_fraction: float,
  random_fraction: float,
):
  tokens = x["targets"]
  corrupted = iid_mask_tokens(
    tokens, seed, mask_id, num_regular_ids, noise_density, mask_fraction, random_fraction
  )
  return {"inputs": _append_eos(corrupted, eos_id), "targets": _append_eos(tokens, eos_id)}


def _iid_masking(
  dataset: tf.data.Dataset,
  sequence_length: Mapping[str, int],
  output_features: Mapping[str, Feature],
  noise_density: float,
  mask_fraction: float,
  random_fraction: float,
) -> tf.data.Dataset:
  """Segments of inputs - 1 tokens, i.i.d.-corrupted; targets are the segment."""
  vocabulary = _targets_vocabulary(output_features)
  ds = concat_and_split(dataset, sequence_length["inputs"] - 1)
  return _iid_corrupt(
    ds,
    mask_id=vocabulary.vocab_size - 1,
    num_regular_ids=vocabulary.vocab_size - vocabulary.extra_ids,
    eos_id=vocabulary.eos_id,
    noise_density=noise_density,
    mask_fraction=mask_fraction,
    random_fraction=random_fraction,
  )


@gin.configurable
def iid_denoising(
  dataset: tf.data.Dataset,
  sequence_length: Mapping[str, int],
  output_features: Mapping[str, Feature],
  noise_density: float = 0.15,
) -> tf.data.Dataset:
  """BERT's own masking (Devlin et al.): of the selected tokens, 80% become the mask
  token, 10% a random token and 10% stay; targets are the uncorrupted segment.

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
  return _iid_masking(dataset, sequence_length, output_features, noise_density, 0.8, 0.1)


@gin.configurable
def bert_style(
  dataset: tf.data.Dataset,
  sequence_length: Mapping[str, int],
  output_features: Mapping[str, Feature],
  noise_density: float = 0.15,
) -> tf.data.Dataset:
  """The T5 paper's "BERT-style" objective (section 3.3.1): of the corrupted tokens,
  90% become the mask token and 10% a random token; targets are the original segment.

  Lengths as `iid_denoising`.
  """
  return _iid_masking(dataset, sequence_length, output_features, noise_density, 0.9, 0.1)


@gin.configurable
def mass_style(
  dataset: tf.data.Dataset,
  sequence_length: Mapping[str, int],
  output_features: Mapping[str, Feature],
  noise_density: float = 0.15,
) -> tf.data.Dataset:
  """MASS-style (the T5 paper's variant): every corrupted token becomes the mask token;
  targets are the original segment. Lengths as `iid_denoising`.
  """
  return _iid_masking(dataset, sequence_length, output_features, noise_density, 1.0, 0.0)


@map_over_dataset_with_seed
def _shuffle_tokens(x, seed, eos_id: int):
  tokens = x["targets"]
  order = tf.argsort(tf.random.stateless_uniform([tf.size(tokens)], as_seed(seed)))
  shuffled = tf.gather(tokens, order)
  return {"inputs": _append_eos(shuffled, eos_id), "targets": _append_eos(tokens, eos_id)}


def deshuffling(
  dataset: tf.data.Dataset,
  sequence_length: Mapping[str, int],
  output_features: Mapping[str, Feature],
) -> tf.data.Dataset:
  """Deshuffling (the T5 paper, section 3.3.1): the inputs are the segment's tokens in
  a random order, the targets the segment. Lengths as `iid_denoising`.
  """
  vocabulary = _targets_vocabulary(output_features)
  ds = concat_and_split(dataset, sequence_length["inputs"] - 1)
  return _shuffle_tokens(ds, eos_id=vocabulary.eos_id)


@map_over_dataset_with_seed
def _iid_spans(x, seed, vocab_size: int, eos_id: int, noise_density: float, drop: bool):
  tokens = x["targets"]
  noise = tf.random.stateless_uniform([tf.size(tokens)], as_seed(seed)) < noise_density
  # The first token stays clean, as in `random_spans_noise_mask`, so that each input
  # sentinel and the targets' same sentinel both precede the span they stand for.
  noise &= tf.range(tf.size(tokens)) > 0
  if drop:
    inputs, targets = tf.boolean_mask(tokens, ~noise), tf.boolean_mask(tokens, noise)
  else:
    inputs = replace_spans_with_sentinels(tokens, noise, vocab_size)
    targets = replace_spans_with_sentinels(tokens, ~noise, vocab_size)
  return {"inputs": _append_eos(inputs, eos_id), "targets": _append_eos(targets, eos_id)}


def _iid_span_objective(
  dataset: tf.data.Dataset,
  sequence_length: Mapping[str, int],
  output_features: Mapping[str, Feature],
  noise_density: float,
  drop: bool,
) -> tf.data.Dataset:
  vocabulary = _targets_vocabulary(output_features)
  ds = concat_and_split(dataset, sequence_length["inputs"] - 1)
  return _iid_spans(
    ds,
    vocab_size=vocabulary.vocab_size,
    eos_id=vocabulary.eos_id,
    noise_density=noise_density,
    drop=drop,
  )


@gin.configurable
def iid_replace_spans(
  dataset: tf.data.Dataset,
  sequence_length: Mapping[str, int],
  output_features: Mapping[str, Feature],
  noise_density: float = 0.15,
) -> tf.data.Dataset:
  """ "Replace corrupted spans" (the T5 paper, section 3.3.2): tokens are corrupted
  i.i.d. and each run of consecutive corrupted tokens becomes one sentinel; the targets
  are each sentinel followed by the tokens it replaced.

  The first token of a segment is never corrupted (as in span corruption). Segments
  hold sequence_length['inputs'] - 1 tokens, so the inputs always fit;
  targets need about noise_density * 2 of the inputs length.
  """
  return _iid_span_objective(dataset, sequence_length, output_features, noise_density, False)


@gin.configurable
def iid_drop_tokens(
  dataset: tf.data.Dataset,
  sequence_length: Mapping[str, int],
  output_features: Mapping[str, Feature],
  noise_density: float = 0.15,
) -> tf.data.Dataset:
  """ "Drop corrupted tokens" (the T5 paper, section 3.3.2): tokens are corrupted
  i.i.d. and removed from the inputs; the targets are the removed tokens in order.
  Lengths as `iid_replace_spans`.
  """
  return _iid_span_objective(dataset, sequence_length, output_features, noise_density, True)


@map_over_dataset_with_seed
def _split_prefix(x, seed, max_inputs: int, max_targets: int, eos_id: int):
  tokens = x["targets"]
  length = tf.size(tokens)
  low = tf.maximum(1, length - max_targets)
  high = tf.minimum(length - 1, max_inputs)
  split = tf.random.stateless_uniform(
    [], as_seed(seed), minval=low, maxval=high + 1, dtype=tf.int32
  )
  return {
    "inputs": _append_eos(tokens[:split], eos_id),
    "targets": _append_eos(tokens[split:], eos_id),
  }


def prefix_lm(
  dataset: tf.data.Dataset,
  sequence_length: Mapping[str, int],
  output_features: Mapping[str, Feature],
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


def lm(
  dataset: tf.data.Dataset,
  sequence_length: Mapping[str, int],
  output_features: Mapping[str, Feature],
) -> tf.data.Dataset:
  """Plain language modelling: targets are segments of targets - 1 tokens, with EOS.

  There are no inputs, so the task's output features are `objective_features('lm')`
  and only a decoder-only model reads it (seqio's LMFeatureConverter, through
  `seqio.DecoderFeatureConverter`).

  Args:
    dataset: tokenized examples with 'targets'.
    sequence_length: needs 'targets'.
    output_features: the task's features ('targets' vocabulary).

  Returns:
    A dataset of {'targets'} ending in EOS.
  """
  eos_id = _targets_vocabulary(output_features).eos_id
  if eos_id is None:
    raise ConfigError("lm: the 'targets' vocabulary has no EOS id to end each segment with")
  ds = concat_and_split(dataset, sequence_length["targets"] - 1)
  return ds.map(
    lambda x: {"targets": _append_eos(x["targets"], eos_id)}, num_parallel_calls=tf.data.AUTOTUNE
  )


def electra_text(
  dataset: tf.data.Dataset,
  sequence_length: Mapping[str, int],
  output_features: Mapping[str, Feature],
) -> tf.data.Dataset:
  """ELECTRA / METRO-T5 pre-training's features: segments of inputs - 1 tokens plus EOS,
  uncorrupted, as both inputs and targets. `t5x_lite.electra.ElectraModel` masks and
  corrupts the inputs in its train step (the generator's samples depend on its params),
  and its decoder reconstructs the targets. Set the targets length to the inputs length.

  Args:
    dataset: tokenized examples with 'targets'.
    sequence_length: needs 'inputs'.
    output_features: the task's features ('targets' vocabulary).

  Returns:
    A dataset of {'inputs', 'targets'}, equal, ending in EOS.
  """
  eos_id = _targets_vocabulary(output_features).eos_id
  if eos_id is None:
    raise ConfigError(
      "electra_text: the 'targets' vocabulary has no EOS id to end each segment with"
    )
  ds = concat_and_split(dataset, sequence_length["inputs"] - 1)

  def both(x):
    text = _append_eos(x["targets"], eos_id)
    return {"inputs": text, "targets": text}

  return ds.map(both, num_parallel_calls=tf.data.AUTOTUNE)


UNSUPERVISED_OBJECTIVES = {
  "span_corruption": span_corruption,
  "iid_replace_spans": iid_replace_spans,
  "iid_drop_tokens": iid_drop_tokens,
  "bert_style": bert_style,
  "iid_denoising": iid_denoising,
  "mass_style": mass_style,
  "deshuffling": deshuffling,
  "prefix_lm": prefix_lm,
  "lm": lm,
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


def objective_features(
  objective: str, vocabulary: seqio.Vocabulary | None = None
) -> dict[str, Feature]:
  """A task's output features for `objective`: 'targets' alone for 'lm', else
  'inputs' and 'targets' (`preprocessors.text_to_text_features`)."""
  features = preprocessors.text_to_text_features(vocabulary)
  return {"targets": features["targets"]} if objective == "lm" else features


def text_as_targets(dataset: tf.data.Dataset, text_key: str = "text") -> tf.data.Dataset:
  """{'targets': x[text_key]}: the text an unsupervised objective reads.

  Raises:
    MissingFeatureError: if the records lack `text_key`.
  """
  require_features(dataset, (text_key,), "text_as_targets")
  return dataset.map(lambda x: {"targets": x[text_key]}, num_parallel_calls=tf.data.AUTOTUNE)
