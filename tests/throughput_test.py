"""Tests for t5x_lite.training.throughput: the peak table, the peaks MFU is taken against,
and the rates written to the training logs."""

import dataclasses

import jax
import pytest

from t5x_lite.training import throughput


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
  """Each test keeps its measured peaks (`best_measured_flops`) to itself."""
  monkeypatch.setenv("T5X_LITE_CACHE", str(tmp_path))


def test_fastest_activation_dtype_is_bfloat16_only_where_native_and_faster():
  assert throughput.fastest_activation_dtype("gpu") == "bfloat16"
  assert throughput.fastest_activation_dtype("tpu") == "bfloat16"
  avx512_bf16 = frozenset({"avx2", "avx512f", "avx512_bf16"})
  amx = frozenset({"avx512f", "amx_bf16", "amx_tile"})
  avx2_only = frozenset({"avx2", "fma"})

  def never() -> float:
    raise AssertionError("measured where bfloat16 is not native")

  assert throughput.fastest_activation_dtype("cpu", avx512_bf16, lambda: 1.4) == "bfloat16"
  assert throughput.fastest_activation_dtype("cpu", amx, lambda: 3.0) == "bfloat16"
  # Native instructions, but XLA:CPU's bfloat16 matmul no faster than float32's.
  assert throughput.fastest_activation_dtype("cpu", avx512_bf16, lambda: 0.6) == "float32"
  assert throughput.fastest_activation_dtype("cpu", avx512_bf16, lambda: 1.05) == "float32"
  assert throughput.fastest_activation_dtype("cpu", avx2_only, never) == "float32"
  assert throughput.fastest_activation_dtype("cpu", frozenset(), never) == "float32"


def test_the_cpu_bfloat16_speedup_is_measured_once_per_machine(tmp_path, monkeypatch):
  monkeypatch.setenv("T5X_LITE_CACHE", str(tmp_path))
  calls = []

  def measure() -> float:
    calls.append(1)
    return 0.6

  flags = frozenset({"avx512f", "avx512_bf16"})
  assert throughput.cached_cpu_bfloat16_speedup(flags, measure) == 0.6
  assert throughput.cached_cpu_bfloat16_speedup(flags, measure) == 0.6
  assert len(calls) == 1 and (tmp_path / "cpu_bfloat16_speedup.json").exists()
  # Another flag set (or CPU, or jax version) is measured again.
  assert throughput.cached_cpu_bfloat16_speedup(flags | {"amx_bf16"}, lambda: 2.0) == 2.0
  assert len(calls) == 1


def test_the_bfloat16_speedup_is_a_positive_ratio():
  assert throughput.bfloat16_matmul_speedup(size=64, rounds=1) > 0


def test_cpu_peak_is_measured_in_the_model_dtype_with_no_second_figure():
  # A bfloat16 model is measured against the bfloat16 matmul (MFU under 100% where
  # the CPU multiplies bfloat16 faster than float32).
  peaks = throughput.device_peak_flops(dtype="bfloat16")
  assert peaks.flops > 0 and peaks.source.startswith("bfloat16 matmul measured on")
  assert peaks.measured_flops is None
  assert throughput.device_peak_flops().source.startswith("float32 matmul measured on")


@pytest.mark.parametrize(
  "kind, precision, want",
  [
    ("TPU v4", "bfloat16", 275e12),
    ("TPU v5 lite", "bfloat16", 197e12),
    ("TPU v5e", "bfloat16", 197e12),  # the precompiler's name
    ("TPU v5", "bfloat16", 459e12),
    ("TPU v5p", "bfloat16", 459e12),
    ("TPU v6 lite", "bfloat16", 918e12),
    ("TPU v4", "float32", None),  # no data-sheet figure: MFU over the measured matmul
    ("TPU v4", "bfloat16_3x", None),
    ("NVIDIA A100-SXM4-80GB", "bfloat16", 312e12),
    ("NVIDIA A100-PCIE-40GB", "tensorfloat32", 156e12),
    ("NVIDIA A100-SXM4-40GB", "float32", 19.5e12),
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989e12),
    ("NVIDIA H100 80GB HBM3", "tensorfloat32", 494.7e12),
    ("NVIDIA H100 80GB HBM3", "float32", 67e12),
    ("NVIDIA H100 PCIe", "bfloat16", 756.5e12),  # not the SXM's 989
    ("NVIDIA H100 NVL", "bfloat16", 835.5e12),
    ("NVIDIA H200", "bfloat16", 989e12),
    ("NVIDIA H200 NVL", "bfloat16", 835.5e12),
    ("NVIDIA GH200 480GB", "bfloat16", None),
    ("cpu", "float32", None),
  ],
)
def test_data_sheet_table_by_device_kind_and_precision(kind, precision, want):
  assert throughput.table_peak_flops(kind, precision) == want


@pytest.mark.parametrize(
  "dtype, platform, default_precision, want",
  [
    ("bfloat16", "gpu", None, "bfloat16"),
    ("bfloat16", "tpu", "highest", "bfloat16"),  # the setting is for 32-bit inputs
    ("float32", "gpu", None, "tensorfloat32"),  # jax's default on Ampere and later
    ("float32", "tpu", None, "bfloat16"),  # one bfloat16 pass
    ("float32", "cpu", None, "float32"),
    ("float32", "gpu", "highest", "float32"),
    ("float32", "gpu", "float32", "float32"),
    ("float32", "tpu", "high", "bfloat16_3x"),
    ("float32", "gpu", "tensorfloat32", "tensorfloat32"),
    ("float32", "gpu", "bfloat16", "bfloat16"),
    ("float32", "gpu", "BF16_BF16_F32", "bf16_bf16_f32"),  # a dot algorithm: no column
  ],
)
def test_matmul_precision(dtype, platform, default_precision, want):
  assert throughput.matmul_precision(dtype, platform, default_precision) == want


