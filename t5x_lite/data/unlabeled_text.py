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
  + cpython_corpus.prose          paragraphs of Python's own documentation
"""

import re
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import Optional

import tensorflow as tf

from t5x_lite.data import cpython_corpus, file_sources

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
    yield from file_sources.read_jsonl(path, {"text": field})["text"]

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
