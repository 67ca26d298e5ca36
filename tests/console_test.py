"""Tests of `t5x_lite.core.console`: explicit start-up choices and the stderr line filter.

That an entry point's whole output is free of start-up noise is checked on a
real training run in train_test.py.
"""

import os
import subprocess
import sys

import pytest

from t5x_lite.core import console

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
  """Runs `code` in a fresh interpreter whose environment lacks TF_CPP_MIN_LOG_LEVEL."""
  environ = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
  return subprocess.run(
    [sys.executable, "-c", code],
    cwd=REPO,
    env={**environ, **env},
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )


def test_defaults_fill_only_what_the_user_left_unset():
  cache = {"T5X_LITE_CACHE": "/data/cache"}
  assert console.default_environment(cache, accelerator=False) == {
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "TF_ENABLED_DEVICE_TYPES": "CPU",
    "JAX_PLATFORMS": "cpu",
    "JAX_COMPILATION_CACHE_DIR": "/data/cache/jax_compilation_cache",
  }
  # Empty counts as set: JAX_COMPILATION_CACHE_DIR= turns the cache off.
  user = {"TF_CPP_MIN_LOG_LEVEL": "0", "JAX_PLATFORMS": "", "JAX_COMPILATION_CACHE_DIR": ""}
  assert console.default_environment(user, accelerator=False) == {"TF_ENABLED_DEVICE_TYPES": "CPU"}
  assert "JAX_COMPILATION_CACHE_DIR" not in console.default_environment(
    {}, accelerator=False, compilation_cache=False
  )
  home = os.path.expanduser(os.path.join("~", ".cache", "t5x_lite", "jax_compilation_cache"))
  assert console.default_environment({}, accelerator=False)["JAX_COMPILATION_CACHE_DIR"] == home


def test_jax_chooses_its_platform_where_an_accelerator_may_exist():
  assert "JAX_PLATFORMS" not in console.default_environment({}, accelerator=True)


@pytest.mark.slow
def test_filter_drops_matching_lines_of_native_and_python_writes():
  code = (
    "import os, sys\nfrom t5x_lite.core import console\n"
    "with console.native_stderr_without(('cudart_stub.cc', 'noise')):\n"
    "  os.write(2, b'kept 1\\nI0000 cudart_stub.cc:31] Could not find cuda drivers\\n')\n"
    "  print('some noise', file=sys.stderr)\n"
    "  print('kept 2', file=sys.stderr)\n"
    "print('kept 3', file=sys.stderr)\n"
  )
  result = _python(code)
  assert result.returncode == 0 and result.stderr == "kept 1\nkept 2\nkept 3\n", result.stderr


@pytest.mark.slow
def test_lines_before_a_crash_inside_the_filter_still_show():
  crash = (
    "import os\nfrom t5x_lite.core import console\n"
    "with console.native_stderr_without(('noise',)):\n"
    "  os.write(2, b'noise\\nF0000 the real problem\\n')\n"
    "  os.abort()\n"
  )
  result = _python(crash)
  assert result.returncode != 0
  assert "F0000 the real problem" in result.stderr and "noise" not in result.stderr


@pytest.mark.slow
def test_tensorflow_import_prints_no_cuda_stub_lines():
  result = _python("from t5x_lite.core import console\nconsole.quiet_startup()\nimport tensorflow")
  assert result.returncode == 0, result.stderr
  assert not any(noise in result.stderr for noise in console.TENSORFLOW_IMPORT_NOISE), result.stderr


