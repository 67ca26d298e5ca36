"""The official SQuAD JSON layout as a seqio source: one example per question.

SQuAD v1.1's `train-v1.1.json` / `dev-v1.1.json` (and v2.0's files) nest questions
inside paragraphs inside articles:

  {"version": "1.1", "data": [{"title": ..., "paragraphs": [{"context": ...,
    "qas": [{"id": ..., "question": ..., "answers": [{"text": ..., "answer_start": n}, ...]}]}]}]}

`SquadJsonSource` reads that file as it is published (no conversion script) into the
string features `id`, `title`, `context`, `question` and the list feature `answers`:
every acceptable answer text of the question, in file order (a variable-length string
tensor). Keep `answers` through preprocessing (`preprocessors.text_to_text(...,
keep_features=('answers',))`) and let the postprocessor hand the whole list to the
metric (`task_metrics.all_answers`), so `task_metrics.squad` scores exact match and F1
against the best of them, as the official script does.
"""

import json
from collections.abc import Mapping
from typing import Any, Optional

import tensorflow as tf

from t5x_lite.data.file_sources import Columns, DataFileError, FileRecordsSource

FEATURES = ("id", "title", "context", "question", "answers")


def _field(node: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
  """`node[key]`, checked to be a `kind`; errors name the path inside the file."""
  if not isinstance(node, dict) or key not in node:
    raise DataFileError(f"{where}: missing field '{key}'.")
  value = node[key]
  if not isinstance(value, kind):
    kinds = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
    raise DataFileError(f"{where}.{key}: expected a {kinds}, got {value!r:.80}.")
  return value


def read_squad_json(path: str) -> Columns:
  """Reads a SQuAD-layout JSON file: one record per question.

  Args:
    path: the file (local or gs://).

  Returns:
    {'id', 'title', 'context', 'question': [strings], 'answers': [lists of strings]}.
    A question without answers (SQuAD 2.0's unanswerable ones) has an empty list.

  Raises:
    DataFileError: invalid JSON, or a missing or mistyped field, named by its path
      in the file, e.g. `dev.json: data[3].paragraphs[0].qas[2]: missing field 'question'`.
  """
  with tf.io.gfile.GFile(path, "r") as f:
    try:
      document = json.loads(f.read().removeprefix("\ufeff"))
    except json.JSONDecodeError as e:
      raise DataFileError(f"{path}:{e.lineno}: invalid JSON ({e.msg}).") from e
  out: dict[str, list[Any]] = {name: [] for name in FEATURES}  # answers: lists of strings
  for a, article in enumerate(_field(document, "data", list, path)):
    where = f"{path}: data[{a}]"
    title = article.get("title", "") if isinstance(article, dict) else ""
    for p, paragraph in enumerate(_field(article, "paragraphs", list, where)):
      at = f"{where}.paragraphs[{p}]"
      context = _field(paragraph, "context", str, at)
      for q, qa in enumerate(_field(paragraph, "qas", list, at)):
        here = f"{at}.qas[{q}]"
        answers = _field(qa, "answers", list, here)
        out["id"].append(str(_field(qa, "id", (str, int), here)))
        out["title"].append(str(title))
        out["context"].append(context)
        out["question"].append(_field(qa, "question", str, here))
        out["answers"].append(
          [_field(answer, "text", str, f"{here}.answers[{i}]") for i, answer in enumerate(answers)]
        )
  return out


class SquadJsonSource(FileRecordsSource):
  """SQuAD-layout JSON files per split, e.g. {'validation': 'squad/dev-v1.1.json'}.

  Features: `id`, `title`, `context`, `question` (strings) and `answers` (every
  answer text of the question, a variable-length string tensor); see `read_squad_json`.

  Args:
    split_to_file: {split: file name (relative to the data dir, or absolute)}.
    data_dir: directory for relative names; None uses `file_sources.local_data_dir()`.
  """

  def __init__(self, split_to_file: Mapping[str, str], data_dir: Optional[str] = None):
    super().__init__(
      {split: [name] for split, name in split_to_file.items()},
      lambda paths: read_squad_json(paths[0]),
      data_dir,
    )
