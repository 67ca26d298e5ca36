r"""One prepared GPU benchmark: T5 1.1 small and base, bfloat16, each kernel set beside HF.

Runs tools/benchmark.py once per entry of the plan (`gpu_plan`, or `dry_run_plan` with
--dry_run), each in its own process, within one time budget (--budget_s), and writes
three files to OUT_DIR: gpu_benchmark.json (every run's figures, their status, the
package versions and the GPU), summary.txt (one line per run, then the top ops by
time of each profiled kernel set, from tools/profile_summary.py) and gpu_benchmark.log
(everything the runs printed). What the plan measures, most important first:

* base at batch 128 (inputs 512, targets 114, the shapes of docs/performance.md's
  GPU rows) with 'xla_gpu' and 'reference' (the kernel sets' A/B at the best batch);
* base at batch 128 profiled (`jax.profiler`, 3 steps) with 'xla_gpu' and without
  command buffers (`NO_COMMAND_BUFFERS`: the profiler shows a CUDA graph as one op);
* small at batch 64 and 128 and base at batch 32 with 'xla_gpu' and HF transformers
  (PyTorch) beside them (not beside base at batch 128, as in those rows: HF's
  activations there would share the GPU's memory with the memory JAX keeps); small at
  batch 64 also decodes (greedy and beam-4, 64 new tokens);
* base at batch 128 with XLA's own values of `console.GPU_XLA_FLAGS`' options
  (`console.GPU_XLA_DEFAULTS` in XLA_FLAGS), the other runs having ours;
* base at batch 128 with the chunked loss (`EncoderDecoderModel.loss_chunk_length`).

--kernels replaces every run's kernel sets; --only keeps some runs.

Compiling a T5 train step for a GPU takes longer than timing it (docs/performance.md),
so a first phase compiles every run's programs, one process per run and kernel set
(`benchmark.py --compile_only`), `COMPILE_WORKERS` at a time (--compile_workers; 0: no
such phase), into JAX's persistent compilation cache in the work folder, within half
of the budget; the timed runs then follow one at a time and load their programs from
it (each run's `compile_cache_hits` says how many). A run that does not finish in the time left is
stopped and recorded as such; one that fails runs again with its last kernel set alone
(`measure_all`); the files are always written.

It needs jax (with CUDA), flax, optax, orbax-checkpoint, gin-config, torch and
transformers; not seqio or TensorFlow (the batches are random token ids).
tools/gpu_benchmark.sh installs wheels carried in .whl/ first (docs/performance.md).

  python tools/gpu_benchmark.py /tmp/gpu_out            # on a GPU machine
  python tools/gpu_benchmark.py /tmp/gpu_out --dry_run  # tiny configs on the CPU
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tools"))
import profile_summary  # noqa: E402  (tools/profile_summary.py)

PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "flax", "optax", "orbax-checkpoint")
PACKAGES += ("gin-config", "torch", "transformers", "numpy")
OUTPUTS = ("gpu_benchmark.json", "summary.txt", "gpu_benchmark.log")
# Seconds kept for the summaries after the last run.
RESERVE_S = 20.0
# Train steps traced per kernel set of a profiled run.
PROFILE_STEPS = 3
# Compile processes at a time. One per CPU, all at once, finished none within the
# compile phase on a GPU machine; three at a time each took about as long as one alone
# (docs/performance.md).
COMPILE_WORKERS = 4
# Share of the budget for the compile phase.
COMPILE_SHARE = 0.5
# XLA_FLAGS of the profiled run: no command buffers, whose CUDA graphs the profiler
# shows as one op (every kernel of the step under `command_buffer_1`).
NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="


@dataclasses.dataclass(frozen=True)
class Run:
  """One tools/benchmark.py process of the plan.

  Attributes:
    name: the run's key in the JSON.
    flags: its command-line flags (shapes, kernel sets, peers), --json excluded.
    xla_flags: added to XLA_FLAGS ('' for none).
    profile: trace its train steps (--profile_dir in the work folder).
  """

  name: str
  flags: tuple[str, ...]
  xla_flags: str = ""
  profile: bool = False


def xla_defaults() -> str:
  """XLA_FLAGS of a run with XLA's own values of the start-up GPU options."""
  from t5x_lite.core import console  # imports gin: after main's check that it is there

  return " ".join(console.GPU_XLA_DEFAULTS)


