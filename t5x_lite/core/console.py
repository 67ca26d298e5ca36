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
  libraries log `cudart_stub.cc ... Could not find cuda drivers` and, on CPUs
  where TensorFlow turns oneDNN on, `port.cc ... oneDNN custom operations are
  on` while loading, before any log level applies. The filter is a separate process,
  so a crash during the import still shows everything else it printed.

TF_CPP_MIN_LOG_LEVEL=0 JAX_PLATFORMS= shows everything again.

Not about the console, but it too must happen before anything loads: an entry point
in `HUGE_PAGE_ENTRY_POINTS` (train, eval, infer, tools/benchmark.py) that imports this
module first restarts itself once (`os.execve`, same process id and arguments) with
`glibc.malloc.hugetlb=1` added to GLIBC_TUNABLES, on Linux with glibc 2.35 or later
and transparent huge pages not 'never'. XLA:CPU allocates a train step's buffers anew
at every step, and glibc hands the memory back to the kernel between steps, so each
step faulted in ~3 GB again, one 4 KiB page at a time (T5 1.1 small, batch 8: 800k
page faults, 2.3 s of system time per 8.3 s step). With 2 MiB pages it takes 10-20k
faults and 0.65 s, and the step 7.2 s. GLIBC_TUNABLES naming `glibc.malloc.hugetlb`
at all (`=0` turns it off) is left as it is.

`quiet_library_logs()` (called by `cli.setup` and the tools) also drops the
INFO lines of chatty libraries and the warnings expected in normal use from
absl's log (`_QuietLibraryInfo`); their other warnings and errors still show.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.abc
import importlib.machinery
import importlib.util
import logging as logging_std
import os
import subprocess
import sys
import types
from collections.abc import Iterator, Mapping, Sequence

from absl import logging  # absl loads neither TensorFlow nor JAX

# Device files of TPUs (v2-v4: accel, v5 and later: vfio), NVIDIA GPUs (dxg: WSL)
# and AMD GPUs. JAX_PLATFORMS is left unset when any exists.
ACCELERATOR_DEVICES = ("/dev/accel*", "/dev/vfio/*", "/dev/nvidia*", "/dev/dxg", "/dev/kfd")
# Lines TensorFlow's shared libraries print while loading on a machine without CUDA.
TENSORFLOW_IMPORT_NOISE = (
  "All log messages before absl::InitializeLog() is called are written to STDERR",
  "cudart_stub.cc",
  "oneDNN custom operations are on",
)
# `python -m` modules and scripts (parent dir/name) that restart with huge-page malloc.
HUGE_PAGE_ENTRY_POINTS = (
  "t5x_lite.train",
  "t5x_lite.eval",
  "t5x_lite.infer",
  "tools/benchmark.py",
)
MALLOC_HUGE_PAGES = "glibc.malloc.hugetlb=1"
TRANSPARENT_HUGE_PAGES = "/sys/kernel/mm/transparent_hugepage/enabled"
# Copies stdin to stderr without the lines that contain an argument.
_LINE_FILTER = """
import sys
drop = [arg.encode() for arg in sys.argv[1:]]
for line in sys.stdin.buffer:
  if not any(part in line for part in drop):
    sys.stderr.buffer.write(line)
    sys.stderr.buffer.flush()
"""


def huge_page_tunables(environ: Mapping[str, str], glibc_version: str, thp_mode: str) -> str | None:
  """GLIBC_TUNABLES with `MALLOC_HUGE_PAGES` added, or None where it would not apply.

  Args:
    environ: the current environment.
    glibc_version: `os.confstr('CS_GNU_LIBC_VERSION')`, e.g. 'glibc 2.36' ('' if none).
    thp_mode: /sys/kernel/mm/transparent_hugepage/enabled, e.g. 'always [madvise] never'.

  Returns:
    The new GLIBC_TUNABLES value; None if the environment already names
    `glibc.malloc.hugetlb`, glibc is older than 2.35 (no such tunable), or
    transparent huge pages are off.
  """
  current = environ.get("GLIBC_TUNABLES", "")
  if "glibc.malloc.hugetlb=" in current:
    return None
  name, _, version = glibc_version.partition(" ")
  try:
    major, minor = (int(part) for part in version.split(".")[:2])
  except ValueError:
    return None
  if name != "glibc" or (major, minor) < (2, 35) or "[" not in thp_mode or "[never]" in thp_mode:
    return None
  return ":".join(part for part in (current, MALLOC_HUGE_PAGES) if part)


