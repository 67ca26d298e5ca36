"""Tests of the SQuAD metric of t5x_lite.data.task_metrics against the official v1.1 definitions.

The expected numbers are worked out by hand from the official SQuAD v1.1
evaluation script: normalise (lowercase, drop punctuation, drop the words a/an/the,
collapse whitespace), exact match of the normalised strings, F1 of the bags of
normalised tokens (0 when no token is shared), each the maximum over an example's
answers, averaged over examples and scaled to 0-100.
"""

import pytest

from t5x_lite.data import task_metrics

# (answers, prediction, exact match, token F1), one per example.
SAMPLE = [
  (["the Eiffel Tower"], "Eiffel tower.", 1, 1.0),  # article, case, punctuation
  (["Denver Broncos", "The Broncos"], "the broncos", 1, 1.0),  # the second answer matches
  (["Saint-Pierre"], "saint pierre", 0, 0.0),  # "saintpierre": punctuation is deleted, not spaced
  (["an analysis"], "Analysis!", 1, 1.0),  # "an" as a word only: "analysis" keeps its "an"
  (["quick brown fox"], "the brown dog", 0, 0.4),  # 1 shared: P 1/2, R 1/3
  (["Paris"], "", 0, 0.0),  # empty prediction
  (["1990 census", "census of 1990 results"], "1990 census results", 0, 6 / 7),  # 0.8 vs 6/7
  (["New York New York"], "new york", 0, 2 / 3),  # bags: P 2/2, R 2/4
  ("  Marie   CURIE ", "marie curie", 1, 1.0),  # one answer given as a string; whitespace
]


def test_normalize_squad_answer():
  assert task_metrics.normalize_squad_answer("  The  Eiffel-Tower, a Landmark! ") == (
    "eiffeltower landmark"
  )
  assert task_metrics.normalize_squad_answer("Theatre an anthem") == "theatre anthem"


@pytest.mark.parametrize("answers, prediction, em, f1", SAMPLE)
def test_squad_per_example(answers, prediction, em, f1):
  result = task_metrics.squad([answers], [prediction])
  assert result == pytest.approx({"em": 100.0 * em, "f1": 100.0 * f1})


def test_squad_means_over_examples():
  answers, predictions, _, _ = zip(*SAMPLE)
  result = task_metrics.squad(list(answers), list(predictions))
  # em: 4 of 9 exact; f1: (4 + 0.4 + 6/7 + 2/3) / 9.
  assert result == pytest.approx({"em": 400 / 9, "f1": 100 * (4 + 0.4 + 6 / 7 + 2 / 3) / 9})
  assert result["f1"] == pytest.approx(65.8201058)


def test_squad_answer_of_only_articles_matches_exactly_with_zero_f1():
  """v1.1 compares '' == '' as an exact match, but F1 has no shared token."""
  assert task_metrics.squad([["The"]], ["a"]) == {"em": 100.0, "f1": 0.0}


def test_log_lines_say_which_metrics_are_correlations_times_100():
  assert task_metrics.shown("matthews_corrcoef", 23.456) == "matthews_corrcoef 23.46 (x100)"
  assert task_metrics.shown("spearman_corrcoef", -5.0) == "spearman_corrcoef -5 (x100)"
  assert task_metrics.shown("accuracy", 91.25) == "accuracy 91.25"
  assert task_metrics.matthews_corrcoef([0, 1, 1, 0], [0, 1, 1, 0]) == {"matthews_corrcoef": 100.0}


def test_matthews_correlation_matches_hand_computations():
  # Binary: tp=2, tn=1, fp=1, fn=1: (2*1 - 1*1) / sqrt(3*3*2*2) = 1/6.
  mcc = task_metrics.matthews_corrcoef([1, 1, 1, 0, 0], [1, 1, 0, 1, 0])["matthews_corrcoef"]
  assert mcc == pytest.approx(100 / 6)
  assert task_metrics.matthews_corrcoef([0, 1, 0, 1], [1, 0, 1, 0]) == {"matthews_corrcoef": -100.0}
  # One predicted class only: undefined, reported as 0.
  assert task_metrics.matthews_corrcoef([0, 1, 1], [1, 1, 1]) == {"matthews_corrcoef": 0.0}
  # An invalid prediction (-1) is a third class (Gorodkin). Over the labels (-1, 0, 1):
  # target counts (0, 1, 2), prediction counts (1, 1, 1), 2 right of n = 3:
  # (2*3 - 3) / sqrt((9 - 5) * (9 - 3)) = 3 / sqrt(24).
  mcc = task_metrics.matthews_corrcoef([0, 1, 1], [0, -1, 1])["matthews_corrcoef"]
  assert mcc == pytest.approx(100 * 3 / 24**0.5)
  # Three classes, all right but one: per-class counts t = (2, 1, 1), p = (1, 2, 1), trace 3,
  # n = 4: (3*4 - 5) / sqrt((16 - 6) * (16 - 6)) = 0.7.
  mcc = task_metrics.matthews_corrcoef([0, 0, 1, 2], [0, 1, 1, 2])["matthews_corrcoef"]
  assert mcc == pytest.approx(70.0)


def test_binary_f1_matches_hand_computations():
  # tp=1, fp=1, fn=1: 2/(2+1+1).
  assert task_metrics.f1_with_invalid([1, 1, 0, 0], [1, 0, 1, 0]) == {"f1": 50.0}
  # No positive targets and no positive predictions: 0, not a division by zero.
  assert task_metrics.f1_with_invalid([0, 0], [0, 0]) == {"f1": 0.0}
  # An invalid prediction is wrong either way: for target 1 a false negative, for 0 a false
  # positive: tp=1, fn=1, fp=1.
  assert task_metrics.f1_with_invalid([1, 1, 0], [1, 7, -1]) == {"f1": 50.0}


def test_a_question_without_answers_is_right_only_when_the_prediction_is_empty():
  """SQuAD 2.0's unanswerable questions: the official v2.0 script scores 1 for an empty
  prediction (exact match and F1; "The." normalises to empty) and 0 for any other."""
  assert task_metrics.squad([[], [], []], ["", "The.", "a cat"]) == pytest.approx(
    {"em": 200 / 3, "f1": 200 / 3}
  )
