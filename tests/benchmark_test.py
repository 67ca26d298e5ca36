"""Smoke test of tools/benchmark.py: a tiny config, a couple of steps, every figure.

Speed is never asserted here (DESIGN.md section 6); the slow tests check that the tool
runs end to end (ours, HF transformers, the input pipeline; T5X itself), writes the
documented JSON keys and that every rate is a positive number. The fast tests check how
T5X's figures (tools/t5x_peer_bench.py's JSON line) become ratios, MFU and table columns,
and how a failing peer is reported, with a fake peer interpreter.

The T5X test runs the real peer, `bash ../shared/peers/install_t5x.sh $HOME/t5x_peer`'s
venv; it is skipped, saying so, when that venv is missing. T5X_PEER_PYTHON overrides it.
"""

import json
import os
import pathlib
import stat
import subprocess
import sys

import pytest

from t5x_lite.nn import flops
from t5x_peer import PEER_PYTHON, needs_t5x_peer
from tiny_models import tiny_config

REPO = pathlib.Path(__file__).resolve().parents[1]

sys.path.insert(0, str(REPO / "tools"))
import benchmark  # noqa: E402  (tools/benchmark.py)

RATES = (
  "train_tokens_per_s",
  "hf_train_tokens_per_s",
  "train_mfu",
  "hf_train_mfu",
  "greedy_tokens_per_s",
  "hf_greedy_tokens_per_s",
  "beam_tokens_per_s",
  "hf_beam_tokens_per_s",
  "jax_peak_flops",
  "torch_peak_flops",
  "train_compile_s",
  "train_speedup_vs_hf",
  "greedy_speedup_vs_hf",
  "beam_speedup_vs_hf",
  "data_examples_per_s",
  "train_examples_per_s",
  "data_vs_train_consumption",
  "max_rss_mib",
  "max_rss_mib_ours",
  "kernels_reference_train_tokens_per_s",
  "kernels_reference_greedy_tokens_per_s",
  "kernels_reference_beam_tokens_per_s",
  "train_speedup_vs_kernels_reference",
)


TINY_FLAGS = (
  "--gin_file=models/t5_1_1/tiny.gin",
  "--batch_size=2",
  "--input_length=16",
  "--target_length=8",
  "--decode_length=3",
  "--num_beams=2",
  "--reps=2",
  "--warmup=1",
  # The MFU bound below needs a peak that holds while the other xdist worker loads
  # the CPU: a 128 x 128 matmul timed in microseconds came out below the tiny
  # train step itself (MFU 1.81); 512 x 512 takes milliseconds per run.
  "--matmul_size=512",
)


def run_benchmark_tool(out: pathlib.Path, *flags: str) -> subprocess.CompletedProcess:
  """tools/benchmark.py at the tiny shapes with `flags`, writing its JSON to `out`."""
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the tool runs on the real (single) CPU device
  return subprocess.run(
    [sys.executable, str(REPO / "tools" / "benchmark.py"), *TINY_FLAGS, *flags, f"--json={out}"],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
    check=False,
  )


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> tuple[dict, str]:
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  out = tmp_path_factory.mktemp("bench") / "bench.json"
  proc = run_benchmark_tool(out, "--data_batches=2", "--compare_hf", "--kernels=auto,reference")
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(out.read_text()), proc.stdout


@pytest.mark.slow
def test_json_has_positive_figures(result):
  figures, _ = result
  for key in RATES:
    assert isinstance(figures[key], (int, float)) and figures[key] > 0, key
  assert 0 < figures["train_mfu"] < 1.5


@pytest.mark.slow
def test_same_model_both_sides(result):
  figures, _ = result
  assert figures["num_params"] == figures["hf_num_params"]
  # Same weights, same greedy argmax: the decodes agree almost everywhere.
  assert figures["greedy_token_agreement"] >= 0.5
  assert figures["kernels"] == "xla_cpu"  # 'auto' on the CPU
  # Another kernel set computes the same network: its greedy decodes agree, and its
  # losses after as many steps on the same batch from the same parameters.
  assert figures["kernels_reference_greedy_token_agreement"] == 1.0
  assert figures["kernels_reference_train_last_loss_rel_diff"] < 1e-4
  assert figures["train_tokens_per_step"] == 2 * (16 + 8)
  assert figures["settings"]["decode_length"] == 3


