"""Tests for tools/profile_summary.py: top XLA ops by time from a jax.profiler trace."""

import gzip
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
import profile_summary  # noqa: E402

_ENCODER = "jit(step)/jvp(Transformer)/Transformer.encode/encoder/layers_0/mlp"
# Lines as a GPU program's `as_text()` writes them (abridged).
HLO = "\n".join(
  [
    "HloModule jit_step, is_scheduled=true",
    "  %gemm.3 = (bf16[64,2048]{1,0}, s8[4194304]{0}) custom-call(bf16[64,768]{1,0} %p, "
    'bf16[768,2048]{1,0} %w), custom_call_target="__cublas$gemm", '
    f'metadata={{op_name="{_ENCODER}/wi_0/dot_general" stack_frame_id=3}}',
    "  %loop_fusion.7 = bf16[64,2048]{1,0} fusion(bf16[64,2048]{1,0} %a), kind=kLoop, "
    f'calls=%fused_computation.7, metadata={{op_name="{_ENCODER}/gelu" stack_frame_id=4}}',
    "  %triton_gemm.1 = bf16[64,768]{1,0} fusion(bf16[64,2048]{1,0} %b), kind=kCustom, "
    'calls=%c, backend_config={"operation_queue_id":"0","fusion_backend_config":'
    '{"kind":"__triton_gemm"}}',
    "  ROOT %tuple.9 = (bf16[64,768]{1,0}) tuple(bf16[64,768]{1,0} %triton_gemm.1)",
  ]
)


def _event(pid, op, dur, run, module="jit_step", name=None):
  args = {"hlo_op": op, "hlo_module": module, "run_id": run}
  return {"ph": "X", "pid": pid, "tid": 1, "ts": 0, "dur": dur, "name": name or op, "args": args}


def _write_trace(folder, events):
  meta = [
    {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
    {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
  ]
  path = folder / "plugins" / "profile" / "run1" / "host.trace.json.gz"
  path.parent.mkdir(parents=True)
  with gzip.open(path, "wt") as f:
    json.dump({"traceEvents": meta + events}, f)
  return path


def test_device_ops_of_the_longest_program_are_ranked_per_run(tmp_path):
  events = []
  for run in ("r1", "r2"):
    events += [
      _event(1, "gemm.3", 600.0, run, name="nvjet_tst_128x256"),
      _event(1, "loop_fusion.7", 150.0, run, name="loop_fusion_7"),
      _event(1, "loop_fusion.7", 50.0, run, name="loop_fusion_7"),  # a second kernel
      _event(1, "triton_gemm.1", 200.0, run),
      _event(1, "copy.1", 1.0, run, module="jit_convert"),  # another, shorter program
      _event(2, "host_op", 10_000.0, run),  # host threads: ignored where a device ran
    ]
  _write_trace(tmp_path, events)
  (tmp_path / "hlo.txt").write_text(HLO)
  summary = profile_summary.summarize_dir(str(tmp_path), top=2)
  assert summary.program == "jit_step" and summary.device == "/device:GPU:0"
  assert summary.runs == 2 and summary.seconds_per_run == pytest.approx(1e-3)
  first, second = summary.rows
  assert (first.op, first.kind, first.event) == ("gemm.3", "__cublas$gemm", "nvjet_tst_128x256")
  assert first.seconds_per_run == pytest.approx(600e-6) and first.share == pytest.approx(0.6)
  assert first.where == ".../Transformer.encode/encoder/layers_0/mlp/wi_0/dot_general"
  assert (second.op, second.kind, second.calls_per_run) == ("loop_fusion.7", "kLoop", 2)
  assert summary.kinds == pytest.approx({"__cublas$gemm": 0.6, "kLoop": 0.2, "__triton_gemm": 0.2})
  text = profile_summary.format_summary(summary)
  assert "program jit_step on /device:GPU:0: 2 runs, 1.000 ms of op time per run" in text
  assert "__cublas$gemm 60.0%" in text


def _gpu_trace(folder, events, lines):
  meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}}]
  meta += [
    {"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": name}}
    for tid, name in lines.items()
  ]
  path = folder / "t.trace.json.gz"
  with gzip.open(path, "wt") as f:
    json.dump({"traceEvents": meta + events}, f)
  return str(path)


