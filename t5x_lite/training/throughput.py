"""Per-device peak FLOP/s and throughput/MFU arithmetic for training logs.

MFU = model FLOPs per second achieved per device / peak FLOP/s of the device.
Model FLOPs come from `t5x_lite.nn.flops.flops_per_token` (forward + backward of
the network's matmuls, no rematerialisation); the peak comes from, in order:

1. `device_peak_flops.override` (gin), e.g. for a device missing below;
2. `PEAK_BF16_FLOPS` for TPUs and NVIDIA GPUs: dense bf16 matmul peaks from
  the vendors' spec sheets (per chip / per GPU, no sparsity). MFU against the
  bf16 peak is the usual convention even for float32 runs;
3. on CPU (or an unknown device): a matmul in the model's activation dtype
  measured at startup on the first device (`measure_matmul_flops`, the same
  measurement as tools/benchmark.py's), i.e. what XLA's CPU backend actually
  reaches on this machine: a bfloat16 model on a CPU with native bfloat16 is
  measured against the bfloat16 matmul, not the slower float32 one. With
  several (fake) CPU devices on one host they share those cores, so per-device
  MFU there is an upper bound.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import gin
import jax
import jax.numpy as jnp

# device_kind substring -> dense bf16 peak FLOP/s per device. Longest match wins.
PEAK_BF16_FLOPS: dict[str, float] = {
  "TPU v4": 275e12,
  "TPU v5 lite": 197e12,  # v5e
  "TPU v5e": 197e12,
  "TPU v5p": 459e12,
  "TPU v5": 459e12,  # v5p reports "TPU v5"
  "TPU v6 lite": 918e12,  # v6e (Trillium)
  "TPU v6e": 918e12,
  "A100": 312e12,
  "H100": 989e12,  # SXM; PCIe parts peak at 756e12
  "H200": 989e12,
}


# CPU flags (Linux /proc/cpuinfo) of native bfloat16 matmul instructions.
NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags() -> frozenset[str]:
  """The first processor's flags from /proc/cpuinfo (empty where there is none)."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("flags"):
          return frozenset(line.split(":", 1)[1].split())
  except OSError:
    pass
  return frozenset()


@gin.configurable
def fastest_activation_dtype(
  backend: str | None = None, flags: frozenset[str] | None = None
) -> str:
  """'bfloat16' where bfloat16 matmuls run natively, else 'float32'.

  Accelerators (TPU, GPU) and CPUs with AVX512-BF16 or AMX-BF16 multiply bfloat16
  natively; elsewhere XLA:CPU emulates it, slower than float32. The recipes set
  `T5Config.dtype = @fastest_activation_dtype()`: on a CPU with AVX512-BF16 their
  runs reached the same loss and metric at each step as float32, sooner
  (docs/recipes.md). Parameters and the optimizer stay float32 either way.

  Args:
    backend: the JAX backend (default `jax.default_backend()`).
    flags: the CPU's flags (default `cpu_flags()`).

  Returns:
    A `T5Config.dtype` name.
  """
  backend = backend or jax.default_backend()
  native = backend != "cpu" or bool(
    (cpu_flags() if flags is None else flags) & NATIVE_BF16_CPU_FLAGS
  )
  return "bfloat16" if native else "float32"


def table_peak_flops(device_kind: str) -> float | None:
  """Peak bf16 FLOP/s for a `jax.Device.device_kind`, or None if not listed."""
  matches = [k for k in PEAK_BF16_FLOPS if k.lower() in device_kind.lower()]
  if not matches:
    return None
  return PEAK_BF16_FLOPS[max(matches, key=len)]


def measure_matmul_flops(
  size: int = 1024, dtype: jnp.dtype = jnp.float32, repeats: int = 10, warmup: int = 2
) -> float:
  """Measured matmul FLOP/s on the first device (median of `repeats` timed runs).

  The peak that MFU is computed against here and in tools/benchmark.py. The
  product of two random [size, size] matrices of `dtype` accumulates in
  float32, as matmul units do: XLA:CPU's bf16-output dot is about 4x slower
  than bf16 inputs with a float32 result, which understated the bf16 peak.

  Args:
    size: square matrix size.
    dtype: input dtype (the model's activation dtype).
    repeats: timed runs.
    warmup: untimed runs before timing (the first one compiles).

  Returns:
    FLOP/s of `size x size @ size x size` (2 * size**3 FLOPs per run).
  """
  device = jax.devices()[0]
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


@gin.configurable
def device_peak_flops(
  override: float | None = None, dtype: str | jnp.dtype = "float32"
) -> tuple[float, str]:
  """Peak FLOP/s of one device of this process and where the number comes from.

  Args:
    override: a value to use instead of the table / measurement.
    dtype: the model's activation dtype: the dtype of the measured matmul.

  Returns:
    (peak FLOP/s, source description for the logs).
  """
  kind = jax.devices()[0].device_kind
  if override:
    return float(override), "gin device_peak_flops.override"
  peak = table_peak_flops(kind)
  if peak is not None:
    return peak, f"bf16 spec-sheet peak of {kind}"
  name = jnp.dtype(dtype).name
  return measure_matmul_flops(dtype=jnp.dtype(dtype)), f"{name} matmul measured on {kind}"


@dataclasses.dataclass(frozen=True)
class Throughput:
  """Turns step timings into per-device rates and MFU.

  Attributes:
    rows_per_step: global batch size (packed rows).
    tokens_per_step: rows * (input_len + target_len): token positions per step.
    flops_per_step: model FLOPs of one training step (all devices).
    num_devices: devices the step runs on.
    peak_flops_per_device: from `device_peak_flops`.
  """

  rows_per_step: int
  tokens_per_step: int
  flops_per_step: float
  num_devices: int
  peak_flops_per_device: float

  def rates(self, steps: int, seconds: float) -> dict[str, float]:
    """Per-device rates over `steps` steps that took `seconds`."""
    per_device_second = 1.0 / (seconds * self.num_devices)
    return {
      "throughput/seqs_per_sec_per_device": steps * self.rows_per_step * per_device_second,
      "throughput/tokens_per_sec_per_device": steps * self.tokens_per_step * per_device_second,
      "throughput/mfu": steps
      * self.flops_per_step
      * per_device_second
      / self.peak_flops_per_device,
      "throughput/step_time_sec": seconds / steps,
    }