def _flags(gin: str, batch: int, *extra: str, common: Sequence[str]) -> tuple[str, ...]:
  """The run's flags: `common` less those that `extra` sets again, then `extra`."""
  overridden = {flag.split("=", 1)[0] for flag in extra}
  kept = [flag for flag in common if flag.split("=", 1)[0] not in overridden]
  return (f"--gin_file={gin}", f"--batch_size={batch}", *kept, *extra)


def gpu_plan() -> list[Run]:
  """The H100/H200 plan of the module docstring, most important first."""
  common = (
    "--dtype=bfloat16",
    "--input_length=512",
    "--target_length=114",
    "--decode_length=64",
    "--num_beams=4",
    "--reps=3",
    "--warmup=2",
    "--settle=1",
    "--matmul_size=8192",
    "--kernels=xla_gpu",
  )
  small, base = "models/t5_1_1/small.gin", "models/t5_1_1/base.gin"
  no_decode = ("--skip=data,decode",)
  return [
    Run("base_b128", _flags(base, 128, *no_decode, "--kernels=xla_gpu,reference", common=common)),
    Run(
      "base_b128_profile",
      _flags(base, 128, *no_decode, "--reps=1", "--warmup=1", common=common),
      NO_COMMAND_BUFFERS,
      profile=True,
    ),
    Run("small_b64", _flags(small, 64, "--compare_hf", "--skip=data", common=common)),
    Run("base_b32", _flags(base, 32, "--compare_hf", *no_decode, common=common)),
    Run("small_b128", _flags(small, 128, "--compare_hf", *no_decode, common=common)),
    Run(
      "base_b128_xla_defaults",
      _flags(base, 128, *no_decode, common=common),
      xla_defaults(),
    ),
    Run(
      "base_b128_loss_chunk57",
      _flags(base, 128, "--loss_chunk_length=57", *no_decode, common=common),
    ),
  ]


def dry_run_plan() -> list[Run]:
  """The script's paths at tiny sizes on the CPU, in two runs: one with HF, decoding and
  the profile (its XLA_FLAGS without command buffers); one at another batch with XLA's
  own GPU options and the chunked loss."""
  common = (
    "--dtype=bfloat16",
    "--input_length=32",
    "--target_length=8",
    "--decode_length=4",
    "--num_beams=2",
    "--reps=2",
    "--warmup=1",
    "--settle=0",
    "--matmul_size=256",
    "--kernels=xla_gpu,reference",
  )
  tiny = "models/t5_1_1/tiny.gin"
  return [
    Run(
      "tiny_b2",
      _flags(tiny, 2, "--compare_hf", "--skip=data", common=common),
      NO_COMMAND_BUFFERS,
      profile=True,
    ),
    Run(
      "tiny_b4_xla_defaults_loss_chunk4",
      _flags(tiny, 4, "--loss_chunk_length=4", "--skip=data,decode", common=common),
      xla_defaults(),
    ),
  ]


def single_kernel_runs(run: Run) -> list[Run]:
  """`run` once per kernel set of its --kernels, each named '<run>.<kernels>'."""
  [kernels] = [f for f in run.flags if f.startswith("--kernels=")]
  return [
    dataclasses.replace(
      run,
      name=f"{run.name}.{name}",
      flags=tuple(f"--kernels={name}" if f == kernels else f for f in run.flags),
    )
    for name in kernels.split("=", 1)[1].split(",")
  ]


def compile_jobs(plan: Sequence[Run]) -> list[tuple[Run, Run]]:
  """(run, job) pairs of phase 1: one job per kernel set of each run (--kernels=<one>), so
  that the compilations of one run proceed in parallel too."""
  return [(run, job) for run in plan for job in single_kernel_runs(run)]


