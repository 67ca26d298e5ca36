"""Training until a validation metric stops improving, keeping its best step.

A recipe is judged by its task's real metric (BLEU, accuracy, ROUGE) on held-out
data, and trained until that metric stops improving rather than for a fixed
number of steps. `EarlyStopping` watches one metric of the in-training seqio
evaluation (`train.infer_eval_period`), e.g. `local_multi30k_ende/bleu`:

* after each evaluation it records the best value and its step in
  MODEL_DIR/best.json (rewritten atomically, so a resumed run continues the
  count where the stopped one left it);
* the training loop saves a checkpoint at every new best step and the
  checkpointer never rotates that step out (`TrainCheckpointer.protect`);
* after `patience` evaluations in a row without an improvement of more than
  `min_delta`, training stops (with a final checkpoint), and the final
  evaluation (`train.final_eval_dataset_cfg`) scores the best step.

Gin: `train.early_stopping = @EarlyStopping()`, `EarlyStopping.metric`,
`.mode` ('max' or 'min'), `.patience`, `.min_delta`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import gin
import jax

from t5x_lite.core.errors import ConfigError
from t5x_lite.core.types import GIN_REQUIRED

BEST_FILE = "best.json"
MODES = ("max", "min")


@gin.configurable
@dataclasses.dataclass
class EarlyStopping:
  """Stops training when `metric` has not improved for `patience` evaluations.

  Attributes:
    metric: a key of the in-training evaluation's results, '<task>/<metric>'
      (e.g. 'local_glue_sst2/accuracy'), or 'loss' for the periodic eval loss.
    mode: 'max' (higher is better) or 'min'.
    patience: evaluations without improvement before stopping; 0 never stops
      (the best step is still tracked and kept).
    min_delta: an improvement must exceed this much.
  """

  metric: str = GIN_REQUIRED
  mode: str = "max"
  patience: int = 3
  min_delta: float = 0.0
  history: list[tuple[int, float]] = dataclasses.field(default_factory=list)

  def __post_init__(self):
    if self.mode not in MODES:
      raise ConfigError(f"EarlyStopping.mode must be one of {MODES}, got {self.mode!r}.")
    if self.patience < 0:
      raise ConfigError(f"EarlyStopping.patience must be >= 0, got {self.patience}.")
    if self.min_delta < 0:
      raise ConfigError(f"EarlyStopping.min_delta must be >= 0, got {self.min_delta}.")

  def _replay(self) -> tuple[int | None, float | None, int]:
    """(best step, best value, evaluations since the best) of the history."""
    best_step, best_value, since = None, None, 0
    for step, value in self.history:
      if not math.isfinite(value):
        improves = False
      elif best_value is None:
        improves = True
      else:
        gain = value - best_value if self.mode == "max" else best_value - value
        improves = gain > self.min_delta
      if improves:
        best_step, best_value, since = step, value, 0
      else:
        since += 1
    return best_step, best_value, since

  @property
  def best_step(self) -> int | None:
    """The step of the best value so far (None before the first evaluation)."""
    return self._replay()[0]

  @property
  def best_value(self) -> float | None:
    """The best value so far."""
    return self._replay()[1]

  def update(self, step: int, results: Mapping[str, float]) -> bool:
    """Records one evaluation's results; returns whether `step` is the new best.

    Raises:
      ConfigError: the results have no `metric` (naming the keys they have).
    """
    if self.metric not in results:
      raise ConfigError(
        f"EarlyStopping.metric {self.metric!r} is not among the evaluation's metrics "
        f"{sorted(results)}."
      )
    self.history.append((step, float(results[self.metric])))
    return self.best_step == step

  @property
  def should_stop(self) -> bool:
    """Whether `patience` evaluations in a row brought no improvement."""
    return self.patience > 0 and self._replay()[2] >= self.patience

  def state(self) -> dict[str, Any]:
    """The JSON record of MODEL_DIR/best.json."""
    best_step, best_value, since = self._replay()
    return {
      "metric": self.metric,
      "mode": self.mode,
      "best_step": best_step,
      "best_value": best_value,
      "evals_since_best": since,
      "history": [
        [step, value if math.isfinite(value) else str(value)] for step, value in self.history
      ],
    }

  def save(self, model_dir: str) -> None:
    """Writes MODEL_DIR/best.json atomically (process 0)."""
    if jax.process_index() != 0:
      return
    path = os.path.join(model_dir, BEST_FILE)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(self.state(), f, indent=1)
    os.replace(tmp, path)

  def restore(self, model_dir: str, restored_step: int | None) -> None:
    """Continues a stopped run's record if it watched the same metric.

    Evaluations after `restored_step` (a run killed after its last save) are
    redone by the resumed run, so they are dropped from the history.
    """
    record = read_best(model_dir)
    if record is None or (record.get("metric"), record.get("mode")) != (self.metric, self.mode):
      return
    if restored_step is None:
      return
    self.history = [
      (int(step), float(value))
      for step, value in record.get("history", [])
      if step <= restored_step
    ]


def read_best(model_dir: str) -> dict[str, Any] | None:
  """MODEL_DIR/best.json as a dict, or None if the run never recorded a best step."""
  path = os.path.join(model_dir, BEST_FILE)
  if not os.path.isfile(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)
