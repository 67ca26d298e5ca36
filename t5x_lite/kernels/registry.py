"""`T5Config.kernels` -> a `Kernels` set: the one place a backend's kernels are chosen.

A new backend plugs in with a module beside `xla_cpu` that defines `KERNELS = Kernels(
name=..., ...)` (e.g. `dataclasses.replace(reference.KERNELS, name='gpu', attention=...)`
to replace one primitive), an entry in `KERNELS` below, and, to make it the default
there, an entry in `AUTO` for its backend; tests/kernels_test.py then checks it against
the reference.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax

from t5x_lite.kernels import reference, xla_cpu, xla_gpu
from t5x_lite.kernels.base import Kernels

KERNELS: dict[str, Kernels] = {
  k.name: k for k in (reference.KERNELS, xla_cpu.KERNELS, xla_gpu.KERNELS)
}
# The set 'auto' picks per backend (`jax.default_backend()`); other backends: 'reference'.
# 'gpu' stays 'reference' until 'xla_gpu''s decoded tokens are compared with the
# reference's on a GPU (docs/performance.md: it trains faster in both shapes measured).
AUTO: dict[str, str] = {'cpu': 'xla_cpu'}
# The values `T5Config.kernels` accepts.
NAMES: tuple[str, ...] = ('auto', *KERNELS)
# The backend 'auto' resolves for inside `compiling_for`; None: the process's default.
_TARGET_BACKEND: contextvars.ContextVar[str | None] = contextvars.ContextVar(
  'target_backend', default=None
)


@contextlib.contextmanager
def compiling_for(backend: str) -> Iterator[None]:
  """Inside the block, 'auto' resolves for `backend` (e.g. 'tpu').

  For programs traced in one process for another backend's devices: the TPU
  precompiler (`t5x_lite.run.precompile`) traces on a host whose default backend is
  the CPU, and its TPU program must get the TPU's kernels.
  """
  token = _TARGET_BACKEND.set(backend)
  try:
    yield
  finally:
    _TARGET_BACKEND.reset(token)


def select(name: str) -> Kernels:
  """The kernels named `name`; 'auto' resolves for the backend jax runs on.

  Called where the network builds its layers, so 'auto' resolves when a program is
  traced: for the backend of `compiling_for` inside one, else the process's default.

  Raises:
    KeyError: for a name not in `NAMES` (`T5Config` validates its value first).
  """
  if name == 'auto':
    name = AUTO.get(_TARGET_BACKEND.get() or jax.default_backend(), 'reference')
  return KERNELS[name]