@dataclasses.dataclass
class Context:
  """Where the runs write, how they start, and when the budget ends."""

  out_dir: str
  work_dir: str
  python: str
  deadline: float
  log: Any  # the open gpu_benchmark.log
  lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)  # of the log

  def env(self, run: Run) -> dict[str, str]:
    """The run's environment: the compilation cache, no GPU preallocation (several
    processes share the GPU while compiling), XLA_FLAGS plus the run's."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH", "")) if p)
    env["JAX_COMPILATION_CACHE_DIR"] = os.path.join(self.work_dir, "compilation_cache")
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    env["PYTHONUNBUFFERED"] = "1"
    if run.xla_flags:
      env["XLA_FLAGS"] = " ".join(f for f in (env.get("XLA_FLAGS", ""), run.xla_flags) if f)
    return env

  def command(self, run: Run, compile_only: bool) -> list[str]:
    """tools/benchmark.py with the run's flags; compile_only drops HF and the profile."""
    phase = "compile" if compile_only else "measure"
    flags = [f for f in run.flags if not (compile_only and f == "--compare_hf")]
    flags.append(f"--json={os.path.join(self.work_dir, phase, run.name + '.json')}")
    if compile_only:
      flags.append("--compile_only")
    elif run.profile:
      # A fallback run ('<run>.<kernels>') profiles into its run's folder.
      folder = os.path.join(self.work_dir, "profile", run.name.split(".")[0])
      flags.append(f"--profile_dir={folder}")
      flags.append(f"--profile_steps={PROFILE_STEPS}")
    return [self.python, os.path.join(REPO, "tools", "benchmark.py"), *flags]


def execute(ctx: Context, run: Run, compile_only: bool, deadline: float) -> dict[str, Any]:
  """Runs one phase of `run` until `deadline` at most; its JSON figures (if it wrote
  them) and how it ended."""
  phase = "compile" if compile_only else "measure"
  os.makedirs(os.path.join(ctx.work_dir, phase), exist_ok=True)
  command = ctx.command(run, compile_only)
  start = time.time()
  if deadline - start <= 0:
    return {"status": "skipped: no time left in --budget_s", "seconds": 0.0}
  try:
    proc = subprocess.run(
      command, cwd=REPO, env=ctx.env(run), capture_output=True, text=True, timeout=deadline - start
    )
    status = "ok" if proc.returncode == 0 else f"failed with status {proc.returncode}"
    output = proc.stdout + proc.stderr
  except subprocess.TimeoutExpired as e:
    status = f"stopped after {deadline - start:.0f} s (--budget_s)"
    output = "".join(
      x.decode() if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr)
    )
  seconds = time.time() - start
  with ctx.lock:  # phase 1's jobs finish in parallel threads
    ctx.log.write(f"===== {run.name} ({phase}): {status}, {seconds:.1f} s\n")
    ctx.log.write(f"$ {' '.join(command)}\n{output}\n")
    ctx.log.flush()
  result: dict[str, Any] = {"status": status, "seconds": seconds}
  if status != "ok":
    lines = [line for line in output.splitlines() if line.strip()]
    result["last_lines"] = lines[-5:]
  path = os.path.join(ctx.work_dir, phase, run.name + ".json")
  if os.path.exists(path):
    with open(path) as f:
      result["figures"] = json.load(f)
  return result


def with_kernels(run: Run, kernels: str) -> Run:
  """`run` with its --kernels replaced by `kernels` (comma-separated kernel sets)."""
  flags = tuple(f"--kernels={kernels}" if f.startswith("--kernels=") else f for f in run.flags)
  return dataclasses.replace(run, flags=flags)


def compile_all(
  ctx: Context, plan: Sequence[Run], share: float, workers: int = COMPILE_WORKERS
) -> dict[str, Any]:
  """Phase 1: every run's programs compiled, `workers` processes at a time in plan
  order, within `share` of the time left; per run, how its jobs ended (none with
  workers=0: each timed run then compiles its own)."""
  if workers <= 0:
    return {run.name: {} for run in plan}
  deadline = time.time() + (ctx.deadline - time.time()) * share
  jobs = compile_jobs(plan)
  workers = max(1, min(len(jobs), workers, len(os.sched_getaffinity(0))))
  with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
    futures = [(run, job, pool.submit(execute, ctx, job, True, deadline)) for run, job in jobs]
  out: dict[str, Any] = {run.name: {} for run in plan}
  for run, job, future in futures:
    out[run.name][job.name] = future.result()
  return out


