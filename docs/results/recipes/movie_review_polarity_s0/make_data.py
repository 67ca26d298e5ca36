"""Writes my_data-style TSV files of Pang & Lee's movie review polarity (NLTK's zip).

Each review joined into one line (`sentence<TAB>label`, 1 = pos); the reviews of the
standard tenth fold (file names cv900-cv999) are the validation split, the rest train:
1,800 and 200 reviews, half of each positive.

  python make_data.py ../shared/data/nltk/movie_reviews.zip movie_data
"""

import os
import re
import sys
import zipfile


def main(archive: str, out_dir: str) -> None:
  reviews = zipfile.ZipFile(archive)
  splits: dict[str, list[str]] = {"train.tsv": [], "dev.tsv": []}
  for name in sorted(reviews.namelist()):
    match = re.search(r"/(pos|neg)/cv(\d)\d\d_\d+\.txt$", name)
    if not match:
      continue
    text = " ".join(reviews.read(name).decode("utf-8").split())
    split = "dev.tsv" if match.group(2) == "9" else "train.tsv"
    splits[split].append(f"{text}\t{int(match.group(1) == 'pos')}")
  os.makedirs(out_dir, exist_ok=True)
  for file, rows in splits.items():
    with open(os.path.join(out_dir, file), "w") as f:
      f.write("sentence\tlabel\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
  main(*sys.argv[1:])
