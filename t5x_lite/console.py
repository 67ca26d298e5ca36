"""Quiet start-up for the entry points and tools: import this module first.

TensorFlow (which only reads data and writes TensorBoard files here) and JAX
print lines at every start on a machine without accelerators that say nothing
about the run. Imported before either of them loads, this module

* sets defaults for these environment variables; a value the user set, even
  an empty one, always wins:

  - TF_CPP_MIN_LOG_LEVEL=2: TensorFlow's (and XLA's) C++ INFO and WARNING
    lines are dropped, errors still show. E.g. tf.data's `cache_dataset_ops.cc
    ... did not fully read the dataset being cached`, logged whenever a
    training iterator over a small task (seqio caches those in memory) is
    deleted.
  - TF_ENABLED_DEVICE_TYPES=CPU: TensorFlow never initialises CUDA (`failed
    call to cuInit` on a CPU machine, GPU memory taken from JAX on a GPU one).
  - JAX_PLATFORMS=cpu, only when no accelerator device file exists
    (`ACCELERATOR_DEVICES`): otherwise JAX loads libtpu to look for a TPU, which
    prints `TPU_ACCELERATOR_TYPE` and `TPU_WORKER_HOSTNAMES` errors and
    `Unable to initialize backend 'tpu'`. `--precompile` is unaffected: it
    loads libtpu's compile-only topologies itself.

* unless the user set TF_CPP_MIN_LOG_LEVEL, drops `TENSORFLOW_IMPORT_NOISE`
  from what the first `import tensorflow` writes to stderr: its shared
  libraries log `cudart_stub.cc ... Could not find cuda drivers` while
  loading, before any log level applies. The filter is a separate process,
  so a crash during the import still shows everything else it printed.

TF_CPP_MIN_LOG_LEVEL=0 JAX_PLATFORMS= shows everything again.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.abc
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import types
from collections.abc import Iterator, Mapping, Sequence

# Device files of TPUs (v2-v4: accel, v5 and later: vfio), NVIDIA GPUs (dxg: WSL)
# and AMD GPUs. JAX_PLATFORMS is left unset when any exists.
ACCELERATOR_DEVICES = ("/dev/accel*", "/dev/vfio/*", "/dev/nvidia*", "/dev/dxg", "/dev/kfd")
# Lines TensorFlow's shared libraries print while loading on a machine without CUDA.
TENSORFLOW_IMPORT_NOISE = (
    "All log messages before absl::InitializeLog() is called are written to STDERR",
    "cudart_stub.cc",
)
# Copies stdin to stderr without the lines that contain an argument.
_LINE_FILTER = """
import sys
drop = [arg.encode() for arg in sys.argv[1:]]
for line in sys.stdin.buffer:
  if not any(part in line for part in drop):
    sys.stderr.buffer.write(line)
    sys.stderr.buffer.flush()
"""


def has_accelerator() -> bool:
  """Whether a TPU or GPU device file (`ACCELERATOR_DEVICES`) exists."""
  return any(glob.glob(pattern) for pattern in ACCELERATOR_DEVICES)


def default_environment(environ: Mapping[str, str], accelerator: bool) -> dict[str, str]:
  """The module docstring's defaults that `environ` does not set.

  Args:
    environ: the current environment.
    accelerator: whether the machine may have a TPU or GPU (`has_accelerator`).

  Returns:
    Variable name -> default value, for the variables `environ` lacks.
  """
  defaults = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLED_DEVICE_TYPES": "CPU"}
  if not accelerator:
    defaults["JAX_PLATFORMS"] = "cpu"
  return {name: value for name, value in defaults.items() if name not in environ}


@contextlib.contextmanager
def native_stderr_without(drop: Sequence[str]) -> Iterator[None]:
  """Drops the lines containing any of `drop` from everything written to stderr.

  File descriptor 2 itself is redirected, so C++ libraries are filtered as well
  as Python; a child process filters and outlives a crash of this one.

  Args:
    drop: substrings of the lines to drop.
  """
  sys.stderr.flush()
  line_filter = subprocess.Popen([sys.executable, "-I", "-c", _LINE_FILTER, *drop],
                                 stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
  original = os.dup(2)
  os.dup2(line_filter.stdin.fileno(), 2)
  try:
    yield
  finally:
    sys.stderr.flush()
    os.dup2(original, 2)
    os.close(original)
    line_filter.stdin.close()
    line_filter.wait()


class _QuietTensorFlowImport(importlib.abc.MetaPathFinder):
  """Runs the first `import tensorflow` in `native_stderr_without(TENSORFLOW_IMPORT_NOISE)`."""

  def find_spec(
      self,
      fullname: str,
      path: Sequence[str] | None,
      target: types.ModuleType | None = None,
  ) -> importlib.machinery.ModuleSpec | None:
    """TensorFlow's own spec, its loader wrapped; None for every other module."""
    del path, target
    if fullname != "tensorflow":
      return None
    sys.meta_path.remove(self)  # once: TensorFlow's submodules load as usual
    spec = importlib.util.find_spec(fullname)
    if spec is None or spec.loader is None:
      return spec
    exec_module = spec.loader.exec_module

    def exec_quietly(module: types.ModuleType) -> None:
      with native_stderr_without(TENSORFLOW_IMPORT_NOISE):
        exec_module(module)

    spec.loader.exec_module = exec_quietly  # this spec's loader instance only
    return spec


# The user's TF_CPP_MIN_LOG_LEVEL (read before the defaults are set) turns the filter off.
_FILTER_IMPORT = "TF_CPP_MIN_LOG_LEVEL" not in os.environ and "tensorflow" not in sys.modules
os.environ.update(default_environment(os.environ, has_accelerator()))
if _FILTER_IMPORT:
  sys.meta_path.insert(0, _QuietTensorFlowImport())