def measure_all(ctx: Context, plan: Sequence[Run]) -> dict[str, Any]:
  """Phase 2: the timed runs, one at a time, each with the time left. A run of several
  kernel sets that fails (not one stopped for time) runs again with its last set alone
  (the reference), under 'fallback', so that one set's failure leaves the others'."""
  results = {}
  for run in plan:
    results[run.name] = execute(ctx, run, False, ctx.deadline - RESERVE_S)
    alone = single_kernel_runs(run)
    if results[run.name]["status"].startswith("failed") and len(alone) > 1:
      results[run.name]["fallback"] = execute(ctx, alone[-1], False, ctx.deadline - RESERVE_S)
  return results


def environment() -> dict[str, Any]:
  """Package versions and the GPU (nvidia-smi), where there is one."""
  versions = {}
  for name in PACKAGES:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = None
  gpu = None
  try:
    query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    gpu = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
  except (OSError, subprocess.TimeoutExpired):
    pass
  return {"python": sys.version.split()[0], "packages": versions, "nvidia_smi": gpu}


def _side(figures: dict[str, Any], prefix: str, label: str) -> str:
  step = figures.get(f"{prefix}train_step_s")
  if not step:
    return f"{label} -"
  text = f"{label} {step * 1e3:.1f} ms, {figures[f'{prefix}train_tokens_per_s']:,.0f} tok/s"
  if figures.get(f"{prefix}train_mfu") is not None:
    text += f", MFU {figures[f'{prefix}train_mfu']:.1%}"
  if figures.get(f"{prefix}train_mfu_measured_matmul") is not None:
    text += f" ({figures[f'{prefix}train_mfu_measured_matmul']:.1%} of measured matmul)"
  for name in ("greedy", "beam"):
    if figures.get(f"{prefix}{name}_tokens_per_s"):
      text += f", {name} {figures[f'{prefix}{name}_tokens_per_s']:,.0f} tok/s"
  if figures.get(f"{prefix}train_last_loss_rel_diff") is not None:
    diff = figures[f"{prefix}train_last_loss_rel_diff"]
    text += f", last loss vs {figures.get('kernels')}'s: {diff:.1e} relative"
  return text


def run_line(name: str, measured: dict[str, Any], compiled: dict[str, Any]) -> str:
  """One line of summary.txt: how the run ended, then each side's figures."""
  head = f"{name} [{measured['status']}, {measured['seconds']:.0f} s"
  if compiled:
    head += "; compile phase: " + ", ".join(
      f"{job.split('.')[-1]} {r['status']} ({r['seconds']:.0f} s)" for job, r in compiled.items()
    )
  figures = measured.get("figures")
  if not figures:
    failed = head + "]" + "".join(f"\n    {line}" for line in measured.get("last_lines", []))
    if "fallback" in measured:
      failed += "\n  " + run_line("its last kernel set alone", measured["fallback"], {})
    return failed
  head += f"; {figures.get('compile_cache_hits', 0)} programs from the cache]"
  sides = [_side(figures, "", figures.get("kernels", "ours"))]
  for other in figures.get("settings", {}).get("compare_kernels", []):
    sides.append(_side(figures, f"kernels_{other}_", other))
  if "hf_train_step_s" in figures:
    sides.append(_side(figures, "hf_", "HF"))
  ratios = [
    f"{figures['kernels']}/{key.split('_vs_')[1].removeprefix('kernels_')} {value:.2f}x"
    for key, value in figures.items()
    if key.startswith("train_speedup_vs_") and value
  ]
  return "\n    ".join([head, *sides, ", ".join(ratios)])


