"""Postprocessors and seqio-style metric functions for text-to-text tasks.

Metric functions take `(targets, predictions)` lists (after the task's
postprocessor) and return a dict of floats, scaled to 0-100 as in T5.
Postprocessors map a decoded string to the value the metrics compare; they
take seqio's `example` and `is_target` keyword arguments.
"""

import collections
import math
import re
import string
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import sacrebleu

INVALID_LABEL = -1
# Correlations, in [-1, 1], reported times 100 like T5's; `shown` marks them in log lines
# (the others are percentages or, for BLEU, 0-100 by definition).
TIMES_100 = frozenset({"matthews_corrcoef", "pearson_corrcoef", "spearman_corrcoef"})
_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def shown(name: str, value: float) -> str:
  """`name value` for a log line; a correlation reported x100 says so: `... 23.5 (x100)`."""
  return f"{name} {value:.4g}" + (" (x100)" if name in TIMES_100 else "")


def string_label_to_class_id(
  string_label: str,
  label_classes: Sequence[str],
  example: Optional[dict[str, Any]] = None,
  is_target: bool = False,
) -> int:
  """Index of `string_label` in `label_classes`, or -1 for anything else."""
  del example, is_target
  label = string_label.strip()
  return label_classes.index(label) if label in label_classes else INVALID_LABEL


def string_to_float(
  string: str,
  default: float = math.nan,
  example: Optional[dict[str, Any]] = None,
  is_target: bool = False,
) -> float:
  """Parses a float; unparsable predictions become `default` (NaN)."""
  del example, is_target
  try:
    return float(string)
  except ValueError:
    return default


def all_answers(
  answer: str,
  example: Optional[dict[str, Any]] = None,
  is_target: bool = False,
  answers_key: str = "answers",
) -> str | list[str]:
  """Targets: every acceptable answer of the example; predictions: unchanged.

  The postprocessor of a question-answering task whose records carry a list
  feature of answers (`squad_source.SquadJsonSource`, or `JsonlSource` with
  `list_policy={key: 'all'}`) kept by `preprocessors.text_to_text(...,
  keep_features=(answers_key,))`: `squad` then scores each prediction against
  the best of them. Without that feature the target text itself is the answer.
  """
  if not is_target or example is None or answers_key not in example:
    return answer
  return [a.decode("utf-8") if isinstance(a, bytes) else str(a) for a in example[answers_key]]


def accuracy(targets: Sequence[Any], predictions: Sequence[Any]) -> dict[str, float]:
  """Percentage of exact matches."""
  return {"accuracy": 100.0 * float(np.mean(np.array(targets) == np.array(predictions)))}


def f1_with_invalid(targets: Sequence[int], predictions: Sequence[int]) -> dict[str, float]:
  """Binary F1 (positive class 1) where an invalid prediction counts as wrong."""
  target_ids, predicted = np.asarray(targets), np.asarray(predictions)
  invalid = (predicted != 0) & (predicted != 1)
  predicted = np.where(invalid, 1 - target_ids, predicted)
  true_pos = int(np.sum((predicted == 1) & (target_ids == 1)))
  false_pos = int(np.sum((predicted == 1) & (target_ids != 1)))
  false_neg = int(np.sum((predicted != 1) & (target_ids == 1)))
  counted = 2 * true_pos + false_pos + false_neg
  # No positive target and no positive prediction: 0, as scikit-learn's f1_score gives.
  return {"f1": 100.0 * 2 * true_pos / counted if counted else 0.0}


def matthews_corrcoef(targets: Sequence[int], predictions: Sequence[int]) -> dict[str, float]:
  """Matthews correlation (CoLA), times 100: Gorodkin's multiclass form, so an invalid
  prediction (-1) is a class of its own; 0 where either side has a single class (what
  scikit-learn's matthews_corrcoef computes)."""
  labels, codes = np.unique(
    np.concatenate([np.asarray(targets), np.asarray(predictions)]), return_inverse=True
  )
  n = len(targets)
  confusion = np.zeros((len(labels), len(labels)), np.float64)  # [target, predicted]
  np.add.at(confusion, (codes[:n], codes[n:]), 1.0)
  per_target, per_prediction = confusion.sum(axis=1), confusion.sum(axis=0)  # [labels]
  covariance = np.trace(confusion) * n - per_target @ per_prediction
  target_variance = n * n - per_target @ per_target
  prediction_variance = n * n - per_prediction @ per_prediction
  if target_variance * prediction_variance == 0:
    return {"matthews_corrcoef": 0.0}
  correlation = covariance / np.sqrt(target_variance * prediction_variance)
  return {"matthews_corrcoef": 100.0 * float(correlation)}


