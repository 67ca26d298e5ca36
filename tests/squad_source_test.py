"""Several reference answers, from the file to the metric: the SQuAD JSON source, JSONL
list fields, `text_to_text(keep_features=...)`, `task_metrics.all_answers` and `squad`.

docs/new_task.md's question-answering registration runs as written on a tiny SQuAD-layout
fixture; seqio's evaluator then scores chosen predictions, so exact match and F1 are
checked against every answer of each question.
"""

import json
import re
from pathlib import Path

import gin
import numpy as np
import pytest
import seqio

from t5x_lite.data import file_sources, squad_source, task_metrics
from t5x_lite.data.file_sources import DataFileError

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "new_task.md"
# Two articles; the second question has three answers, the fourth none (SQuAD 2.0).
SQUAD = {
  "version": "1.1",
  "data": [
    {
      "title": "Cats",
      "paragraphs": [
        {
          "context": "The cat sat on the mat in the old house.",
          "qas": [
            {
              "id": "q1",
              "question": "Where did the cat sit?",
              "answers": [{"text": "on the mat", "answer_start": 8}],
            },
            {
              "id": "q2",
              "question": "Which house?",
              "answers": [
                {"text": "the old house", "answer_start": 26},
                {"text": "old house", "answer_start": 30},
                {"text": "house", "answer_start": 34},
              ],
            },
          ],
        }
      ],
    },
    {
      "title": "Dogs",
      "paragraphs": [
        {
          "context": "Dogs ran far away from home every day.",
          "qas": [
            {
              "id": "q3",
              "question": "How often?",
              "answers": [
                {"text": "every day", "answer_start": 28},
                {"text": "daily", "answer_start": 0},
              ],
            },
            {"id": "q4", "question": "What colour were they?", "answers": []},
          ],
        }
      ],
    },
  ],
}
ANSWERS = [["on the mat"], ["the old house", "old house", "house"], ["every day", "daily"], []]
# Per question: a prediction and its best exact match and F1 over the answers.
PREDICTIONS = ["on a mat", "House!", "each day", ""]
EXPECTED_EM = [1.0, 1.0, 0.0, 1.0]  # "on a mat" normalises to "on mat", as "on the mat" does
EXPECTED_F1 = [1.0, 1.0, 0.5, 1.0]  # "each day" vs "every day": 1 of 2 tokens


@pytest.fixture
def data_dir(tmp_path):
  (tmp_path / "squad").mkdir()
  for name in ("train-v1.1.json", "dev-v1.1.json"):
    (tmp_path / "squad" / name).write_text(json.dumps(SQUAD), encoding="utf-8")
  return tmp_path


def test_reads_one_record_per_question_with_every_answer(data_dir):
  records = squad_source.read_squad_json(str(data_dir / "squad" / "dev-v1.1.json"))
  assert records["id"] == ["q1", "q2", "q3", "q4"]
  assert records["title"] == ["Cats", "Cats", "Dogs", "Dogs"]
  assert records["answers"] == ANSWERS
  assert records["context"][2] == "Dogs ran far away from home every day."
  source = squad_source.SquadJsonSource({"validation": "squad/dev-v1.1.json"}, str(data_dir))
  [example, *_] = source.get_dataset("validation", shuffle=False).as_numpy_iterator()
  assert (
    example["answers"].tolist() == [b"on the mat"]
    and example["question"] == b"Where did the cat sit?"
  )
  assert source.num_input_examples("validation") == 4


def test_bad_files_are_named_with_the_path_inside_them(tmp_path):
  broken = dict(
    SQUAD,
    data=[{"title": "x", "paragraphs": [{"context": "c", "qas": [{"id": "a", "answers": []}]}]}],
  )
  path = tmp_path / "bad.json"
  path.write_text(json.dumps(broken))
  with pytest.raises(
    DataFileError,
    match=re.escape(f"{path}: data[0].paragraphs[0].qas[0]: missing field 'question'"),
  ):
    squad_source.read_squad_json(str(path))
  path.write_text('{"data": [}')
  with pytest.raises(DataFileError, match=re.escape(f"{path}:1: invalid JSON")):
    squad_source.read_squad_json(str(path))


