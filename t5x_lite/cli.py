"""Command-line plumbing shared by the train / eval / infer entry points.

T5X-style flags: --gin_file, --gin_bindings, --gin.NAME=VALUE and
--gin_search_paths (defined, with gin parsing, in `t5x_lite.core.gin_config`), and

  --tfds_data_dir=DIR       seqio/TFDS data directory override
  --data_dir=DIR            directory of local-file tasks (gin local_data_dir.path)
  --coordinator_address, --process_count, --process_index
                            multi-host: passed to jax.distributed.initialize

`run` also adds `CPU_XLA_FLAGS` to XLA_FLAGS (see there) unless XLA_FLAGS sets them.

Use:  `cli.run(main)` in an entry point; `main` calls `cli.setup()` first
(`gin_entry_point(run)` is such a `main`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import gin
import jax
from absl import app, flags, logging

from t5x_lite.core import console
from t5x_lite.core.errors import ConfigError
from t5x_lite.core.gin_config import check_required_macros, parse_gin_flags, resolved_macro, run_app

# How gin's RuntimeError for an unbound `gin.REQUIRED` Python default begins.
_GIN_MISSING_BINDINGS = "Required bindings for"
# T5X's gin macro for the module(s) that register the run's tasks.
TASK_MODULE_MACRO = "MIXTURE_OR_TASK_MODULE"
# XLA:CPU options `run` adds to XLA_FLAGS, before jax starts a backend, unless
# XLA_FLAGS already names them (docs/performance.md, "Without XLA:CPU's tree reduction
# rewriter").
# - YNNPACK's reduce fusion is slow on leading-axis sums: in a T5 1.1 small train step
#   (batch 8, 512/114, 2 cores) the relative-bias gradient, a sum over batch and layers
#   of [8, 6, 512, 512], took 1.9 s of 15 s; XLA's own reduction loops take ~0.1 s.
#   YNNPACK keeps the dots and elementwise fusions. Other backends ignore xla_cpu_*.
# - XLA:CPU's tree_reduction_rewriter splits each long reduction into windows of 32,
#   which stops XLA from fusing it with its producers: a softmax over [8, 6, 512, 512]
#   takes 14 ms with it and 7.7 without, and train and decode steps are 4-9% faster
#   without it (RMSNorm's scale gradient, the one sum it sped up, is a matmul on CPU).
#   GPU's passes are named tree-reduction-rewriter and gpu-tree-reduction-rewriter; a
#   softmax-and-sums program compiled for a v5e slice came out the same to the byte.
CPU_XLA_FLAGS = {
  "xla_cpu_experimental_ynn_fusion_type": "-reduce",
  "xla_disable_hlo_passes": "tree_reduction_rewriter",
}

FLAGS = flags.FLAGS
flags.DEFINE_string("tfds_data_dir", None, "Overrides the TFDS data dir of seqio tasks.")
flags.DEFINE_multi_string(
  "module_import",
  [],
  "Module(s) that register seqio tasks, e.g. my_tasks for ./my_tasks.py; imported "
  "before the gin files are parsed, from the working directory or PYTHONPATH.",
)
flags.DEFINE_string(
  "data_dir", None, "Directory of local-file tasks; shorthand for --gin.local_data_dir.path."
)
flags.DEFINE_string("coordinator_address", None, "Multi-host: 'host:port' of process 0.")
flags.DEFINE_integer("process_count", None, "Multi-host: number of processes.")
flags.DEFINE_integer("process_index", None, "Multi-host: index of this process.")
flags.DEFINE_bool(
  "verbose", False, "Print the traceback of expected errors too (by default: one ERROR line)."
)


def initialize_distributed() -> None:
  """Calls jax.distributed.initialize when multi-host flags are given."""
  given = [FLAGS.coordinator_address, FLAGS.process_count, FLAGS.process_index]
  if all(v is None for v in given):
    return
  if any(v is None for v in given):
    raise app.UsageError("--coordinator_address, --process_count and --process_index go together.")
  jax.distributed.initialize(
    coordinator_address=FLAGS.coordinator_address,
    num_processes=FLAGS.process_count,
    process_id=FLAGS.process_index,
  )
  logging.info("Process %d of %d", jax.process_index(), jax.process_count())


def setup(optional_macros: Sequence[str] = ()) -> None:
  """Multi-host init, TFDS dir, task modules, gin: the first call of an entry point.

  Args:
    optional_macros: `%gin.REQUIRED` macros this run does not need (e.g.
      MODEL_DIR for --precompile); every other one must be set.

  Raises:
    ConfigError: a bad gin file or binding, an unset required macro, or a task
      module that cannot be imported.
  """
  import seqio  # TensorFlow: only for the entry points that read data

  from t5x_lite.data import pipeline

  console.quiet_library_logs()
  initialize_distributed()
  if FLAGS.tfds_data_dir:
    seqio.set_tfds_data_dir_override(FLAGS.tfds_data_dir)
  pipeline.import_task_modules(FLAGS.module_import)
  data_dir = [f"local_data_dir.path = {FLAGS.data_dir!r}"] if FLAGS.data_dir else []
  parse_gin_flags(extra_bindings=data_dir)
  pipeline.import_task_modules(_task_module_macro())
  check_required_macros(optional_macros)


def _task_module_macro() -> list[str]:
  """The gin macro MIXTURE_OR_TASK_MODULE (T5X's name) as a list of modules to import."""
  try:
    value = resolved_macro(gin.query_parameter(f"%{TASK_MODULE_MACRO}"))
  except ValueError:  # not bound
    return []
  if value is None or value is gin.REQUIRED:
    return []
  return [value] if isinstance(value, str) else list(value)


def add_cpu_xla_flags(environ: dict[str, str] | None = None) -> str:
  """Appends `CPU_XLA_FLAGS` that XLA_FLAGS does not set yet; returns the new value.

  Takes effect only if called before jax initialises its backends.
  """
  environ = os.environ if environ is None else environ
  current = environ.get("XLA_FLAGS", "")
  added = [
    f"--{name}={value}" for name, value in CPU_XLA_FLAGS.items() if f"--{name}=" not in current
  ]
  environ["XLA_FLAGS"] = " ".join([current.strip()] + added).strip()
  return environ["XLA_FLAGS"]


def _gin_missing_bindings_as_config_error(
  main: Callable[[Sequence[str]], None],
) -> Callable[[Sequence[str]], None]:
  """`main` with gin's RuntimeError for an unbound `gin.REQUIRED` default as a ConfigError."""

  def wrapped(argv: Sequence[str]) -> None:
    try:
      main(argv)
    except RuntimeError as e:
      if not str(e).startswith(_GIN_MISSING_BINDINGS):
        raise
      raise ConfigError(f"{e}: bind them in a gin file or with --gin.NAME=VALUE") from e

  return wrapped


def run(main: Callable[[Sequence[str]], None], argv: Sequence[str] | None = None) -> None:
  """`absl.app.run(main)` with the `--gin.NAME=VALUE` shorthand rewritten,
  `CPU_XLA_FLAGS` added to XLA_FLAGS and `UserError`s reported as one line."""
  add_cpu_xla_flags()
  run_app(_gin_missing_bindings_as_config_error(main), argv, lambda: FLAGS.verbose)


def gin_entry_point(run: Callable[[], object]) -> Callable[[Sequence[str]], None]:
  """An entry point's absl `main`: no positional arguments, `setup()`, then `run()`.

  Args:
    run: the library call that does the work once gin is parsed, e.g.
      `eval_lib.evaluate_checkpoints` (every argument bound in gin).

  Returns:
    `main(argv)` for `cli.run`.
  """

  def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
      raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    setup()
    run()

  return main
