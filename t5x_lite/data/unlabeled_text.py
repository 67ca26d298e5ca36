"""Unlabeled text for pre-training, read from local data sets and CPython's docs.

`UnlabeledTextSource` turns files laid out like ../shared/data into one corpus of
documents with a deterministic 95/5 train/validation split (a document's split
is a hash of its text, `cpython_corpus.split_of`). Only text that a downstream
task sees as *input* is read: labels, targets, dev and test files of the tasks
fine-tuned on later never enter the corpus.

  wikitext2/{valid,test}.txt      Wikipedia paragraphs (section headings dropped)
  tinyshakespeare/input.txt       speeches (blocks between blank lines)
  multi30k_en_de/train.en.gz      English captions (the German side is a target)
  scitldr_a/train.jsonl           abstracts (`source`; the summaries are targets)
  glue/SST-2/train.tsv            sentences (labels dropped)
  glue/RTE/train.tsv              premises and hypotheses (labels dropped)
  nltk/brown.zip                  the Brown Corpus, one document per sample (POS tags dropped)
  nltk/movie_reviews.zip          Pang & Lee IMDb reviews, one document per review
  nltk/{state_union,inaugural}.zip  one document per speech
  nltk/{abc,webtext}.zip          news and web text, one document per line
  + cpython_corpus.prose          paragraphs of Python's own documentation
"""

import hashlib
import io
import os
import re
import sys
import zipfile
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Optional

import gin
import tensorflow as tf

from t5x_lite.core import cache
from t5x_lite.data import cpython_corpus, file_sources, vocab

SPLITS = ("train", "validation")
# A WikiText section heading: " = Title = ", " = = Subsection = = ".
_WIKI_HEADING = re.compile(r"^\s*(= )+.*( =)+\s*$")


def wikitext_paragraphs(path: str) -> Iterator[str]:
  """Non-empty, non-heading lines of a WikiText file (one paragraph each)."""
  for _, line in file_sources.numbered_lines(path):
    if line.strip() and not _WIKI_HEADING.match(line):
      yield " ".join(line.split())


def blank_line_blocks(path: str) -> Iterator[str]:
  """Blocks of lines between blank lines, joined with spaces."""
  block: list[str] = []
  for _, line in file_sources.numbered_lines(path):
    if line.strip():
      block.append(line.strip())
    elif block:
      yield " ".join(block)
      block = []
  if block:
    yield " ".join(block)


def lines(path: str) -> Iterator[str]:
  """Non-empty lines."""
  for _, line in file_sources.numbered_lines(path):
    if line.strip():
      yield line.strip()


def _zip_members(path: str, folder: str) -> Iterator[tuple[str, str]]:
  """(name, text) of the text files under `folder`/ in a zip archive, by name.

  Raises:
    file_sources.DataFileError: the archive cannot be read, naming it.
  """
  try:
    with tf.io.gfile.GFile(path, "rb") as f:
      archive = zipfile.ZipFile(io.BytesIO(f.read()))
  except (zipfile.BadZipFile, OSError) as e:
    raise file_sources.DataFileError(f"{path}: not a readable zip archive ({e}).") from e
  for name in sorted(archive.namelist()):
    base = name.rsplit("/", 1)[-1]
    if name.startswith(f"{folder}/") and base and base not in ("README", "cats.txt", "CONTENTS"):
      yield name, archive.read(name).decode("utf-8", errors="replace")


# Brown's tokens are `word/tag`; its quotes are written `` and ''.
_QUOTES = {"``": '"', "''": '"'}


def brown_samples(path: str) -> Iterator[str]:
  """The Brown Corpus's 500 samples as plain text (tags dropped, quotes restored)."""
  for _, text in _zip_members(path, "brown"):
    words = [token.rsplit("/", 1)[0] for token in text.split()]
    yield " ".join(_QUOTES.get(w, w) for w in words)


def zip_files(folder: str) -> Callable[[str], Iterator[str]]:
  """A reader of each text file under `folder`/ of a zip archive as one document."""

  def read(path: str) -> Iterator[str]:
    for _, text in _zip_members(path, folder):
      if document := " ".join(text.split()):
        yield document

  return read


def zip_lines(folder: str) -> Callable[[str], Iterator[str]]:
  """A reader of each non-empty line of the text files under `folder`/ of a zip archive."""

  def read(path: str) -> Iterator[str]:
    for _, text in _zip_members(path, folder):
      yield from (" ".join(line.split()) for line in text.splitlines() if line.strip())

  return read


def tsv_columns(*columns: str) -> Callable[[str], Iterator[str]]:
  """A reader of the named columns of a TSV file with a header row."""

  def read(path: str) -> Iterator[str]:
    records = file_sources.read_tsv(path)
    for column in columns:
      if column not in records:
        raise file_sources.DataFileError(
          f"{path} has no column {column!r} (its header has {sorted(records)})."
        )
      yield from (text for text in records[column] if text.strip())

  return read


def jsonl_field(field: str) -> Callable[[str], Iterator[str]]:
  """A reader of one JSON-lines field (a list of sentences is space-joined)."""

  def read(path: str) -> Iterator[str]:
    for text in file_sources.read_jsonl(path, {"text": field})["text"]:
      assert isinstance(text, str)  # a list is space-joined (the default list policy)
      yield text

  return read


