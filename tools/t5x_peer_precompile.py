"""T5X's side of the per-chip memory comparison, with XLA's cost analysis added.

Runs ../shared/peers/t5x_precompile.py (T5X's own train step, compiled for a TPU
slice on compile-only devices) unchanged, in the T5X venv, and adds to its JSON the
compiled step's `cost_analysis()` (FLOPs and bytes accessed per chip), which the
roofline columns of the README's table need and the peer script does not record:

  $HOME/t5x_peer/venv/bin/python tools/t5x_peer_precompile.py \
      --json_out=t5x_base_2x4.json -- --size=base --topology=v5e:2x4

Arguments after `--` go to the peer script as they are (see its docstring).
"""

import argparse
import json
import os
import runpy
import sys

DEFAULT_SCRIPT = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
  "..",
  "shared",
  "peers",
  "t5x_precompile.py",
)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json_out", required=True, help="where the merged JSON goes")
  parser.add_argument("--script", default=DEFAULT_SCRIPT, help="the peer's t5x_precompile.py")
  args, peer_args = parser.parse_known_args()
  peer_args = [a for a in peer_args if a != "--"]
  if not os.path.isfile(args.script):
    sys.exit(f"ERROR: T5X precompile script not found: {args.script} (pass --script)")

  import jax  # pylint: disable=g-import-not-at-top  # the T5X venv's jax

  costs = {}
  memory_analysis = jax.stages.Compiled.memory_analysis

  def memory_analysis_and_costs(compiled):
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):
      analysis = analysis[0] if analysis else {}
    for name, key in (("xla_flops_per_chip", "flops"), ("xla_bytes_per_chip", "bytes accessed")):
      value = (analysis or {}).get(key)
      costs[name] = float(value) if value is not None and value >= 0 else None
    return memory_analysis(compiled)

  jax.stages.Compiled.memory_analysis = memory_analysis_and_costs
  peer_json = args.json_out + ".peer"
  sys.argv = [args.script, *peer_args, f"--json_out={peer_json}"]
  try:
    runpy.run_path(args.script, run_name="__main__")
  except SystemExit as e:
    if e.code:
      raise
  with open(peer_json) as f:
    result = json.load(f)
  os.remove(peer_json)
  result.update(costs)
  with open(args.json_out, "w") as f:
    json.dump(result, f, indent=1)
  print(json.dumps(costs), flush=True)


if __name__ == "__main__":
  main()