def write_outputs(
  ctx: Context, plan: Sequence[Run], compiled: dict[str, Any], measured: dict[str, Any]
) -> None:
  """gpu_benchmark.json and summary.txt in the output folder."""
  lines = [run_line(run.name, measured[run.name], compiled[run.name]) for run in plan]
  profiles: dict[str, Any] = {}
  for run in (r for r in plan if r.profile):
    folder = os.path.join(ctx.work_dir, "profile", run.name)
    for kernels in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
      key = f"{run.name}/{kernels}"
      try:
        summary = profile_summary.summarize_dir(
          os.path.join(folder, kernels), top=10, runs=PROFILE_STEPS
        )
      except (profile_summary.ProfileError, OSError, ValueError) as e:
        profiles[key] = {"error": str(e)}
        lines.append(f"\nprofile {key}: ERROR: {e}")
        continue
      profiles[key] = profile_summary.summary_json(summary)
      lines.append(f"\nprofile {key}, top ops by time:\n{profile_summary.format_summary(summary)}")
  report = {
    "environment": environment(),
    "plan": [dataclasses.asdict(run) for run in plan],
    "compile_phase": compiled,
    "runs": measured,
    "profiles": profiles,
  }
  with open(os.path.join(ctx.out_dir, "gpu_benchmark.json"), "w") as f:
    json.dump(report, f, indent=2, sort_keys=True)
  with open(os.path.join(ctx.out_dir, "summary.txt"), "w") as f:
    f.write("\n".join(lines) + "\n")


def main(argv: Sequence[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("out_dir", help="where the three output files go (created)")
  parser.add_argument("--dry_run", action="store_true", help="tiny configs, on the CPU")
  parser.add_argument("--budget_s", type=float, default=None, help="seconds for everything")
  parser.add_argument("--work_dir", default=None, help="caches, traces (default: a temp dir)")
  parser.add_argument("--only", default="", help="comma-separated run names (default: all)")
  parser.add_argument(
    "--kernels", default="", help="kernel sets of every run, e.g. xla_gpu (default: the plan's)"
  )
  parser.add_argument(
    "--compile_workers",
    type=int,
    default=COMPILE_WORKERS,
    help="compile processes at a time in phase 1 (0: no compile phase)",
  )
  args = parser.parse_args(argv)
  check = subprocess.run([sys.executable, "-c", "import gin, flax, optax"], capture_output=True)
  if check.returncode != 0:
    print(
      f"ERROR: {sys.executable} cannot import gin-config, flax or optax "
      f"({check.stderr.decode().strip().splitlines()[-1]}); carry their wheels in .whl/ "
      "and run tools/gpu_benchmark.sh (docs/performance.md)",
      file=sys.stderr,
    )
    return 1
  plan = dry_run_plan() if args.dry_run else gpu_plan()
  if args.only:
    unknown = sorted(set(args.only.split(",")) - {run.name for run in plan})
    if unknown:
      names = ", ".join(run.name for run in plan)
      print(
        f"ERROR: --only={args.only}: no run named {', '.join(unknown)} (runs: {names})",
        file=sys.stderr,
      )
      return 1
    plan = [run for run in plan if run.name in args.only.split(",")]
  if args.kernels:
    from t5x_lite.kernels import registry  # imports jax: after the check above

    for name in args.kernels.split(","):
      if name not in registry.NAMES:
        print(
          f"ERROR: --kernels={args.kernels}: no kernel set named {name} "
          f"(sets: {', '.join(registry.NAMES)})",
          file=sys.stderr,
        )
        return 1
    plan = [with_kernels(run, args.kernels) for run in plan]
  budget = args.budget_s or (300.0 if args.dry_run else 450.0)
  os.makedirs(args.out_dir, exist_ok=True)
  work_dir = args.work_dir or tempfile.mkdtemp(prefix="gpu_benchmark_")
  with open(os.path.join(args.out_dir, "gpu_benchmark.log"), "w") as log:
    ctx = Context(args.out_dir, work_dir, sys.executable, time.time() + budget, log)
    compiled = compile_all(ctx, plan, share=COMPILE_SHARE, workers=args.compile_workers)
    measured = measure_all(ctx, plan)
    write_outputs(ctx, plan, compiled, measured)
  print(open(os.path.join(args.out_dir, "summary.txt")).read(), end="")
  return 0 if all(r["status"] == "ok" for r in measured.values()) else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