# {file name relative to the data dir: reader of its documents}
LOCAL_DATA_READERS: Mapping[str, Callable[[str], Iterable[str]]] = {
  "wikitext2/valid.txt": wikitext_paragraphs,
  "wikitext2/test.txt": wikitext_paragraphs,
  "tinyshakespeare/input.txt": blank_line_blocks,
  "multi30k_en_de/train.en.gz": lines,
  "scitldr_a/train.jsonl": jsonl_field("source"),
  "glue/SST-2/train.tsv": tsv_columns("sentence"),
  "glue/RTE/train.tsv": tsv_columns("sentence1", "sentence2"),
  "nltk/brown.zip": brown_samples,
  "nltk/movie_reviews.zip": zip_files("movie_reviews"),
  "nltk/state_union.zip": zip_files("state_union"),
  "nltk/inaugural.zip": zip_files("inaugural"),
  "nltk/abc.zip": zip_lines("abc"),
  "nltk/webtext.zip": zip_lines("webtext"),
}


class UnlabeledTextSource(file_sources.InMemorySource):
  """Documents under feature 'text', split 95/5 by a hash of each document.

  Repeated documents are kept once. Files are re-read when they change.

  Args:
    readers: {file name: reader}; names are relative to the data dir
      (`file_sources.local_data_dir`) unless absolute.
    include_cpython_prose: also add `cpython_corpus.prose` (its own split).
    data_dir: directory for relative names; None uses the gin/env default.
  """

  def __init__(
    self,
    readers: Mapping[str, Callable[[str], Iterable[str]]] = LOCAL_DATA_READERS,
    include_cpython_prose: bool = True,
    data_dir: Optional[str] = None,
  ):
    self._readers = dict(readers)
    self._include_cpython_prose = include_cpython_prose
    self._data_dir = data_dir
    super().__init__(self._split_documents, splits=SPLITS)

  def paths(self) -> list[str]:
    """The corpus files, resolved against the data dir at call time."""
    return [file_sources.resolve_path(name, self._data_dir) for name in self._readers]

  def _cache_key(self, split: str) -> Hashable:
    return split, tuple((p, tf.io.gfile.stat(p).mtime_nsec) for p in self.paths())

  def _split_documents(self, split: str) -> dict[str, list[str]]:
    documents: dict[str, None] = {}
    for path, read in zip(self.paths(), self._readers.values()):
      for document in read(path):
        if cpython_corpus.split_of(document) == split:
          documents[document] = None
    if self._include_cpython_prose:
      documents.update(dict.fromkeys(cpython_corpus.prose(split)))
    return {"text": list(documents)}


# Bump when the vocabulary's training text or settings change: it names the cache file.
_VOCABULARY_RECIPE_VERSION = 1
# SentencePiece skips training sentences longer than 4192 bytes; documents are cut
# at whitespace into pieces of about this many characters instead.
_VOCABULARY_LINE_CHARS = 1000


def _pieces_of(document: str) -> Iterator[str]:
  """`document` cut at spaces into pieces of at most about `_VOCABULARY_LINE_CHARS`."""
  start = 0
  while len(document) - start > _VOCABULARY_LINE_CHARS:
    cut = document.rfind(" ", start, start + _VOCABULARY_LINE_CHARS)
    cut = start + _VOCABULARY_LINE_CHARS if cut <= start else cut
    yield document[start:cut]
    start = cut + 1
  yield document[start:]


@gin.configurable
def corpus_vocabulary_path(
  vocab_size: int = 16000,
  extra_files: Sequence[str] = ("multi30k_en_de/train.de.gz",),
  extra_repeats: int = 2,
  data_dir: Optional[str] = None,
  directory: Optional[str] = None,
) -> str:
  """The recipes' vocabulary, trained on first use and cached.

  A unigram SentencePiece model with T5's ids, trained deterministically on the
  train split of this corpus (`UnlabeledTextSource`) plus the lines of
  `extra_files`: target-side training text the corpus leaves out (the German of
  Multi30k), so that one vocabulary serves pre-training and every fine-tuning
  task. Extra lines are repeated `extra_repeats` times, so that a language with
  few lines still gets whole-word pieces. The cache file is named by a hash of the
  settings and of each file's path, size and modification time, so changed data
  trains a new vocabulary. Concurrent processes build it once (`cache.build_once`).

  Gin: `get_vocabulary.sentencepiece_model_file = @corpus_vocabulary_path()`.

  Args:
    vocab_size: SentencePiece pieces (seqio adds 100 extra ids on top).
    extra_files: line files (.gz ok) relative to the data dir, or absolute.
    extra_repeats: how many times each extra line is seen.
    data_dir: directory for relative names; None uses the gin/env default.
    directory: cache directory; defaults to `t5x_lite.cache.cache_dir()`.

  Returns:
    Path of the cached `.model` file.

  Raises:
    file_sources.DataFileError: naming a missing corpus or extra file.
  """
  source = UnlabeledTextSource(data_dir=data_dir)
  extra = [file_sources.resolve_path(name, data_dir) for name in extra_files]
  # Absolute paths: the same files reached through another relative path share the cache.
  stamps = [
    (path if "://" in path else os.path.abspath(path), stat.length, stat.mtime_nsec)
    for path in source.paths() + extra
    for stat in [tf.io.gfile.stat(path)]
  ]
  key = repr(
    (
      _VOCABULARY_RECIPE_VERSION,
      cpython_corpus.CORPUS_VERSION,
      sys.version,
      vocab_size,
      extra_repeats,
      stamps,
    )
  )
  digest = hashlib.sha256(key.encode()).hexdigest()[:12]
  path = os.path.join(directory or cache.cache_dir(), f"corpus_spm_{vocab_size}_{digest}.model")

  def text() -> Iterator[str]:
    for document in source.records("train")["text"]:
      assert isinstance(document, str)  # the source's documents are strings
      yield from _pieces_of(document)
    for _ in range(extra_repeats):
      for name in extra:
        yield from lines(name)

  return cache.build_once(path, lambda: vocab.train_sentencepiece(text(), vocab_size))