def test_huge_page_tunables_are_added_only_where_glibc_and_the_kernel_take_them():
  thp = "always [madvise] never"
  assert console.huge_page_tunables({}, "glibc 2.36", thp) == "glibc.malloc.hugetlb=1"
  # The user's other tunables stay; theirs for hugetlb (even =0) wins.
  user = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
  assert (
    console.huge_page_tunables(user, "glibc 2.39", "[always] madvise never")
    == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
  )
  assert (
    console.huge_page_tunables({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "glibc 2.36", thp)
    is None
  )
  assert console.huge_page_tunables({}, "glibc 2.34", thp) is None  # no such tunable yet
  assert console.huge_page_tunables({}, "glibc 2.36", "always madvise [never]") is None
  assert console.huge_page_tunables({}, "", thp) is None  # not glibc (musl, macOS)


def _huge_pages_available() -> bool:
  try:
    with open(console.TRANSPARENT_HUGE_PAGES) as f:
      thp = f.read()
    glibc = os.confstr("CS_GNU_LIBC_VERSION") or ""
  except (OSError, ValueError):
    return False
  return console.huge_page_tunables({}, glibc, thp) is not None


def test_importing_the_library_changes_nothing_in_the_process():
  """Nothing of ours on import (TensorFlow and libtpu set variables of their own)."""
  ours = ("XLA_FLAGS", "JAX_PLATFORMS", "TF_ENABLED_DEVICE_TYPES", "GLIBC_TUNABLES")
  code = (
    "import os, sys\n"
    f"ours = {ours!r}\n"
    "before = [os.environ.get(k) for k in ours]\n"
    "from t5x_lite.core import console\n"
    "import t5x_lite.train, t5x_lite.cli, t5x_lite.models, t5x_lite.run.interactive\n"
    "print([os.environ.get(k) for k in ours] == before, console.startup_choices(), flush=True)\n"
  )
  result = _python(code)
  assert result.returncode == 0, result.stderr
  assert result.stdout.split() == ["True", "[]"]


def test_quiet_startup_sets_only_what_the_user_left_unset_and_says_so():
  code = (
    "import os\n"
    "from t5x_lite.core import console\n"
    "choices = console.quiet_startup(import_tensorflow=False)\n"
    "print(os.environ['TF_ENABLED_DEVICE_TYPES'], os.environ['TF_CPP_MIN_LOG_LEVEL'])\n"
    "print('|'.join(choices))\n"
  )
  result = _python(code, TF_ENABLED_DEVICE_TYPES="CPU,GPU", XLA_FLAGS="")
  assert result.returncode == 0, result.stderr
  values, choices = result.stdout.splitlines()
  assert values.split() == ["CPU,GPU", "2"]  # the user's value wins
  assert "TF_CPP_MIN_LOG_LEVEL=2" in choices.split("|")
  if not console.has_accelerator():
    assert f"XLA_FLAGS += {' '.join(console.CPU_XLA_FLAGS)}" in choices.split("|")
  assert not any(c.startswith("TF_ENABLED_DEVICE_TYPES") for c in choices.split("|"))


@pytest.mark.skipif(
  not _huge_pages_available(), reason="needs glibc >= 2.35 and transparent huge pages"
)
def test_huge_pages_flag_restarts_the_entry_point_once_and_only_when_asked():
  # `cli.run` with --huge_pages: the child restarts itself once, in the same process.
  code = (
    "import os, sys\n"
    "print(os.getpid(), os.environ.get('GLIBC_TUNABLES'), flush=True)\n"
    "from t5x_lite import cli\n"
    "cli.run(lambda argv: print('main', os.environ.get('GLIBC_TUNABLES'), flush=True))\n"
  )
  environ = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
  result = subprocess.run(
    [sys.executable, "-c", code, "--huge_pages"],
    cwd=REPO,
    env=environ,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert result.returncode == 0, result.stderr
  first, second, main = result.stdout.splitlines()
  assert first.split()[1] == "None"
  assert second.split() == [first.split()[0], "glibc.malloc.hugetlb=1"]
  assert main == "main glibc.malloc.hugetlb=1"
  assert "restarting with GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in result.stderr
  assert "--huge_pages: on (GLIBC_TUNABLES=glibc.malloc.hugetlb=1)" in result.stderr
  # Without the flag nothing restarts.
  plain = subprocess.run(
    [sys.executable, "-c", code], cwd=REPO, env=environ, capture_output=True, text=True, timeout=120
  )
  assert plain.returncode == 0, plain.stderr
  assert [line.split()[-1] for line in plain.stdout.splitlines()] == ["None", "None"]


def test_huge_pages_is_read_from_the_command_line_as_absl_reads_the_flag():
  assert console.asks_for_huge_pages(["--gin_file=x.gin", "--huge_pages"])
  assert console.asks_for_huge_pages(["--huge_pages=true"])
  assert not console.asks_for_huge_pages(["--huge_pages", "--nohuge_pages"])
  assert not console.asks_for_huge_pages(["--huge_pages=false"])
  assert not console.asks_for_huge_pages(["--gin.huge_pages=True", "--huge_pagesx"])


def test_cpu_xla_flags_are_added_without_overriding_the_users():
  ours = list(console.CPU_XLA_FLAGS)
  environ = {}
  assert console.add_cpu_xla_flags(environ) == ours
  assert environ["XLA_FLAGS"].split() == ours
  environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  console.add_cpu_xla_flags(environ)
  assert environ["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=8", *ours]
  # A value the user chose is kept, and a second call adds nothing.
  chosen = "--xla_cpu_experimental_ynn_fusion_type= --xla_disable_hlo_passes=cse"
  environ = {"XLA_FLAGS": chosen}
  assert console.add_cpu_xla_flags(environ) == []
  assert environ["XLA_FLAGS"] == chosen


def test_gpu_xla_flags_are_added_on_a_gpu_machine_without_overriding_the_users():
  ours = list(console.GPU_XLA_FLAGS)
  environ = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
  assert console.add_gpu_xla_flags(environ) == ours
  assert environ["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/x", *ours]
  # XLA's own values, named by the user (a run without ours), stay as they are.
  defaults = " ".join(console.GPU_XLA_DEFAULTS)
  environ = {"XLA_FLAGS": defaults}
  assert console.add_gpu_xla_flags(environ) == [] and environ["XLA_FLAGS"] == defaults
  code = (
    "import os\n"
    "from t5x_lite.core import console\n"
    "console.has_gpu = console.has_accelerator = lambda: True\n"
    "choices = console.quiet_startup(import_tensorflow=False)\n"
    "print(os.environ['XLA_FLAGS'])\n"
    "print('|'.join(choices))\n"
  )
  result = _python(code, XLA_FLAGS="")
  assert result.returncode == 0, result.stderr
  flags, choices = result.stdout.splitlines()
  assert flags.split() == ours  # and none of the CPU's
  assert f"XLA_FLAGS += {' '.join(ours)}" in choices.split("|")
  assert "JAX_PLATFORMS=cpu" not in choices


@pytest.mark.parametrize("flags", ["GPU_XLA_FLAGS", "GPU_XLA_DEFAULTS"])
def test_the_gpu_xla_flags_are_options_this_jaxlib_knows(flags):
  """XLA aborts on an unknown option or value in XLA_FLAGS; the CPU jaxlib parses the
  GPU options too, so a renamed one fails here before it fails on a GPU machine."""
  value = " ".join(getattr(console, flags))
  code = "import jax.numpy as jnp\nprint(float(jnp.ones(3).sum()))\n"
  result = _python(code, XLA_FLAGS=value, JAX_PLATFORMS="cpu")
  assert result.returncode == 0 and result.stdout.split() == ["3.0"], result.stderr[-2000:]
  wrong = value.replace("+WHILE", "+LOOPS").replace("+FUSION", "+LOOPS")
  bad = _python(code, XLA_FLAGS=wrong, JAX_PLATFORMS="cpu")
  assert bad.returncode != 0  # so a bad value would have failed above


_EXIT_CHILD = """
import atexit, concurrent.futures, os, sys, threading, time
from t5x_lite import cli
from t5x_lite.core.errors import ConfigError


class Teardown:
  def __del__(self, write=os.write):  # bound now: the module's names are gone by then
    write(1, b'module teardown\\n')


KEEP = Teardown()  # a module global: only the interpreter's teardown deletes it
POOL = concurrent.futures.ThreadPoolExecutor(2)  # never shut down: exiting stops its workers
atexit.register(lambda: sys.stdout.write('atexit handler\\n'))


def main(argv):
  sys.stdout.write(f'unflushed line {POOL.submit(len, "abc").result()}\\n')  # a pipe: buffered
  writer = threading.Thread(target=lambda: (time.sleep(0.5), print('thread done')))
  writer.start()  # non-daemon: exiting waits for it
  if argv[1:] == ['fail']:
    raise ConfigError('EVAL_STEPS must be at least 1')


cli.run(main)
"""


@pytest.mark.parametrize("fail", [False, True], ids=["finished", "failed"])
def test_fast_exit_keeps_output_threads_atexit_and_status_and_skips_only_teardown(fail):
  def run(*flags: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-c", _EXIT_CHILD, *flags, *(["fail"] if fail else [])]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)

  expected = ["unflushed line 3", "thread done", "atexit handler"]
  fast, normal = run(), run("--nofast_exit")
  assert (fast.returncode, normal.returncode) == ((1, 1) if fail else (0, 0))
  assert fast.stdout.splitlines() == expected  # no teardown: the global is never deleted
  assert normal.stdout.splitlines() == [*expected, "module teardown"]
  for result in (fast, normal):
    errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR")]
    assert errors == (["ERROR: EVAL_STEPS must be at least 1"] if fail else [])
