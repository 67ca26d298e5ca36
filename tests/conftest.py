"""Test setup: 8 fake CPU devices so sharding is exercised on one machine."""

import os
import tempfile

import gin  # no JAX import: the environment below still comes first
import pytest

# Must happen before jax is imported anywhere in the test session.
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One offline vocabulary trained per machine and shared by every test (and xdist worker).
os.environ.setdefault("T5X_LITE_CACHE", os.path.join(tempfile.gettempdir(), "t5x_lite_test_cache"))


@pytest.fixture
def clean_gin():
  """Gin's config cleared before and after the test (`pytestmark = usefixtures('clean_gin')`)."""
  gin.clear_config()
  yield
  gin.clear_config()
