"""Tiny archives laid out like ../shared/data/nltk, for the tests of the pre-training corpus."""

from __future__ import annotations

import zipfile
from pathlib import Path

WORDS = (
  "river stone light garden music winter harbor village letter window morning candle "
  "mountain forest bridge market summer ocean silver thunder meadow castle lantern orchard"
).split()


def sentences(tag: str, n: int) -> list[str]:
  """`n` distinct sentences that name their file (`tag`)."""
  return [
    f"{tag} {WORDS[i % len(WORDS)]} and the {WORDS[(3 * i + 1) % len(WORDS)]} {i} ."
    for i in range(n)
  ]


def _write_zip(path: Path, members: dict[str, str]) -> None:
  with zipfile.ZipFile(path, "w") as archive:
    for name, text in members.items():
      archive.writestr(name, text)


def write_nltk(data_dir: Path) -> None:
  """Tiny archives laid out like NLTK's (a README inside each, as the real ones have)."""
  (data_dir / "nltk").mkdir(parents=True, exist_ok=True)
  tagged = [" ".join(f"{w}/nn" for w in s.split()) for s in sentences("brown", 10)]
  _write_zip(
    data_dir / "nltk/brown.zip",
    {
      "brown/README": "not text",
      "brown/ca01": "\n\n\t" + "\n\n\t".join(tagged[:5]) + " ``/`` quoted/nn ''/''\n",
      "brown/ca02": "\n\n\t" + "\n\n\t".join(tagged[5:]) + "\n",
    },
  )
  reviews = sentences("moviereview", 8)
  _write_zip(
    data_dir / "nltk/movie_reviews.zip",
    {f"movie_reviews/pos/cv{i:03d}.txt": f"{s} \nit was fine . \n" for i, s in enumerate(reviews)},
  )
  for name in ("state_union", "inaugural"):
    speeches = sentences(name.replace("_", ""), 6)
    _write_zip(
      data_dir / f"nltk/{name}.zip",
      {f"{name}/{1900 + i}-Someone.txt": f"{s}\n\nmore of it .\n" for i, s in enumerate(speeches)},
    )
  for name in ("abc", "webtext"):
    lines = sentences(f"{name}line", 12)
    _write_zip(
      data_dir / f"nltk/{name}.zip",
      {f"{name}/README": "not text", f"{name}/a.txt": "\n".join(lines) + "\n"},
    )
