r"""Measures input-pipeline throughput (examples/s, tokens/s) of a task or mixture.

  python tools/data_benchmark.py --name=cpython_span_corruption \
      --sequence_length=inputs=512,targets=114 --batch_size=8 --num_batches=50

Prints one JSON line (see `measure_pipeline`). Gin flags (--gin_bindings,
--gin.NAME=VALUE, --gin_file) are those of the entry points, e.g. for a task's
data directory. tools/benchmark.py reports `measure_pipeline` too.
"""

from t5x_lite.core import console

if __name__ == "__main__":  # first, before TensorFlow and JAX load (logged later)
  console.quiet_startup()  # environment defaults, TensorFlow imported quietly

import json
import time
from collections.abc import Mapping, Sequence

import numpy as np
import tensorflow as tf
from absl import flags

from t5x_lite.core import gin_config
from t5x_lite.data import pipeline

FLAGS = flags.FLAGS


def measure_pipeline(
  name: str,
  task_feature_lengths: Mapping[str, int],
  batch_size: int = 8,
  num_batches: int = 50,
  warmup_batches: int = 5,
  split: str = "train",
  seed: int = 0,
) -> dict[str, float]:
  """Times `num_batches` packed batches of the pipeline training reads.

  That is `pipeline.host_dataset` (seqio.get_dataset with EncDecFeatureConverter(pack=True),
  shuffled, repeated, batched, prefetched), read on this host after a warm-up.

  Args:
    name: registered task or mixture.
    task_feature_lengths: e.g. {'inputs': 512, 'targets': 114}.
    batch_size: packed rows per batch.
    num_batches: batches timed.
    warmup_batches: batches read before timing (tracing, buffers filling).
    split: split to read.
    seed: pipeline seed.

  Returns:
    examples_per_s (task examples, counted by segment ids), input_tokens_per_s
    and target_tokens_per_s (non-padding), rows_per_s, input_fill and
    target_fill (non-padding fraction), seconds.

  Raises:
    ConfigError: an unknown task or mixture, or a preprocessor asking for a
      feature its input lacks.
  """
  config = pipeline.DatasetConfig(
    name, task_feature_lengths, batch_size, split=split, shuffle=True, seed=seed, pack=True
  )
  batches = pipeline.host_dataset(config, num_epochs=None).as_numpy_iterator()
  for _ in range(warmup_batches):
    next(batches)
  examples = input_tokens = target_tokens = 0
  start = time.perf_counter()
  for _ in range(num_batches):
    batch = next(batches)
    examples += int(np.sum(np.max(batch["encoder_segment_ids"], axis=1)))
    input_tokens += int(np.count_nonzero(batch["encoder_input_tokens"]))
    target_tokens += int(np.count_nonzero(batch["decoder_target_tokens"]))
  seconds = time.perf_counter() - start
  rows = num_batches * batch_size
  return {
    "examples_per_s": examples / seconds,
    "input_tokens_per_s": input_tokens / seconds,
    "target_tokens_per_s": target_tokens / seconds,
    "rows_per_s": rows / seconds,
    "input_fill": input_tokens / (rows * task_feature_lengths["inputs"]),
    "target_fill": target_tokens / (rows * task_feature_lengths["targets"]),
    "seconds": seconds,
  }


def define_flags() -> None:
  """This tool's own flags; defined when it runs, not on import, because
  tools/benchmark.py imports `measure_pipeline` and has a --batch_size of its own."""
  flags.DEFINE_string("name", "cpython_span_corruption", "Task or mixture.")
  flags.DEFINE_string("sequence_length", "inputs=512,targets=114", "Feature lengths.")
  flags.DEFINE_integer("batch_size", 8, "Packed rows per batch.")
  flags.DEFINE_integer("num_batches", 50, "Batches timed.")
  flags.DEFINE_string("split", "train", "Split.")


def main(argv: Sequence[str]) -> None:
  """Parses the gin flags, times the pipeline and prints one JSON line."""
  del argv
  import tasks  # noqa: F401  (registers the built-in tasks)

  gin_config.parse_gin_flags()
  lengths = {k: int(v) for k, v in (item.split("=") for item in FLAGS.sequence_length.split(","))}
  result = measure_pipeline(
    FLAGS.name, lengths, FLAGS.batch_size, FLAGS.num_batches, split=FLAGS.split
  )
  threads = tf.config.threading.get_inter_op_parallelism_threads()
  print(
    json.dumps(
      {
        "name": FLAGS.name,
        "lengths": lengths,
        "batch_size": FLAGS.batch_size,
        "inter_op_threads": threads,
        **{k: round(v, 3) for k, v in result.items()},
      }
    )
  )


if __name__ == "__main__":
  define_flags()
  gin_config.run_app(main)
