"""Start-up choices of the entry points and tools, each explicit and logged.

Importing this module changes nothing. An entry point (train, eval, infer, the tools)
calls `quiet_startup()` as its first statement, before TensorFlow or JAX load;
`quiet_library_logs()` (from `t5x_lite.cli.setup` or the tool) then logs what it chose
(`startup_choices()`) as one INFO line. A library user who imports t5x_lite from
Python gets none of it: the process stays as they made it; `add_cpu_xla_flags()` or
`add_gpu_xla_flags()`, called before JAX starts, gives a Python process the XLA options
the entry points compile with on a CPU or GPU machine.

`quiet_startup()`:

* sets defaults for these environment variables; a value the user set, even an empty
  one, always wins:

  - TF_CPP_MIN_LOG_LEVEL=2: TensorFlow's (and XLA's) C++ INFO and WARNING lines are
    dropped, errors still show. E.g. tf.data's `cache_dataset_ops.cc ... did not fully
    read the dataset being cached`, logged whenever a training iterator over a small
    task (seqio caches those in memory) is deleted.
  - TF_ENABLED_DEVICE_TYPES=CPU: TensorFlow, which only reads data and writes
    TensorBoard files here, never initialises CUDA (`failed call to cuInit` on a CPU
    machine, GPU memory taken from JAX on a GPU one).
  - XLA_FLAGS gains `CPU_XLA_FLAGS` (the options the `xla_cpu` kernels were tuned
    under), only when no accelerator device file exists and XLA_FLAGS does not name
    them; a value of yours for either option wins.
  - XLA_FLAGS gains `GPU_XLA_FLAGS` (the latency-hiding scheduler, command buffers for
    loops), only when a GPU device file exists (`GPU_DEVICES`); a value of yours for
    either option wins, so XLA_FLAGS holding `GPU_XLA_DEFAULTS` runs with XLA's own
    choices (tools/gpu_benchmark.sh measures both).
  - JAX_COMPILATION_CACHE_DIR=<cache directory>/jax_compilation_cache
    (`compilation_cache_dir`; the cache directory is $T5X_LITE_CACHE, else
    ~/.cache/t5x_lite): JAX's persistent compilation cache, so a program that took a
    second or more to compile (a train step, an eval step, a decode) is loaded from
    disk by the next run of the same model and shapes instead of compiled again. An
    empty JAX_COMPILATION_CACHE_DIR turns it off; tools/benchmark.py leaves it off.
  - JAX_PLATFORMS=cpu, only when no accelerator device file exists
    (`ACCELERATOR_DEVICES`): otherwise JAX loads libtpu to look for a TPU, which prints
    `TPU_ACCELERATOR_TYPE` and `TPU_WORKER_HOSTNAMES` errors and `Unable to initialize
    backend 'tpu'`. `--precompile` is unaffected: it loads libtpu's compile-only
    topologies itself.

* with `import_tensorflow=True` (the entry points that read data), imports TensorFlow
  at once with `TENSORFLOW_IMPORT_NOISE` dropped from what it writes to stderr, unless
  the user set TF_CPP_MIN_LOG_LEVEL: its shared libraries log `cudart_stub.cc ... Could
  not find cuda drivers` and, on CPUs where TensorFlow turns oneDNN on, `port.cc ...
  oneDNN custom operations are on` while loading, before any log level applies. The
  filter is a child process that lives only for the import, so a crash during it still
  shows everything else it printed.

TF_CPP_MIN_LOG_LEVEL=0 JAX_PLATFORMS= shows everything again.

`restart_with_huge_pages()`, which `--huge_pages` asks for (`t5x_lite.cli`), restarts
the entry point once (`os.execve`, same process id and arguments) with
`glibc.malloc.hugetlb=1` added to GLIBC_TUNABLES, on Linux with glibc 2.35 or later and
transparent huge pages not 'never'. XLA:CPU allocates a step's buffers anew at every
step and glibc hands the memory back between steps, so with 4 KiB pages a large step
faults its memory in again, one page at a time, at every step (docs/performance.md has
the measurements). Setting GLIBC_TUNABLES=glibc.malloc.hugetlb=1 yourself does the
same without a restart.

`quiet_library_logs()` (called by `cli.setup` and the tools) also drops the INFO lines
of chatty libraries and the warnings expected in normal use from absl's log
(`_QuietLibraryInfo`); their other warnings and errors still show.

`exit_without_teardown()`, which `t5x_lite.core.gin_config.run_app` (the entry points'
and tools' `app.run`) calls when the run ends (unless `--nofast_exit`), exits as
`sys.exit` would: it waits for the threads Python would wait for, runs the `atexit`
handlers and flushes the standard streams, then calls `os._exit`. It skips only
Python's teardown of the objects still in memory, TensorFlow's and JAX's modules above
all, which takes longer than a short run's own steps. An error that escapes as a
traceback exits as Python does.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import glob
import logging as logging_std
import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import NoReturn

from absl import logging  # absl loads neither TensorFlow nor JAX

from t5x_lite.core import cache  # nor does this (gin, the standard library)

# Device files of TPUs (v2-v4: accel, v5 and later: vfio), NVIDIA GPUs (dxg: WSL)
# and AMD GPUs. JAX_PLATFORMS is left unset when any exists.
ACCELERATOR_DEVICES = ("/dev/accel*", "/dev/vfio/*", "/dev/nvidia*", "/dev/dxg", "/dev/kfd")
# Lines TensorFlow's shared libraries print while loading on a machine without CUDA.
TENSORFLOW_IMPORT_NOISE = (
  "All log messages before absl::InitializeLog() is called are written to STDERR",
  "cudart_stub.cc",
  "oneDNN custom operations are on",
)
# XLA:CPU options of the entry points on a CPU machine (`quiet_startup`):
# - YNNPACK's reduce fusion is slow on leading-axis sums (the relative-bias gradient, a
#   sum over batch and layers of [batch, heads, q, k]); XLA's own reduction loops are
#   fast. YNNPACK keeps the dots. Other backends ignore xla_cpu_*.
# - XLA:CPU's tree_reduction_rewriter splits each long reduction into windows of 32,
#   which stops XLA from fusing it with its producers (the softmax's sums, every row
#   reduction); RMSNorm's scale gradient, the one sum it sped up, is a matmul in the
#   xla_cpu kernels. docs/performance.md has the measurements.
# Given per program instead (`jax.jit(compiler_options=...)`, YNNPACK's fusion types as
# LIBRARY_FUSION_TYPE_DOT), the same options made the T5 1.1 small train step slower
# than these flags (docs/performance.md), so they stay process-wide, set explicitly.
CPU_XLA_FLAGS = (
  "--xla_cpu_experimental_ynn_fusion_type=-reduce",
  "--xla_disable_hlo_passes=tree_reduction_rewriter",
)
# GPU device files (NVIDIA, WSL, AMD): where quiet_startup adds GPU_XLA_FLAGS.
GPU_DEVICES = ("/dev/nvidia[0-9]*", "/dev/dxg", "/dev/kfd")
# XLA:GPU options of the entry points on a GPU machine (`quiet_startup`), the two the
# JAX-on-GPU anchors set (NVIDIA's JAX containers, MaxText's GPU recipes):
# - the latency-hiding scheduler orders the program so that asynchronous work
#   (collectives, copies) overlaps compute; XLA's default is off;
# - command buffers (CUDA graphs) for loops too: XLA records fusions and library calls
#   into CUDA graphs by default; '+WHILE,+CONDITIONAL' adds while loops and conditionals
#   (decoding's token loop, scanned layers), launched as one graph instead of kernel
#   by kernel from the host.
# Whether they help T5 here is for tools/gpu_benchmark.sh to show (with and without).
GPU_XLA_FLAGS = (
  "--xla_gpu_enable_latency_hiding_scheduler=true",
  "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL",
)
# The same options at XLA's own values ('+FUSION' adds a type already in XLA's default
# list, i.e. leaves the list as it is): in XLA_FLAGS, a run without GPU_XLA_FLAGS.
GPU_XLA_DEFAULTS = (
  "--xla_gpu_enable_latency_hiding_scheduler=false",
  "--xla_gpu_enable_command_buffer=+FUSION",
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


def restart_with_huge_pages() -> tuple[bool, str]:
  """Restarts this process with `huge_page_tunables` (see the module docstring).

  Returns only when no restart happens: (whether huge-page malloc is on, why), e.g.
  after the restart, or where glibc or the kernel lack it. Otherwise the process is
  replaced by the same command line with the new GLIBC_TUNABLES.
  """
  current = os.environ.get("GLIBC_TUNABLES", "")
  if MALLOC_HUGE_PAGES in current.split(":"):
    return True, f"on (GLIBC_TUNABLES={current})"
  if "glibc.malloc.hugetlb=" in current:
    return False, f"GLIBC_TUNABLES={current} sets glibc.malloc.hugetlb already"
  try:
    glibc_version = os.confstr("CS_GNU_LIBC_VERSION") or ""
  except (ValueError, OSError):  # not glibc
    glibc_version = ""
  try:
    with open(TRANSPARENT_HUGE_PAGES) as f:
      thp_mode = f.read().strip()
  except OSError:
    thp_mode = "unreadable"
  tunables = huge_page_tunables(os.environ, glibc_version, thp_mode)
  if tunables is None or not sys.platform.startswith("linux"):
    return False, (
      f"needs Linux, glibc 2.35+ and transparent huge pages; here {glibc_version or 'no glibc'}"
      f", {TRANSPARENT_HUGE_PAGES}: {thp_mode}"
    )
  logging.info("--huge_pages: restarting with GLIBC_TUNABLES=%s", tunables)
  sys.stdout.flush()
  sys.stderr.flush()
  environ = _USER_ENVIRON or dict(os.environ)  # without quiet_startup's defaults
  os.execve(sys.executable, sys.orig_argv, {**environ, "GLIBC_TUNABLES": tunables})
  raise AssertionError("unreachable: os.execve returned")


def exit_without_teardown(code: object = 0) -> NoReturn:
  """Ends an entry point that has finished its work as `sys.exit(code)` would, less the
  interpreter's teardown (`--fast_exit`, see the module docstring).

  Waits for the threads that Python's own exit would wait for (non-daemon ones, after
  stopping idle `concurrent.futures` workers), runs the `atexit` handlers (JAX's
  backend and multi-host shutdown, absl's and logging's flushes), flushes Python's and
  C's standard streams, then calls `os._exit`. What is skipped is only the teardown of
  the modules and objects left in memory: TensorFlow's and JAX's thousands of modules
  take longer to dismantle than a short run's own steps.

  Args:
    code: `SystemExit.code`: None or an int is the exit status; anything else is
      printed on stderr and the status is 1.
  """
  # What Python's own exit does first, neither with a public name: threading's exit
  # hooks (concurrent.futures stops its idle workers there) and the wait for the
  # non-daemon threads, then the atexit handlers.
  threading._shutdown()  # noqa: SLF001  # pyright: ignore[reportAttributeAccessIssue]
  atexit._run_exitfuncs()  # noqa: SLF001
  if code is None:
    status = 0
  elif isinstance(code, int):
    status = code
  else:
    print(code, file=sys.stderr)
    status = 1
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):  # a closed pipe or stream
      pass
  ctypes.CDLL(None).fflush(None)  # C stdio of the native libraries
  os._exit(status)


def has_accelerator() -> bool:
  """Whether a TPU or GPU device file (`ACCELERATOR_DEVICES`) exists."""
  return any(glob.glob(pattern) for pattern in ACCELERATOR_DEVICES)


def has_gpu() -> bool:
  """Whether a GPU device file (`GPU_DEVICES`) exists."""
  return any(glob.glob(pattern) for pattern in GPU_DEVICES)


def add_xla_flags(
  flags: Sequence[str], environ: MutableMapping[str, str] | None = None
) -> list[str]:
  """Appends the `flags` whose options XLA_FLAGS does not name yet; returns those added.

  Takes effect only before JAX starts its backends.
  """
  environ = os.environ if environ is None else environ
  current = environ.get("XLA_FLAGS", "")
  added = [flag for flag in flags if flag.split("=")[0] + "=" not in current]
  if added:
    environ["XLA_FLAGS"] = " ".join([current.strip(), *added]).strip()
  return added


def add_cpu_xla_flags(environ: MutableMapping[str, str] | None = None) -> list[str]:
  """`add_xla_flags(CPU_XLA_FLAGS)`: what `quiet_startup` adds on a machine without
  accelerators; Python code calls it first to compile as the entry points do."""
  return add_xla_flags(CPU_XLA_FLAGS, environ)


def add_gpu_xla_flags(environ: MutableMapping[str, str] | None = None) -> list[str]:
  """`add_xla_flags(GPU_XLA_FLAGS)`: what `quiet_startup` adds on a GPU machine;
  Python code calls it first to compile as the entry points do."""
  return add_xla_flags(GPU_XLA_FLAGS, environ)


def default_environment(
  environ: Mapping[str, str], accelerator: bool, compilation_cache: bool = True
) -> dict[str, str]:
  """The module docstring's defaults that `environ` does not set.

  Args:
    environ: the current environment.
    accelerator: whether the machine may have a TPU or GPU (`has_accelerator`).
    compilation_cache: whether to default JAX_COMPILATION_CACHE_DIR
      (`compilation_cache_dir`).

  Returns:
    Variable name -> default value, for the variables `environ` lacks.
  """
  defaults = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLED_DEVICE_TYPES": "CPU"}
  if not accelerator:
    defaults["JAX_PLATFORMS"] = "cpu"
  if compilation_cache:
    defaults["JAX_COMPILATION_CACHE_DIR"] = compilation_cache_dir(environ)
  return {name: value for name, value in defaults.items() if name not in environ}


def compilation_cache_dir(environ: Mapping[str, str]) -> str:
  """`jax_compilation_cache` in the t5x_lite cache directory (`cache.cache_dir`'s
  choice: $T5X_LITE_CACHE, else ~/.cache/t5x_lite)."""
  root = environ.get(cache.CACHE_ENV) or cache.DEFAULT_CACHE_DIR
  return os.path.join(os.path.abspath(os.path.expanduser(root)), "jax_compilation_cache")


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
  assert line_filter.stdin is not None  # stdin=PIPE
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


# What `quiet_startup` chose, for `startup_choices`.
_CHOICES: list[str] = []
# The environment as the user gave it, before `quiet_startup`'s defaults: what a
# `restart_with_huge_pages` restarts with, so the restarted process chooses alike.
_USER_ENVIRON: dict[str, str] = {}


def asks_for_huge_pages(argv: Sequence[str]) -> bool:
  """Whether a command line sets the `--huge_pages` flag (`t5x_lite.cli`), last one winning."""
  on = False
  for arg in argv:
    if arg == "--huge_pages":
      on = True
    elif arg.startswith("--huge_pages="):
      on = arg.split("=", 1)[1].lower() in ("true", "1", "t", "yes", "y")
    elif arg == "--nohuge_pages":
      on = False
  return on


def quiet_startup(import_tensorflow: bool = True, compilation_cache: bool = True) -> list[str]:
  """The module docstring's environment defaults, then a quiet TensorFlow import.

  Call it first in an entry point, before TensorFlow or JAX load; a later call adds
  nothing. Never called on import. A command line with `--huge_pages` restarts here,
  before anything loads (`restart_with_huge_pages`; `cli.run` logs the outcome).

  Args:
    import_tensorflow: import TensorFlow now, its load-time noise filtered (for
      entry points that read data with seqio).
    compilation_cache: default JAX's persistent compilation cache on (False for a
      tool that measures compile times).

  Returns:
    What it did, one short phrase per choice (also `startup_choices()`).
  """
  if not _USER_ENVIRON:
    _USER_ENVIRON.update(os.environ)
  if asks_for_huge_pages(sys.argv[1:]):
    restart_with_huge_pages()  # returns only if it cannot, or it did already
  user_log_level = "TF_CPP_MIN_LOG_LEVEL" in os.environ
  defaults = default_environment(os.environ, has_accelerator(), compilation_cache)
  os.environ.update(defaults)
  for name, value in defaults.items():
    reason = " (no accelerator device file)" if name == "JAX_PLATFORMS" else ""
    _CHOICES.append(f"{name}={value}{reason}")
  added = add_cpu_xla_flags() if not has_accelerator() else []
  added += add_gpu_xla_flags() if has_gpu() else []
  if added:
    _CHOICES.append(f"XLA_FLAGS += {' '.join(added)}")
  if import_tensorflow and "tensorflow" not in sys.modules:
    if user_log_level:
      import tensorflow  # noqa: F401
    else:
      with native_stderr_without(TENSORFLOW_IMPORT_NOISE):
        import tensorflow  # noqa: F401
      _CHOICES.append("TensorFlow's load-time messages filtered")
  return list(_CHOICES)


def add_startup_choice(phrase: str) -> None:
  """Records a choice an entry point made after `quiet_startup` (for the `Start-up:` line)."""
  if phrase not in _CHOICES:
    _CHOICES.append(phrase)


def startup_choices() -> list[str]:
  """What `quiet_startup` set in this process ([] if it was not called)."""
  return list(_CHOICES)


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
  """Adds `_QuietLibraryInfo` to absl's log handler and logs `startup_choices()` (once).

  For entry points and tools, after absl has parsed the flags.
  """
  handler = logging.get_absl_handler()
  if not any(isinstance(f, _QuietLibraryInfo) for f in handler.filters):
    handler.addFilter(_QuietLibraryInfo())
    if _CHOICES:
      logging.info("Start-up: %s", "; ".join(_CHOICES))
