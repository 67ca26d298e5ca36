"""Per-device peak FLOP/s and throughput/MFU arithmetic for training logs.

MFU = model FLOPs per second achieved per device / peak FLOP/s of the device.
Model FLOPs come from `t5x_lite.nn.flops.flops_per_token` (forward + backward of
the network's matmuls, no rematerialisation). Two peaks (`device_peak_flops`):

1. the figure `throughput/mfu` is taken against, as the field reports MFU (MaxText,
   llm.c, nanoGPT, PaLM): `device_peak_flops.override` (gin) if set, else the
   device's data-sheet peak for the precision its matmuls run in
   (`DATASHEET_PEAK_FLOPS`, `matmul_precision`), else (on CPU, or a device or
   precision missing from the table) the measured matmul below;
2. a matmul in the model's activation dtype measured at startup on the first
   device (`measure_matmul_flops`, the same measurement as tools/benchmark.py's),
   i.e. what XLA actually reaches there: on CPU the MFU figure itself (a bfloat16
   model on a CPU with native bfloat16 is measured against the bfloat16 matmul),
   elsewhere the second figure, `throughput/mfu_measured_matmul`. With several
   (fake) CPU devices on one host they share those cores, so per-device MFU there
   is an upper bound. A run started while other work holds the cores measures less
   than the device can do, which would inflate its MFU (past 100%), so the figure is
   the best measurement of any run on the machine (`best_measured_flops`).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable

import gin
import jax
import jax.numpy as jnp
from absl import logging

from t5x_lite.core import cache

# Dense (no sparsity) peak FLOP/s per device (TPU chip, GPU) by the precision its matrix
# units run at; no timings. Sources, by key:
# - TPU: the Cloud TPU system architecture pages (v4, v5e, v5p, v6e), bf16 per chip.
# - A100: NVIDIA A100 Tensor Core GPU data sheet (same figures for SXM and PCIe).
# - H100: NVIDIA H100 Tensor Core GPU data sheet (SXM, NVL and PCIe columns), whose
#   tensor figures are with 2:4 sparsity, halved here; TF32 494.7 for the SXM from the
#   NVIDIA H100 Tensor Core GPU Architecture whitepaper.
# - H200: NVIDIA H200 Tensor Core GPU data sheet (SXM and NVL), halved likewise.
# Keys are `jax.Device.device_kind` strings or parts of them (the longest key inside a
# kind wins): jax reports 'TPU v4', 'TPU v5 lite' (v5e), 'TPU v5' or 'TPU v5p',
# 'TPU v6 lite' (v6e), and an NVIDIA GPU's CUDA name, e.g. 'NVIDIA A100-SXM4-80GB',
# 'NVIDIA H100 80GB HBM3' (the SXM part), 'NVIDIA H100 PCIe', 'NVIDIA H200'. Other
# GPUs (e.g. 'NVIDIA GH200 480GB') are absent, and their MFU is over the measured matmul.
DATASHEET_PEAK_FLOPS: dict[str, dict[str, float]] = {
  "TPU v4": {"bfloat16": 275e12},
  "TPU v5 lite": {"bfloat16": 197e12},  # v5e
  "TPU v5e": {"bfloat16": 197e12},
  "TPU v5": {"bfloat16": 459e12},  # v5p
  "TPU v5p": {"bfloat16": 459e12},
  "TPU v6 lite": {"bfloat16": 918e12},  # v6e (Trillium)
  "TPU v6e": {"bfloat16": 918e12},
  "A100": {"bfloat16": 312e12, "tensorfloat32": 156e12, "float32": 19.5e12},
  "NVIDIA H100 80GB HBM3": {"bfloat16": 989e12, "tensorfloat32": 494.7e12, "float32": 67e12},
  "NVIDIA H100 NVL": {"bfloat16": 835.5e12, "tensorfloat32": 417.5e12, "float32": 60e12},
  "NVIDIA H100 PCIe": {"bfloat16": 756.5e12, "tensorfloat32": 378e12, "float32": 51e12},
  "NVIDIA H200": {"bfloat16": 989e12, "tensorfloat32": 494.7e12, "float32": 67e12},  # SXM
  "NVIDIA H200 NVL": {"bfloat16": 835.5e12, "tensorfloat32": 417.5e12, "float32": 60e12},
}


# CPU flags (Linux /proc/cpuinfo) of native bfloat16 matmul instructions.
NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def _first_cpu() -> dict[str, str]:
  """The first processor's fields in /proc/cpuinfo (empty where there is none)."""
  fields: dict[str, str] = {}
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if not line.strip():
          break  # the end of the first processor
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
  except OSError:
    pass
  return fields


