"""Evaluation entry point: `python -m t5x_lite.eval --gin_file=runs/eval.gin --gin.NAME=VALUE`.

Runs seqio evaluation (prediction and scoring metrics; loss for tasks without
metrics) on one checkpoint step or on every step of a MODEL_DIR, skipping steps
already evaluated in EVAL_OUTPUT_DIR. Example:

  python -m t5x_lite.eval --gin_file=runs/eval.gin \
    --gin.CHECKPOINT_PATH=./runs/sst2 --gin.EVAL_OUTPUT_DIR=./runs/sst2/eval \
    --gin.MIXTURE_OR_TASK_NAME=local_glue_sst2

Flags are those of `t5x_lite.cli` (shared with train and infer); the run is
`t5x_lite.run.eval_lib.evaluate_checkpoints`, its options are in gin/runs/eval.gin.
"""

from t5x_lite.core import console

if __name__ == "__main__":  # first, before TensorFlow and JAX load (logged later)
  console.quiet_startup()  # environment defaults, TensorFlow imported quietly

import tasks  # noqa: F401  (registers seqio tasks and mixtures)
from t5x_lite import cli
from t5x_lite.run import eval_lib

main = cli.gin_entry_point(eval_lib.evaluate_checkpoints)

if __name__ == "__main__":
  cli.run(main)
