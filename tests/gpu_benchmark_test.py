"""Tests for tools/gpu_benchmark.sh and tools/gpu_benchmark.py: the prepared GPU run.

The slow test runs the whole script on the CPU with --dry_run (tiny configs): the
parallel compile phase, the timed runs with both kernel sets and HF, XLA's own GPU
options, the chunked loss, the profile and its summary, the three output files. The
fast tests check the GPU plan itself (what a GPU session will measure) and the pieces.
"""

import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from t5x_lite.core import console
from xla_flags import xla_flags

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import gpu_benchmark  # noqa: E402  (tools/gpu_benchmark.py)


def _flag(run: gpu_benchmark.Run, name: str) -> str | None:
  values = [f.split("=", 1)[1] for f in run.flags if f.startswith(f"--{name}=")]
  return values[-1] if values else None


def test_the_gpu_plan_measures_small_and_base_at_two_batches_mostly_beside_hf():
  plan = {run.name: run for run in gpu_benchmark.gpu_plan()}
  shapes = {
    name: (_flag(run, "gin_file"), int(_flag(run, "batch_size"))) for name, run in plan.items()
  }
  assert set(shapes.values()) == {
    ("models/t5_1_1/small.gin", 64),
    ("models/t5_1_1/small.gin", 128),
    ("models/t5_1_1/base.gin", 32),
    ("models/t5_1_1/base.gin", 128),
  }
  with_hf = {shapes[n] for n, run in plan.items() if "--compare_hf" in run.flags}
  assert ("models/t5_1_1/base.gin", 128) not in with_hf and len(with_hf) == 3
  for run in plan.values():
    assert len([f for f in run.flags if f.startswith("--kernels=")]) == 1
    expected = "xla_gpu,reference" if run.name == "base_b128" else "xla_gpu"
    assert _flag(run, "kernels") == expected
    assert _flag(run, "dtype") == "bfloat16" and _flag(run, "matmul_size") == "8192"
    assert (_flag(run, "input_length"), _flag(run, "target_length")) == ("512", "114")
  assert [n for n, run in plan.items() if run.profile] == ["base_b128_profile"]
  assert plan["base_b128_profile"].xla_flags == "--xla_gpu_enable_command_buffer="
  assert [n for n, run in plan.items() if "decode" not in _flag(run, "skip")] == ["small_b64"]
  assert plan["base_b128_xla_defaults"].xla_flags == " ".join(console.GPU_XLA_DEFAULTS)
  assert _flag(plan["base_b128_loss_chunk57"], "loss_chunk_length") == "57"
  assert list(plan)[:2] == ["base_b128", "base_b128_profile"]  # the most important first


def test_compile_jobs_split_the_kernel_sets_and_drop_hf(tmp_path):
  run = gpu_benchmark.gpu_plan()[0]
  jobs = gpu_benchmark.compile_jobs([run])
  assert [job.name for _, job in jobs] == ["base_b128.xla_gpu", "base_b128.reference"]
  ctx = gpu_benchmark.Context(str(tmp_path), str(tmp_path / "work"), "python3", 0.0, None)
  command = ctx.command(jobs[1][1], compile_only=True)
  assert "--kernels=reference" in command and "--compile_only" in command
  assert "--compare_hf" not in command and not any("profile_dir" in c for c in command)
  profiled = gpu_benchmark.gpu_plan()[1]
  measured = ctx.command(profiled, compile_only=False)
  assert f"--profile_dir={tmp_path}/work/profile/base_b128_profile" in measured
  assert f"--profile_steps={gpu_benchmark.PROFILE_STEPS}" in measured
  hf_run = gpu_benchmark.gpu_plan()[2]
  assert "--compare_hf" in ctx.command(hf_run, compile_only=False)
  assert "--compare_hf" not in ctx.command(hf_run, compile_only=True)
  env = ctx.env(dataclasses.replace(run, xla_flags="--xla_a=1"))
  assert env["JAX_COMPILATION_CACHE_DIR"] == f"{tmp_path}/work/compilation_cache"
  assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
  assert env["XLA_FLAGS"].split()[-1] == "--xla_a=1"


