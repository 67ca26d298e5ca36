"""Tests for the registered tasks (tasks/), local-file sources and task metrics."""

import gzip
import json
import math
import os
import tempfile

os.environ.setdefault("T5X_LITE_CACHE", os.path.join(tempfile.gettempdir(), "t5x_lite_test_cache"))

import gin  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import seqio  # noqa: E402
import tensorflow_datasets as tfds  # noqa: E402

import nltk_fixtures  # noqa: E402
import tasks  # noqa: E402,F401
from t5x_lite.data import cpython_corpus, file_sources, objectives, task_metrics  # noqa: E402

LENGTHS = {"inputs": 64, "targets": 16}
TFDS_TASKS = sorted(n for n in seqio.TaskRegistry.names() if n.startswith(("c4_", "glue_", "wmt")))
LOCAL_TASKS = sorted(n for n in seqio.TaskRegistry.names() if n.startswith("local_"))
OFFLINE_TASKS = ["cpython_span_corruption", "cpython_code_to_docstring", "cpython_electra"]


def _write_fixture_data(root) -> None:
  """A tiny copy of ../shared/data's layout."""
  sentences = [f"sentence number {i} is {'good' if i % 2 else 'bad'}" for i in range(12)]
  for name in ("SST-2",):
    d = root / "glue" / name
    d.mkdir(parents=True)
    rows = "".join(f"{s}\t{i % 2}\n" for i, s in enumerate(sentences))
    for split in ("train", "dev"):
      # Saved by an editor that writes a UTF-8 byte-order mark: still 'sentence'.
      (d / f"{split}.tsv").write_text("\ufeffsentence\tlabel\n" + rows, encoding="utf-8")
  d = root / "glue" / "RTE"
  d.mkdir(parents=True)
  rows = "".join(
    f"{i}\t{s}\tit is {i}\t{'entailment' if i % 2 else 'not_entailment'}\n"
    for i, s in enumerate(sentences)
  )
  for split in ("train", "dev"):
    (d / f"{split}.tsv").write_text("index\tsentence1\tsentence2\tlabel\n" + rows)
  d = root / "multi30k_en_de"
  d.mkdir()
  for prefix in ("train", "val", "test_2016_flickr"):
    for lang, word in (("en", "dog"), ("de", "Hund")):
      with gzip.open(d / f"{prefix}.{lang}.gz", "wt") as f:
        f.write("".join(f"a {word} number {i}\n" for i in range(10)))
  d = root / "scitldr_a"
  d.mkdir()
  for split in ("train", "dev", "test"):
    with open(d / f"{split}.jsonl", "w") as f:
      for i in range(6):
        record = {"source": [f"We study {i}.", "It works."], "target": [f"Study {i}.", "x"]}
        f.write(json.dumps(record) + "\n")
  d = root / "tinyshakespeare"
  d.mkdir()
  (d / "input.txt").write_text("\n".join(sentences * 5) + "\n\n")
  d = root / "wikitext2"
  d.mkdir()
  for split in ("valid", "test"):
    (d / f"{split}.txt").write_text("\n = Title = \n\n" + "\n".join(sentences * 5))
  nltk_fixtures.write_nltk(root)


@pytest.fixture(name="data_dir")
def fixture_data_dir(tmp_path):
  _write_fixture_data(tmp_path)
  with gin.unlock_config():
    gin.bind_parameter("local_data_dir.path", str(tmp_path))
  yield tmp_path
  gin.clear_config()


def _packed_batch(task: seqio.Task, split: str, lengths=LENGTHS, **kwargs) -> dict:
  if "inputs" not in task.output_features:  # a language-model task: decoder-only features
    lengths = {"targets": lengths["targets"]}
    ds = task.get_dataset(lengths, split=split, shuffle=False, seed=0, **kwargs)
    ds = seqio.DecoderFeatureConverter(pack=True)(ds, task_feature_lengths=lengths).batch(2)
    batch = next(ds.as_numpy_iterator())
    assert batch["decoder_target_tokens"].shape[1:] == (lengths["targets"],)
    assert batch["decoder_segment_ids"].max() >= 1
    assert (batch["decoder_loss_weights"].sum(axis=1) > 0).all()
    return batch
  ds = task.get_dataset(lengths, split=split, shuffle=False, seed=0, **kwargs)
  ds = seqio.EncDecFeatureConverter(pack=True)(ds, task_feature_lengths=lengths).batch(2)
  batch = next(ds.as_numpy_iterator())
  # Short data may pack into a single row.
  assert batch["encoder_input_tokens"].shape[1:] == (lengths["inputs"],)
  assert batch["decoder_target_tokens"].shape[1:] == (lengths["targets"],)
  assert batch["encoder_segment_ids"].max() >= 1
  assert (batch["decoder_loss_weights"].sum(axis=1) > 0).all()
  return batch


