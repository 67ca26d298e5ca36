"""The base class of expected failures, which entry points report as one line.

An error that the user can fix from the command line (a gin binding, a data
file, a checkpoint directory, a task name) subclasses `UserError`. The entry
points (`t5x_lite.cli.run`) print such an error as a single
`ERROR: <message>` line on stderr and exit with status 1, without a traceback
unless `--verbose` is given. Anything else is a bug and keeps its traceback.
The message must name the thing that is wrong: the gin binding, the file and
line, the parameter path.
"""

import importlib
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import NoReturn


class UserError(Exception):
  """An expected failure caused by the input; its message names what to fix."""


class ConfigError(UserError, ValueError):
  """A gin file, binding or flag is wrong or missing."""


class CheckpointError(UserError, RuntimeError):
  """Base class of the errors raised for unusable checkpoints."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
  """No checkpoint (or no such step) at the path given."""


class CorruptCheckpointError(CheckpointError):
  """A checkpoint file is truncated, corrupt or missing."""


class WriteError(UserError, OSError):
  """An output cannot be written: a read-only or full disk, a file in the way."""


class MissingExtraError(UserError, ImportError):
  """A tool needs an optional extra of the package that is not installed."""


def require_extra(extra: str, modules: Sequence[str], what: str) -> None:
  """Raises `MissingExtraError` saying how to install `extra` unless `modules` import.

  Args:
    extra: the setup.py extra, e.g. 'hf'.
    modules: the modules it provides, e.g. ('safetensors',).
    what: what needs them, e.g. 'tools/convert_hf_checkpoint.py'.
  """
  for module in modules:
    try:
      importlib.import_module(module)
    except ImportError as e:
      raise MissingExtraError(
        f"{what} needs the `{extra}` extra ({module} is not installed): pip install -e '.[{extra}]'"
      ) from e


def fail(message: str) -> NoReturn:
  """Prints `ERROR: message` on stderr and exits with status 1.

  gin's `In call to configurable ...` notes, which it appends to every error raised
  inside a configurable, are dropped: the message itself names what is wrong.
  """
  lines = [
    line for line in message.splitlines() if not line.strip().startswith("In call to configurable")
  ]
  print("ERROR: " + "\n".join(lines), file=sys.stderr, flush=True)
  sys.exit(1)


def reporting(
  main: Callable[[Sequence[str]], None], verbose: Callable[[], bool] = lambda: False
) -> Callable[[Sequence[str]], None]:
  """`main` with a `UserError` reported by `fail` (and its traceback when `verbose()`).

  Args:
    main: an absl `main(argv)`.
    verbose: read after the flags are parsed, e.g. `lambda: FLAGS.verbose`.
  """

  def wrapped(argv: Sequence[str]) -> None:
    try:
      main(argv)
    except UserError as e:
      if verbose():
        traceback.print_exc()
      fail(str(e))

  return wrapped
