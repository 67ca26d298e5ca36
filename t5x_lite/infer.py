"""Inference entry point: `python -m t5x_lite.infer --gin_file=runs/infer.gin --gin.NAME=VALUE`.

Decodes (or scores) the inputs of a JSONL/TSV file or of a task split into a JSONL
file, resuming where an earlier run stopped. Example:

  python -m t5x_lite.infer --gin_file=runs/infer.gin \
    --gin.CHECKPOINT_PATH=./runs/quickstart --gin.INPUT_FILE=inputs.jsonl \
    --gin.OUTPUT_FILE=./runs/quickstart/predictions.jsonl \
    --gin.DecodeConfig.decode_fn="'beam'" --gin.DecodeConfig.num_decodes=4

Flags are those of `t5x_lite.cli` (shared with train and eval); the run is
`t5x_lite.run.infer_lib.infer`, its options are in gin/runs/infer.gin.
"""

from t5x_lite.core import console

if __name__ == "__main__":  # first, before TensorFlow and JAX load (logged later)
  console.quiet_startup()  # environment defaults, TensorFlow imported quietly

import tasks  # noqa: F401  (registers seqio tasks and mixtures)
from t5x_lite import cli
from t5x_lite.run import infer_lib

main = cli.gin_entry_point(infer_lib.infer)

if __name__ == "__main__":
  cli.run(main)
