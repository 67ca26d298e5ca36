"""tools/compare.py's rows run by a fake runner, in a process of their own.

compare.py defines absl flags at import, as tools/benchmark.py does with some of the
same names, so the two cannot be imported into one test process. tests/compare_test.py
runs this script instead; it prints, as one JSON line, each run's arguments, the rows
and the Markdown table:

  python tests/compare_fake_runs.py TABLE_DIR ROW_INDEX --table=objectives --seeds=N

The fake runner writes the metrics a run's model directory would hold: an eval loss of
5 + seed and an accuracy of 60 + 4 * seed on each GLUE task.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import compare  # noqa: E402  (tools/compare.py)
from absl import flags  # noqa: E402

GLUE_TASKS = ("local_glue_sst2", "local_glue_rte")


class FakeRunner:
  """Records each run's arguments and writes the metrics its model directory would hold."""

  def __init__(self, table_dir: str):
    self.table_dir, self.calls = table_dir, []

  def run(self, args: list[str], log_path: str) -> float:
    del log_path
    self.calls.append(args)
    model_dir = next(a.split("=", 1)[1] for a in args if a.startswith("--gin.MODEL_DIR="))
    seeds = [b.rsplit(" ", 1)[1] for b in args if b.startswith("--gin_bindings=RANDOM_SEED")]
    seed = int(seeds[-1]) if seeds else 0
    os.makedirs(model_dir)
    records = [{"split": "eval", "loss": 5.0 + seed}]
    records += [{"split": "eval", f"{t}/accuracy": 60.0 + 4 * seed} for t in GLUE_TASKS]
    Path(model_dir, "metrics.jsonl").write_text("\n".join(map(json.dumps, records)) + "\n")
    return 10.0


def main() -> None:
  table_dir, index, *argv = sys.argv[1:]
  flags.FLAGS(["compare.py", *argv])
  infos = []

  def model_info(variant: compare.Variant, directory: str) -> dict:
    infos.append(directory)
    return {"params": 1, "flops_per_token": 2.0 if variant.pretrained else None}

  compare._model_info = model_info
  runner = FakeRunner(table_dir)
  rows = compare.variants(flags.FLAGS.table)
  variant = rows[int(index)]
  runs = [
    compare.run_variant(runner, variant, flags.FLAGS.table, s) for s in range(flags.FLAGS.seeds)
  ]
  row = compare.seeds_row(runs)
  result = {
    "calls": runner.calls,
    "runs": runs,
    "row": row,
    "table": compare.markdown([row], flags.FLAGS.table),
    "model_info_dirs": infos,
    "variant": variant.name,
    "last_variant": rows[-1].name,
  }
  print(json.dumps(result))


if __name__ == "__main__":
  main()