@pytest.mark.slow
def test_table_printed(result):
  _, stdout = result
  for label in (
    "train tokens/s",
    "greedy decode tokens/s",
    "beam decode tokens/s",
    "train MFU",
    "data / train consumption",
  ):
    assert label in stdout


# ------------------------------------------------------------------------------- T5X


def tiny_settings(**overrides) -> benchmark.Settings:
  fields = dict(config=tiny_config(), batch_size=2, input_length=16, target_length=8)
  fields.update(decode_length=4, num_beams=2)
  return benchmark.Settings(**{**fields, **overrides})


# tools/t5x_peer_bench.py's JSON line (the figures that matter here; values made up).
FAKE_PEER = {
  "train_step_s": 1.0,
  "greedy_s": 0.1,
  "beam_s": 0.8,
  "peak_flops": 2e11,
  "num_params": 1234,
  "one_hot": False,
  "gin_file": "flaxformer/t5x/configs/t5/models/t5_1_1_base.gin",
  "gin_bindings": ["import seqio", "EMBED_DIM = 32", "NUM_HEADS = 4"],
  "train_compile_s": 3.0,
}


def test_t5x_figures_become_ratios_mfu_and_columns():
  s = tiny_settings()
  raw = {"train_step_s": 0.5, "greedy_s": 0.2, "beam_s": 0.4, "jax_peak_flops": 1e11}
  raw.update(benchmark.merge_t5x(FAKE_PEER))
  r = {**raw, **benchmark.derive(s, raw)}

  tokens = 2 * (16 + 8)
  step_flops = flops.flops_per_token(s.config, 16, 8) * tokens
  assert r["t5x_train_tokens_per_s"] == pytest.approx(tokens / 1.0)
  assert r["t5x_greedy_tokens_per_s"] == pytest.approx(2 * 4 / 0.1)  # once per example
  assert r["t5x_beam_tokens_per_s"] == pytest.approx(2 * 4 / 0.8)
  # MFU as HF's: our FLOP count over the peak measured on that side.
  assert r["t5x_train_mfu"] == pytest.approx(step_flops / 1.0 / 2e11)
  assert r["train_mfu"] == pytest.approx(step_flops / 0.5 / 1e11)
  assert r["train_speedup_vs_t5x"] == pytest.approx(2.0)  # ours / T5X tokens/s
  assert r["greedy_speedup_vs_t5x"] == pytest.approx(0.5)
  assert r["beam_speedup_vs_t5x"] == pytest.approx(2.0)
  assert r["train_speedup_vs_hf"] is None  # HF not measured

  table = benchmark.format_table(r).splitlines()
  assert table[0].split() == ["t5x_lite", "HF", "torch", "ours/HF", "T5X", "ours/T5X"]
  train = next(line for line in table if line.startswith("train tokens/s")).split()
  assert train[-2:] == ["48", "2"]  # T5X's tokens/s, ours/T5X
  assert "gather (--t5x_one_hot=false) embedding" in "\n".join(table)
  assert "T5X" not in benchmark.format_table({k: v for k, v in r.items() if "t5x" not in k})


def test_other_kernel_sets_become_ratios_and_columns():
  s = tiny_settings(compare_kernels=("reference",))
  raw = {"train_step_s": 0.5, "greedy_s": 0.2, "jax_peak_flops": 1e11, "kernels": "xla_cpu"}
  raw |= {"kernels_reference_train_step_s": 1.0, "kernels_reference_greedy_s": 0.1}
  raw |= {"train_last_loss": 2.02, "kernels_reference_train_last_loss": 2.0}
  r = {**raw, **benchmark.derive(s, raw), "settings": {"compare_kernels": ["reference"]}}
  assert r["kernels_reference_train_last_loss_rel_diff"] == pytest.approx(0.01)
  assert "kernels_reference_train_first_loss_rel_diff" not in r  # not measured
  step_flops = flops.flops_per_token(s.config, 16, 8) * 2 * (16 + 8)
  assert r["kernels_reference_train_mfu"] == pytest.approx(step_flops / 1.0 / 1e11)
  assert r["train_speedup_vs_kernels_reference"] == pytest.approx(2.0)
  assert r["greedy_speedup_vs_kernels_reference"] == pytest.approx(0.5)
  table = benchmark.format_table(r).splitlines()
  assert table[0].split() == ["t5x_lite", "HF", "torch", "ours/HF", "reference", "ours/reference"]
  train = next(line for line in table if line.startswith("train tokens/s")).split()
  assert train[-2:] == ["48", "2"]  # the reference's tokens/s, ours/reference
  assert "t5x_lite kernels: xla_cpu (--kernels)" in table