def cpu_flags() -> frozenset[str]:
  """The first processor's flags from /proc/cpuinfo (empty where there is none)."""
  return frozenset(_first_cpu().get("flags", "").split())


# bfloat16 over float32 matmul FLOP/s at or above which a CPU's bfloat16 counts as faster.
BF16_MIN_SPEEDUP = 1.1


def cpu_identity() -> str:
  """The first processor's model name, family and model from /proc/cpuinfo, e.g.
  'Intel(R) Xeon(R) Processor (family 6 model 207)' ('' where there is none)."""
  fields = _first_cpu()
  if not fields:
    return ""
  family, model = fields.get("cpu family", "?"), fields.get("model", "?")
  return f"{fields.get('model name', '')} (family {family} model {model})"


def bfloat16_matmul_speedup(size: int = 1024, rounds: int = 3) -> float:
  """bfloat16 over float32 matmul FLOP/s on the first device (`measure_matmul_flops`
  of each dtype, interleaved `rounds` times; the ratio of their medians)."""
  f32, bf16 = [], []
  for _ in range(rounds):
    f32.append(measure_matmul_flops(size, jnp.float32, repeats=5, warmup=1))
    bf16.append(measure_matmul_flops(size, jnp.bfloat16, repeats=5, warmup=1))
  return statistics.median(bf16) / statistics.median(f32)


def cached_cpu_bfloat16_speedup(
  flags: frozenset[str], measure: Callable[[], float] = bfloat16_matmul_speedup
) -> float:
  """`measure()` once per CPU (`cpu_identity`), flag set and jax version, kept in
  `<cache dir>/cpu_bfloat16_speedup.json` (so every run on a machine picks the same
  dtype) and logged where it is measured."""
  path = os.path.join(cache.cache_dir(), "cpu_bfloat16_speedup.json")
  key = "|".join((cpu_identity(), ",".join(sorted(flags & NATIVE_BF16_CPU_FLAGS)), jax.__version__))
  with cache.locked_json(path) as known:
    if key not in known:
      known[key] = measure()
      logging.info(
        "bfloat16 matmuls run %.2fx float32's on this CPU (%s; measured once, kept in %s)",
        known[key],
        key,
        path,
      )
  return float(known[key])


@gin.configurable
def fastest_activation_dtype(
  backend: str | None = None,
  flags: frozenset[str] | None = None,
  measure: Callable[[], float] | None = None,
) -> str:
  """'bfloat16' where bfloat16 matmuls are faster than float32's, else 'float32'.

  Accelerators (TPU, GPU) multiply bfloat16 natively. A CPU needs AVX512-BF16 or
  AMX-BF16, and even then XLA:CPU's bfloat16 matmul is not always the faster one
  (docs/performance.md has a CPU where it is slower), so on such a CPU the two are
  timed once (`cached_cpu_bfloat16_speedup`) and bfloat16 is chosen
  only at `BF16_MIN_SPEEDUP` or more. Elsewhere XLA:CPU emulates bfloat16, slower than
  float32. The recipes set `T5Config.dtype = @fastest_activation_dtype()`: where
  bfloat16 was faster their runs reached the same loss and metric at each step as
  float32, sooner (docs/recipes.md). Parameters and the optimizer stay float32 either way.
  Each process of a multi-process CPU job decides for itself: set `T5Config.dtype` there.

  Args:
    backend: the JAX backend (default `jax.default_backend()`).
    flags: the CPU's flags (default `cpu_flags()`).
    measure: returns bfloat16 over float32 matmul FLOP/s (default
      `bfloat16_matmul_speedup`, cached per machine).

  Returns:
    A `T5Config.dtype` name.
  """
  backend = backend or jax.default_backend()
  if backend != "cpu":
    return "bfloat16"
  flags = cpu_flags() if flags is None else flags
  if not flags & NATIVE_BF16_CPU_FLAGS:
    return "float32"
  if measure is None:
    speedup = cached_cpu_bfloat16_speedup(flags)
  else:
    speedup = measure()
  return "bfloat16" if speedup >= BF16_MIN_SPEEDUP else "float32"