def test_expected_registrations():
  assert TFDS_TASKS == sorted(
    [f"c4_v220_{objective}" for objective in objectives.UNSUPERVISED_OBJECTIVES]
    + ["wmt16_ende"]
    + [f"glue_{n}_v2" for n in "cola sst2 mrpc qqp stsb mnli qnli rte wnli".split()]
  )
  assert {"quickstart", "glue_v2"} <= set(seqio.MixtureRegistry.names())
  assert len(seqio.MixtureRegistry.get("glue_v2").tasks) == 9
  # The recipes' corpus under every objective, and ELECTRA's uncorrupted text.
  unlabeled = [f"local_unlabeled_{o}" for o in objectives.UNSUPERVISED_OBJECTIVES]
  unlabeled.append("local_unlabeled_electra")
  assert [n for n in LOCAL_TASKS if n.startswith("local_unlabeled_")] == sorted(unlabeled)
  assert len(LOCAL_TASKS) == 6 + len(unlabeled)


@pytest.mark.parametrize("name", TFDS_TASKS)
def test_tfds_task_yields_packed_batch(name):
  task = seqio.TaskRegistry.get(name)
  with tfds.testing.mock_data(num_examples=6):
    # Mock data has no split sizes; skip seqio's size-based in-memory cache.
    _packed_batch(task, "validation", try_in_mem_cache=False)


@pytest.mark.parametrize("name", LOCAL_TASKS)
def test_local_task_yields_packed_batch(name, data_dir):
  del data_dir
  task = seqio.TaskRegistry.get(name)
  split = task.splits[0]
  _packed_batch(task, split)
  assert task.num_input_examples(split) > 0


def test_local_task_formats(data_dir):
  del data_dir
  sst2 = seqio.TaskRegistry.get("local_glue_sst2")
  ex = next(sst2.get_dataset(LENGTHS, split="validation", shuffle=False).as_numpy_iterator())
  assert ex["inputs_pretokenized"] == b"sst2 sentence: sentence number 0 is bad"
  assert ex["targets_pretokenized"] == b"negative"
  assert sst2.num_input_examples("train") == 12
  mt = seqio.TaskRegistry.get("local_multi30k_ende")
  ex = next(mt.get_dataset(LENGTHS, split="test", shuffle=False).as_numpy_iterator())
  assert ex["inputs_pretokenized"] == b"translate English to German: a dog number 0"
  assert ex["targets_pretokenized"] == b"a Hund number 0"
  tldr = seqio.TaskRegistry.get("local_scitldr_a")
  ex = next(tldr.get_dataset(LENGTHS, split="validation", shuffle=False).as_numpy_iterator())
  assert ex["inputs_pretokenized"] == b"summarize: We study 0. It works."
  assert ex["targets_pretokenized"] == b"Study 0."
  shakespeare = seqio.TaskRegistry.get("local_tinyshakespeare_span_corruption")
  assert shakespeare.num_input_examples("train") == 60  # empty lines dropped


@pytest.mark.parametrize("name", OFFLINE_TASKS + ["quickstart"])
def test_offline_tasks_yield_packed_batches(name):
  provider = seqio.get_mixture_or_task(name)
  lengths = {"inputs": 128, "targets": 32}
  ds = seqio.get_dataset(
    name,
    lengths,
    seqio.EncDecFeatureConverter(pack=True),
    dataset_split="validation",
    shuffle=True,
    seed=0,
    num_epochs=None,
    batch_size=2,
  )
  batch = next(ds.as_numpy_iterator())
  assert batch["encoder_input_tokens"].shape == (2, 128)
  assert provider.num_input_examples("validation") > 100


def test_same_seed_same_batches():
  def batches(seed):
    ds = seqio.get_dataset(
      "quickstart",
      {"inputs": 64, "targets": 16},
      seqio.EncDecFeatureConverter(pack=True),
      shuffle=True,
      seed=seed,
      num_epochs=None,
      batch_size=4,
    )
    return [b["encoder_input_tokens"] for b in ds.take(3).as_numpy_iterator()]

  first, again, other = batches(5), batches(5), batches(6)
  assert all(np.array_equal(a, b) for a, b in zip(first, again))
  assert not all(np.array_equal(a, b) for a, b in zip(first, other))


