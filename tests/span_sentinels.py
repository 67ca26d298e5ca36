"""Undoing the sentinel objectives (span corruption, i.i.d. replace-spans) in tests."""

from __future__ import annotations

from collections.abc import Sequence


def put_back(inputs: Sequence[int], targets: Sequence[int], first_sentinel: int) -> list[int]:
  """The text an example was made from: each sentinel of `inputs` (an id of at least
  `first_sentinel`) replaced by the tokens that follow the same sentinel in `targets`.
  Both without their EOS."""
  runs: dict[int, list[int]] = {}
  run: list[int] = []
  for t in targets:
    if t >= first_sentinel:
      run = runs.setdefault(int(t), [])
    else:
      run.append(int(t))
  return [u for t in inputs for u in (runs[int(t)] if t >= first_sentinel else [int(t)])]
