"""Evaluation entry point: `python -m t5x_lite.eval --gin_file=runs/eval.gin --gin.NAME=VALUE`.

Runs seqio evaluation (prediction and scoring metrics; loss for tasks without
metrics) on one checkpoint step or on every step of a MODEL_DIR, skipping steps
already evaluated in EVAL_OUTPUT_DIR. Example:

  python -m t5x_lite.eval --gin_file=runs/eval.gin \
    --gin.CHECKPOINT_PATH=./runs/sst2 --gin.EVAL_OUTPUT_DIR=./runs/sst2/eval \
    --gin.MIXTURE_OR_TASK_NAME=local_glue_sst2

Flags are those of `t5x_lite.cli` (shared with train and infer); the run is
`t5x_lite.eval_lib.evaluate_checkpoints`, its options are in gin/runs/eval.gin.
"""

from t5x_lite import console  # noqa: F401  (first: quiets TensorFlow and JAX start-up)

from collections.abc import Sequence

from absl import app

import tasks  # noqa: F401  (registers seqio tasks and mixtures)
from t5x_lite import cli, eval_lib, train_lib


def main(argv: Sequence[str]) -> None:
  """Parses gin and evaluates; expected failures: one ERROR line (`cli.run`)."""
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  cli.setup()
  eval_lib.evaluate_checkpoints(train_lib.build_model)


if __name__ == "__main__":
  cli.run(main)
