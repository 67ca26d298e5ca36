"""Test setup: 8 fake CPU devices so sharding is exercised on one machine."""

import os
import tempfile

import gin  # no JAX import: the environment below still comes first
import pytest
from xla_flags import xla_flags

# Must happen before jax is imported anywhere in the test session.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags(devices=8)).strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One offline vocabulary trained per machine and shared by every test (and xdist worker).
os.environ.setdefault("T5X_LITE_CACHE", os.path.join(tempfile.gettempdir(), "t5x_lite_test_cache"))
# JAX's persistent compilation cache, shared by the tests and the entry points and tools
# they run as subprocesses: programs that take a second or more to compile (train and
# decode steps of the tiny configs, which many tests share) compile once per machine.
os.environ.setdefault(
  "JAX_COMPILATION_CACHE_DIR", os.path.join(os.environ["T5X_LITE_CACHE"], "jax_compilation_cache")
)
# Every program, not only those over JAX's default 1 s of compile time: most of the
# suite's programs are tiny and compile in well under a second, and a test builds new
# jitted functions (a new Trainer, a new model) for programs that earlier tests compiled
# already. Caching them all took a cold run of the model, network, kernels, trainer and
# decoder-only tests 7% less time (2 workers); a cache hit loads the executable the
# compiler produced for the identical program, so nothing a test checks changes.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


@pytest.fixture
def clean_gin():
  """Gin's config cleared before and after the test (`pytestmark = usefixtures('clean_gin')`)."""
  gin.clear_config()
  yield
  gin.clear_config()


# The documentation test's two halves (readme_flow_test.HALVES) are the longest tests,
# the first by far. With `-n N --dist worksteal` (the suite's
# command) worker k starts with the k-th N-th of the collection; putting one half at the
# start of each of the first two shares runs them side by side from the start, the
# short tests filling in around them.
_LONGEST = "readme_flow_test.py::test_readme_commands_run_as_written"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
  # Runs in each xdist worker, which knows the worker count and the command line.
  worker = getattr(config, "workerinput", None)
  if worker is None or "worksteal" not in " ".join(worker.get("mainargv", [])):
    return
  longest = [item for item in items if _LONGEST in item.nodeid]
  if len(longest) != 2 or worker["workercount"] < 2:
    return
  rest = [item for item in items if _LONGEST not in item.nodeid]
  share = len(items) // worker["workercount"]
  items[:] = [longest[0], *rest[: share - 1], longest[1], *rest[share - 1 :]]
