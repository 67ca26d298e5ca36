"""Command-line plumbing shared by the train / eval / infer entry points.

T5X-style flags: --gin_file, --gin_bindings, --gin.NAME=VALUE and
--gin_search_paths (defined, with gin parsing, in `t5x_lite.core.gin_config`), and

  --tfds_data_dir=DIR       seqio/TFDS data directory override
  --data_dir=DIR            directory of local-file tasks (gin local_data_dir.path)
  --coordinator_address, --process_count, --process_index
                            multi-host: passed to jax.distributed.initialize

  --huge_pages              restart once with huge-page malloc (`console.restart_with_huge_pages`)

Nothing here changes the process on its own: the entry point's `console.quiet_startup()`
call makes the start-up choices, `setup` logs them, and the kernels' XLA options travel
with each compiled program, so a run from the command line and one from Python compile
the same programs.

Use:  `cli.run(main)` in an entry point; `main` calls `cli.setup()` first
(`gin_entry_point(run)` is such a `main`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import gin
import jax
from absl import app, flags, logging

from t5x_lite.core import console
from t5x_lite.core.errors import ConfigError
from t5x_lite.core.gin_config import check_required_macros, parse_gin_flags, run_app
from t5x_lite.core.gin_refs import resolved_macro

# How gin's RuntimeError for an unbound `gin.REQUIRED` Python default begins.
_GIN_MISSING_BINDINGS = "Required bindings for"
# T5X's gin macro for the module(s) that register the run's tasks.
TASK_MODULE_MACRO = "MIXTURE_OR_TASK_MODULE"
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
flags.DEFINE_bool(
  "huge_pages",
  False,
  "Restart once with glibc.malloc.hugetlb=1 in GLIBC_TUNABLES (Linux, glibc 2.35+): "
  "faster CPU steps for large models, whose step buffers are re-faulted at every step.",
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

  Also has AutoGraph leave t5x_lite's and seqio's preprocessing as written
  (`t5x_lite.data.autograph_rules`), said in the `Start-up:` line.

  Args:
    optional_macros: `%gin.REQUIRED` macros this run does not need (e.g.
      MODEL_DIR for --precompile); every other one must be set.

  Raises:
    ConfigError: a bad gin file or binding, an unset required macro, or a task
      module that cannot be imported.
  """
  import seqio  # TensorFlow: only for the entry points that read data

  from t5x_lite.data import autograph_rules, pipeline

  autograph_rules.install()
  console.add_startup_choice("AutoGraph leaves t5x_lite's and seqio's preprocessing as written")
  console.quiet_library_logs()  # logs the entry point's start-up choices
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
  """`absl.app.run(main)` with the `--gin.NAME=VALUE` shorthand rewritten, `--huge_pages`
  applied and `UserError`s reported as one line."""

  def main_after_restart(argv: Sequence[str]) -> None:
    if FLAGS.huge_pages:  # returns only when it does not restart
      on, state = console.restart_with_huge_pages()
      (logging.info if on else logging.warning)("--huge_pages: %s", state)
    main(argv)

  run_app(_gin_missing_bindings_as_config_error(main_after_restart), argv, lambda: FLAGS.verbose)


def gin_entry_point(run: Callable[..., object]) -> Callable[[Sequence[str]], None]:
  """An entry point's absl `main`: no positional arguments, `setup()`, then `run()`.

  Args:
    run: the library call that does the work once gin is parsed, e.g.
      `eval_lib.evaluate_checkpoints` (every argument bound in gin, so it is called
      with none).

  Returns:
    `main(argv)` for `cli.run`.
  """

  def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
      raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    setup()
    run()

  return main