def test_shards_are_disjoint():
  task = seqio.TaskRegistry.get("cpython_code_to_docstring")

  def inputs(shard):
    ds = task.get_dataset(
      LENGTHS, split="validation", shuffle=True, seed=1, shard_info=seqio.ShardInfo(shard, 2)
    )
    return [ex["inputs_pretokenized"] for ex in ds.as_numpy_iterator()]

  shard0, shard1 = inputs(0), inputs(1)
  assert shard0 and shard1
  assert not set(shard0) & set(shard1)
  assert len(shard0) + len(shard1) == task.num_input_examples("validation")


def test_offline_splits_are_disjoint_and_stable():
  for corpus in (cpython_corpus.prose, cpython_corpus.docstring_pairs):
    train, validation = set(corpus("train")), set(corpus("validation"))
    assert train and validation and not train & validation
    assert 0.02 < len(validation) / (len(train) + len(validation)) < 0.08
  train_docs = {doc for _, doc in cpython_corpus.docstring_pairs("train")}
  assert not train_docs & {doc for _, doc in cpython_corpus.docstring_pairs("validation")}
  assert cpython_corpus.split_of("def f(): pass") == cpython_corpus.split_of("def f(): pass")


def test_missing_file_names_path_and_gin_param(tmp_path):
  with gin.unlock_config():
    gin.bind_parameter("local_data_dir.path", str(tmp_path / "nowhere"))
  try:
    task = seqio.TaskRegistry.get("local_glue_sst2")
    with pytest.raises(file_sources.DataFileError) as e:
      task.get_dataset(LENGTHS, split="train", shuffle=False)
    assert str(tmp_path / "nowhere" / "glue" / "SST-2" / "train.tsv") in str(e.value)
    assert "local_data_dir.path" in str(e.value)
    with pytest.raises(file_sources.DataFileError, match="local_data_dir.path"):
      seqio.TaskRegistry.get("local_wikitext2_span_corruption").get_dataset(LENGTHS, split="test")
  finally:
    gin.clear_config()


def test_malformed_rows_name_file_and_line(tmp_path):
  tsv = tmp_path / "bad.tsv"
  tsv.write_text("sentence\tlabel\ngood\t1\n\nonly one field\n")
  with pytest.raises(file_sources.DataFileError, match=f"{tsv}:4: expected 2"):
    file_sources.read_tsv(str(tsv))
  jsonl = tmp_path / "bad.jsonl"
  jsonl.write_text('{"a": "x"}\n{"a": \n')
  with pytest.raises(file_sources.DataFileError, match=f"{jsonl}:2: invalid JSON"):
    file_sources.read_jsonl(str(jsonl), {"inputs": "a"})
  jsonl.write_text('{"a": "x"}\n\n{"b": "y"}\n')
  with pytest.raises(file_sources.DataFileError, match=f"{jsonl}:3: missing field 'a'"):
    file_sources.read_jsonl(str(jsonl), {"inputs": "a"})
  (tmp_path / "a.txt").write_text("1\n2\n")
  (tmp_path / "b.txt").write_text("1\n")
  with pytest.raises(file_sources.DataFileError, match="line-aligned"):
    file_sources.read_parallel(str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), "s", "t")


def test_metrics():
  assert task_metrics.accuracy([0, 1, 1, 0], [0, 1, 0, 0]) == {"accuracy": 75.0}
  # The invalid prediction (-1) counts as wrong: tp=1, fp=0, fn=1 -> F1 = 2/3.
  assert task_metrics.f1_with_invalid([1, 1, 0], [1, -1, 0])["f1"] == pytest.approx(200 / 3)
  assert task_metrics.matthews_corrcoef([0, 1, 0, 1], [0, 1, 0, 1])["matthews_corrcoef"] == 100
  corr = task_metrics.pearson_spearman([1.0, 2.0, 3.0, 4.0], [1.1, 2.0, 2.9, math.nan])
  assert corr["spearman_corrcoef"] < 100 and corr["pearson_corrcoef"] > -100
  perfect = task_metrics.bleu(["a dog runs in the park"], ["a dog runs in the park"])
  assert perfect["bleu"] == pytest.approx(100)
  assert task_metrics.bleu(["a dog runs in the park"], ["cats sleep"])["bleu"] < 5
  assert task_metrics.rouge(["return the sum"], ["return the sum"])["rouge1"] == pytest.approx(100)
  assert task_metrics.string_label_to_class_id(" positive", ["negative", "positive"]) == 1
  assert task_metrics.string_label_to_class_id("maybe", ["negative", "positive"]) == -1
  assert math.isnan(task_metrics.string_to_float("n/a"))
