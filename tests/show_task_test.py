"""Tests for tools/show_task.py (a subprocess for the CLI, in-process for lookups)."""

import functools
import importlib.util
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("T5X_LITE_CACHE", os.path.join(tempfile.gettempdir(), "t5x_lite_test_cache"))

import pytest  # noqa: E402

import tasks  # noqa: E402,F401
from t5x_lite.core.errors import ConfigError  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.lru_cache(maxsize=None)
def _load_tool():
  """Imports tools/show_task.py once (its absl flags can only be defined once)."""
  spec = importlib.util.spec_from_file_location(
    "show_task", os.path.join(REPO, "tools", "show_task.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "tools/show_task.py", *args],
    cwd=REPO,
    env=dict(os.environ, **(env or {})),
    capture_output=True,
    text=True,
    timeout=300,
  )


@pytest.mark.slow
def test_list_prints_every_task_and_mixture():
  result = _run("--list")
  assert result.returncode == 0, result.stderr[-3000:]
  names = result.stdout.split()
  # A fresh process: this one's registry also holds tasks other test modules added.
  registered = subprocess.run(
    [
      sys.executable,
      "-c",
      "import seqio, tasks; print(*seqio.TaskRegistry.names(), *seqio.MixtureRegistry.names())",
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
    check=True,
  ).stdout.split()
  assert names == sorted(set(registered))
  assert {"quickstart", "cpython_span_corruption", "glue_v2", "local_glue_sst2"} <= set(names)


@pytest.mark.slow
def test_shows_each_stage_of_a_mixture():
  result = _run("quickstart", "--num_examples", "1", "--sequence_length", "inputs=64,targets=16")
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  assert "cpython_span_corruption: 0." in out and "cpython_code_to_docstring: 0." in out
  assert "preprocessed text and tokens" in out and "pieces:" in out
  assert "after EncDecFeatureConverter(pack=True)" in out
  assert "encoder_segment_ids" in out and "decoder_positions" in out


def test_shows_raw_records_of_a_task(capsys):
  tool = _load_tool()
  lengths = tool.parse_sequence_length("inputs=64,targets=16")
  assert lengths == {"inputs": 64, "targets": 16}
  with pytest.raises(ConfigError, match="name=int"):
    tool.parse_sequence_length("inputs:64")
  tool.show("cpython_code_to_docstring", 1, "validation", lengths, seed=0, truncation_examples=20)
  out = capsys.readouterr().out
  assert "raw records (cpython_code_to_docstring, validation)" in out
  assert "code: 'def " in out and "inputs_pretokenized: 'summarize python: def " in out
  assert (
    "== truncation at --sequence_length (the first 20 examples of each task's 'validation' "
    "split, or all if fewer)" in out
  )
  assert "cpython_code_to_docstring: " in out and " of 20 examples (" in out
  assert "have inputs longer than 64 tokens and are truncated" in out
  assert "have targets longer than 16 tokens and are truncated" in out


def test_a_language_model_task_shows_decoder_only_features(capsys):
  tool = _load_tool()
  lengths = {"inputs": 64, "targets": 24}  # the LM task reads targets alone
  tool.show("cpython_lm", 1, "validation", lengths, seed=0, truncation_examples=5)
  out = capsys.readouterr().out
  assert "== after DecoderFeatureConverter(pack=True)" in out
  assert "decoder_segment_ids: [1, 1" in out and "encoder_input_tokens" not in out


def test_unknown_name_or_split_lists_the_choices():
  tool = _load_tool()
  with pytest.raises(ConfigError, match="'quickstrat' \\(closest: quickstart"):
    tool.show("quickstrat", 1, "train", {"inputs": 8, "targets": 8}, seed=0)
  with pytest.raises(ConfigError, match="glue_sst2_v2"):
    tool.show("glue_sst_v2", 1, "train", {"inputs": 8, "targets": 8}, seed=0)
  with pytest.raises(ConfigError, match="quickstart has no split 'dev'; it has"):
    tool.show("quickstart", 1, "dev", {"inputs": 8, "targets": 8}, seed=0)


@pytest.mark.slow
def test_missing_feature_is_one_error_line(tmp_path):
  (tmp_path / "train.tsv").write_text("sentence\tlbl\ngood\t1\n")
  (tmp_path / "show_task_test_tasks.py").write_text(
    "import functools, seqio\n"
    "from t5x_lite.data import file_sources, preprocessors\n"
    "seqio.TaskRegistry.add('show_task_test_sentiment',\n"
    "    source=file_sources.TsvSource({'train': 'train.tsv'}),\n"
    "    preprocessors=preprocessors.supervised_preprocessors(functools.partial(\n"
    "        preprocessors.text_to_text, prefix='s', feature_names=('sentence',))),\n"
    "    output_features=preprocessors.text_to_text_features(), metric_fns=[])\n"
  )
  result = _run(
    "show_task_test_sentiment",
    "--module_import=show_task_test_tasks",
    f"--data_dir={tmp_path}",
    env={"PYTHONPATH": str(tmp_path)},
  )
  assert result.returncode == 1, result.stderr[-3000:]
  errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
  assert errors == [
    "ERROR: Task show_task_test_sentiment: preprocessor text_to_text asks for feature "
    "'label', but the source has columns ['sentence', 'lbl']"
  ]
  assert "Traceback" not in result.stderr