def test_device_stream_kernels_are_counted_once_beside_a_derived_ops_line(tmp_path):
  kernel = _event(1, "gemm.3", 600.0, "r1", name="nvjet_tst_128x256") | {"tid": 7}
  derived = {"ph": "X", "pid": 1, "tid": 9, "ts": 0, "dur": 600.0, "name": "gemm.3", "args": {}}
  trace = _gpu_trace(tmp_path, [kernel, derived], {7: "Stream #13(Compute)", 9: "XLA Ops"})
  summary = profile_summary.summarize(trace, runs=1)
  assert [(r.op, r.seconds_per_run) for r in summary.rows] == [("gemm.3", pytest.approx(6e-4))]
  # Without the stream line, the derived line's events are the ops, by name.
  trace = _gpu_trace(tmp_path, [derived], {9: "XLA Ops"})
  assert [r.op for r in profile_summary.summarize(trace, runs=1).rows] == ["gemm.3"]


def test_device_kernels_without_op_names_are_ranked_by_kernel(tmp_path):
  kernels = [
    {"ph": "X", "pid": 1, "tid": 7, "ts": 0, "dur": d, "name": n, "args": {"correlation_id": 1}}
    for n, d in (("nvjet_a", 30.0), ("loop_fusion_k", 10.0), ("nvjet_a", 30.0))
  ]
  summary = profile_summary.summarize(_gpu_trace(tmp_path, kernels, {7: "Stream #13"}), runs=2)
  assert [(r.op, r.share) for r in summary.rows] == [("nvjet_a", 6 / 7), ("loop_fusion_k", 1 / 7)]
  assert summary.seconds_per_run == pytest.approx(35e-6)


def test_a_cpu_trace_of_a_jitted_function(tmp_path):
  """A real trace: XLA:CPU's ops on the host, named from the compiled HLO text."""

  @jax.jit
  def step(x, w):
    for _ in range(3):
      x = jax.nn.gelu(x @ w)
    return jax.nn.softmax(x, axis=-1).sum()

  x, w = jnp.ones((256, 256)), jnp.full((256, 256), 0.01)
  (tmp_path / "hlo.txt").write_text(step.lower(x, w).compile().as_text())
  step(x, w).block_until_ready()
  with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
    for _ in range(4):
      step(x, w).block_until_ready()
  summary = profile_summary.summarize_dir(str(tmp_path), top=10)
  assert summary.program == "jit_step" and summary.device == "/host:CPU"
  assert summary.runs == 4 and summary.seconds_per_run > 0
  assert 3 <= len(summary.rows) <= 10
  assert sum(row.share for row in summary.rows) <= 1.0 + 1e-9
  assert [row.seconds_per_run for row in summary.rows] == sorted(
    (row.seconds_per_run for row in summary.rows), reverse=True
  )
  for row in summary.rows:  # every op found in the HLO text, with jax's name for it
    assert row.kind and row.where.startswith("jit(step)/"), row


def test_the_tool_prints_one_error_line_without_a_trace(tmp_path):
  tool = os.path.join(REPO, "tools", "profile_summary.py")
  result = subprocess.run([sys.executable, tool, str(tmp_path)], capture_output=True, text=True)
  assert result.returncode == 1 and result.stdout == ""
  assert (
    result.stderr
    == f"ERROR: no *.trace.json.gz under {tmp_path} (write one with jax.profiler.trace)\n"
  )


def test_a_step_inside_command_buffers_says_how_to_see_its_ops(tmp_path):
  events = [
    _event(1, "command_buffer_1", 900.0, "r1", name="sm90_xmma_gemm") | {"tid": 7},
    _event(1, "loop_fusion.7", 100.0, "r1") | {"tid": 7},
  ]
  trace = _gpu_trace(tmp_path, events, {7: "Stream #13(Compute)"})
  text = profile_summary.format_summary(profile_summary.summarize(trace, runs=1))
  assert text.splitlines()[-1].startswith("note: 90% of the op time is in command buffers")
  assert "--xla_gpu_enable_command_buffer=" in text.splitlines()[-1]
  events[0]["dur"] = 50.0  # a small graph: no note
  trace = _gpu_trace(tmp_path, events, {7: "Stream #13(Compute)"})
  assert "note" not in profile_summary.format_summary(profile_summary.summarize(trace, runs=1))
