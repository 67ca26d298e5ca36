"""Offline text corpus: documentation and code that ship with CPython.

Two corpora, each with deterministic, disjoint train/validation splits:

* `prose(split)`: paragraphs of `pydoc_data.topics` (the Python language
  reference topics) and of the docstrings of the standard library's pure-Python
  modules, for unsupervised objectives (span corruption) and vocabulary
  training.
* `docstring_pairs(split)`: (function source without its docstring, first
  line of its docstring) for a supervised text-to-text task.

Documents (a pydoc topic, a docstring) are assigned to a split by a hash of
their first line, so docstrings that share a summary line share a split, and
the split does not depend on file order or machine. Paragraphs and code are
deduplicated, and validation keeps nothing that also occurs in train. Order
within a split is the sorted walk of the stdlib tree. The extracted corpora
are cached as JSON in `t5x_lite.core.cache.cache_dir()`.
"""

import ast
import functools
import hashlib
import json
import os
import re
import sys
import sysconfig
from collections.abc import Iterator
from typing import Any

import pydoc_data.topics

from t5x_lite.core import cache

SPLITS = ("train", "validation")
# Bump when extraction changes: it names the cache file.
CORPUS_VERSION = 3
# reST heading underlines such as "*******" or "=======".
_UNDERLINE = re.compile(r"([*=~^#+-])\1{2,}")
# One item in `_VALIDATION_BUCKETS` out of `_NUM_BUCKETS` goes to validation.
_NUM_BUCKETS = 100
_VALIDATION_BUCKETS = 5
_SKIPPED_DIRS = frozenset(
  {
    "__pycache__",
    "ensurepip",
    "idlelib",
    "lib2to3",
    "pydoc_data",
    "site-packages",
    "dist-packages",
    "tkinter",
    "turtledemo",
    "venv",
  }
)
# Docstring first lines outside this word range are too terse or too long to
# be a useful summary target.
_MIN_SUMMARY_WORDS, _MAX_SUMMARY_WORDS = 3, 24
# Functions longer than this (characters of source) are skipped.
_MAX_FUNCTION_CHARS = 4000


def split_of(text: str) -> str:
  """Returns the split ('train' or 'validation') that `text` belongs to."""
  bucket = int(hashlib.md5(text.encode("utf-8")).hexdigest(), 16) % _NUM_BUCKETS
  return "validation" if bucket < _VALIDATION_BUCKETS else "train"


def _check_split(split: str) -> None:
  if split not in SPLITS:
    raise ValueError(f"Unknown split {split!r}; the offline corpus has {SPLITS}.")


def _paragraphs(text: str) -> list[str]:
  """Splits text at blank lines; collapses whitespace; drops heading underlines."""
  paragraphs = []
  for block in text.split("\n\n"):
    lines = [line for line in block.splitlines() if not _UNDERLINE.fullmatch(line.strip())]
    flat = " ".join(" ".join(lines).split())
    if flat:
      paragraphs.append(flat)
  return paragraphs


def stdlib_files() -> list[str]:
  """Returns the standard library's .py files (tests and GUIs excluded), sorted."""
  root = sysconfig.get_paths()["stdlib"]
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS and not d.startswith("test"))
    for name in sorted(filenames):
      if name.endswith(".py") and not name.startswith("test_"):
        found.append(os.path.join(dirpath, name))
  return found


@functools.lru_cache(maxsize=None)
def _stdlib_trees() -> tuple[tuple[str, ast.Module], ...]:
  """Parses every stdlib file once per process: ((source, tree), ...)."""
  trees = []
  for path in stdlib_files():
    with open(path, encoding="utf-8") as f:
      source = f.read()
    try:
      trees.append((source, ast.parse(source)))
    except SyntaxError:
      continue  # A few files are templates or test data, not valid Python.
  return tuple(trees)


_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _stdlib_docstrings() -> Iterator[tuple[ast.AST, str]]:
  """Yields (node, cleaned docstring) for documented stdlib modules/classes/functions."""
  for _, tree in _stdlib_trees():
    for node in ast.walk(tree):
      if isinstance(node, _DOCUMENTED):
        docstring = ast.get_docstring(node)
        if docstring:
          yield node, docstring


def _first_line(text: str) -> str:
  return text.split("\n", 1)[0].strip()


