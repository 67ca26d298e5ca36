"""Writes my_data-style TSV files of ABC news sentences labelled by their programme (NLTK).

NLTK's `abc` corpus holds one sentence a line from two Australian Broadcasting
Commission programmes of 2006, Rural News and Science News. The task: given one
sentence, which programme ran it. Lines of 8 words or more; the first 80% of each
programme's lines are the training pool and the last 20% the validation pool (so no
story is split across them), from which 2,000 and 500 a programme are drawn with a
fixed seed: 4,000 training and 1,000 validation sentences, half of each 'rural'.

  python make_data.py ../shared/data/nltk/abc.zip abc_data
"""

import os
import random
import sys
import zipfile

PER_LABEL = {"train.tsv": 2000, "dev.tsv": 500}


def main(archive: str, out_dir: str) -> None:
  corpus = zipfile.ZipFile(archive)
  rng = random.Random(0)
  splits: dict[str, list[str]] = {name: [] for name in PER_LABEL}
  for label in ("rural", "science"):
    lines = corpus.read(f"abc/{label}.txt").decode("utf-8", errors="replace").splitlines()
    lines = [" ".join(line.split()) for line in lines]
    lines = [line for line in lines if len(line.split()) >= 8]
    cut = int(0.8 * len(lines))
    for name, pool in (("train.tsv", lines[:cut]), ("dev.tsv", lines[cut:])):
      splits[name] += [f"{text}\t{label}" for text in rng.sample(pool, PER_LABEL[name])]
  os.makedirs(out_dir, exist_ok=True)
  for name, rows in splits.items():
    rng.shuffle(rows)
    with open(os.path.join(out_dir, name), "w") as f:
      f.write("sentence\tlabel\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
  main(*sys.argv[1:])
