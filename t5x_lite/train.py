"""Training entry point: `python -m t5x_lite.train --gin_file=... --gin.NAME=VALUE`.

Example (the CPU quickstart):

  python -m t5x_lite.train --gin_file=quickstart.gin

Check that a config fits a TPU slice first (no TPU needed; `t5x_lite.run.precompile`):

  python -m t5x_lite.train --gin_file=... --precompile --topology=v5e:4x4

Flags are described in `t5x_lite.cli`; the loop in `t5x_lite.run.train_lib`.
Importing `tasks` registers the project's seqio tasks and mixtures; add your
own with an `import my_tasks` line in a gin file.
"""

from t5x_lite.core import console

if __name__ == "__main__":  # first, before TensorFlow and JAX load (logged later)
  console.quiet_startup()  # environment defaults, TensorFlow imported quietly

import sys
from collections.abc import Sequence

from absl import app, flags

import tasks  # noqa: F401  (registers seqio tasks and mixtures)
from t5x_lite import cli
from t5x_lite.run import precompile, train_lib

flags.DEFINE_bool(
  "precompile",
  False,
  "Only compile the train step for --topology and report per-chip memory "
  "and FLOPs; exit status 1 if it does not fit. Needs the `tpu` extra.",
)
flags.DEFINE_string("topology", None, "TPU slice for --precompile, e.g. v5e:4x4, v4:2x2x2.")


def main(argv: Sequence[str]) -> None:
  """Parses gin and trains (expected failures: one ERROR line, see `cli.run`)."""
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  # --precompile compiles the step only: it writes nothing and runs no steps.
  cli.setup(optional_macros=("MODEL_DIR", "TRAIN_STEPS") if flags.FLAGS.precompile else ())
  if flags.FLAGS.precompile:
    sys.exit(precompile.run(flags.FLAGS.topology))
  train_lib.train()


if __name__ == "__main__":
  cli.run(main)
