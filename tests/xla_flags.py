"""XLA flags of the test session and of the entry points and tools its tests start.

Every program the suite compiles is a tiny model run for a few steps, so compiling
is most of a test's time. `FAST_COMPILE` makes XLA's CPU backend compile sooner, at
the cost of slower code:

- `--xla_backend_optimization_level=0`: machine code without LLVM's optimisation passes;
- `--xla_cpu_use_fusion_emitters=false`: fusions emitted by XLA's elemental IR
  emitters instead of its MLIR fusion emitters, which take far longer to compile the
  many small loop fusions of a tiny model (its parameter initialisation above all).

Tests check their results at the same tolerances either way (docs/testing.md has the
measurements). Tests that time the code (tests/benchmark_test.py) and those that
compile for a TPU keep XLA's defaults, as users' runs do.
"""

from __future__ import annotations

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def xla_flags(devices: int | None = None) -> str:
  """XLA_FLAGS for a test process: `FAST_COMPILE`, and `devices` fake CPU devices if given."""
  flags = [FAST_COMPILE]
  if devices is not None:
    flags.append(f"--xla_force_host_platform_device_count={devices}")
  return " ".join(flags)