@dataclasses.dataclass(frozen=True)
class _FakeDevice:
  platform: str
  device_kind: str


def _on(monkeypatch, platform: str, kind: str, measured: float = 7e14) -> list:
  calls = []
  monkeypatch.setattr(jax, "devices", lambda *a: [_FakeDevice(platform, kind)])

  def measure(**kwargs):
    calls.append(kwargs)
    return measured

  monkeypatch.setattr(throughput, "measure_matmul_flops", measure)
  return calls


def test_a_listed_gpu_reports_the_data_sheet_peak_and_the_measured_matmul(monkeypatch):
  calls = _on(monkeypatch, "gpu", "NVIDIA H100 80GB HBM3")
  peaks = throughput.device_peak_flops(dtype="bfloat16")
  assert peaks.flops == 989e12 and peaks.measured_flops == 7e14
  assert peaks.source == "bfloat16 data-sheet peak of NVIDIA H100 80GB HBM3"
  assert peaks.measured_source == "bfloat16 matmul measured on NVIDIA H100 80GB HBM3"
  assert "9.89e+14" in peaks.describe() and "second figure: 7e+14" in peaks.describe()
  assert [str(c["dtype"]) for c in calls] == ["bfloat16"]
  # float32 activations run their matmuls as TF32 at jax's default precision
  assert throughput.device_peak_flops(dtype="float32").flops == 494.7e12


def test_an_unlisted_gpu_or_an_override(monkeypatch):
  _on(monkeypatch, "gpu", "NVIDIA GH200 480GB")
  peaks = throughput.device_peak_flops(dtype="bfloat16")
  assert (peaks.flops, peaks.measured_flops) == (7e14, None)
  assert peaks.source == "bfloat16 matmul measured on NVIDIA GH200 480GB"
  peaks = throughput.device_peak_flops(override=8e14, dtype="bfloat16")
  assert (peaks.flops, peaks.measured_flops) == (8e14, 7e14)
  assert peaks.source == "gin device_peak_flops.override"


def test_a_run_on_busy_cores_keeps_the_machines_best_measured_peak(tmp_path, monkeypatch, caplog):
  # An idle start measures 3e11; a later start beside other work measures a third of
  # that, and its MFU is still over 3e11. A faster measurement becomes the best.
  for measured, want in [(3e11, 3e11), (1e11, 3e11), (3.3e11, 3.3e11), (3.2e11, 3.3e11)]:
    _on(monkeypatch, "cpu", "cpu", measured)
    caplog.clear()
    peaks = throughput.device_peak_flops()
    assert peaks.flops == want and peaks.measured_flops is None
    assert peaks.source.startswith("float32 matmul measured on cpu")
    assert ("the best of this machine's runs" in peaks.source) == (want > measured)
    busy = [r.getMessage() for r in caplog.records if "other work is using" in r.getMessage()]
    assert len(busy) == (measured < 0.7 * want), busy
  assert "33% of this machine's best (3.3e+11, kept in" in _busy_line(monkeypatch, caplog, 1.1e11)
  # A GPU's measurement (the second figure) is kept the same way, apart from the CPU's.
  for measured in (7e14, 2e14):
    _on(monkeypatch, "gpu", "NVIDIA H100 80GB HBM3", measured)
    peaks = throughput.device_peak_flops(dtype="bfloat16")
    assert (peaks.flops, peaks.measured_flops) == (989e12, 7e14)  # the faster, first run's
  _on(monkeypatch, "cpu", "cpu", 3.3e11)
  assert throughput.device_peak_flops().flops == 3.3e11  # not the GPU's
  assert len(list(tmp_path.glob("measured_matmul_flops.json"))) == 1


def _busy_line(monkeypatch, caplog, measured: float) -> str:
  """The busy-cores warning of a CPU run that measures `measured`."""
  _on(monkeypatch, "cpu", "cpu", measured)
  caplog.clear()
  throughput.device_peak_flops()
  [line] = [r.getMessage() for r in caplog.records if "other work is using" in r.getMessage()]
  return line


def test_rates_and_the_second_mfu_figure():
  counts = dict(rows_per_step=8, tokens_per_step=8 * 100, flops_per_step=4e9, num_devices=2)
  rates = throughput.Throughput(**counts, peak_flops_per_device=1e10).rates(steps=10, seconds=4.0)
  assert rates["throughput/seqs_per_sec_per_device"] == pytest.approx(10.0)
  assert rates["throughput/tokens_per_sec_per_device"] == pytest.approx(1000.0)
  assert rates["throughput/mfu"] == pytest.approx(0.5)
  assert rates["throughput/step_time_sec"] == pytest.approx(0.4)
  assert "throughput/mfu_measured_matmul" not in rates  # on CPU: one figure
  both = throughput.Throughput(
    **counts, peak_flops_per_device=2e10, measured_peak_flops_per_device=1.25e10
  ).rates(steps=10, seconds=4.0)
  assert both["throughput/mfu"] == pytest.approx(0.25)
  assert both["throughput/mfu_measured_matmul"] == pytest.approx(0.4)
