"""Tests for t5x_lite.data.vocab, t5x_lite.core.cache and tools/train_vocab.py."""

import os
import subprocess
import sys
import tempfile
import threading

# One shared cache per machine: the offline vocabulary is trained once, also
# under pytest-xdist (first use is serialized by a lock file).
os.environ.setdefault("T5X_LITE_CACHE", os.path.join(tempfile.gettempdir(), "t5x_lite_test_cache"))

import gin  # noqa: E402
import pytest  # noqa: E402
import seqio  # noqa: E402
import tensorflow as tf  # noqa: E402

from t5x_lite.core import cache
from t5x_lite.data import cpython_corpus, vocab  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_offline_vocabulary_has_t5_ids():
  v = vocab.get_vocabulary()
  assert (v.pad_id, v.eos_id, v.unk_id) == (0, 1, 2)
  assert v.tokenizer.bos_id() == -1
  assert v.extra_ids == 100
  assert v.vocab_size == 8000 + 100
  assert v.tokenizer.id_to_piece(0) == "<pad>" and v.tokenizer.id_to_piece(1) == "</s>"
  text = "Return the number of items in a container."
  ids = v.encode(text)
  assert ids and max(ids) < 8000 and 2 not in ids
  assert v.decode(ids) == text
  assert v.encode("<extra_id_0>")[-1] == v.vocab_size - 1


def test_default_vocabulary_follows_gin(tmp_path):
  small = tmp_path / "small.model"
  small.write_bytes(vocab.train_sentencepiece(cpython_corpus.prose("validation"), vocab_size=300))
  deferred = vocab.default_vocabulary()
  assert deferred.vocab_size == 8100
  with gin.unlock_config():
    gin.bind_parameter("get_vocabulary.sentencepiece_model_file", str(small))
  try:
    assert deferred.vocab_size == 400
    assert deferred.resolved.sentencepiece_model_file == str(small)
    ids = deferred.encode_tf(tf.constant("for loop"))
    assert int(tf.reduce_max(ids)) < 300
  finally:
    gin.clear_config()
  assert deferred.vocab_size == 8100


def test_training_is_deterministic():
  text = cpython_corpus.prose("validation")
  assert vocab.train_sentencepiece(text, 300) == vocab.train_sentencepiece(text, 300)
  assert vocab.train_sentencepiece(text, 300) != vocab.train_sentencepiece(text[1:], 300)


def test_parallel_first_use_trains_once(tmp_path, monkeypatch):
  calls = []
  real_train = vocab.train_sentencepiece

  def counting_train(sentences, vocab_size):
    calls.append(vocab_size)
    return real_train(list(sentences)[:300], vocab_size)

  monkeypatch.setattr(vocab, "train_sentencepiece", counting_train)
  paths = []
  threads = [
    threading.Thread(target=lambda: paths.append(vocab.offline_vocabulary_path(200, str(tmp_path))))
    for _ in range(4)
  ]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert calls == [200]
  assert len(set(paths)) == 1 and len(paths) == 4
  assert seqio.SentencePieceVocabulary(paths[0], extra_ids=100).vocab_size == 300
  leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp_")]
  assert not leftovers


def test_cache_dir_precedence(monkeypatch, tmp_path):
  monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "env"))
  assert cache.cache_dir() == str(tmp_path / "env")
  assert cache.cache_dir(str(tmp_path / "explicit")) == str(tmp_path / "explicit")
  monkeypatch.delenv(cache.CACHE_ENV)
  assert cache.cache_dir() == os.path.expanduser("~/.cache/t5x_lite")


@pytest.mark.slow
def test_train_vocab_tool_from_task(tmp_path):
  output = tmp_path / "out.model"
  result = subprocess.run(
    [
      sys.executable,
      "tools/train_vocab.py",
      "--task=cpython_code_to_docstring",
      "--text_field=docstring",
      "--max_examples=800",
      "--vocab_size=250",
      f"--output={output}",
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  v = seqio.SentencePieceVocabulary(str(output), extra_ids=100)
  assert (v.pad_id, v.eos_id, v.unk_id, v.vocab_size) == (0, 1, 2, 350)
  assert v.tokenizer.bos_id() == -1
  assert "Return" in v.decode(v.encode("Return the value."))