def matmul_precision(dtype: str | jnp.dtype, platform: str, default_precision: str | None) -> str:
  """The precision a model's matmuls run at: the `DATASHEET_PEAK_FLOPS` column of its MFU.

  bfloat16 (float16) activations: their own. float32 at jax's default precision: TF32
  on a GPU, one bfloat16 pass on a TPU (the JAX documentation's "Matmul precision"
  page), float32 on a CPU; `jax_default_matmul_precision` set to 'float32' or 'highest'
  makes it float32, to 'tensorfloat32' or 'high' TF32 on a GPU and several bfloat16
  passes on a TPU ('bfloat16_3x', a column no data sheet gives).

  Args:
    dtype: the model's activation dtype.
    platform: the device's platform ('cpu', 'gpu', 'tpu').
    default_precision: `jax.config.jax_default_matmul_precision` (None: the default).

  Returns:
    'bfloat16', 'float16', 'tensorfloat32', 'bfloat16_3x', 'float32', or the
    precision's own name where it names a dot algorithm.
  """
  name = jnp.dtype(dtype).name
  if name != "float32":
    return name
  precision = (default_precision or "default").lower()
  if precision in ("default", "fastest", "bfloat16"):
    if platform == "tpu" or precision == "bfloat16":
      return "bfloat16"
    return "tensorfloat32" if platform == "gpu" else "float32"
  if precision in ("tensorfloat32", "high"):
    return "bfloat16_3x" if platform == "tpu" else "tensorfloat32"
  if precision in ("float32", "highest"):
    return "float32"
  return precision


def table_peak_flops(device_kind: str, precision: str = "bfloat16") -> float | None:
  """Data-sheet peak FLOP/s of a `jax.Device.device_kind` at `precision` (a
  `matmul_precision` value), or None where the table has no figure."""
  matches = [k for k in DATASHEET_PEAK_FLOPS if k.lower() in device_kind.lower()]
  if not matches:
    return None
  return DATASHEET_PEAK_FLOPS[max(matches, key=len)].get(precision)


def measure_matmul_flops(
  size: int | None = None, dtype: jnp.dtype = jnp.float32, repeats: int = 10, warmup: int = 2
) -> float:
  """Measured matmul FLOP/s on the first device (median of `repeats` timed runs).

  The MFU peak on CPU and the second figure elsewhere, here and in
  tools/benchmark.py. The product of two random [size, size] matrices of `dtype`
  accumulates in float32, as matmul units do: XLA:CPU's bf16-output dot is about 4x
  slower than bf16 inputs with a float32 result, which understated the bf16 peak.

  Args:
    size: square matrix size; None: 1024 on a CPU, 8192 on an accelerator (where a
      smaller product is too short to keep the matrix units busy).
    dtype: input dtype (the model's activation dtype).
    repeats: timed runs.
    warmup: untimed runs before timing (the first one compiles).

  Returns:
    FLOP/s of `size x size @ size x size` (2 * size**3 FLOPs per run).
  """
  device = jax.devices()[0]
  if size is None:
    size = 1024 if device.platform == "cpu" else 8192
  x, y = jax.device_put(
    jax.random.normal(jax.random.PRNGKey(0), (2, size, size), dtype), device
  )  # 2 x [size, size]
  matmul = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
  for _ in range(warmup):
    matmul(x, y).block_until_ready()  # [size, size]
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(x, y).block_until_ready()
    times.append(time.perf_counter() - start)
  return 2.0 * size**3 / statistics.median(times)


# A measurement below this fraction of the machine's best is logged as made on busy cores.
BUSY_FRACTION = 0.7


def best_measured_flops(measured: float, what: str) -> tuple[float, str]:
  """The larger of `measured` and the best earlier measurement of `what` on this machine.

  A matmul timed while other processes hold the cores runs slower than the device
  can, and MFU over it overstates the run (a training run started beside another
  measured a third of the machine's float32 matmul and logged MFU over 100%). So
  each measurement is kept, per `what`, CPU (`cpu_identity`), local device count,
  XLA_FLAGS and jax version, in `<cache dir>/measured_matmul_flops.json`, and the
  best of them is the peak.

  Args:
    measured: this run's FLOP/s (`measure_matmul_flops`).
    what: what was measured, e.g. 'float32 matmul measured on cpu'.

  Returns:
    (the best FLOP/s, where it comes from: `what`, with the file where an earlier
    run's measurement is the best).
  """
  path = os.path.join(cache.cache_dir(), "measured_matmul_flops.json")
  devices, xla_flags = str(jax.local_device_count()), os.environ.get("XLA_FLAGS", "")
  key = "|".join((what, cpu_identity(), devices, xla_flags, jax.__version__))
  with cache.locked_json(path) as known:
    best = known[key] = max(measured, float(known.get(key, 0.0)))
  if measured >= best:
    return measured, what
  if measured < BUSY_FRACTION * best:
    logging.warning(
      "The %s reached %.3g FLOP/s, %.0f%% of this machine's best (%.3g, kept in %s): "
      "other work is using the cores. MFU is over the best.",
      what.replace(" measured on", " on"),
      measured,
      100 * measured / best,
      best,
      path,
    )
  return best, f"{what}, the best of this machine's runs ({path})"


