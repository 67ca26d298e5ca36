"""Command-line plumbing shared by the train / eval / infer entry points.

T5X-style flags:

  --gin_file=FILE           repeatable; found directly or under --gin_search_paths
  --gin_bindings='A.b = 1'  repeatable
  --gin.NAME=VALUE          shorthand, rewritten to --gin_bindings='NAME = VALUE'
                            before absl parses argv. VALUE is used as written when it
                            is a Python literal or a gin reference (@fn, %MACRO);
                            anything else is taken as a string, so
                            --gin.MODEL_DIR=./runs/x works without quoting.
  --gin_search_paths=a,b    default: the repository's gin/ and gin/models/ (paths
                            relative to the working directory are tried first)
                            (so `include 't5_1_1/small.gin'` works)
  --tfds_data_dir=DIR       seqio/TFDS data directory override
  --data_dir=DIR            directory of local-file tasks (gin local_data_dir.path)
  --coordinator_address, --process_count, --process_index
                            multi-host: passed to jax.distributed.initialize

`run` also adds `CPU_XLA_FLAGS` to XLA_FLAGS (see there) unless XLA_FLAGS sets them.

Use:  `cli.run(main)` in an entry point; `main` calls `cli.setup()` first.
"""

from __future__ import annotations

import ast
import logging as logging_std
import os
import sys
from collections.abc import Callable, Sequence

import gin
import jax
import seqio
from absl import app, flags, logging

REPO_GIN_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gin")
DEFAULT_GIN_SEARCH_PATHS = (REPO_GIN_DIR, os.path.join(REPO_GIN_DIR, "models"))
_GIN_SHORTHAND = "--gin."
# Library sources whose INFO logs are dropped (their warnings still show).
QUIET_LIBRARY_PATHS = (f"{os.sep}orbax{os.sep}", f"{os.sep}seqio{os.sep}",
                       f"{os.sep}tensorflow{os.sep}")
# Warnings that are expected in normal use: restoring one item (params) of a
# step directly from its item directory, which has no step metadata file.
SILENT_MESSAGES = ("Metadata file does not exist",)
# gin's package-path file reader logs an ERROR for every search path that does
# not hold a file, although the next one does; those records are dropped.
SILENT_LIBRARY_PATHS = (os.path.join("gin", "resource_reader.py"),)

# XLA:CPU options `run` adds to XLA_FLAGS, before jax starts a backend, unless
# XLA_FLAGS already names them (other backends ignore xla_cpu_* options).
# YNNPACK's reduce fusion is slow on leading-axis sums: in a T5 1.1 small train step
# (batch 8, 512/114, 2 cores) the relative-bias gradient, a sum over batch and layers
# of [8, 6, 512, 512], took 1.9 s of 15 s; XLA's own reduction loops take ~0.1 s.
# YNNPACK keeps the dots and elementwise fusions (tools/benchmark.py, README).
CPU_XLA_FLAGS = {"xla_cpu_experimental_ynn_fusion_type": "-reduce"}

FLAGS = flags.FLAGS
flags.DEFINE_multi_string("gin_file", [], "Gin config file(s), parsed in order.")
flags.DEFINE_multi_string("gin_bindings", [], "Gin bindings, applied after the files.")
flags.DEFINE_list("gin_search_paths", list(DEFAULT_GIN_SEARCH_PATHS),
                  "Directories searched for --gin_file and gin `include`s.")
flags.DEFINE_string("tfds_data_dir", None, "Overrides the TFDS data dir of seqio tasks.")
flags.DEFINE_string("data_dir", None,
                    "Directory of local-file tasks; shorthand for --gin.local_data_dir.path.")
flags.DEFINE_string("coordinator_address", None, "Multi-host: 'host:port' of process 0.")
flags.DEFINE_integer("process_count", None, "Multi-host: number of processes.")
flags.DEFINE_integer("process_index", None, "Multi-host: index of this process.")


def _gin_value(value: str) -> str:
  """`value` itself if gin can read it as written, else a quoted string."""
  stripped = value.strip()
  if stripped.startswith(("@", "%")):
    return stripped
  try:
    ast.literal_eval(stripped)
    return stripped
  except (ValueError, SyntaxError):
    return repr(value)