def _main_entry_point() -> str:
  """`__main__` as 'package.module' (python -m) or 'dir/script.py' (a script path)."""
  main = sys.modules.get("__main__")
  spec = getattr(main, "__spec__", None)
  if spec is not None:
    return spec.name
  path = getattr(main, "__file__", None)
  if not path:
    return ""
  head, script = os.path.split(os.path.abspath(path))
  return f"{os.path.basename(head)}/{script}"


def restart_with_huge_page_malloc() -> None:
  """Restarts an entry point once with `huge_page_tunables` (see the module docstring)."""
  if not sys.platform.startswith("linux") or _main_entry_point() not in HUGE_PAGE_ENTRY_POINTS:
    return
  try:
    glibc_version = os.confstr("CS_GNU_LIBC_VERSION") or ""
  except (ValueError, OSError):  # not glibc
    return
  try:
    with open(TRANSPARENT_HUGE_PAGES) as f:
      thp_mode = f.read()
  except OSError:
    return
  tunables = huge_page_tunables(os.environ, glibc_version, thp_mode)
  if tunables is None:
    return
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, sys.orig_argv, {**os.environ, "GLIBC_TUNABLES": tunables})


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
  line_filter = subprocess.Popen(
    [sys.executable, "-I", "-c", _LINE_FILTER, *drop],
    stdin=subprocess.PIPE,
    stdout=subprocess.DEVNULL,
  )
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


# Library sources whose INFO logs are dropped (their warnings still show).
QUIET_LIBRARY_PATHS = (
  f"{os.sep}orbax{os.sep}",
  f"{os.sep}seqio{os.sep}",
  f"{os.sep}tensorflow{os.sep}",
  f"{os.sep}jax{os.sep}",
  f"{os.sep}rouge_score{os.sep}",
)
# Warnings that are expected in normal use (dropped when the message contains one):
# restoring one item (params) of a step directly from its item directory, which has
# no step metadata file; seqio's advice on every training dataset of a function
# source (resumes are exact here: the iterator position is saved) and on every
# dataset of a mixture of uncached tasks (`t5x_lite.data.mixing` counts input examples);
# and the packing converter's note that it drops the `*_pretokenized` text features,
# which the model never takes.
SILENT_MESSAGES = (
  "Metadata file does not exist",
  "Using an uncached FunctionDataset for training is not recommended",
  "not cached so using number of input examples instead of preprocessed examples",
  "will be removed during packing",
)
# gin's package-path file reader logs an ERROR for every search path that does
# not hold a file, although the next one does; those records are dropped.
SILENT_LIBRARY_PATHS = (os.path.join("gin", "resource_reader.py"),)


class _QuietLibraryInfo(logging_std.Filter):
  """Drops INFO/DEBUG records of chatty libraries (orbax logs every file it writes)."""

  def filter(self, record: logging_std.LogRecord) -> bool:
    """False for records to drop."""
    if any(part in record.pathname for part in SILENT_LIBRARY_PATHS):
      return False
    if any(m in str(record.msg) for m in SILENT_MESSAGES):
      return False
    if record.levelno >= logging_std.WARNING:
      return True
    return not any(part in record.pathname for part in QUIET_LIBRARY_PATHS)


def quiet_library_logs() -> None:
  """Adds `_QuietLibraryInfo` to absl's log handler (once), for entry points and tools."""
  handler = logging.get_absl_handler()
  if not any(isinstance(f, _QuietLibraryInfo) for f in handler.filters):
    handler.addFilter(_QuietLibraryInfo())


restart_with_huge_page_malloc()
# The user's TF_CPP_MIN_LOG_LEVEL (read before the defaults are set) turns the filter off.
_FILTER_IMPORT = "TF_CPP_MIN_LOG_LEVEL" not in os.environ and "tensorflow" not in sys.modules
os.environ.update(default_environment(os.environ, has_accelerator()))
if _FILTER_IMPORT:
  sys.meta_path.insert(0, _QuietTensorFlowImport())
