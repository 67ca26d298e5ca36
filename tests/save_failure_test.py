"""Tests of how a failed checkpoint save is explained and cleaned up (faults_test.py fills
the disk of a real training run)."""

import errno
import os

import pytest
import tensorflow as tf
from etils import epath

from t5x_lite.checkpoint import save_failure


def _raised_from(cause: BaseException) -> BaseException:
  try:
    try:
      raise cause
    except BaseException as e:
      raise RuntimeError("orbax: save of step 10 failed") from e
  except RuntimeError as wrapped:
    return wrapped


@pytest.mark.parametrize(
  "error, reason",
  [
    (OSError(errno.ENOSPC, "No space left on device"), "No space left on device"),
    (_raised_from(OSError(errno.EFBIG, "File too large")), "File too large"),
    (
      tf.errors.ResourceExhaustedError(None, None, "x.tempstate; No space left on device"),
      "No space left on device",
    ),
    (ValueError('Error writing "d/ab": [OS error: Disk quota exceeded]'), "Disk quota exceeded"),
  ],
)
def test_write_failure_finds_the_os_reason_in_wrapped_errors(error, reason):
  assert save_failure.write_failure(error) == reason


def test_other_errors_are_not_write_failures():
  assert save_failure.write_failure(_raised_from(KeyError("params"))) is None


def test_the_partial_save_is_removed_and_the_message_names_step_space_and_last_step(tmp_path):
  root = epath.Path(tmp_path)
  (tmp_path / "5" / "params").mkdir(parents=True)
  (tmp_path / "5" / "params" / "data").write_bytes(b"x" * 3000)
  partial = tmp_path / "10.orbax-checkpoint-tmp-1234" / "params"
  partial.mkdir(parents=True)
  (partial / "data").write_bytes(b"x" * 100)

  removed = save_failure.remove_partial(root, 10)
  assert removed == ["10.orbax-checkpoint-tmp-1234"]
  assert sorted(os.listdir(tmp_path)) == ["5"]
  message = str(save_failure.failed_save_error(root, 10, "No space left on device", [5], removed))
  assert message.startswith(
    f"Saving checkpoint step 10 to {tmp_path}/10 failed: No space left on device "
    "(a step takes 2.9 KiB, as step 5 does; "
  )
  assert "free on its disk); removed its partial files (10.orbax-checkpoint-tmp-1234); " in message
  assert f"the last committed step 5 is intact ({tmp_path}/5)" in message
