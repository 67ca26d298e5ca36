"""The vocabulary a checkpoint was trained with, loaded from what its `train_meta` records.

Training records its SentencePiece vocabulary in every step's `train_meta`
(`checkpoints.vocabulary_fingerprint`: the model file's path, a hash of its pieces,
the extra ids). `resolve` turns that record back into a vocabulary, so eval, infer
and `t5x_lite.run.interactive` run a checkpoint trained with a non-default
vocabulary without the gin file that bound it in training: the recorded file when it
is still there with the same pieces, else the configured vocabulary when it has the
same pieces (a copy elsewhere, e.g. the offline vocabulary cached on another
machine), else a one-line error naming the file. Checkpoints that record none
(converted ones, older ones) keep the configured vocabulary.
"""

from __future__ import annotations

from typing import Any

import gin
import seqio
import tensorflow as tf
from absl import logging
from etils import epath

from t5x_lite.checkpoint import checkpoints
from t5x_lite.core.errors import ConfigError
from t5x_lite.core.paths import shown
from t5x_lite.data import vocab

# Gin parameters that choose the vocabulary explicitly; when one is bound, it wins.
_VOCABULARY_BINDINGS = (
  ("get_vocabulary", "sentencepiece_model_file"),
  ("build_model", "vocabulary"),
)


def recorded(step_dir: epath.Path) -> dict[str, Any] | None:
  """The vocabulary fingerprint in the step's `train_meta`, or None."""
  return (checkpoints.read_json_item(step_dir, checkpoints.TRAIN_META) or {}).get(
    checkpoints.VOCABULARY_KEY
  )


def _same(fingerprint: dict[str, Any] | None, stored: dict[str, Any]) -> bool:
  return fingerprint is not None and (fingerprint["sha256"], fingerprint["extra_ids"]) == (
    stored["sha256"],
    stored["extra_ids"],
  )


def resolve(step_dir: epath.Path) -> seqio.SentencePieceVocabulary | None:
  """The vocabulary `step_dir` was trained with; None when it records none.

  Args:
    step_dir: a checkpoint step directory.

  Returns:
    The recorded SentencePiece model file, loaded, when it exists with the recorded
    pieces; else the configured vocabulary (`vocab.get_vocabulary()`) when its pieces
    are the recorded ones; None for a checkpoint without a record.

  Raises:
    ConfigError: one line naming the recorded file, when neither has its pieces.
  """
  stored = recorded(step_dir)
  if not stored:
    return None
  path = stored["sentencepiece_model_file"]
  if tf.io.gfile.exists(path):
    loaded = vocab.get_vocabulary(path, int(stored["extra_ids"]))
    if _same(checkpoints.vocabulary_fingerprint(loaded), stored):
      return loaded
    problem = "which now holds a different vocabulary"
  else:
    problem = "which does not exist here"
  configured = vocab.get_vocabulary()
  if _same(checkpoints.vocabulary_fingerprint(configured), stored):
    return configured
  raise ConfigError(
    f"{shown(step_dir)} was trained with the vocabulary {path} ({stored['extra_ids']} "
    f"extra ids), {problem}; bind --gin.get_vocabulary.sentencepiece_model_file=\"'COPY'\" "
    "(Python: vocabulary=seqio.SentencePieceVocabulary(COPY)) to a copy of that file."
  )


def gin_binds_vocabulary() -> bool:
  """Whether gin chooses the vocabulary (get_vocabulary's file, or build_model's)."""
  bound = []
  for configurable, name in _VOCABULARY_BINDINGS:
    try:
      bound.append(name in gin.get_bindings(configurable))
    except ValueError:  # not registered: its module is not imported, so gin binds nothing
      bound.append(False)
  return any(bound)


def adopt(step_dir: epath.Path) -> None:
  """Makes the vocabulary `step_dir` records the run's configured one (eval, infer).

  Unless gin already chooses a vocabulary (then `checkpoints.check_vocabulary`
  compares the two), binds `get_vocabulary.sentencepiece_model_file` and
  `.extra_ids` to the recorded file, so the model and every registered task
  (`vocab.default_vocabulary()`) use it; the binding is logged and appears in the
  operative config.

  Raises:
    ConfigError: as `resolve`.
  """
  if gin_binds_vocabulary():
    return
  vocabulary = resolve(step_dir)
  if vocabulary is None or vocabulary is vocab.get_vocabulary():
    return
  path = str(vocabulary.sentencepiece_model_file)
  with gin.unlock_config():
    gin.bind_parameter("get_vocabulary.sentencepiece_model_file", path)
    gin.bind_parameter("get_vocabulary.extra_ids", int(vocabulary.extra_ids))
  logging.info("Vocabulary: %s, as recorded by %s.", path, shown(step_dir))
