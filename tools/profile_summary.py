r"""Top XLA ops by time from a `jax.profiler` trace: where a compiled step spends its time.

Reads the Chrome/Perfetto trace (`*.trace.json.gz`) that `jax.profiler.trace(dir)`
writes under dir/plugins/profile/<run>/, keeps the events of XLA ops (those whose args
name an `hlo_op`): on a GPU the kernels on the device's streams, on a CPU XLA:CPU's
thunks on the host threads. It takes the program with the most op time (the train
step), sums each op's time over the traced runs, and prints the top ops per run with
their share, kind (fusion kind, or a custom call's target such as cuBLAS' gemm or
cuDNN's attention) and where they come from (the op_name jax recorded, e.g.
`.../encoder/layers_3/mlp/wi_0/dot_general`), read from the compiled program's HLO
text when `hlo.txt` lies beside the trace (tools/benchmark.py --profile_dir writes it).
Only the standard library: it runs wherever the trace is, without TensorBoard.

  python tools/profile_summary.py /tmp/profile/xla_gpu --top=10 --json=/tmp/top.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import sys
from collections.abc import Iterable, Sequence
from typing import Any

# One HLO instruction: name, result shape, opcode (shapes of tuples hold ', ').
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = .*? (?P<opcode>[a-z][\w\-]*)\(")
_FUSION_KIND = re.compile(r", kind=(k\w+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_BACKEND_KIND = re.compile(r'"kind":"(__[^"]+)"')
_OP_NAME = re.compile(r'op_name="([^"]+)"')


# The HLO name XLA:GPU gives a command buffer (a CUDA graph of many ops' kernels).
COMMAND_BUFFER = "command_buffer"


class ProfileError(ValueError):
  """No trace, or no XLA op in it: one line for the user."""


@dataclasses.dataclass(frozen=True)
class Op:
  """What the compiled program says of one HLO instruction.

  Attributes:
    kind: a custom call's target, a custom fusion's backend kind (e.g.
      '__triton_gemm'), a fusion's kind ('kLoop', 'kInput', 'kOutput'), or the opcode.
    where: jax's op_name of the instruction ('' if none).
  """

  kind: str
  where: str = ""


@dataclasses.dataclass(frozen=True)
class Row:
  """One op's time over the traced runs.

  Attributes:
    op: the HLO instruction name (`hlo_op`).
    seconds_per_run: its summed time per run of the program.
    share: its part of the program's summed op time.
    calls_per_run: its events per run (a fusion may launch several kernels).
    kind: `Op.kind` ('' without the HLO text).
    where: `Op.where`.
    event: the name of its longest event (on a GPU, the kernel's).
  """

  op: str
  seconds_per_run: float
  share: float
  calls_per_run: float
  kind: str
  where: str
  event: str


@dataclasses.dataclass(frozen=True)
class Summary:
  """The top ops of one program in one trace."""

  trace: str
  program: str
  runs: int
  seconds_per_run: float
  device: str
  rows: list[Row]
  kinds: dict[str, float]  # kind -> share of the op time


def find_trace(path: str) -> str:
  """The newest `*.trace.json.gz` at or under `path` (a file, or a profile folder)."""
  if os.path.isfile(path):
    return path
  found = glob.glob(os.path.join(path, "**", "*.trace.json.gz"), recursive=True)
  if not found:
    raise ProfileError(f"no *.trace.json.gz under {path} (write one with jax.profiler.trace)")
  return max(found, key=os.path.getmtime)


def read_hlo(text: str) -> dict[str, Op]:
  """HLO instruction name -> `Op`, from a compiled program's `as_text()`."""
  ops = {}
  for line in text.splitlines():
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    opcode = match["opcode"]
    kind = opcode
    if opcode == "custom-call" and (target := _TARGET.search(line)):
      kind = target[1]
    elif opcode == "fusion" and (fusion := _FUSION_KIND.search(line)):
      backend = _BACKEND_KIND.search(line)
      kind = backend[1] if fusion[1] == "kCustom" and backend else fusion[1]
    op_name = _OP_NAME.search(line)
    ops[match["name"]] = Op(kind, op_name[1] if op_name else "")
  return ops


def _with_op(event: dict[str, Any], op: str) -> dict[str, Any]:
  return {**event, "args": {**(event.get("args") or {}), "hlo_op": op}}


def op_events(trace: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
  """(where they ran, the complete events of XLA ops, each naming its `hlo_op`).

  A device's (GPU, TPU) where any ran on one, else the host's (XLA:CPU). On a device,
  the kernels on its stream lines ('Stream #...') where they name their op; else its
  'XLA Ops' line (the op is the event's name), so that an op is never counted twice;
  else every device event, by its kernel name.
  """
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  processes, lines = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      processes[e["pid"]] = e["args"]["name"]
    elif e.get("ph") == "M" and e.get("name") == "thread_name":
      lines[(e["pid"], e.get("tid"))] = e["args"]["name"]
  complete = [e for e in events if e.get("ph") == "X"]
  on_device = [e for e in complete if processes.get(e.get("pid"), "").startswith("/device:")]
  line = lambda e: lines.get((e.get("pid"), e.get("tid")), "")  # noqa: E731
  annotated = [e for e in on_device if "hlo_op" in (e.get("args") or {})]
  streams = [e for e in annotated if line(e).startswith("Stream")]
  chosen = streams or [_with_op(e, e.get("name", "?")) for e in on_device if line(e) == "XLA Ops"]
  chosen = chosen or annotated or [_with_op(e, e.get("name", "?")) for e in on_device]
  if not on_device:
    chosen = [e for e in complete if "hlo_op" in (e.get("args") or {})]
  where = sorted({processes.get(e.get("pid"), "?") for e in chosen})
  return ", ".join(where), chosen


def _short(op_name: str, parts: int = 6) -> str:
  """The last `parts` components of an op_name, e.g. '.../layers_0/mlp/wi_0/dot_general'."""
  components = op_name.split("/")
  return op_name if len(components) <= parts else ".../" + "/".join(components[-parts:])


def summarize(
  trace_path: str, hlo: dict[str, Op] | None = None, top: int = 10, runs: int | None = None
) -> Summary:
  """The `top` ops by time of the program with the most op time in the trace.

  Args:
    trace_path: a `*.trace.json.gz` file.
    hlo: `read_hlo` of the program, to name each op's kind and source.
    top: rows to keep.
    runs: runs of the program traced; None: its distinct `run_id`s (1 if none).

  Raises:
    ProfileError: no XLA op in the trace.
  """
  with gzip.open(trace_path, "rt") as f:
    trace = json.load(f)
  device, events = op_events(trace)
  if not events:
    raise ProfileError(f"{trace_path}: no XLA op events (events whose args name an hlo_op)")
  by_program: dict[str, float] = collections.Counter()
  for e in events:
    by_program[e["args"].get("hlo_module", "?")] += float(e.get("dur", 0.0))
  program = max(by_program, key=by_program.get)
  events = [e for e in events if e["args"].get("hlo_module", "?") == program]
  run_ids = {e["args"]["run_id"] for e in events if "run_id" in e["args"]}
  runs = runs or max(1, len(run_ids))
  return _rows(trace_path, program, runs, device, events, hlo or {}, top)


def _rows(
  trace_path: str,
  program: str,
  runs: int,
  device: str,
  events: Iterable[dict[str, Any]],
  hlo: dict[str, Op],
  top: int,
) -> Summary:
  micros: dict[str, float] = collections.Counter()
  calls: dict[str, int] = collections.Counter()
  longest: dict[str, tuple[float, str]] = {}
  for e in events:
    op, duration = e["args"]["hlo_op"], float(e.get("dur", 0.0))
    micros[op] += duration
    calls[op] += 1
    longest[op] = max(longest.get(op, (-1.0, "")), (duration, e.get("name", "")))
  total = sum(micros.values())
  kinds: dict[str, float] = collections.Counter()
  for op, duration in micros.items():
    kinds[hlo.get(op, Op("?")).kind] += duration / total
  rows = [
    Row(
      op=op,
      seconds_per_run=micros[op] * 1e-6 / runs,
      share=micros[op] / total,
      calls_per_run=calls[op] / runs,
      kind=hlo.get(op, Op("")).kind,
      where=_short(hlo.get(op, Op("")).where),
      event=longest[op][1],
    )
    for op in sorted(micros, key=micros.get, reverse=True)[:top]
  ]
  kinds = dict(sorted(kinds.items(), key=lambda item: -item[1]))
  return Summary(trace_path, program, runs, total * 1e-6 / runs, device, rows, kinds)


def format_summary(summary: Summary) -> str:
  """The summary as a plain-text table."""
  lines = [
    f"trace: {summary.trace}",
    f"program {summary.program} on {summary.device}: {summary.runs} runs, "
    f"{summary.seconds_per_run * 1e3:.3f} ms of op time per run (summed over ops)",
    f"{'rank':>4} {'ms/run':>9} {'share':>6} {'calls':>6}  {'op':28} {'kind':22} where",
  ]
  for rank, row in enumerate(summary.rows, 1):
    lines.append(
      f"{rank:>4} {row.seconds_per_run * 1e3:>9.3f} {row.share:>6.1%} {row.calls_per_run:>6g}  "
      f"{row.op[:28]:28} {row.kind[:22]:22} {row.where or row.event}"
    )
  lines.append("op time by kind: " + ", ".join(f"{k} {v:.1%}" for k, v in summary.kinds.items()))
  graphs = sum(row.share for row in summary.rows if row.op.startswith(COMMAND_BUFFER))
  if graphs >= 0.5:
    lines.append(
      f"note: {graphs:.0%} of the op time is in command buffers (CUDA graphs), whose kernels "
      "all carry the buffer's name; profile with XLA_FLAGS=--xla_gpu_enable_command_buffer= "
      "to see each op"
    )
  return "\n".join(lines)


def summary_json(summary: Summary) -> dict[str, Any]:
  """The summary as JSON-ready data."""
  return dataclasses.asdict(summary)


def summarize_dir(path: str, top: int = 10, runs: int | None = None) -> Summary:
  """`summarize` of the newest trace under `path`, with `path`/hlo.txt when it exists."""
  trace = find_trace(path)
  hlo_path = os.path.join(path if os.path.isdir(path) else os.path.dirname(path), "hlo.txt")
  hlo = None
  if os.path.exists(hlo_path):
    with open(hlo_path) as f:
      hlo = read_hlo(f.read())
  return summarize(trace, hlo, top, runs)


def main(argv: Sequence[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("path", help="a profile folder (jax.profiler.trace's) or a trace file")
  parser.add_argument("--top", type=int, default=10, help="ops to list")
  parser.add_argument(
    "--runs", type=int, default=None, help="program runs traced (default: counted)"
  )
  parser.add_argument("--json", default=None, help="also write the summary as JSON here")
  args = parser.parse_args(argv)
  try:
    summary = summarize_dir(args.path, args.top, args.runs)
  except (ProfileError, OSError, json.JSONDecodeError) as e:
    print(f"ERROR: {e}", file=sys.stderr)
    return 1
  print(format_summary(summary))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(summary_json(summary), f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