def pearson_spearman(targets: Sequence[float], predictions: Sequence[float]) -> dict[str, float]:
  """Pearson and Spearman correlations (STS-B), times 100; NaN predictions -> 0."""
  predicted = np.nan_to_num(np.asarray(predictions, np.float64), nan=0.0)
  expected = np.asarray(targets, np.float64)
  # Imported here, like rouge_score below: each takes most of a second to import, in
  # every process that registers the tasks, and few tasks score with it.
  import scipy.stats  # noqa: PLC0415

  # (scipy's result tuples have no item types, so float() of an item does not type-check.)
  pearson = scipy.stats.pearsonr(expected, predicted)[0]
  spearman = scipy.stats.spearmanr(expected, predicted)[0]
  return {
    "pearson_corrcoef": 100.0 * float(pearson),  # pyright: ignore[reportArgumentType]
    "spearman_corrcoef": 100.0 * float(spearman),  # pyright: ignore[reportArgumentType]
  }


def bleu(targets: Sequence[str], predictions: Sequence[str]) -> dict[str, float]:
  """Corpus BLEU with sacrebleu's defaults (13a tokenization, exp smoothing)."""
  return {"bleu": float(sacrebleu.corpus_bleu(list(predictions), [list(targets)]).score)}


ROUGE_TYPES = ("rouge1", "rouge2", "rougeLsum")


def rouge_per_example(targets: Sequence[str], predictions: Sequence[str]) -> dict[str, np.ndarray]:
  """ROUGE-1/2/Lsum F-measures of each example, times 100: {type: [examples]}."""
  from rouge_score import rouge_scorer  # noqa: PLC0415  (see pearson_spearman)

  scorer = rouge_scorer.RougeScorer(ROUGE_TYPES)
  # rougeLsum treats newlines as sentence boundaries.
  scores = [
    scorer.score(t.replace(". ", ".\n"), p.replace(". ", ".\n"))
    for t, p in zip(targets, predictions)
  ]
  return {t: 100.0 * np.array([s[t].fmeasure for s in scores], np.float64) for t in ROUGE_TYPES}


def rouge(targets: Sequence[str], predictions: Sequence[str]) -> dict[str, float]:
  """Mean ROUGE-1/2/Lsum F-measures over examples, times 100 (deterministic)."""
  return {t: float(np.mean(v)) for t, v in rouge_per_example(targets, predictions).items()}


def normalize_squad_answer(text: str) -> str:
  """SQuAD v1.1 answer normalisation: lowercase, drop punctuation and articles, one space."""
  text = "".join(c for c in text.lower() if c not in _PUNCTUATION)
  return " ".join(_ARTICLES.sub(" ", text).split())


def _token_f1(target: str, prediction: str) -> float:
  """F1 of the bags of normalised tokens (0 when nothing is shared)."""
  target_tokens = normalize_squad_answer(target).split()
  predicted_tokens = normalize_squad_answer(prediction).split()
  shared = sum(
    (collections.Counter(target_tokens) & collections.Counter(predicted_tokens)).values()
  )
  if shared == 0:
    return 0.0
  precision, recall = shared / len(predicted_tokens), shared / len(target_tokens)
  return 2 * precision * recall / (precision + recall)


def squad(targets: Sequence[str | Sequence[str]], predictions: Sequence[str]) -> dict[str, float]:
  """SQuAD v1.1 exact match and token F1, each the best over an example's answers, times 100.

  An example without answers (SQuAD 2.0's unanswerable questions) scores 1 for both
  when the prediction is empty after normalisation, else 0, as SQuAD 2.0's script does.

  Args:
    targets: per example, the acceptable answers (or one answer string).
    predictions: per example, the predicted answer.

  Returns:
    {"em": mean exact match, "f1": mean token F1}, both in [0, 100].
  """
  em, f1 = [], []
  for answers, prediction in zip(targets, predictions, strict=True):
    answers = [answers] if isinstance(answers, str) else list(answers)
    normalized = normalize_squad_answer(prediction)
    if not answers:
      em.append(float(not normalized))
      f1.append(float(not normalized))
      continue
    em.append(max(float(normalize_squad_answer(a) == normalized) for a in answers))
    f1.append(max(_token_f1(a, prediction) for a in answers))
  return {"em": 100.0 * float(np.mean(em)), "f1": 100.0 * float(np.mean(f1))}
