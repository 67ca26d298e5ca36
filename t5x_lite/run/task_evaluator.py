"""seqio evaluation of one task or mixture split with a `ModelRunner`.

`TaskEvaluator` runs `seqio.Evaluator` over a task or mixture split: prediction
metrics (`ModelRunner.predict` -> decode with the output vocabulary -> the task's
postprocessor -> metric fns) and scoring metrics (`ModelRunner.score`). A task with
no metric fns gets a loss-only evaluation (`nll_per_token`: mean negative
log-likelihood per target token, without the z-loss and label smoothing that the
training loop's teacher-forced `loss` includes) and a logged note; seqio itself
would skip it. The data is read and cached once, so one evaluator serves every
checkpoint step (`t5x_lite.run.eval_lib`). `PredictionsJsonlLogger` writes each
example's inputs, targets and predictions as JSONL.
"""

from __future__ import annotations

import contextlib
import json
import logging as stdlib_logging
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import seqio
import tensorflow as tf
import tqdm
from absl import logging

from t5x_lite.data import pipeline, task_metrics
from t5x_lite.run import model_runner
from t5x_lite.core.errors import ConfigError
from t5x_lite.core.types import PyTree

Metrics = dict[str, dict[str, float]]
INFERENCES_DIR = "inferences"
_ENCODER_INPUTS = "encoder_input_tokens"
# seqio.Evaluator's multi-line advice on the given lengths, said in one line of ours
# (`TaskEvaluator._log_lengths`), and its note that it has no loggers (the Python API's
# choice).
_SEQIO_ADVICE = (
  "Given sequence lengths are longer than necessary",
  "Given sequence lengths *may be* insufficient",
  "'logger_cls' is empty",
)


class _DropSeqioAdvice(stdlib_logging.Filter):
  """Drops the `_SEQIO_ADVICE` records."""

  def filter(self, record: stdlib_logging.LogRecord) -> bool:
    return not any(advice in str(record.msg) for advice in _SEQIO_ADVICE)


@contextlib.contextmanager
def _without_seqio_advice() -> Iterator[None]:
  """absl's logger without the `_SEQIO_ADVICE` records inside the block."""
  drop, logger = _DropSeqioAdvice(), logging.get_absl_logger()
  logger.addFilter(drop)
  try:
    yield
  finally:
    logger.removeFilter(drop)


def _jsonable(value: Any) -> Any:
  """numpy scalars/arrays and bytes -> JSON values."""
  if isinstance(value, bytes):
    return value.decode("utf-8", errors="replace")
  if isinstance(value, np.ndarray):
    return _jsonable(value.tolist())
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if isinstance(value, dict):
    return {k: _jsonable(v) for k, v in value.items()}
  return value


class PredictionsJsonlLogger(seqio.Logger):
  """seqio logger writing inputs, targets and predictions to one JSONL file per step."""

  def __call__(
    self,
    task_name: str,
    step: int | None,
    metrics: Mapping[str, Any],
    dataset: tf.data.Dataset | None,
    inferences: Mapping[str, Sequence[Any]] | None,
    targets: Sequence[Any] | None,
  ) -> None:
    """Writes `inferences/<task>-step_<step>.jsonl` (process 0; nothing without outputs)."""
    del metrics
    if not inferences or dataset is None or jax.process_index() != 0:
      return
    directory = os.path.join(self.output_dir, INFERENCES_DIR)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{task_name}-step_{step}.jsonl")
    columns = {k: v for k, v in inferences.items() if k != "aux_value"}
    with open(path, "w", encoding="utf-8") as f:
      for i, example in enumerate(dataset.as_numpy_iterator()):
        # (TensorFlow's stubs have as_numpy_iterator yield arrays; here each is a dict.)
        record = {
          name: _jsonable(example.get(f"{name}_pretokenized", example.get(name)))  # pyright: ignore[reportAttributeAccessIssue]
          for name in ("inputs", "targets")
          if name in example
        }
        if targets is not None:
          record["target"] = _jsonable(targets[i])
        record.update({k: _jsonable(v[i]) for k, v in columns.items()})
        f.write(json.dumps(record, ensure_ascii=False) + "\n")


def _floats(results: Mapping[str, Any]) -> dict[str, float]:
  """Numeric metric values as floats (seqio Scalars unwrapped; text/images dropped)."""
  out = {}
  for name, value in results.items():
    value = value.value if isinstance(value, seqio.metrics.Scalar) else value
    if isinstance(value, np.ndarray) and value.ndim == 0:
      value = value[()]
    if isinstance(value, (int, float, np.number)):
      out[name] = float(value)
  return out


def _materialised(ds: tf.data.Dataset) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """An enumerated dataset of model features as numpy: (indices [n], {name: [n, ...]})."""
  indices, features = [], []
  for index, example in ds.batch(1024).as_numpy_iterator():
    indices.append(index)
    features.append(example)
  if not indices:
    return np.zeros([0], np.int64), {}
  names = features[0].keys()
  return np.concatenate(indices), {k: np.concatenate([f[k] for f in features]) for k in names}


