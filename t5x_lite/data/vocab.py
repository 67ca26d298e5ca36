"""SentencePiece vocabularies with T5's ids (pad 0, eos 1, unk 2, no bos).

Two vocabularies are offered through the gin-configurable `get_vocabulary()`:

* the offline default: a small unigram SentencePiece model trained
  deterministically from text that ships with CPython (`t5x_lite.data.cpython_corpus`)
  on first use and cached under `t5x_lite.core.cache.cache_dir()`;
* any SentencePiece model file, e.g. T5's public vocabulary
  (`T5_PUBLIC_VOCABULARY`, gs://t5-data/vocabs/cc_all.32000/sentencepiece.model)
  for users who can reach it:

      get_vocabulary.sentencepiece_model_file = %T5_PUBLIC_VOCABULARY

Tasks are registered at import time, before gin files are parsed, so they use
`default_vocabulary()`: a `DeferredVocabulary` that calls `get_vocabulary()`
whenever it is used, which makes the gin choice apply to every registered task.
Inside `with resolving_to(vocabulary):` it resolves to that vocabulary instead
(`t5x_lite.run.interactive` evaluates a task with its checkpoint's vocabulary so).
"""

import contextlib
import functools
import hashlib
import io
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Optional

import gin
import seqio
import sentencepiece as spm
import tensorflow as tf

from t5x_lite.core import cache
from t5x_lite.data import cpython_corpus

T5_PUBLIC_VOCABULARY = "gs://t5-data/vocabs/cc_all.32000/sentencepiece.model"
gin.constant("T5_PUBLIC_VOCABULARY", T5_PUBLIC_VOCABULARY)

NUM_EXTRA_IDS = 100
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2

# Bump when the offline corpus or training recipe changes: it names the cache file.
_OFFLINE_RECIPE_VERSION = 1


def train_sentencepiece(
  sentences: Iterable[str],
  vocab_size: int,
  model_type: str = "unigram",
  character_coverage: float = 1.0,
  num_threads: int = 1,
) -> bytes:
  """Trains a SentencePiece model with T5's special ids.

  Training reads `sentences` in the given order without sampling or shuffling,
  and with `num_threads=1` the model is byte-for-byte reproducible.

  Args:
    sentences: training text, one piece of text per item (empty items skipped).
    vocab_size: number of pieces, including pad/eos/unk (extra ids are added
      by `seqio.SentencePieceVocabulary(path, extra_ids=100)` on top).
    model_type: 'unigram' (T5) or 'bpe'.
    character_coverage: fraction of characters covered by the model.
    num_threads: training threads; 1 keeps training deterministic.

  Returns:
    The serialized model (write it to a `.model` file).
  """
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
    sentence_iterator=(s for s in sentences if s.strip()),
    model_writer=model,
    vocab_size=vocab_size,
    model_type=model_type,
    character_coverage=character_coverage,
    pad_id=PAD_ID,
    eos_id=EOS_ID,
    unk_id=UNK_ID,
    bos_id=-1,
    num_threads=num_threads,
    input_sentence_size=0,
    shuffle_input_sentence=False,
    minloglevel=2,
  )
  return model.getvalue()


@gin.configurable
def offline_vocabulary_path(vocab_size: int = 8000, directory: Optional[str] = None) -> str:
  """Returns the offline vocabulary's model file, training it on first use.

  The model is trained from the train split of the CPython corpus
  (`t5x_lite.data.cpython_corpus.vocabulary_training_text`). Concurrent processes
  (e.g. pytest-xdist workers) serialize on a lock file; the first trains, the
  others find the finished file.

  Args:
    vocab_size: SentencePiece pieces (seqio adds 100 extra ids on top).
    directory: cache directory; defaults to `t5x_lite.core.cache.cache_dir()`.

  Returns:
    Path of the cached `.model` file.
  """
  directory = directory or cache.cache_dir()
  key = f"{_OFFLINE_RECIPE_VERSION}-{cpython_corpus.CORPUS_VERSION}-{vocab_size}-{sys.version}"
  digest = hashlib.sha256(key.encode()).hexdigest()[:12]
  path = os.path.join(directory, f"offline_spm_{vocab_size}_{digest}.model")
  return cache.build_once(
    path,
    lambda: train_sentencepiece(cpython_corpus.vocabulary_training_text(), vocab_size),
  )


