"""Tests of the shared entry-point flags (t5x_lite.cli)."""

import os
import subprocess
import sys

import gin
import pytest
from absl import app, flags

import tasks  # noqa: F401  (registers local_data_dir through tasks.local)
from t5x_lite import cli
from t5x_lite.core import errors
from t5x_lite.data import file_sources, pipeline

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_data_dir_flag_sets_local_data_dir(tmp_path):
  gin.clear_config()
  flags.FLAGS.unparse_flags()
  flags.FLAGS(["prog", f"--data_dir={tmp_path}", "--gin_file=quickstart.gin"])
  try:
    cli.setup()
    path, _ = file_sources.local_data_dir()
    assert path == str(tmp_path)
  finally:
    flags.FLAGS.unparse_flags()
    gin.clear_config()


def test_task_modules_are_found_in_the_working_directory(tmp_path, monkeypatch):
  # A tool run as `python tools/x.py` has tools/ on sys.path, not the working directory.
  (tmp_path / "cli_test_user_tasks.py").write_text("REGISTERED = True\n")
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
  pipeline.import_task_modules(["cli_test_user_tasks"])
  assert sys.modules["cli_test_user_tasks"].REGISTERED
  with pytest.raises(errors.ConfigError, match="no module 'cli_test_no_such_module'"):
    pipeline.import_task_modules(["cli_test_no_such_module"])
  # T5X's gin macro names the module too.
  (tmp_path / "cli_test_macro_tasks.py").write_text("REGISTERED = True\n")
  gin.clear_config()
  flags.FLAGS.unparse_flags()
  flags.FLAGS(
    [
      "prog",
      "--gin_file=quickstart.gin",
      "--gin_bindings=MIXTURE_OR_TASK_MODULE = 'cli_test_macro_tasks'",
    ]
  )
  try:
    cli.setup()
    assert sys.modules["cli_test_macro_tasks"].REGISTERED
  finally:
    flags.FLAGS.unparse_flags()
    gin.clear_config()


def test_gin_entry_point_sets_up_then_runs():
  calls = []

  def run():
    calls.append(gin.query_parameter("%TRAIN_STEPS"))

  main = cli.gin_entry_point(run)
  gin.clear_config()
  flags.FLAGS.unparse_flags()
  flags.FLAGS(["prog", "--gin_file=quickstart.gin", "--gin_bindings=TRAIN_STEPS = 3"])
  try:
    with pytest.raises(app.UsageError, match="Unexpected arguments: extra args"):
      main(["prog", "extra", "args"])
    assert calls == []
    main(["prog"])
    assert calls == [3]  # gin was parsed before `run`
  finally:
    flags.FLAGS.unparse_flags()
    gin.clear_config()


@pytest.mark.slow
@pytest.mark.parametrize(
  "args, message",
  [
    (
      ["--gin_file=quickstart.gin", "--gin.train.total_stpes=3"],
      "ERROR: Configurable 'train' doesn't have a parameter named 'total_stpes'",
    ),
    (
      ["--gin_file=quickstart.gin", "--gin_file=runs/finetune.gin"],
      "ERROR: gin macros INITIAL_CHECKPOINT_PATH, MIXTURE_OR_TASK_NAME, MODEL_DIR, "
      "TASK_FEATURE_LENGTHS, TRAIN_STEPS are required (%gin.REQUIRED) but never set",
    ),
    (["--gin_file=no_such.gin"], "ERROR: gin file not found: no_such.gin"),
    (
      ["--gin_file=quickstart.gin", "--gin.T5Config.attention_logits_dtype='fp8'"],
      "ERROR: T5Config.attention_logits_dtype must be one of",
    ),
    (
      ["--gin_file=quickstart.gin", "--module_import=cli_test_no_such_module"],
      "ERROR: --module_import=cli_test_no_such_module: no module",
    ),
  ],
)
def test_entry_point_reports_bad_input_in_one_line(tmp_path, args, message):
  (tmp_path / "runs").mkdir()
  result = subprocess.run(
    [sys.executable, "-m", "t5x_lite.train", *args],
    cwd=tmp_path,
    capture_output=True,
    text=True,
    timeout=300,
    env=dict(os.environ, PYTHONPATH=REPO),
  )
  assert result.returncode == 1, result.stderr[-2000:]
  assert "Traceback" not in result.stderr, result.stderr[-2000:]
  assert result.stderr.strip().splitlines()[-1].startswith(message), result.stderr[-2000:]