def by_input_length(
  features: Mapping[str, np.ndarray], batch_size: int
) -> tuple[np.ndarray, list[int | None]]:
  """An order of the examples, longest input first, and each batch's input width.

  An encoder-decoder's `encoder_input_tokens` [n, length] are zero-padded on the right
  to the longest of the split; a batch of the order needs only a `bucket` of its own
  longest row, and the encoder and cross-attention cost follows the input length.
  Decoder-only features (prompt and targets in one row) keep their width: None.

  Returns:
    (order [n] of row positions, one width per batch of `batch_size` rows in order).
  """
  rows = len(next(iter(features.values()), []))
  starts = range(0, rows, batch_size)
  if _ENCODER_INPUTS not in features:
    return np.arange(rows), [None for _ in starts]
  tokens = features[_ENCODER_INPUTS]  # [n, length]
  nonzero = tokens != 0
  # [n]: one past the last non-padding token (0 for an empty row).
  lengths = np.where(nonzero.any(1), tokens.shape[1] - np.argmax(nonzero[:, ::-1], 1), 0)
  order = np.argsort(-lengths, kind="stable")
  cap = tokens.shape[1]
  widths: list[int | None] = [model_runner.bucket(int(lengths[order[s]]), cap) for s in starts]
  return order, widths


class TaskEvaluator:
  """seqio evaluation of one task/mixture split, plus loss-only tasks; data cached once."""

  def __init__(
    self,
    runner: model_runner.ModelRunner,
    dataset_cfg: pipeline.DatasetConfig,
    *,
    num_examples: int | None = None,
    log_dir: str | None = None,
    logger_cls: Sequence[type[seqio.Logger]] = (),
  ):
    """Reads and caches the evaluation data.

    Args:
      runner: predicts / scores batches of `dataset_cfg.batch_size` rows.
      dataset_cfg: mixture_or_task_name, split, task_feature_lengths (None: seqio
        measures the longest example), batch_size, seed, and the model's
        architecture (`pipeline.for_model`), which picks the feature converter.
      num_examples: at most this many examples per task (None: all).
      log_dir: where `logger_cls` write.
      logger_cls: seqio loggers (TensorBoard, predictions JSONL, ...).

    Raises:
      ConfigError: if no task of the mixture has the split.
    """
    self.runner, self.cfg, self.num_examples = runner, dataset_cfg, num_examples
    name, split = dataset_cfg.mixture_or_task_name, dataset_cfg.split
    lengths = dataset_cfg.task_feature_lengths
    with (
      pipeline.naming_failing_task(name, split, lengths, dataset_cfg.seed),
      _without_seqio_advice(),
    ):
      self.seqio = seqio.Evaluator(
        name,
        pipeline.feature_converter(dataset_cfg, pack=False),
        eval_split=split,
        sequence_length=lengths,
        seed=dataset_cfg.seed,
        num_examples=num_examples,
        logger_cls=logger_cls,
        log_dir=log_dir,
        async_compute_metrics=False,
      )
    self._log_lengths()
    subtasks = seqio.get_subtasks(pipeline.get_mixture_or_task(name))
    self.loss_tasks = [t for t in subtasks if split in t.splits and not t.metric_objs]
    if not self.loss_tasks and not self.seqio.eval_tasks:
      raise ConfigError(f"No task of {name} has a {split!r} split.")
    for task in self.loss_tasks:
      logging.warning(
        "Note: task %s has no metric functions; evaluating its loss "
        "(mean negative log-likelihood per target token) only.",
        task.name,
      )
    self._loss_loggers = tuple(cls(output_dir=log_dir) for cls in logger_cls)
    self._loss_data = {t.name: self._loss_dataset(t) for t in self.loss_tasks}

  def _log_lengths(self) -> None:
    """One line per evaluated task: its longest example against the lengths given."""
    given = self.cfg.task_feature_lengths
    for task in self.seqio.eval_tasks:
      longest, count = {}, 0
      for example in self.seqio.cached_task_datasets[task.name].as_numpy_iterator():
        count += 1
        for name in ("inputs", "targets"):
          if name in example:
            longest[name] = max(longest.get(name, 0), len(example[name]))
      if given is None:
        fit = "(TASK_FEATURE_LENGTHS=None: these)"
      else:
        fit = f"TASK_FEATURE_LENGTHS={longest} would fit them all (given: {dict(given)})"
        if cut := [k for k, v in longest.items() if v >= given.get(k, v + 1)]:
          fit += f"; {' and '.join(cut)} at the given length may have been truncated"
      logging.info(
        "Evaluating %s (%s): %d examples of at most %s tokens; %s.",
        task.name,
        self.cfg.split,
        count,
        " and ".join(f"{v} {k.removesuffix('s')}" for k, v in longest.items()),
        fit,
      )

  def _loss_dataset(self, task: seqio.Task) -> tf.data.Dataset:
    """Model features of a loss-only task, cached in memory."""
    lengths = self.cfg.task_feature_lengths
    if lengths is None:
      raise ConfigError(
        f"Task {task.name} has no metrics, so it is evaluated by its loss, "
        "which needs TASK_FEATURE_LENGTHS (got None)."
      )
    with pipeline.naming_failing_task(task.name, self.cfg.split, lengths, self.cfg.seed):
      ds = task.get_dataset(
        sequence_length=dict(lengths),
        split=self.cfg.split,
        shuffle=False,
        num_epochs=1,
        seed=self.cfg.seed,
      )
    if self.num_examples is not None:
      ds = ds.take(self.num_examples)
    return pipeline.feature_converter(self.cfg, pack=False)(ds, dict(lengths)).cache()

  def _batches(
    self, ds: tf.data.Dataset, desc: str
  ) -> Iterator[tuple[np.ndarray, dict[str, np.ndarray]]]:
    """(indices, numpy features) batches of an enumerated dataset, with a progress bar.

    Examples go longest input first (`by_input_length`), so a batch holds inputs of
    similar length, cut to a `model_runner.bucket` of its longest (a handful of shapes,
    each compiled once). seqio puts the outputs back in the dataset's order by their
    indices.
    """
    indices, features = _materialised(ds)
    order, widths = by_input_length(features, self.runner.batch_size)
    with tqdm.tqdm(
      total=len(indices),
      unit="ex",
      desc=desc,
      file=sys.stderr,
      disable=jax.process_index() != 0,
    ) as bar:
      for start, width in zip(range(0, len(order), self.runner.batch_size), widths):
        rows = order[start : start + self.runner.batch_size]
        batch = {k: v[rows] for k, v in features.items()}
        if width is not None:
          batch[_ENCODER_INPUTS] = batch[_ENCODER_INPUTS][:, :width]
        yield indices[rows], batch
        bar.update(len(rows))

  def _predict(self, params: PyTree, ds: tf.data.Dataset, with_aux: bool = False):
    """seqio predict_fn / predict_with_aux_fn."""
    out, scores, generated, start = [], [], 0, time.perf_counter()
    for indices, features in self._batches(ds, "predict"):
      tokens, batch_scores = self.runner.predict(params, features)
      out += list(zip(indices.tolist(), tokens))
      scores += batch_scores.tolist()
      generated += int(np.count_nonzero(tokens))
    seconds = time.perf_counter() - start
    logging.info(
      "Predicted %d examples: %.1f examples/s, %.0f generated tokens/s.",
      len(out),
      len(out) / seconds,
      generated / seconds,
    )
    return (out, {"scores": scores}) if with_aux else out

  def _score(self, params: PyTree, ds: tf.data.Dataset) -> list[tuple[int, float]]:
    """seqio score_fn: (index, target log-likelihood) pairs."""
    out = []
    for indices, features in self._batches(ds, "score"):
      out += list(zip(indices.tolist(), self.runner.score(params, features).tolist()))
    return out

  def _loss(self, params: PyTree, task: seqio.Task) -> dict[str, float]:
    """Mean negative log-likelihood per target token of a loss-only task."""
    total, tokens, examples = 0.0, 0.0, 0
    for _, features in self._batches(self._loss_data[task.name].enumerate(), "loss"):
      total -= float(self.runner.score(params, features).sum())
      tokens += float((features["decoder_loss_weights"] > 0).sum())
      examples += len(features["decoder_target_tokens"])
    if tokens == 0:
      raise ConfigError(f"Task {task.name} has no target tokens in split {self.cfg.split}.")
    return {"nll_per_token": total / tokens, "num_examples": float(examples)}

  def evaluate(self, params: PyTree, step: int) -> Metrics:
    """Evaluates `params`; returns {task: {metric: value}} and calls the loggers."""
    future, _ = self.seqio.evaluate(
      compute_metrics=True,
      step=step,
      predict_fn=lambda dataset, model_feature_shapes=None: self._predict(params, dataset),
      predict_with_aux_fn=lambda dataset, model_feature_shapes=None: self._predict(
        params, dataset, with_aux=True
      ),
      score_fn=lambda dataset, model_feature_shapes=None: self._score(params, dataset),
    )
    results = {task: _floats(metrics) for task, metrics in (future.result() or {}).items()}
    for task in self.loss_tasks:
      results[task.name] = self._loss(params, task)
      scalars = {k: seqio.metrics.Scalar(v) for k, v in results[task.name].items()}
      for logger in self._loss_loggers:
        logger(
          task_name=task.name,
          step=step,
          metrics=scalars,
          dataset=None,
          inferences=None,
          targets=None,
        )
    for task, metrics in results.items():
      logging.info(
        "step %d %s: %s",
        step,
        task,
        ", ".join(task_metrics.shown(k, v) for k, v in metrics.items()),
      )
    return results


# ------------------------------------------------------------------ checkpoints