@functools.lru_cache(maxsize=None)
def _sentencepiece_vocabulary(path: str, extra_ids: int) -> seqio.SentencePieceVocabulary:
  return seqio.SentencePieceVocabulary(path, extra_ids=extra_ids)


@gin.configurable
def get_vocabulary(
  sentencepiece_model_file: Optional[str] = None,
  extra_ids: int = NUM_EXTRA_IDS,
) -> seqio.SentencePieceVocabulary:
  """Returns the configured vocabulary (gin: `get_vocabulary.*`).

  Args:
    sentencepiece_model_file: a SentencePiece model with T5 ids, local or
      gs://; None selects the offline vocabulary (trained and cached on first
      use, see `offline_vocabulary_path`).
    extra_ids: sentinel ids appended at the top of the vocabulary.

  Returns:
    A `seqio.SentencePieceVocabulary` (one shared object per file and extra ids).
  """
  path = sentencepiece_model_file or offline_vocabulary_path()
  return _sentencepiece_vocabulary(path, extra_ids)


# `resolving_to` stack: the innermost vocabulary wins over `get_vocabulary()`.
_RESOLVING_TO: list[seqio.Vocabulary] = []


@contextlib.contextmanager
def resolving_to(vocabulary: seqio.Vocabulary) -> Iterator[None]:
  """Within the block, `default_vocabulary()` (every task's deferred vocabulary) is `vocabulary`.

  For running registered tasks with a model's own vocabulary without a gin binding.
  A task's datasets capture the vocabulary when they are built, so build them, and
  decode their predictions, inside the block.
  """
  _RESOLVING_TO.append(vocabulary)
  try:
    yield
  finally:
    _RESOLVING_TO.pop()


class DeferredVocabulary(seqio.Vocabulary):
  """A vocabulary that resolves `get_vocabulary()` each time it is used.

  Task registrations run at import time, before gin is parsed; this proxy lets
  them name "the configured vocabulary" and still honour later gin bindings.
  Nothing is trained or loaded until a method is called.
  """

  def __init__(self):
    super().__init__(extra_ids=0)

  @property
  def resolved(self) -> seqio.Vocabulary:
    """The vocabulary `get_vocabulary()` returns under the current gin config, or
    inside `resolving_to(v)` that `v`."""
    return _RESOLVING_TO[-1] if _RESOLVING_TO else get_vocabulary()

  @property
  def bos_id(self) -> Optional[int]:
    return self.resolved.bos_id

  @property
  def eos_id(self) -> Optional[int]:
    return self.resolved.eos_id

  @property
  def pad_id(self) -> int:
    return self.resolved.pad_id

  @property
  def unk_id(self) -> Optional[int]:
    return self.resolved.unk_id

  @property
  def extra_ids(self) -> int:
    return self.resolved.extra_ids

  @property
  def vocab_size(self) -> int:
    return self.resolved.vocab_size

  @property
  def _base_vocab_size(self) -> int:
    return self.resolved._base_vocab_size  # pylint: disable=protected-access

  def encode(self, s: Any) -> Sequence[int]:
    return self.resolved.encode(s)

  def _encode(self, s: str) -> Sequence[int]:
    return self.resolved.encode(s)

  def decode(self, ids: Iterable[int]) -> str:
    return self.resolved.decode(ids)

  def _decode(self, ids: Sequence[int]) -> str:
    return self.resolved.decode(ids)

  def encode_tf(self, s: tf.Tensor) -> tf.Tensor:
    return self.resolved.encode_tf(s)

  def _encode_tf(self, s: tf.Tensor) -> tf.Tensor:
    return self.resolved.encode_tf(s)

  def decode_tf(self, ids: tf.Tensor) -> tf.Tensor:
    return self.resolved.decode_tf(ids)

  def _decode_tf(self, ids: tf.Tensor) -> tf.Tensor:
    return self.resolved.decode_tf(ids)

  def __eq__(self, other: object) -> bool:
    if isinstance(other, DeferredVocabulary):
      return True
    return self.resolved == other

  def __hash__(self) -> int:
    return hash(DeferredVocabulary)

  def __str__(self) -> str:
    return f"DeferredVocabulary(-> {self.resolved})"


_DEFAULT_VOCABULARY = DeferredVocabulary()


def default_vocabulary() -> DeferredVocabulary:
  """Returns the vocabulary every registered task uses (see module docstring)."""
  return _DEFAULT_VOCABULARY
