"""Tests of `--precompile`: ahead-of-time TPU compilation of the real train step.

The compile tests run `python -m t5x_lite.train --precompile` for compile-only TPU
devices; they need libtpu (`pip install -e '.[tpu]'`) and are skipped without it.
The input-error tests need nothing beyond the default install.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys

import jax
import pytest

from t5x_lite.run import precompile
from t5x_peer import PEER_PYTHON, needs_t5x_peer

pytestmark = pytest.mark.slow  # subprocess runs of the entry points

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu missing: pip install -e '.[tpu]'")
TINY = (
  "--gin_file=quickstart.gin",
  "--gin.BATCH_SIZE=8",
  "--gin.TASK_FEATURE_LENGTHS={'inputs': 64, 'targets': 16}",
)


def _precompile(topology: str, *gin_args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  env.pop("XLA_FLAGS", None)  # the 8 fake CPU devices of conftest play no part here
  return subprocess.run(
    [sys.executable, "-m", "t5x_lite.train", *gin_args, "--precompile", f"--topology={topology}"],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
    check=False,
  )


def test_unknown_topology_lists_accepted_names():
  for name in ("v9:4x4", "v5e-16", "v5e:4x4x4", "v4:2x2", "v5e:0x4"):
    with pytest.raises(precompile.PrecompileError) as e:
      precompile.parse_topology(name)
    message = str(e.value)
    assert repr(name) in message
    for accepted in ("v4:2x2x1", "v5e:4x4", "v5p:2x2x2", "v6e:16x16"):
      assert accepted in message


def test_parse_topology_and_hbm_table():
  gen, dims = precompile.parse_topology("v5e:4x8")
  assert (gen.name, dims, gen.hbm_gib) == ("v5e", (4, 8), 16)
  assert {g: precompile.GENERATIONS[g].hbm_gib for g in precompile.GENERATIONS} == {
    "v4": 32,
    "v5e": 16,
    "v5p": 95,
    "v6e": 32,
  }


def test_mesh_that_does_not_divide_chips_names_both_numbers():
  with pytest.raises(
    precompile.PrecompileError, match=r"num_partitions=3 .* the 8 chips of v5e:2x4"
  ):
    precompile.slice_partitioner(jax.devices()[:8], "v5e:2x4", 3, False)
  partitioner = precompile.slice_partitioner(jax.devices()[:8], "v5e:2x4", 2, True)
  assert dict(partitioner.mesh.shape) == {"data": 4, "model": 2}
  assert ("embed", "data") in partitioner.rules


def _report(memory, loops=False, xla_bytes=1.638e12):
  return precompile.PrecompileReport(
    topology="v5e:2x2",
    chips=4,
    mesh={"data": 4, "model": 1},
    generation=precompile.GENERATIONS["v5e"],
    memory=memory,
    compiler_error=None,
    xla_flops_per_chip=1.97e14,
    xla_bytes_per_chip=xla_bytes,
    model_flops_per_step=4 * 1.5e14,
    loops_counted_once=loops,
  )


def test_report_roofline_and_verdict_basis():
  gib = precompile.GIB
  report = _report(precompile.MemoryUse(gib, gib, gib, 14 * gib, 13 * gib))
  # 1.97e14 FLOPs at 197 TFLOP/s: 1 s; 1.638e12 bytes at 819 GB/s: 2 s (memory-bound).
  assert report.roofline_seconds == pytest.approx(2.0)
  assert report.projected_mfu == pytest.approx(1.5e14 / (197e12 * 2.0))
  lines = report.lines()
  assert "a step takes at least 2e+03 ms, MFU at most 38.1%" in lines[-3]
  assert lines[-2].startswith("Verdict by arguments + outputs - aliased + temporaries (15.000 GiB)")
  assert lines[-1] == "FITS"
  over = _report(precompile.MemoryUse(gib, gib, gib, 15.5 * gib, 12 * gib))
  assert over.lines()[-1] == "DOES NOT FIT" and "(16.500 GiB)" in over.lines()[-2]
  looped = _report(precompile.MemoryUse(gib, gib, gib, 2 * gib, gib), loops=True)
  assert looped.roofline_seconds is None
  assert "Roofline: not projected" in "\n".join(looped.lines())


def test_missing_libtpu_says_how_to_install(monkeypatch):
  real_find_spec = importlib.util.find_spec
  monkeypatch.setattr(
    importlib.util,
    "find_spec",
    lambda name, *a: None if name == "libtpu" else real_find_spec(name, *a),
  )
  with pytest.raises(precompile.PrecompileError, match=re.escape("pip install -e '.[tpu]'")):
    precompile.run("v5e:2x2")


def test_missing_topology_flag_lists_names():
  with pytest.raises(precompile.PrecompileError, match="v5e:4x4"):
    precompile.run(None)


@needs_libtpu
def test_tiny_config_fits_a_small_slice():
  result = _precompile("v5e:2x2", *TINY)
  assert result.returncode == 0, result.stderr[-4000:]
  out = result.stdout
  assert "Topology v5e:2x2: 4 chips, mesh data=4 x model=1, HBM 16.00 GiB" in out
  total = float(re.search(r"Per-chip total: ([\d.]+) GiB of 16.00 GiB", out).group(1))
  assert 0 < total < 16
  xla = float(re.search(r"FLOPs per step: XLA (\S+) per chip", out).group(1))
  model = float(re.search(r"model matmuls (\S+) ", out).group(1))
  # XLA counts every op of the 4 chips' programs; the matmuls dominate.
  assert 0.8 * model < 4 * xla < 3 * model
  roofline = re.search(r"a step takes at least (\S+) ms, MFU at most (\S+)%", out)
  assert float(roofline.group(1)) > 0 and 0 < float(roofline.group(2)) <= 100
  assert "Verdict by arguments + outputs - aliased + temporaries" in out
  assert out.strip().endswith("FITS")


@needs_libtpu
@pytest.mark.parametrize(
  "args",
  [
    ("--gin_file=quickstart_decoder_only.gin",),
    ("--gin_file=quickstart_prefix_lm.gin",),
    ("--gin_file=quickstart.gin", "--gin_bindings=T5Config.share_encoder_decoder = True"),
    ("--gin_file=quickstart_electra.gin",),  # ElectraModel: generator and RTD head too
  ],
)
def test_every_architecture_precompiles_for_a_v5e_slice(args):
  result = _precompile("v5e:2x2", *args, "--gin.BATCH_SIZE=8")
  assert result.returncode == 0, result.stderr[-4000:]
  assert result.stdout.strip().endswith("FITS")
  assert re.search(r"model matmuls \S+ ", result.stdout)


@needs_libtpu
def test_long_sequences_keep_per_chip_memory_small():
  """Regression bound: a [batch, q, k] relative-position bias with heads minor once made
  1.25 GiB of temporaries here (a TPU pads the 4 heads to 128 lanes); now 0.11 GiB."""
  result = _precompile(
    "v5e:1x1",
    *TINY[:2],
    "--gin.TASK_FEATURE_LENGTHS={'inputs': 512, 'targets': 114}",
    "--gin.T5Config.dtype=bfloat16",
  )
  assert result.returncode == 0, result.stderr[-4000:]
  total = float(re.search(r"Per-chip total: ([\d.]+) GiB", result.stdout).group(1))
  assert total < 0.25, result.stdout


@needs_libtpu
def test_impossible_config_exits_nonzero_with_advice():
  # A batch of 4096 x (512 + 114) tokens on one v5e chip: logits alone exceed HBM.
  result = _precompile(
    "v5e:1x1",
    "--gin_file=quickstart.gin",
    "--gin.BATCH_SIZE=4096",
    "--gin.TASK_FEATURE_LENGTHS={'inputs': 512, 'targets': 114}",
  )
  assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-4000:]
  assert "DOES NOT FIT" in result.stdout
  for advice in ("num_partitions", "fsdp", "remat_policy", "loss_chunk_length", "num_microbatches"):
    assert advice in result.stderr


def test_unknown_topology_through_the_entry_point():
  result = _precompile("v5x:4x4", *TINY)
  assert result.returncode == 1
  assert "Unknown TPU topology 'v5x:4x4'" in result.stderr and "v6e:2x2" in result.stderr


# T5X's scalable_t5 T5 1.1 shrunk to one layer per stack with small widths.
_TINY_SCALABLE = (
  "--size=small",
  "--batch=16",
  "--inputs_len=64",
  "--targets_len=16",
  *(
    f"--gin_binding=network.T5Config.{name} = {value}"
    for name, value in (
      ("num_encoder_layers", 1),
      ("num_decoder_layers", 1),
      ("emb_dim", 256),
      ("mlp_dim", 512),
      ("num_heads", 4),
    )
  ),
)


def _t5x_peer_precompile(tmp_path, name: str, *args: str) -> dict:
  """tools/t5x_peer_precompile.py in the T5X venv with `args`; its JSON."""
  out = tmp_path / f"{name}.json"
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  result = subprocess.run(
    [PEER_PYTHON, "tools/t5x_peer_precompile.py", f"--json_out={out}", *args],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
    check=False,
  )
  assert result.returncode == 0, result.stderr[-4000:]
  return json.loads(out.read_text())


@needs_t5x_peer
def test_t5x_scalable_peer_reports_memory_and_costs(tmp_path):
  """T5X's scanned network compiles for a slice; fsdp splits its parameters over 'data'."""
  scalable = ("--network=scalable_t5", "--topology=v5e:2x2", *_TINY_SCALABLE)
  plain = _t5x_peer_precompile(tmp_path, "plain", *scalable)
  fsdp = _t5x_peer_precompile(tmp_path, "fsdp", *scalable, "--num_partitions=2", "--fsdp")
  assert plain["mesh"] == {"data": 4, "model": 1} and fsdp["mesh"] == {"data": 2, "model": 2}
  assert plain["scan_layers"] is True and plain["layer_remat"] == "minimal"
  for result in (plain, fsdp):
    assert result["fits"] is True
    assert (
      result["total"] == result["arguments"] + result["outputs"] - result["alias"] + result["temps"]
      or result["total"] == result["peak"]
    )
    assert result["xla_flops_per_chip"] > 0 and result["xla_bytes_per_chip"] > 0
  # The train state is ~all of the arguments: unsharded on 4 data-parallel chips, split
  # 4 ways (2 data x 2 model) with fsdp.
  assert fsdp["arguments"] < 0.5 * plain["arguments"]


@needs_t5x_peer
def test_t5x_flaxformer_peer_gains_cost_analysis(tmp_path):
  """The shipped (unscanned flaxformer) network goes through the peer's own script."""
  figures = _t5x_peer_precompile(
    tmp_path,
    "flaxformer",
    "--",
    "--size=small",
    "--topology=v5e:2x2",
    "--batch=16",
    "--inputs_len=64",
    "--targets_len=16",
    "--gin_binding=NUM_ENCODER_LAYERS = 1",
    "--gin_binding=NUM_DECODER_LAYERS = 1",
  )
  assert figures["codebase"] == "t5x" and figures["scan_layers"] is False
  assert figures["fits"] is True and figures["total"] > figures["arguments"] > 0
  assert figures["xla_flops_per_chip"] > 0 and figures["xla_bytes_per_chip"] > 0
