"""Tests of the gin flags and gin parsing shared by entry points and tools.

The module under test is t5x_lite.core.gin_config.
"""

import glob
import os
import subprocess
import sys

import gin
import pytest
from absl import flags

from t5x_lite.core import errors, gin_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_imports_neither_seqio_nor_tensorflow_nor_jax():
  # Tools that only need a gin-configured network (tools/model_info.py) rely on this.
  code = (
    "import sys, t5x_lite.core.gin_config; "
    "print(sorted(m for m in sys.modules if m.startswith(('seqio', 'tensorflow', 'jax'))))"
  )
  result = subprocess.run(
    [sys.executable, "-c", code],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
    check=True,
  )
  assert result.stdout.strip() == "[]", result.stdout


def test_gin_shorthand_is_rewritten_into_bindings():
  argv = gin_config.rewrite_gin_args(["prog", "--gin.MODEL_DIR=./runs/x", "--gin.TRAIN_STEPS=5"])
  assert argv == ["prog", "--gin_bindings=MODEL_DIR = './runs/x'", "--gin_bindings=TRAIN_STEPS = 5"]


def test_gin_includes_resolve_beside_a_runs_folder(tmp_path, monkeypatch):
  # `python -m` puts the working directory on sys.path; the quickstart leaves ./runs/
  # there, which made gin's package-resource lookup of 'runs/finetune.gin' crash.
  (tmp_path / "runs" / "quickstart").mkdir(parents=True)
  monkeypatch.chdir(tmp_path)
  monkeypatch.syspath_prepend(str(tmp_path))
  gin.clear_config()
  try:
    gin_config.parse_gin(["quickstart_finetune.gin"], [])
    assert gin.query_parameter("%MODEL_DIR") == "./runs/quickstart_ft"
  finally:
    gin.clear_config()


def test_gin_errors_name_the_file_or_binding():
  gin.clear_config()
  with pytest.raises(errors.ConfigError, match="gin file not found: no_such.gin"):
    gin_config.parse_gin(["no_such.gin"], [])
  with pytest.raises(errors.ConfigError, match="No configurable matching 'Nope'.*Nope.x = 1"):
    gin_config.parse_gin(["quickstart.gin"], ["Nope.x = 1"])
  gin.clear_config()


def test_required_macro_reset_by_a_later_file_is_named():
  # runs/finetune.gin includes runs/pretrain.gin, which sets TASK_FEATURE_LENGTHS and
  # INITIAL_CHECKPOINT_PATH back to %gin.REQUIRED after quickstart.gin set the former.
  gin.clear_config()
  try:
    gin_config.parse_gin(["quickstart.gin", "runs/finetune.gin"], [])
    with pytest.raises(
      errors.ConfigError, match=r"INITIAL_CHECKPOINT_PATH, .*TASK_FEATURE_LENGTHS"
    ):
      gin_config.check_required_macros()
    gin.clear_config()
    gin_config.parse_gin(["quickstart.gin"], [])
    gin_config.check_required_macros()  # everything set
    gin.clear_config()
    gin_config.parse_gin(
      ["runs/pretrain.gin"], ["MIXTURE_OR_TASK_NAME = 'x'", "TASK_FEATURE_LENGTHS = {'inputs': 8}"]
    )
    gin_config.check_required_macros(optional=("MODEL_DIR", "TRAIN_STEPS"))  # --precompile
    with pytest.raises(errors.ConfigError, match="MODEL_DIR, TRAIN_STEPS are required"):
      gin_config.check_required_macros()
  finally:
    gin.clear_config()


def test_gin_shorthand_values_are_literals_references_or_strings():
  argv = gin_config.rewrite_gin_args(
    ["prog", "--gin.A=1.5", "--gin.B=@adamw()", "--gin.C=%D", "--gin.E=bf16", "--gin.F='x'"]
  )
  assert argv[1:] == [
    "--gin_bindings=A = 1.5",
    "--gin_bindings=B = @adamw()",
    "--gin_bindings=C = %D",
    "--gin_bindings=E = 'bf16'",
    "--gin_bindings=F = 'x'",
  ]
  with pytest.raises(errors.ConfigError, match="Expected --gin.NAME=VALUE"):
    gin_config.rewrite_gin_args(["prog", "--gin.A"])


def test_every_gin_file_of_the_repository_parses():
  paths = sorted(glob.glob(os.path.join(REPO, "gin", "**", "*.gin"), recursive=True))
  assert len(paths) >= 10
  for path in paths:
    gin.clear_config()
    gin_config.parse_gin([path], [])
  gin.clear_config()


def test_parse_gin_flags_reads_files_bindings_and_extra_bindings():
  gin.clear_config()
  flags.FLAGS.unparse_flags()
  flags.FLAGS(["prog", "--gin_bindings=MODEL_DIR = 'a'"])
  try:
    # No --gin_file: the default file; the extra binding comes last and wins.
    gin_config.parse_gin_flags(["quickstart.gin"], ["TRAIN_STEPS = 7"])
    assert gin.query_parameter("%MODEL_DIR") == "a"
    assert gin.query_parameter("%TRAIN_STEPS") == 7
    gin.clear_config()
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["prog", "--gin_file=no_such.gin"])
    with pytest.raises(errors.ConfigError, match="gin file not found: no_such.gin"):
      gin_config.parse_gin_flags(["quickstart.gin"])
  finally:
    flags.FLAGS.unparse_flags()
    gin.clear_config()
