"""Tests of the MODEL_DIR lock, with real second processes (tests/faults_test.py runs two
training runs on one MODEL_DIR)."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from t5x_lite.core.errors import UserError
from t5x_lite.run import model_dir_lock

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _in_another_process(model_dir, body: str) -> subprocess.CompletedProcess:
  """Runs `body` in a fresh Python with `lock = ModelDirLock(model_dir)` defined."""
  script = textwrap.dedent(f"""
    import os, sys
    from t5x_lite.run import model_dir_lock
    lock = model_dir_lock.ModelDirLock({str(model_dir)!r})
  """) + textwrap.dedent(body)
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
  return subprocess.run(
    [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
  )


def _holder(model_dir) -> dict:
  with open(os.path.join(model_dir, model_dir_lock.LOCK_FILE)) as f:
    return json.load(f)


def test_a_second_process_is_refused_naming_the_holder(tmp_path):
  with model_dir_lock.ModelDirLock(str(tmp_path)):
    assert _holder(tmp_path)["pid"] == os.getpid()
    other = _in_another_process(
      tmp_path,
      """
      try:
        lock.acquire()
      except model_dir_lock.ModelDirLockedError as e:
        print(e)
        sys.exit(3)
      """,
    )
  assert other.returncode == 3, other.stderr
  assert f"MODEL_DIR {tmp_path} is in use by another training run" in other.stdout
  assert f"host {socket.gethostname()}, pid {os.getpid()}, started " in other.stdout
  assert not (tmp_path / model_dir_lock.LOCK_FILE).exists()  # released on exit


def test_a_lock_left_by_a_killed_process_is_taken_over_with_a_warning(tmp_path, caplog):
  killed = _in_another_process(tmp_path, "lock.acquire()\nprint(os.getpid())\nos._exit(0)")
  assert killed.returncode == 0, killed.stderr
  dead_pid = int(killed.stdout)
  assert _holder(tmp_path)["pid"] == dead_pid  # left behind, as by kill -9
  with model_dir_lock.ModelDirLock(str(tmp_path)):
    assert _holder(tmp_path)["pid"] == os.getpid()
  [warning] = [r.getMessage() for r in caplog.records if "stale" in r.getMessage()]
  assert f"pid {dead_pid}" in warning and "no such process on this host" in warning


def _lock_of_another_host(model_dir, age_s: float) -> None:
  path = model_dir / model_dir_lock.LOCK_FILE
  started = time.time() - 3600
  path.write_text(json.dumps({"host": "other-host", "pid": 1, "started": started}))
  os.utime(path, (time.time() - age_s, time.time() - age_s))


def test_a_live_lock_of_another_host_is_refused_and_a_silent_one_taken_over(tmp_path, caplog):
  _lock_of_another_host(tmp_path, age_s=30)
  lock = model_dir_lock.ModelDirLock(str(tmp_path), stale_after_s=600)
  with pytest.raises(model_dir_lock.ModelDirLockedError, match="host other-host, pid 1,.*30 s"):
    lock.acquire()
  assert _holder(tmp_path)["host"] == "other-host"  # untouched

  _lock_of_another_host(tmp_path, age_s=900)
  with lock:
    assert _holder(tmp_path)["pid"] == os.getpid()
  assert any("not refreshed for 900 s" in r.getMessage() for r in caplog.records)


def test_the_lock_is_released_on_an_error_and_taken_again(tmp_path):
  lock = model_dir_lock.ModelDirLock(str(tmp_path))
  with pytest.raises(RuntimeError), lock:
    raise RuntimeError("training failed")
  assert not (tmp_path / model_dir_lock.LOCK_FILE).exists()
  model_dir_lock.acquire_for_job(lock)  # one process: process 0 takes it
  assert _holder(tmp_path)["pid"] == os.getpid()
  with pytest.raises(UserError, match="in use by another training run"):
    model_dir_lock.acquire_for_job(model_dir_lock.ModelDirLock(str(tmp_path)))
  lock.release()
