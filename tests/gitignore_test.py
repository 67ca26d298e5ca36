"""`.gitignore` keeps what the guides (README.md, docs/) have a user create out of
`git add -A`: their data and outputs, not their task code."""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA_AND_OUTPUTS = (
  "my_data/train.tsv",
  "my_data/dev.tsv",
  "runs/quickstart/100/params",
  "inputs.jsonl",
  "prompts.jsonl",
  "reviews.jsonl",
  "corpus.txt",
  "my.model",
)
CODE = ("my_tasks.py", "my_sentiment.gin", "tasks/local.py", "docs/python_api.md")


def _ignored(path: str) -> bool:
  git = shutil.which("git")
  if git is None or not (ROOT / ".git").exists():
    pytest.fail("needs git and a git checkout (a clone of the repository)")
  result = subprocess.run(
    [git, "check-ignore", "--no-index", "-q", path], cwd=ROOT, capture_output=True, check=False
  )
  assert result.returncode in (0, 1), result.stderr
  return result.returncode == 0


def test_data_and_outputs_are_ignored_and_code_is_not():
  assert [p for p in DATA_AND_OUTPUTS if not _ignored(p)] == []
  assert [p for p in CODE if _ignored(p)] == []
