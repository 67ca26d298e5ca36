"""Tests of rewinding MODEL_DIR's logs to a restart's step (faults_test.py does it after a
real kill -9)."""

import json

import tensorflow as tf

from t5x_lite.training import metrics_rewind


def _jsonl(path, steps) -> list[bytes]:
  lines = [
    json.dumps({"step": s, "split": "train", "loss": 1.0 / s}).encode() + b"\n" for s in steps
  ]
  path.write_bytes(b"".join(lines))
  return lines


def test_metrics_jsonl_keeps_the_lines_up_to_the_step_byte_for_byte(tmp_path):
  path = tmp_path / "metrics.jsonl"
  lines = _jsonl(path, range(1, 9))
  with open(path, "ab") as f:
    f.write(b'{"step": 9, "spl')  # cut short by kill -9
  assert metrics_rewind.rewind_metrics_jsonl(str(path), 5) == 4
  assert path.read_bytes() == b"".join(lines[:5])
  assert metrics_rewind.rewind_metrics_jsonl(str(path), 5) == 0  # nothing left to drop
  assert metrics_rewind.rewind_metrics_jsonl(str(tmp_path / "absent.jsonl"), 5) == 0


def _events(directory) -> list[tuple[str, int]]:
  found = []
  for path in sorted(directory.glob("events.out.tfevents.*")):
    for record in tf.data.TFRecordDataset(str(path)):
      event = tf.compat.v1.Event.FromString(record.numpy())
      found += [(v.tag, event.step) for v in event.summary.value]
  return found


def test_rewind_logs_drops_later_steps_from_metrics_and_tensorboard(tmp_path, caplog):
  _jsonl(tmp_path / "metrics.jsonl", range(1, 9))
  writer = tf.summary.create_file_writer(str(tmp_path / "train"))
  with writer.as_default():
    for step in range(1, 9):
      tf.summary.scalar("loss", 1.0 / step, step=step)
  writer.close()
  [event_file] = (tmp_path / "train").glob("events.out.tfevents.*")
  with open(event_file, "ab") as f:
    f.write(b"\x64" + b"\x00" * 11 + b"abc")  # a record cut short by kill -9

  metrics_rewind.rewind_logs(str(tmp_path), 5, ("train", "eval"))
  steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").open()]
  assert steps == [1, 2, 3, 4, 5]
  assert _events(tmp_path / "train") == [("loss", s) for s in range(1, 6)]
  assert any("Dropped 7 records logged after step 5" in r.getMessage() for r in caplog.records)
  assert sorted(p.name for p in (tmp_path / "train").iterdir()) == [event_file.name]
