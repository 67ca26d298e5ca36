"""Tiny seqio text tasks over a byte vocabulary, registered by the tests that train on them."""

from collections.abc import Callable, Sequence

import seqio
import tensorflow as tf

VOCAB = seqio.ByteVocabulary()

Source = Callable[..., tf.data.Dataset]


def register_text_task(
  name: str,
  source: Source,
  splits: Sequence[str],
  preprocessors: Sequence[Callable[..., tf.data.Dataset]] = (
    seqio.preprocessors.tokenize,
    seqio.preprocessors.append_eos,
  ),
) -> str:
  """Registers `name` (once per process): `source(split, shuffle_files, seed)` gives
  {'inputs', 'targets'} strings, tokenized with `VOCAB`. Returns `name`."""
  if name not in seqio.TaskRegistry.names():
    seqio.TaskRegistry.add(
      name,
      source=seqio.FunctionDataSource(source, splits=list(splits)),
      preprocessors=list(preprocessors),
      output_features={"inputs": seqio.Feature(VOCAB), "targets": seqio.Feature(VOCAB)},
    )
  return name