def rewrite_gin_args(argv: Sequence[str]) -> list[str]:
  """Rewrites `--gin.NAME=VALUE` arguments into `--gin_bindings=NAME = VALUE`.

  Args:
    argv: full argv (program name first).

  Returns:
    argv with every shorthand replaced; other arguments untouched.

  Raises:
    ValueError: for `--gin.NAME` without `=VALUE`.
  """
  rewritten = []
  for arg in argv:
    if not arg.startswith(_GIN_SHORTHAND):
      rewritten.append(arg)
      continue
    name, sep, value = arg[len(_GIN_SHORTHAND):].partition("=")
    if not sep or not name:
      raise ValueError(f"Expected --gin.NAME=VALUE, got {arg!r}")
    rewritten.append(f"--gin_bindings={name} = {_gin_value(value)}")
  return rewritten


def parse_gin(
    gin_files: Sequence[str],
    bindings: Sequence[str],
    search_paths: Sequence[str] = DEFAULT_GIN_SEARCH_PATHS,
) -> None:
  """Parses gin files then bindings; unknown names raise naming the binding.

  Import every module whose configurables the files name before calling this.

  Args:
    gin_files: files, absolute/relative or relative to a search path.
    bindings: 'NAME = VALUE' strings.
    search_paths: directories for files and `include` statements.
  """
  for path in search_paths:
    gin.add_config_file_search_path(path)  # a repeated path is harmless
  gin.parse_config_files_and_bindings(list(gin_files), list(bindings), finalize_config=False)


def initialize_distributed() -> None:
  """Calls jax.distributed.initialize when multi-host flags are given."""
  given = [FLAGS.coordinator_address, FLAGS.process_count, FLAGS.process_index]
  if all(v is None for v in given):
    return
  if any(v is None for v in given):
    raise app.UsageError(
        "--coordinator_address, --process_count and --process_index go together.")
  jax.distributed.initialize(
      coordinator_address=FLAGS.coordinator_address,
      num_processes=FLAGS.process_count,
      process_id=FLAGS.process_index,
  )
  logging.info("Process %d of %d", jax.process_index(), jax.process_count())


class _QuietLibraryInfo(logging_std.Filter):
  """Drops INFO/DEBUG records of chatty libraries (orbax logs every file it writes)."""

  def filter(self, record: logging_std.LogRecord) -> bool:
    """False for records to drop."""
    if any(part in record.pathname for part in SILENT_LIBRARY_PATHS):
      return False
    if any(str(record.msg).startswith(m) for m in SILENT_MESSAGES):
      return False
    if record.levelno >= logging_std.WARNING:
      return True
    return not any(part in record.pathname for part in QUIET_LIBRARY_PATHS)


def setup() -> None:
  """Multi-host init, TFDS dir, gin parsing: the first call of an entry point."""
  logging.get_absl_handler().addFilter(_QuietLibraryInfo())
  initialize_distributed()
  if FLAGS.tfds_data_dir:
    seqio.set_tfds_data_dir_override(FLAGS.tfds_data_dir)
  bindings = list(FLAGS.gin_bindings)
  if FLAGS.data_dir:
    bindings.append(f"local_data_dir.path = {FLAGS.data_dir!r}")
  parse_gin(FLAGS.gin_file, bindings, FLAGS.gin_search_paths)


def add_cpu_xla_flags(environ: dict[str, str] | None = None) -> str:
  """Appends `CPU_XLA_FLAGS` that XLA_FLAGS does not set yet; returns the new value.

  Takes effect only if called before jax initialises its backends.
  """
  environ = os.environ if environ is None else environ
  current = environ.get("XLA_FLAGS", "")
  added = [f"--{name}={value}" for name, value in CPU_XLA_FLAGS.items()
           if f"--{name}=" not in current]
  environ["XLA_FLAGS"] = " ".join([current.strip()] + added).strip()
  return environ["XLA_FLAGS"]


def run(main: Callable[[Sequence[str]], None], argv: Sequence[str] | None = None) -> None:
  """`absl.app.run(main)` with the `--gin.NAME=VALUE` shorthand rewritten and
  `CPU_XLA_FLAGS` added to XLA_FLAGS."""
  add_cpu_xla_flags()
  app.run(main, argv=rewrite_gin_args(sys.argv if argv is None else argv))