def test_on_a_listed_device_mfu_is_over_the_data_sheet_and_the_matmul_second():
  s = tiny_settings(compare_kernels=("reference",))
  raw = {"train_step_s": 0.5, "jax_peak_flops": 1e11, "torch_peak_flops": 2e11}
  raw |= {"kernels_reference_train_step_s": 1.0, "hf_train_step_s": 2.0, "t5x_train_step_s": 1.0}
  raw |= {"t5x_peak_flops": 1e11, "kernels": "xla_gpu", "device_kind": "NVIDIA H100 80GB HBM3"}
  raw |= {"datasheet_peak_flops": 4e11, "hf_datasheet_peak_flops": 8e11}
  raw |= {"matmul_precision": "bfloat16"}
  r = {**raw, **benchmark.derive(s, raw), "settings": {"compare_kernels": ["reference"]}}
  step_flops = flops.flops_per_token(s.config, 16, 8) * 2 * (16 + 8)
  assert r["train_mfu"] == pytest.approx(step_flops / 0.5 / 4e11)
  assert r["train_mfu_measured_matmul"] == pytest.approx(step_flops / 0.5 / 1e11)
  assert r["kernels_reference_train_mfu"] == pytest.approx(step_flops / 1.0 / 4e11)
  assert r["hf_train_mfu"] == pytest.approx(step_flops / 2.0 / 8e11)  # torch's precision
  assert r["hf_train_mfu_measured_matmul"] == pytest.approx(step_flops / 2.0 / 2e11)
  assert r["t5x_train_mfu"] == pytest.approx(step_flops / 1.0 / 4e11)  # jax's, as ours
  table = benchmark.format_table(r)
  assert "train MFU, measured matmul" in table
  assert "MFU: over the bfloat16 data-sheet peak of NVIDIA H100 80GB HBM3 (0.4 TFLOP/s)" in table
  # On the CPU (no data-sheet peak): one MFU figure, over the measured matmul.
  cpu = {k: v for k, v in raw.items() if "datasheet" not in k} | {"device_kind": "cpu"}
  derived = benchmark.derive(s, cpu)
  assert "train_mfu_measured_matmul" not in derived
  assert derived["train_mfu"] == pytest.approx(step_flops / 0.5 / 1e11)
  assert "train MFU, measured matmul" not in benchmark.format_table({**cpu, **derived})


def test_data_sheet_peaks_by_device_and_precision(monkeypatch):
  class H100:
    platform, device_kind = "gpu", "NVIDIA H100 80GB HBM3"

  monkeypatch.setattr(benchmark.jax, "devices", lambda *a: [H100()])
  bf16 = benchmark.datasheet_peaks(tiny_settings(config=tiny_config(dtype="bfloat16")))
  assert bf16 == {"matmul_precision": "bfloat16", "datasheet_peak_flops": 989e12}
  f32 = benchmark.datasheet_peaks(tiny_settings())
  assert f32 == {"matmul_precision": "tensorfloat32", "datasheet_peak_flops": 494.7e12}
  monkeypatch.undo()
  assert benchmark.datasheet_peaks(tiny_settings())["datasheet_peak_flops"] is None  # CPU


def fake_interpreter(tmp_path: pathlib.Path, body: str) -> str:
  """An executable standing in for the T5X venv's python: a shell script running `body`."""
  path = tmp_path / "python"
  path.write_text("#!/bin/sh\n" + body + "\n")
  path.chmod(path.stat().st_mode | stat.S_IEXEC)
  return str(path)


