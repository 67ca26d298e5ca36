"""A bag-of-words reference for the ABC programme task: multinomial Naive Bayes over
lower-cased word unigrams with add-one smoothing, trained on train.tsv and scored on
dev.tsv (accuracy, %).

  python bow_baseline.py abc_data
"""

import collections
import math
import re
import sys


def _rows(path: str) -> list[tuple[list[str], str]]:
  with open(path) as f:
    next(f)  # the header
    return [
      (re.findall(r"[a-z0-9']+", text.lower()), label)
      for text, label in (line.rstrip("\n").rsplit("\t", 1) for line in f)
    ]


def main(data_dir: str) -> None:
  train, dev = _rows(f"{data_dir}/train.tsv"), _rows(f"{data_dir}/dev.tsv")
  counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
  docs = collections.Counter(label for _, label in train)
  for words, label in train:
    counts[label].update(words)
  vocab = set().union(*counts.values())
  totals = {label: sum(c.values()) for label, c in counts.items()}

  def score(words: list[str], label: str) -> float:
    prior = math.log(docs[label] / len(train))
    return prior + sum(
      math.log((counts[label][w] + 1) / (totals[label] + len(vocab))) for w in words if w in vocab
    )

  right = sum(max(docs, key=lambda label: score(words, label)) == gold for words, gold in dev)
  print(f"{100 * right / len(dev):.1f}")


if __name__ == "__main__":
  main(*sys.argv[1:])
