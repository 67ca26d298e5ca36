"""Per-device peak FLOP/s and throughput/MFU arithmetic for training logs.

MFU = model FLOPs per second achieved per device / peak FLOP/s of the device.
Model FLOPs come from `t5x_lite.flops.flops_per_token` (forward + backward of
the network's matmuls, no rematerialisation); the peak comes from, in order:

1. `device_peak_flops.override` (gin), e.g. for a device missing below;
2. `PEAK_BF16_FLOPS` for TPUs and NVIDIA GPUs: dense bf16 matmul peaks from
  the vendors' spec sheets (per chip / per GPU, no sparsity). MFU against the
  bf16 peak is the usual convention even for float32 runs;
3. on CPU (or an unknown device): a float32 matmul measured at startup on
  the first device (`measure_matmul_flops`), i.e. what XLA's CPU backend
  actually reaches on this machine. With several (fake) CPU devices on one
  host they share those cores, so per-device MFU there is an upper bound.
"""

from __future__ import annotations

import dataclasses
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


def table_peak_flops(device_kind: str) -> float | None:
  """Peak bf16 FLOP/s for a `jax.Device.device_kind`, or None if not listed."""
  matches = [k for k in PEAK_BF16_FLOPS if k.lower() in device_kind.lower()]
  if not matches:
    return None
  return PEAK_BF16_FLOPS[max(matches, key=len)]


def measure_matmul_flops(size: int = 1024, repeats: int = 10) -> float:
  """Measured float32 matmul FLOP/s on the first device (best of `repeats`).

  Args:
    size: square matrix size.
    repeats: timed runs after one warm-up.

  Returns:
    FLOP/s of `size x size @ size x size` (2 * size**3 FLOPs per run).
  """
  device = jax.devices()[0]
  x = jax.device_put(jnp.ones((size, size), jnp.float32), device)  # [size, size]
  matmul = jax.jit(lambda a: a @ a)  # [size, size]
  matmul(x).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(x).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2.0 * size**3 / best


@gin.configurable
def device_peak_flops(override: float | None = None) -> tuple[float, str]:
  """Peak FLOP/s of one device of this process and where the number comes from.

  Args:
    override: a value to use instead of the table / measurement.

  Returns:
    (peak FLOP/s, source description for the logs).
  """
  kind = jax.devices()[0].device_kind
  if override:
    return float(override), "gin device_peak_flops.override"
  peak = table_peak_flops(kind)
  if peak is not None:
    return peak, f"bf16 spec-sheet peak of {kind}"
  return measure_matmul_flops(), f"float32 matmul measured on {kind}"


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