def _document_split(document: str) -> str:
  """A document's split, decided by its first line.

  Docstrings that share a first line (the summary that
  `docstring_pairs` predicts) thus share a split.
  """
  return split_of(_first_line(document))


def _documents() -> Iterator[str]:
  """Pydoc topics, then stdlib docstrings: the units assigned to splits."""
  for topic in sorted(pydoc_data.topics.topics):
    yield pydoc_data.topics.topics[topic]
  for _, docstring in _stdlib_docstrings():
    yield docstring


def _prose_by_split() -> dict[str, list[str]]:
  """Paragraphs per split; a document's paragraphs all go to its split.

  A paragraph that also occurs in a train document is dropped from
  validation, and repeats are dropped, so the splits are disjoint.
  """
  by_split = {s: [] for s in SPLITS}
  for document in _documents():
    by_split[_document_split(document)].extend(_paragraphs(document))
  train = list(dict.fromkeys(by_split["train"]))
  seen = set(train)
  validation = [p for p in dict.fromkeys(by_split["validation"]) if p not in seen]
  return {"train": train, "validation": validation}


def prose(split: str) -> tuple[str, ...]:
  """Paragraphs of Python documentation for `split` ('train'/'validation')."""
  _check_split(split)
  return _corpus()["prose"][split]


def vocabulary_training_text() -> tuple[str, ...]:
  """Text the offline vocabulary is trained on: the train split of `prose`."""
  return prose("train")


def _summary_line(docstring: str) -> str | None:
  """First line of a docstring if it reads as a one-line summary, else None."""
  first = _first_line(docstring)
  num_words = len(first.split())
  if not _MIN_SUMMARY_WORDS <= num_words <= _MAX_SUMMARY_WORDS:
    return None
  return first


def _undocumented_source(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
  """Source of a function with its docstring statement removed."""
  body = node.body[1:] or [ast.Pass()]
  fields: dict[str, Any] = {**{f: getattr(node, f) for f in node._fields}, "body": body}
  stripped = type(node)(**fields)
  return ast.unparse(ast.fix_missing_locations(stripped))


def _pairs_by_split(train_prose: set[str]) -> dict[str, list[tuple[str, str]]]:
  """Pairs per split, assigned like their docstring in `prose`.

  Pairs are deduplicated by code; a validation pair whose summary is also
  a train paragraph is dropped, so validation targets are unseen text.
  """
  by_split = {s: [] for s in SPLITS}
  seen_code = set()
  for node, docstring in _stdlib_docstrings():
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      continue
    summary = _summary_line(docstring)
    if summary is None:
      continue
    code = _undocumented_source(node)
    if len(code) > _MAX_FUNCTION_CHARS or code in seen_code:
      continue
    seen_code.add(code)
    split = _document_split(docstring)
    if split == "validation" and summary in train_prose:
      continue
    by_split[split].append((code, summary))
  return by_split


def _build_corpus() -> bytes:
  """Extracts both corpora and serializes them as JSON."""
  prose_by_split = _prose_by_split()
  pairs_by_split = _pairs_by_split(set(prose_by_split["train"]))
  corpus = {"prose": prose_by_split, "pairs": pairs_by_split}
  return json.dumps(corpus, ensure_ascii=False).encode("utf-8")


@functools.lru_cache(maxsize=None)
def _corpus() -> dict[str, dict[str, tuple]]:
  """Loads the corpora, extracting them into the cache directory on first use.

  Extraction parses the whole standard library (seconds); the JSON cache file
  is keyed by the Python version, whose stdlib it was extracted from.
  """
  key = f"{CORPUS_VERSION}-{sys.version}"
  digest = hashlib.sha256(key.encode()).hexdigest()[:12]
  path = os.path.join(cache.cache_dir(), f"offline_corpus_{digest}.json")
  with open(cache.build_once(path, _build_corpus), encoding="utf-8") as f:
    corpus = json.load(f)
  return {
    "prose": {s: tuple(v) for s, v in corpus["prose"].items()},
    "pairs": {s: tuple(tuple(p) for p in v) for s, v in corpus["pairs"].items()},
  }


def docstring_pairs(split: str) -> tuple[tuple[str, str], ...]:
  """(function source without docstring, docstring summary line) for `split`."""
  _check_split(split)
  return _corpus()["pairs"][split]