def test_t5x_peer_gets_our_shapes_and_its_json_is_merged(tmp_path, monkeypatch):
  # The fake peer records its arguments and XLA_FLAGS: ours without the forced device count.
  monkeypatch.setenv(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=8 --xla_cpu_experimental_ynn_fusion_type=-reduce",
  )
  python = fake_interpreter(
    tmp_path,
    f'echo "$@" > {tmp_path}/args; echo "${{XLA_FLAGS-unset}}" > {tmp_path}/xla\n'
    "echo 'T5X logs this'; echo '" + json.dumps(FAKE_PEER) + "'",
  )
  figures = benchmark.run_t5x_peer(tiny_settings(compare_t5x=python, threads=3))
  assert figures == {f"t5x_{k}": v for k, v in FAKE_PEER.items()}
  args = (tmp_path / "args").read_text().split()
  assert args[0].endswith("tools/t5x_peer_bench.py")
  for flag in (
    "--embed_dim=32",
    "--num_heads=4",
    "--head_dim=8",
    "--mlp_dim=64",
    "--num_encoder_layers=2",
    "--num_decoder_layers=2",
    "--vocab_size=64",
    "--dtype=float32",
    "--one_hot=false",
    "--batch_size=2",
    "--input_length=16",
    "--target_length=8",
    "--decode_length=4",
    "--num_beams=2",
    "--threads=3",
    "--backend=cpu",
  ):
    assert flag in args, flag
  assert (tmp_path / "xla").read_text().strip() == "--xla_cpu_experimental_ynn_fusion_type=-reduce"


def test_t5x_peer_failure_is_one_line_naming_interpreter_and_stderr(tmp_path):
  python = fake_interpreter(tmp_path, "echo 'Traceback ...' >&2; echo 'ValueError: no' >&2; exit 3")
  with pytest.raises(benchmark.T5XPeerError) as e:
    benchmark.run_t5x_peer(tiny_settings(compare_t5x=python))
  assert str(e.value) == (
    f"--compare_t5x={python}: tools/t5x_peer_bench.py exited with status 3: ValueError: no"
  )
  with pytest.raises(benchmark.T5XPeerError, match="missing/python: cannot run it"):
    benchmark.run_t5x_peer(tiny_settings(compare_t5x=str(tmp_path / "missing" / "python")))
  with pytest.raises(benchmark.T5XPeerError, match="needs a T5 1.1 model"):
    benchmark.t5x_peer_flags(tiny_settings(config=tiny_config(mlp_activations=("relu",))))


@pytest.mark.slow
@needs_t5x_peer
def test_t5x_peer_measures_t5x(tmp_path):
  out = tmp_path / "bench.json"
  proc = run_benchmark_tool(out, "--skip=data", f"--compare_t5x={PEER_PYTHON}")
  assert proc.returncode == 0, proc.stderr[-4000:]
  figures = json.loads(out.read_text())
  for key in (
    "t5x_train_tokens_per_s",
    "t5x_train_mfu",
    "t5x_greedy_tokens_per_s",
    "t5x_beam_tokens_per_s",
    "t5x_peak_flops",
    "train_speedup_vs_t5x",
    "greedy_speedup_vs_t5x",
    "beam_speedup_vs_t5x",
  ):
    assert isinstance(figures[key], (int, float)) and figures[key] > 0, key
  # flaxformer's T5 1.1 at our tiny sizes: the same parameters; exactly 3 tokens decoded.
  assert figures["t5x_num_params"] == figures["num_params"]
  assert figures["t5x_greedy_tokens_shape"] == figures["t5x_beam_tokens_shape"] == [2, 3]
  assert figures["t5x_one_hot"] is False
  assert "ours/T5X" in proc.stdout


def test_time_in_turn_warms_up_each_then_alternates():
  calls = []
  fns = {name: (lambda name=name: calls.append(name)) for name in ("", "hf_")}
  timed = benchmark.time_in_turn(fns, reps=3, warmup=2)
  assert calls == ["", "", "hf_", "hf_"] + ["", "hf_"] * 3
  assert set(timed) == {"", "hf_"}
  for seconds, times in timed.values():
    assert len(times) == 3 and seconds == sorted(times)[1]


def test_time_in_turn_settles_each_side_before_its_timed_call():
  calls = []
  fns = {name: (lambda name=name: calls.append(name)) for name in ("", "hf_")}
  timed = benchmark.time_in_turn(fns, reps=2, warmup=1, settle=1)
  assert calls == ["", "hf_"] + ["", "", "hf_", "hf_"] * 2
  assert all(len(times) == 2 for _, times in timed.values())
