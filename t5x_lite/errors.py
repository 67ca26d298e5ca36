"""The base class of expected failures, which entry points report as one line.

An error that the user can fix from the command line (a gin binding, a data
file, a checkpoint directory, a task name) subclasses `UserError`. The entry
points (`t5x_lite.cli.run`) print such an error as a single
`ERROR: <message>` line on stderr and exit with status 1, without a traceback
unless `--verbose` is given. Anything else is a bug and keeps its traceback.
The message must name the thing that is wrong: the gin binding, the file and
line, the parameter path.
"""


class UserError(Exception):
  """An expected failure caused by the input; its message names what to fix."""


class ConfigError(UserError, ValueError):
  """A gin file, binding or flag is wrong or missing."""
