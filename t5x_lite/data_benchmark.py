"""Throughput of a seqio input pipeline: examples/s and tokens/s after packing.

`measure_pipeline` builds the pipeline the trainer reads (seqio.get_dataset
with EncDecFeatureConverter(pack=True), shuffled, repeated, batched) and times
how fast tf.data produces batches on this host, after a warm-up. CLI:
tools/data_benchmark.py.
"""

import time
from collections.abc import Mapping

import numpy as np
import seqio


def measure_pipeline(
  name: str,
  task_feature_lengths: Mapping[str, int],
  batch_size: int = 8,
  num_batches: int = 50,
  warmup_batches: int = 5,
  split: str = "train",
  seed: int = 0,
) -> dict[str, float]:
  """Times `num_batches` packed batches of a task or mixture.

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
  """
  ds = seqio.get_dataset(
    name,
    task_feature_lengths,
    seqio.EncDecFeatureConverter(pack=True),
    dataset_split=split,
    shuffle=True,
    seed=seed,
    num_epochs=None,
    batch_size=batch_size,
  )
  batches = ds.as_numpy_iterator()
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
