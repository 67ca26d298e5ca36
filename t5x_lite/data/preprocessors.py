"""Text-to-text formatting as seqio preprocessors, and the feature checks they share.

The formatters that name record fields (`text_to_text`, `prefixed_pair`,
`translate`, and `objectives.text_as_targets`) check those names against the
dataset's features when the pipeline is built and raise `MissingFeatureError`
(one line naming the feature and the features there are) instead of a KeyError
deep in a tf.data trace. The unsupervised objectives are in `t5x_lite.data.objectives`.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Optional, TypeAlias

import seqio
import tensorflow as tf

from t5x_lite.data import vocab
from t5x_lite.core.errors import ConfigError

# A seqio.Feature. (seqio re-exports the class as a plain variable, which type checkers
# refuse in annotations.)
Feature: TypeAlias = seqio.utils.Feature
# A function that maps each record of a dataset: `mapped(dataset, **kwargs)`.
DatasetMap: TypeAlias = Callable[..., tf.data.Dataset]


def map_over_dataset(fn: Callable[..., dict[str, tf.Tensor]]) -> DatasetMap:
  """`seqio.map_over_dataset(fn)`, typed: `fn(record, **kwargs)` over each record.

  seqio has no annotations, so type checkers would take the decorated function for `fn`.
  """
  return seqio.map_over_dataset(fn)  # pyright: ignore[reportReturnType]


def map_over_dataset_with_seed(fn: Callable[..., dict[str, tf.Tensor]]) -> DatasetMap:
  """`seqio.map_over_dataset(fn, num_seeds=1)`, typed: `fn(record, seed, **kwargs)`
  over each record, seqio passing each record a stateless seed of its own."""
  return seqio.map_over_dataset(fn, num_seeds=1)  # pyright: ignore[reportReturnType]


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
  spec = dataset.element_spec  # {feature: TensorSpec} for records that are dicts
  available = list(spec) if isinstance(spec, Mapping) else []
  for name in names:
    if name not in available:
      raise MissingFeatureError(preprocessor, name, available)


# ------------------------------------------------------ text-to-text format


def _label_text(
  label: tf.Tensor, label_names: Optional[Sequence[str] | Mapping[str, str]]
) -> tf.Tensor:
  """Label -> target string: int index into names, string via mapping, float 0.2-rounded."""
  if label.dtype == tf.string:
    if not label_names:
      return label
    if not isinstance(label_names, Mapping):
      raise ConfigError(
        f"text_to_text: string labels map through label_names as a {{label: name}} dict, "
        f"not the list {list(label_names)}"
      )
    text = tf.constant("<unk>")
    for raw, name in label_names.items():
      text = tf.where(tf.equal(tf.strings.strip(label), raw), tf.constant(name), text)
    return text
  if label.dtype.is_floating:
    return tf.strings.as_string(tf.round(tf.cast(label, tf.float32) * 5) / 5, precision=1)
  if label_names is None:
    raise ConfigError("text_to_text: int labels need label_names, the class names in order")
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
  keep_features: Sequence[str] = (),
) -> tf.data.Dataset:
  """Formats records as T5 text-to-text, e.g. `sst2 sentence: ...` -> `positive`.

  inputs = "<prefix> <name1>: <value1> <name2>: <value2> ...". targets come
  from `x[label_key]`: an int label indexes `label_names` (-1 or out of range
  -> "<unk>"), a string label is mapped through the `label_names` dict (or
  kept as is without one), a float label is rounded to 0.2 and printed with
  one decimal (STS-B), a list label (several acceptable answers) trains on its
  first item ("" when empty). With `label_key=None`, targets are absent.

  Args:
    dataset: records with the fields `feature_names` and `label_key`.
    prefix: task prefix, e.g. "sst2"; "" for none.
    feature_names: record fields to put in the inputs, in order.
    label_key: field holding the label.
    label_names: class names (int labels) or {raw label: name} (string labels).
    keep_features: record fields copied unchanged into the output, e.g.
      ('answers',) so that every acceptable answer reaches the metric
      (`task_metrics.all_answers`).

  Returns:
    A dataset of {'inputs': string, 'targets': string} (+ 'idx' if the
    records have one, + `keep_features`).

  Raises:
    MissingFeatureError: if the records lack a field named here.
  """
  named = [*feature_names, *([label_key] if label_key else []), *keep_features]
  require_features(dataset, named, "text_to_text")
  return _format_text_to_text(
    dataset,
    prefix=prefix,
    feature_names=feature_names,
    label_key=label_key,
    label_names=label_names,
    keep_features=tuple(keep_features),
  )


@map_over_dataset
def _format_text_to_text(
  x: Mapping[str, tf.Tensor],
  prefix: str,
  feature_names: Sequence[str],
  label_key: Optional[str],
  label_names: Optional[Sequence[str] | Mapping[str, str]],
  keep_features: tuple[str, ...],
) -> dict[str, tf.Tensor]:
  """One record of `text_to_text`."""
  parts = [tf.constant(prefix)] if prefix else []
  for name in feature_names:
    parts += [tf.constant(f"{name}:"), x[name]]
  out = {"inputs": tf.strings.reduce_join(tf.stack(parts), separator=" ")}
  if label_key is not None:
    label = x[label_key]
    if label.shape.rank == 1:  # a list of acceptable answers: train on the first
      label = tf.concat([label, [""]], axis=0)[0]
    out["targets"] = _label_text(label, label_names)
  for name in ("idx", *keep_features):
    if name in x:
      out[name] = x[name]
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


@map_over_dataset
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


def text_to_text_features(
  vocabulary: Optional[seqio.Vocabulary] = None,
) -> dict[str, Feature]:
  """Output features 'inputs' and 'targets', both with EOS.

  Args:
    vocabulary: defaults to `t5x_lite.data.vocab.default_vocabulary()` (the gin
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