def test_a_run_line_says_how_it_ended_and_each_sides_figures():
  figures = {
    "kernels": "xla_gpu",
    "settings": {"compare_kernels": ["reference"]},
    "compile_cache_hits": 3,
    "train_step_s": 0.25,
    "train_tokens_per_s": 320_000.0,
    "train_mfu": 0.2,
    "train_mfu_measured_matmul": 0.3,
    "kernels_reference_train_step_s": 0.3,
    "kernels_reference_train_tokens_per_s": 266_667.0,
    "train_speedup_vs_kernels_reference": 1.2,
    "kernels_reference_train_last_loss_rel_diff": 2e-4,
    "train_speedup_vs_hf": None,
  }
  compiled = {"base_b128.xla_gpu": {"status": "ok", "seconds": 61.0}}
  line = gpu_benchmark.run_line(
    "base_b128", {"status": "ok", "seconds": 40.0, "figures": figures}, compiled
  )
  assert line.splitlines() == [
    "base_b128 [ok, 40 s; compile phase: xla_gpu ok (61 s); 3 programs from the cache]",
    "    xla_gpu 250.0 ms, 320,000 tok/s, MFU 20.0% (30.0% of measured matmul)",
    "    reference 300.0 ms, 266,667 tok/s, last loss vs xla_gpu's: 2.0e-04 relative",
    "    xla_gpu/reference 1.20x",
  ]
  failed = {"status": "failed with status 1", "seconds": 5.0, "last_lines": ["ValueError: x"]}
  assert gpu_benchmark.run_line("b", failed, {}).splitlines()[1] == "    ValueError: x"


def test_a_failed_run_of_two_kernel_sets_runs_again_with_the_reference_alone(monkeypatch):
  ran = []

  def execute(ctx, run, compile_only, deadline):
    ran.append((run.name, _flag(run, "kernels")))
    status = "failed with status 1" if run.name == "base_b128" else "ok"
    return {"status": status, "seconds": 1.0, "last_lines": ["Error: cuDNN"]}

  monkeypatch.setattr(gpu_benchmark, "execute", execute)
  plan = [gpu_benchmark.gpu_plan()[i] for i in (0, 2)]
  ctx = gpu_benchmark.Context("out", "work", "python3", 1e12, None)
  results = gpu_benchmark.measure_all(ctx, plan)
  assert ran == [
    ("base_b128", "xla_gpu,reference"),
    ("base_b128.reference", "reference"),
    ("small_b64", "xla_gpu"),
  ]
  assert (
    results["base_b128"]["fallback"]["status"] == "ok" and "fallback" not in results["small_b64"]
  )
  assert "\n  its last kernel set alone [ok, 1 s]" in gpu_benchmark.run_line(
    "base_b128", results["base_b128"], {}
  )
  both = gpu_benchmark.with_kernels(gpu_benchmark.gpu_plan()[1], "xla_gpu,reference")
  profiled = ctx.command(gpu_benchmark.single_kernel_runs(both)[1], compile_only=False)
  assert "--profile_dir=work/profile/base_b128_profile" in profiled  # beside the full run's