@dataclasses.dataclass(frozen=True)
class PeakFlops:
  """The peaks MFU is reported against (see the module docstring).

  Attributes:
    flops: FLOP/s of `throughput/mfu`: the override, the data-sheet peak, or else the
      measured matmul.
    source: where `flops` comes from, for the logs.
    measured_flops: the measured matmul's FLOP/s where `flops` is not it (the second
      figure, `throughput/mfu_measured_matmul`), else None.
    measured_source: what was measured, for the logs ('' where nothing was).
  """

  flops: float
  source: str
  measured_flops: float | None = None
  measured_source: str = ""

  def describe(self) -> str:
    """One log line: both peaks and their sources."""
    line = f"{self.flops:.3g} ({self.source})"
    if self.measured_flops is not None:
      line += f"; second figure: {self.measured_flops:.3g} ({self.measured_source})"
    return line


@gin.configurable
def device_peak_flops(
  override: float | None = None, dtype: str | jnp.dtype = "float32"
) -> PeakFlops:
  """Peak FLOP/s of one device of this process, where they come from, and the measured matmul.

  The measured matmul is the best of this machine's measurements of it
  (`best_measured_flops`), so a run started on busy cores keeps an honest MFU.

  Args:
    override: a value to use instead of the data sheet (e.g. for a device missing from
      `DATASHEET_PEAK_FLOPS`); the matmul is still measured, as the second figure.
    dtype: the model's activation dtype: the measured matmul's, and with the default
      matmul precision the data-sheet column (`matmul_precision`).

  Returns:
    The `PeakFlops`.
  """
  device = jax.devices()[0]
  name = jnp.dtype(dtype).name
  measured_source = f"{name} matmul measured on {device.device_kind}"
  measured, measured_source = best_measured_flops(
    measure_matmul_flops(dtype=jnp.dtype(dtype)), measured_source
  )
  if override:
    return PeakFlops(float(override), "gin device_peak_flops.override", measured, measured_source)
  # jax.config sets its flags as attributes at run time; its stub has none of them.
  default_precision = jax.config.jax_default_matmul_precision  # pyright: ignore[reportAttributeAccessIssue]
  precision = matmul_precision(dtype, device.platform, default_precision)
  peak = table_peak_flops(device.device_kind, precision)
  if peak is None:
    return PeakFlops(measured, measured_source)
  return PeakFlops(
    peak, f"{precision} data-sheet peak of {device.device_kind}", measured, measured_source
  )


@dataclasses.dataclass(frozen=True)
class Throughput:
  """Turns step timings into per-device rates and MFU.

  Attributes:
    rows_per_step: global batch size (packed rows).
    tokens_per_step: rows * (input_len + target_len): token positions per step.
    flops_per_step: model FLOPs of one training step (all devices).
    num_devices: devices the step runs on.
    peak_flops_per_device: `PeakFlops.flops`.
    measured_peak_flops_per_device: `PeakFlops.measured_flops`: the second MFU figure,
      `throughput/mfu_measured_matmul`, where not None.
  """

  rows_per_step: int
  tokens_per_step: int
  flops_per_step: float
  num_devices: int
  peak_flops_per_device: float
  measured_peak_flops_per_device: float | None = None

  def rates(self, steps: int, seconds: float) -> dict[str, float]:
    """Per-device rates over `steps` steps that took `seconds`."""
    per_device_second = 1.0 / (seconds * self.num_devices)
    model_flops_per_second = steps * self.flops_per_step * per_device_second
    rates = {
      "throughput/seqs_per_sec_per_device": steps * self.rows_per_step * per_device_second,
      "throughput/tokens_per_sec_per_device": steps * self.tokens_per_step * per_device_second,
      "throughput/mfu": model_flops_per_second / self.peak_flops_per_device,
      "throughput/step_time_sec": seconds / steps,
    }
    if self.measured_peak_flops_per_device:
      rates["throughput/mfu_measured_matmul"] = (
        model_flops_per_second / self.measured_peak_flops_per_device
      )
    return rates