def test_jsonl_list_policy_keeps_joins_or_cuts_a_list(tmp_path):
  path = tmp_path / "qa.jsonl"
  rows = [
    {"q": "a?", "answers": ["x y", "z"]},
    {"q": "b?", "answers": "w"},
    {"q": "c?", "answers": []},
  ]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  kept = file_sources.read_jsonl(
    str(path), {"question": "q", "answers": "answers"}, {"answers": "all"}
  )
  assert kept["answers"] == [["x y", "z"], ["w"], []]
  source = file_sources.JsonlSource(
    {"train": str(path)}, {"answers": "answers"}, {"answers": "all"}
  )
  assert [
    x["answers"].tolist() for x in source.get_dataset("train", shuffle=False).as_numpy_iterator()
  ] == [
    [b"x y", b"z"],
    [b"w"],
    [],
  ]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
  assert file_sources.read_jsonl(str(path), {"a": "answers"})["a"] == ["x y z", "w"]
  assert file_sources.read_jsonl(str(path), {"a": "answers"}, {"answers": "first"})["a"] == [
    "x y",
    "w",
  ]
  path.write_text(json.dumps(rows[2]) + "\n")
  with pytest.raises(
    DataFileError, match=rf"{path}:1: field 'answers': expected a string or a non-empty list"
  ):
    file_sources.read_jsonl(str(path), {"a": "answers"})


def test_squad_scores_against_the_best_of_all_answers():
  metrics = task_metrics.squad(ANSWERS, PREDICTIONS)
  assert metrics["em"] == pytest.approx(100 * np.mean(EXPECTED_EM))
  assert metrics["f1"] == pytest.approx(100 * np.mean(EXPECTED_F1))
  first_only = task_metrics.squad([a[:1] for a in ANSWERS], PREDICTIONS)
  assert first_only["f1"] < metrics["f1"]  # "House!" only matches the third answer fully


def _guide_qa_block() -> str:
  text = GUIDE.read_text()
  section = text[text.index("### Several reference answers: question answering") :]
  start = section.index("```python\n") + len("```python\n")
  return section[start : section.index("\n```", start)]


@pytest.mark.usefixtures("clean_gin")
def test_guide_task_carries_every_answer_to_the_metric(data_dir):
  import functools

  from t5x_lite.data import preprocessors

  name = "my_squad"
  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  exec(
    _guide_qa_block(),
    {
      "seqio": seqio,
      "functools": functools,
      "preprocessors": preprocessors,
      "task_metrics": task_metrics,
    },
  )
  gin.bind_parameter("local_data_dir.path", str(data_dir))
  task = seqio.get_mixture_or_task(name)
  [train] = (
    task.get_dataset({"inputs": 64, "targets": 8}, split="train", shuffle=False)
    .take(1)
    .as_numpy_iterator()
  )
  assert (
    train["inputs_pretokenized"]
    == b"question: Where did the cat sit? context: The cat sat on the mat in the old house."
  )
  assert train["targets_pretokenized"] == b"on the mat" and train["answers"].tolist() == [
    b"on the mat"
  ]

  vocabulary = task.output_features["targets"].vocabulary
  evaluator = seqio.Evaluator(
    name,
    seqio.EncDecFeatureConverter(pack=False),
    eval_split="validation",
    sequence_length={"inputs": 64, "targets": 8},
  )

  def predict(dataset, *args):
    """Each question's chosen prediction, as the model's decodes: [8] ids, 0-padded."""
    del args
    out = []
    for i, _ in dataset.as_numpy_iterator():
      ids = vocabulary.encode(PREDICTIONS[int(i)])
      out.append((int(i), np.pad(np.asarray(ids, np.int32), (0, 8 - len(ids)))))
    return out

  metrics, _ = evaluator.evaluate(compute_metrics=True, predict_fn=predict)
  result = metrics.result()[name]
  assert result["em"] == pytest.approx(100 * np.mean(EXPECTED_EM))
  assert result["f1"] == pytest.approx(100 * np.mean(EXPECTED_F1))
  seqio.TaskRegistry.remove(name)
