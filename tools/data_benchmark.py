r"""Measures input-pipeline throughput (examples/s, tokens/s) of a task or mixture.

  python tools/data_benchmark.py --name=cpython_span_corruption \
      --sequence_length=inputs=512,targets=114 --batch_size=8 --num_batches=50

Prints one JSON line (see t5x_lite.data_benchmark.measure_pipeline).
"""

from t5x_lite import console  # noqa: F401  (first: quiets TensorFlow and JAX start-up)

import json
from collections.abc import Sequence

import gin
import tensorflow as tf
from absl import app, flags

from t5x_lite import data_benchmark

_NAME = flags.DEFINE_string("name", "cpython_span_corruption", "Task or mixture.")
_SEQUENCE_LENGTH = flags.DEFINE_string(
  "sequence_length", "inputs=512,targets=114", "Feature lengths."
)
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 8, "Packed rows per batch.")
_NUM_BATCHES = flags.DEFINE_integer("num_batches", 50, "Batches timed.")
_SPLIT = flags.DEFINE_string("split", "train", "Split.")
_GIN_BINDINGS = flags.DEFINE_multi_string("gin_bindings", [], "Gin bindings (e.g. data dir).")


def main(argv: Sequence[str]) -> None:
  del argv
  import tasks  # noqa: F401  (registers the built-in tasks)

  gin.parse_config(_GIN_BINDINGS.value)
  lengths = {k: int(v) for k, v in (item.split("=") for item in _SEQUENCE_LENGTH.value.split(","))}
  result = data_benchmark.measure_pipeline(
    _NAME.value, lengths, _BATCH_SIZE.value, _NUM_BATCHES.value, split=_SPLIT.value
  )
  threads = tf.config.threading.get_inter_op_parallelism_threads()
  print(
    json.dumps(
      {
        "name": _NAME.value,
        "lengths": lengths,
        "batch_size": _BATCH_SIZE.value,
        "inter_op_threads": threads,
        **{k: round(v, 3) for k, v in result.items()},
      }
    )
  )


if __name__ == "__main__":
  app.run(main)
