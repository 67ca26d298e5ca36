"""Gin flags and gin parsing, shared by the entry points and the tools.

T5X-style flags, defined here:

  --gin_file=FILE           repeatable; found directly or under --gin_search_paths
  --gin_bindings='A.b = 1'  repeatable
  --gin.NAME=VALUE          shorthand, rewritten to --gin_bindings='NAME = VALUE'
                            before absl parses argv (`rewrite_gin_args`). VALUE is
                            used as written when it is a Python literal or a gin
                            reference (@fn, %MACRO); anything else is taken as a
                            string, so --gin.MODEL_DIR=./runs/x works without quoting.
  --gin_search_paths=a,b    default: the repository's gin/ and gin/models/ (paths
                            relative to the working directory are tried first)
                            (so `include 't5_1_1/small.gin'` works)
  --nofast_exit             exit through Python's teardown of the loaded modules
                            (by default `run_app` skips it once the run is over:
                            `t5x_lite.core.console.exit_without_teardown`)

Imports only gin, absl, `t5x_lite.core.errors`, `t5x_lite.core.console` (absl and the
standard library) and `t5x_lite.core.gin_refs` (reading the parsed configuration back;
flag-free, so any layer may import it), so a tool that needs a
gin-configured network loads neither seqio, TensorFlow nor JAX through it. The entry
points' other flags and their start-up are `t5x_lite.cli`.

Use: `run_app(main)` as the tool's `app.run`; `parse_gin_flags()` first in `main`,
after importing every module whose configurables the gin files name.
"""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import gin
import gin.config
import gin.resource_reader as resource_reader
from absl import app, flags

from t5x_lite.core import console, errors
from t5x_lite.core.errors import ConfigError
from t5x_lite.core.gin_refs import resolved_macro

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # t5x_lite/
REPO_GIN_DIR = os.path.join(os.path.dirname(_PACKAGE_DIR), "gin")
DEFAULT_GIN_SEARCH_PATHS = (REPO_GIN_DIR, os.path.join(REPO_GIN_DIR, "models"))
_GIN_SHORTHAND = "--gin."

_GIN_FILES = flags.DEFINE_multi_string("gin_file", [], "Gin config file(s), parsed in order.")
_GIN_BINDINGS = flags.DEFINE_multi_string(
  "gin_bindings", [], "Gin bindings, applied after the files."
)
_GIN_SEARCH_PATHS = flags.DEFINE_list(
  "gin_search_paths",
  list(DEFAULT_GIN_SEARCH_PATHS),
  "Directories searched for --gin_file and gin `include`s.",
)
_FAST_EXIT = flags.DEFINE_bool(
  "fast_exit",
  True,
  "Once the run is over and its files are closed, exit without Python's teardown of the "
  "loaded modules (`console.exit_without_teardown`); --nofast_exit exits as Python does.",
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
    ConfigError: for `--gin.NAME` without `=VALUE`.
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


def run_app(
  main: Callable[[Sequence[str]], None],
  argv: Sequence[str] | None = None,
  verbose: Callable[[], bool] = lambda: False,
) -> None:
  """`absl.app.run(main)` with the `--gin.NAME=VALUE` shorthand rewritten,
  `UserError`s (a bad shorthand included) reported as one `ERROR:` line, and the
  process ended by `console.exit_without_teardown` unless `--nofast_exit`.

  Args:
    main: an absl `main(argv)`.
    argv: full argv; default `sys.argv`.
    verbose: read after the flags are parsed; True also prints the traceback.
  """
  try:
    argv = rewrite_gin_args(sys.argv if argv is None else argv)
  except ConfigError as e:
    errors.fail(str(e))
  try:
    app.run(errors.reporting(main, verbose), argv=argv)
  except SystemExit as e:  # app.run ends every run with sys.exit
    if flags.FLAGS.is_parsed() and _FAST_EXIT.value:
      console.exit_without_teardown(e.code)
    raise


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
  readers: list[tuple[Any, Any]] = gin.config._FILE_READERS  # pylint: disable=protected-access
  for i, (reader, exists) in enumerate(readers):
    if exists is resource_reader.system_path_file_exists:
      readers[i] = (reader, _package_resource_exists)


def unset_required_macros() -> list[str]:
  """Names of the gin macros still set to `%gin.REQUIRED` after parsing, sorted."""
  config = gin.config._CONFIG  # pylint: disable=protected-access
  return sorted(
    name
    for (name, selector), params in config.items()
    if selector == "gin.macro" and resolved_macro(params.get("value")) is gin.REQUIRED
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


def parse_gin_flags(default_files: Sequence[str] = (), extra_bindings: Sequence[str] = ()) -> None:
  """`parse_gin` of --gin_file, --gin_bindings then `extra_bindings`, over --gin_search_paths.

  Args:
    default_files: parsed instead of --gin_file when it is not given.
    extra_bindings: 'NAME = VALUE' strings applied after --gin_bindings.

  Raises:
    ConfigError: as `parse_gin`.
  """
  parse_gin(
    _GIN_FILES.value or list(default_files),
    [*_GIN_BINDINGS.value, *extra_bindings],
    _GIN_SEARCH_PATHS.value,
  )


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
