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
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import gin
import gin.resource_reader as resource_reader
import jax
import seqio
from absl import app, flags, logging

from t5x_lite import console, data, errors
from t5x_lite.errors import ConfigError

REPO_GIN_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gin")
DEFAULT_GIN_SEARCH_PATHS = (REPO_GIN_DIR, os.path.join(REPO_GIN_DIR, "models"))
_GIN_SHORTHAND = "--gin."
# How gin's RuntimeError for an unbound `gin.REQUIRED` Python default begins.
_GIN_MISSING_BINDINGS = "Required bindings for"
# T5X's gin macro for the module(s) that register the run's tasks.
TASK_MODULE_MACRO = "MIXTURE_OR_TASK_MODULE"
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
flags.DEFINE_list(
  "gin_search_paths",
  list(DEFAULT_GIN_SEARCH_PATHS),
  "Directories searched for --gin_file and gin `include`s.",
)
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
    name, sep, value = arg[len(_GIN_SHORTHAND) :].partition("=")
    if not sep or not name:
      raise ConfigError(f"Expected --gin.NAME=VALUE, got {arg!r}")
    rewritten.append(f"--gin_bindings={name} = {_gin_value(value)}")
  return rewritten


def _package_resource_exists(config_path: str) -> bool:
  """gin's package-resource check, False instead of a crash on a namespace package.

  gin looks up `include 'runs/pretrain.gin'` as a resource of an importable package
  `runs` when `./runs/pretrain.gin` is not a file; with a `./runs/` folder of
  checkpoints in the working directory (`python -m` puts it on sys.path) that is a
  namespace package without a file, and gin's check raises TypeError instead of
  moving on to the next search path.
  """
  try:
    return resource_reader.system_path_file_exists(config_path)
  except (TypeError, AttributeError, OSError):
    return False


def _use_safe_package_reader() -> None:
  """Swaps gin's package-resource existence check for `_package_resource_exists`."""
  readers = gin.config._FILE_READERS  # pylint: disable=protected-access
  for i, (reader, exists) in enumerate(readers):
    if exists is resource_reader.system_path_file_exists:
      readers[i] = (reader, _package_resource_exists)


def _resolved_macro(value: Any) -> Any:
  """The value a gin macro evaluates to, following `%OTHER` and `%gin.REQUIRED`."""
  while isinstance(value, gin.config.ConfigurableReference) and value.evaluate:
    if value.selector not in ("gin.macro", "gin.constant"):
      return value
    value = value.scoped_configurable_fn()
  return value


def unset_required_macros() -> list[str]:
  """Names of the gin macros still set to `%gin.REQUIRED` after parsing, sorted."""
  config = gin.config._CONFIG  # pylint: disable=protected-access
  return sorted(
    name
    for (name, selector), params in config.items()
    if selector == "gin.macro" and _resolved_macro(params.get("value")) is gin.REQUIRED
  )


def check_required_macros(optional: Sequence[str] = ()) -> None:
  """Raises ConfigError naming every `%gin.REQUIRED` macro left unset (except `optional`)."""
  missing = [name for name in unset_required_macros() if name not in optional]
  if not missing:
    return
  how = " ".join(f"--gin.{name}=..." for name in missing)
  raise ConfigError(
    f"gin macro{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
    f"{'are' if len(missing) > 1 else 'is'} required (%gin.REQUIRED) but never set: "
    f"add {how}, or set {'them' if len(missing) > 1 else 'it'} in a gin file given after "
    "the one that requires it (a later file that includes runs/*.gin resets what an "
    "earlier file set)"
  )


def parse_gin(
  gin_files: Sequence[str],
  bindings: Sequence[str],
  search_paths: Sequence[str] = DEFAULT_GIN_SEARCH_PATHS,
) -> None:
  """Parses gin files then bindings.

  Import every module whose configurables the files name before calling this.

  Args:
    gin_files: files, absolute/relative or relative to a search path.
    bindings: 'NAME = VALUE' strings.
    search_paths: directories for files and `include` statements.

  Raises:
    ConfigError: a missing file, a syntax error, an unknown configurable or
      parameter, or a module gin cannot import; the message names the file and
      line or the binding.
  """
  _use_safe_package_reader()
  for path in search_paths:
    gin.add_config_file_search_path(path)  # a repeated path is harmless
  try:
    gin.parse_config_files_and_bindings(list(gin_files), list(bindings), finalize_config=False)
  except (OSError, SyntaxError, ValueError, ImportError, KeyError, TypeError) as e:
    raise ConfigError(_one_line_gin_error(e)) from e


def _one_line_gin_error(error: Exception) -> str:
  """gin's error message (with its `In file ..., line N` or `In bindings string`) on one line."""
  message = str(error)
  if isinstance(error, OSError) and "Unable to open file" in message:
    message = message.replace("Unable to open file", "gin file not found")
  if isinstance(error, ModuleNotFoundError):
    message = (
      f"{message}: a gin `import` or --module_import names a module that is not on "
      "the Python path (the working directory is searched first)"
    )
  return " ".join(line.strip() for line in message.splitlines() if line.strip())


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
  console.quiet_library_logs()
  initialize_distributed()
  if FLAGS.tfds_data_dir:
    seqio.set_tfds_data_dir_override(FLAGS.tfds_data_dir)
  data.import_task_modules(FLAGS.module_import)
  bindings = list(FLAGS.gin_bindings)
  if FLAGS.data_dir:
    bindings.append(f"local_data_dir.path = {FLAGS.data_dir!r}")
  parse_gin(FLAGS.gin_file, bindings, FLAGS.gin_search_paths)
  data.import_task_modules(_task_module_macro())
  check_required_macros(optional_macros)


def _task_module_macro() -> list[str]:
  """The gin macro MIXTURE_OR_TASK_MODULE (T5X's name) as a list of modules to import."""
  try:
    value = _resolved_macro(gin.query_parameter(f"%{TASK_MODULE_MACRO}"))
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
  try:
    argv = rewrite_gin_args(sys.argv if argv is None else argv)
  except ConfigError as e:
    errors.fail(str(e))
  app.run(
    errors.reporting(_gin_missing_bindings_as_config_error(main), lambda: FLAGS.verbose), argv=argv
  )
