"""Tests of the shared entry-point flags (t5x_lite.cli)."""

import gin
from absl import flags

import tasks  # noqa: F401  (registers local_data_dir through tasks.local)
from t5x_lite import cli, file_sources


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


def test_gin_shorthand_is_rewritten_into_bindings():
  argv = cli.rewrite_gin_args(["prog", "--gin.MODEL_DIR=./runs/x", "--gin.TRAIN_STEPS=5"])
  assert argv == ["prog", "--gin_bindings=MODEL_DIR = './runs/x'",
                  "--gin_bindings=TRAIN_STEPS = 5"]


def test_cpu_xla_flags_are_added_without_overriding_the_users():
  environ = {}
  assert cli.add_cpu_xla_flags(environ) == "--xla_cpu_experimental_ynn_fusion_type=-reduce"
  environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  assert cli.add_cpu_xla_flags(environ).split() == [
      "--xla_force_host_platform_device_count=8",
      "--xla_cpu_experimental_ynn_fusion_type=-reduce"]
  # A value the user chose is kept, and a second call adds nothing.
  environ = {"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type="}
  assert cli.add_cpu_xla_flags(environ) == "--xla_cpu_experimental_ynn_fusion_type="
  assert cli.add_cpu_xla_flags(environ) == "--xla_cpu_experimental_ynn_fusion_type="