def test_a_python_without_gin_is_one_error_line(tmp_path):
  (tmp_path / "gin.py").write_text("raise ImportError('No module named gin')\n")
  env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
  result = subprocess.run(
    [sys.executable, str(REPO / "tools" / "gpu_benchmark.py"), str(tmp_path / "out")],
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert result.returncode == 1 and len(result.stderr.splitlines()) == 1
  assert result.stderr.startswith(
    f"ERROR: {sys.executable} cannot import gin-config, flax or optax"
  )
  assert "carry their wheels in .whl/" in result.stderr


@pytest.mark.slow
def test_dry_run_goes_through_the_whole_script_on_the_cpu(tmp_path):
  out = tmp_path / "out"
  # One real CPU device, compiling as the rest of the suite does: on the CPU the dry run
  # checks the script's paths and outputs, not its timings.
  env = {**os.environ, "XLA_FLAGS": xla_flags()}
  env["PYTHON"] = sys.executable
  # A --work_dir kept in the suite's cache folder (tests/conftest.py), emptied but for its
  # compilation cache, as a GPU machine's work dir keeps it between runs: a warm suite
  # loads the tiny programs instead of compiling them again. Its path stays the same
  # because JAX's cache keys hold the cache's own path (XLA's autotune cache under it).
  work = pathlib.Path(os.environ["T5X_LITE_CACHE"]) / "gpu_benchmark_work"
  work.mkdir(parents=True, exist_ok=True)
  for entry in work.iterdir():
    if entry.name == "compilation_cache":
      continue
    if entry.is_dir() and not entry.is_symlink():
      shutil.rmtree(entry)
    else:
      entry.unlink()
  result = subprocess.run(
    [
      "bash",
      str(REPO / "tools" / "gpu_benchmark.sh"),
      str(out),
      "--dry_run",
      f"--work_dir={work}",
    ],
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
  assert sorted(os.listdir(out)) == sorted(gpu_benchmark.OUTPUTS)
  report = json.loads((out / "gpu_benchmark.json").read_text())
  runs = report["runs"]
  assert set(runs) == {"tiny_b2", "tiny_b4_xla_defaults_loss_chunk4"}
  first = runs["tiny_b2"]["figures"]
  for key in (
    "train_tokens_per_s",
    "kernels_reference_train_tokens_per_s",
    "hf_train_tokens_per_s",
  ):
    assert first[key] > 0, key
  assert first["kernels"] == "xla_gpu" and first["greedy_tokens_per_s"] > 0
  assert first["kernels_reference_greedy_token_agreement"] >= 0.5  # the same network
  assert first["kernels_reference_train_first_loss_rel_diff"] < 1e-3  # bfloat16
  assert first["kernels_reference_train_last_loss_rel_diff"] < 2e-2  # after a few steps
  assert first["compile_cache_hits"] >= 2  # the train steps compiled in the first phase
  assert first["datasheet_peak_flops"] is None  # the CPU: MFU over the measured matmul
  second = runs["tiny_b4_xla_defaults_loss_chunk4"]["figures"]
  assert " ".join(console.GPU_XLA_DEFAULTS) in second["xla_flags"]
  assert second["settings"]["loss_chunk_length"] == 4 and second["train_tokens_per_s"] > 0
  assert set(report["profiles"]) == {"tiny_b2/reference", "tiny_b2/xla_gpu"}
  for profile in report["profiles"].values():
    assert profile["runs"] == 3 and len(profile["rows"]) == 10
    assert all(row["kind"] for row in profile["rows"])  # every op found in the HLO text
    # jax's op_name where the op has one (an XLA-made convert may have none)
    assert sum(bool(row["where"]) for row in profile["rows"]) >= 5
  assert report["environment"]["packages"]["jax"]
  summary = (out / "summary.txt").read_text()
  assert "profile tiny_b2/xla_gpu, top ops by time:" in summary
  assert summary.startswith("tiny_b2 [ok, ")
  assert "===== tiny_b2 (measure): ok" in (out / "gpu_benchmark.log").read_text()


def test_kernels_replace_every_runs_sets_and_zero_workers_skip_the_compile_phase(monkeypatch):
  run = gpu_benchmark.with_kernels(gpu_benchmark.gpu_plan()[0], "xla_gpu")
  assert _flag(run, "kernels") == "xla_gpu" and run.name == "base_b128"
  assert [job.name for _, job in gpu_benchmark.compile_jobs([run])] == ["base_b128.xla_gpu"]
  monkeypatch.setattr(gpu_benchmark, "execute", lambda *a: pytest.fail("compiled"))
  ctx = gpu_benchmark.Context("out", "work", "python3", 1e12, None)
  assert gpu_benchmark.compile_all(ctx, [run], share=0.5, workers=0) == {"base_b128": {}}


def test_an_unknown_kernel_set_is_one_error_line(tmp_path):
  result = subprocess.run(
    [sys.executable, str(REPO / "tools" / "gpu_benchmark.py"), str(tmp_path), "--kernels=cuda"],
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert result.returncode == 1 and result.stderr.startswith("ERROR: --kernels=cuda: no kernel")
  assert len(result.stderr.splitlines()) == 1
