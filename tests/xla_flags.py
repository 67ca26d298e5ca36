"""XLA flags of the test session and of the entry points and tools its tests start.

Every program the suite compiles is a tiny model run for a few steps, so compiling
is most of a test's time. `FAST_COMPILE` sets XLA's backend optimisation level to 0,
so the CPU backend emits machine code without LLVM's optimisation passes: slower code,
compiled sooner. That took a 3-step quickstart from 34 to 28 s (the same losses to
every digit) and the fast suite (`-m "not slow"`, 2 workers) from 521 to 406 s on a
2-core AMD EPYC (Zen 3), with every test passing at its tolerance. Tests that time
the code (tests/benchmark_test.py) and those that compile for a TPU keep XLA's defaults.
"""

from __future__ import annotations

FAST_COMPILE = "--xla_backend_optimization_level=0"


def xla_flags(devices: int | None = None) -> str:
  """XLA_FLAGS for a test process: `FAST_COMPILE`, and `devices` fake CPU devices if given."""
  flags = [FAST_COMPILE]
  if devices is not None:
    flags.append(f"--xla_force_host_platform_device_count={devices}")
  return " ".join(flags)
