"""The recipes: their pre-training corpus and vocabulary, and their gin files run as documented.

docs/recipes.md pre-trains with gin/recipes/pretrain.gin, then trains each task with
gin/recipes/<task>.gin (from the pre-trained checkpoint, or from scratch with
`--gin.INITIAL_CHECKPOINT_PATH=None`), and a task of one's own with
gin/recipes/new_task.gin, from the repository root with relative paths. The subprocess
tests run those commands verbatim (the page is checked to hold them) from a working
directory beside tiny data files laid out like ../shared/data, with a tiny model, a
tiny vocabulary and a few steps appended: the documented way to try a command quickly.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import nltk_fixtures
import pytest
import sentencepiece as spm
import span_sentinels
from xla_flags import xla_flags

from t5x_lite import models
from t5x_lite.checkpoint import checkpoints
from t5x_lite.data import file_sources, unlabeled_text
from t5x_lite.nn import network
from t5x_lite.training import partitioning

REPO = Path(__file__).resolve().parents[1]


def _write_corpus(data_dir: Path) -> None:
  """Every file of `unlabeled_text.LOCAL_DATA_READERS`, and the tasks' files, tiny."""
  for sub in ("wikitext2", "tinyshakespeare", "multi30k_en_de", "scitldr_a", "glue/SST-2"):
    (data_dir / sub).mkdir(parents=True, exist_ok=True)
  (data_dir / "glue/RTE").mkdir(parents=True, exist_ok=True)
  for split in ("valid", "test"):
    lines = [" = Heading of wikitext = ", ""]
    lines += [
      f"{s} more wiki words follow here ." for s in nltk_fixtures.sentences(f"wiki{split}", 30)
    ]
    (data_dir / f"wikitext2/{split}.txt").write_text("\n".join(lines) + "\n")
  speeches = nltk_fixtures.sentences("shakespeare", 40)
  blocks = ["FIRST:\n" + a + "\n" + b for a, b in zip(speeches[::2], speeches[1::2])]
  (data_dir / "tinyshakespeare/input.txt").write_text("\n\n".join(blocks) + "\n")
  for split, n in (("train", 30), ("val", 5), ("test_2016_flickr", 5)):
    with gzip.open(data_dir / f"multi30k_en_de/{split}.en.gz", "wt") as f:
      f.write("\n".join(nltk_fixtures.sentences("caption", n)) + "\n")
    with gzip.open(data_dir / f"multi30k_en_de/{split}.de.gz", "wt") as f:
      f.write("\n".join(f"deutsch satz {i} ." for i in range(n)) + "\n")
  for split, n in (("train", 20), ("dev", 5), ("test", 5)):
    with open(data_dir / f"scitldr_a/{split}.jsonl", "w") as f:
      for i, s in enumerate(nltk_fixtures.sentences("abstract", n)):
        f.write(json.dumps({"source": [s, "we study it ."], "target": [f"tldr summary {i}"]}))
        f.write("\n")
  sst2 = [f"{s}\t{i % 2}" for i, s in enumerate(nltk_fixtures.sentences("review", 40))]
  for name in ("train.tsv", "dev.tsv"):
    (data_dir / f"glue/SST-2/{name}").write_text("sentence\tlabel\n" + "\n".join(sst2) + "\n")
  rte = [
    f"{i}\t{a}\t{b}\tentailment"
    for i, (a, b) in enumerate(
      zip(nltk_fixtures.sentences("premise", 20), nltk_fixtures.sentences("hypothesis", 20))
    )
  ]
  for name in ("train.tsv", "dev.tsv"):
    (data_dir / f"glue/RTE/{name}").write_text(
      "index\tsentence1\tsentence2\tlabel\n" + "\n".join(rte) + "\n"
    )
  nltk_fixtures.write_nltk(data_dir)


def test_corpus_holds_input_side_text_only_in_disjoint_splits(tmp_path):
  _write_corpus(tmp_path)
  source = unlabeled_text.UnlabeledTextSource(include_cpython_prose=False, data_dir=str(tmp_path))
  train, validation = (source.records(split)["text"] for split in ("train", "validation"))
  assert train and validation and not set(train) & set(validation)
  documents = train + validation
  assert len(documents) == len(set(documents))
  text = "\n".join(documents)
  for tag in ("wikivalid", "wikitest", "caption", "abstract", "review", "premise", "hypothesis"):
    assert sum(d.startswith(tag) for d in documents) >= 20, tag
  # Shakespeare: one document per speech, its lines joined.
  assert sum(d.startswith("FIRST: shakespeare") for d in documents) == 20
  # Labels, targets, headings, the German side and the archives' READMEs stay out.
  for absent in ("deutsch", "tldr", "entailment", "Heading", "\t", "not text"):
    assert absent not in text, absent
  assert not any(d in ("0", "1") for d in documents)
  # The split of a document is a function of its text alone.
  again = unlabeled_text.UnlabeledTextSource(include_cpython_prose=False, data_dir=str(tmp_path))
  assert again.records("validation")["text"] == validation


def test_nltk_archives_become_plain_documents(tmp_path):
  _write_corpus(tmp_path)
  source = unlabeled_text.UnlabeledTextSource(include_cpython_prose=False, data_dir=str(tmp_path))
  documents = source.records("train")["text"] + source.records("validation")["text"]
  # Brown: one document per sample, the POS tags dropped and its quote marks restored.
  [sample] = [d for d in documents if d.startswith("brown river")]
  assert "/nn" not in sample and sample.endswith('" quoted "')
  assert sum(d.startswith("brown") for d in documents) == 2
  # A review or a speech is one document; news and web text one per line.
  assert sum(d.startswith("moviereview") for d in documents) == 8
  assert all("it was fine ." in d for d in documents if d.startswith("moviereview"))
  assert sum(d.startswith("stateunion") for d in documents) == 6
  assert sum(d.startswith("inaugural") for d in documents) == 6
  assert sum(d.startswith("abcline") for d in documents) == 12
  assert sum(d.startswith("webtextline") for d in documents) == 12


def test_missing_corpus_file_is_named(tmp_path):
  _write_corpus(tmp_path)
  os.remove(tmp_path / "nltk/abc.zip")
  source = unlabeled_text.UnlabeledTextSource(data_dir=str(tmp_path))
  with pytest.raises(file_sources.DataFileError, match=r"nltk/abc\.zip"):
    source.records("train")


def test_a_damaged_archive_is_named(tmp_path):
  _write_corpus(tmp_path)
  (tmp_path / "nltk/webtext.zip").write_bytes(b"not a zip")
  source = unlabeled_text.UnlabeledTextSource(include_cpython_prose=False, data_dir=str(tmp_path))
  with pytest.raises(file_sources.DataFileError, match=r"webtext\.zip: not a readable zip"):
    source.records("train")


def _corpus_under(objective: str, lengths: dict[str, int], tmp_path, monkeypatch):
  """(40 examples of `local_unlabeled_<objective>` as token lists, the tokenized text, the
  vocabulary)."""
  import seqio

  import tasks  # noqa: F401  (registers the local_unlabeled_* tasks)
  from t5x_lite.data import vocab

  _write_corpus(tmp_path / "data")
  monkeypatch.setenv(file_sources.DATA_DIR_ENV, str(tmp_path / "data"))
  vocabulary = vocab.get_vocabulary(
    unlabeled_text.corpus_vocabulary_path(
      vocab_size=150, data_dir=str(tmp_path / "data"), directory=str(tmp_path / "cache")
    )
  )
  task = seqio.get_mixture_or_task(f"local_unlabeled_{objective}")
  with vocab.resolving_to(vocabulary):
    dataset = task.get_dataset(lengths, split="train", shuffle=False, seed=0)
    examples = [
      {k: list(v) for k, v in x.items() if k in ("inputs", "targets")}
      for x in dataset.take(40).as_numpy_iterator()
    ]
  documents = task.source.get_dataset("train", shuffle=False).take(100)
  stream = [t for d in documents.as_numpy_iterator() for t in vocabulary.encode(d["text"])]
  return examples, stream, vocabulary


def test_the_corpus_under_the_prefix_lm_objective(tmp_path, monkeypatch):
  """local_unlabeled_prefix_lm: the objectives table's prefix LM row at the recipes' size."""
  examples, stream, vocabulary = _corpus_under(
    "prefix_lm", {"inputs": 24, "targets": 8}, tmp_path, monkeypatch
  )
  eos_id = vocabulary.eos_id
  # Each segment of 23 tokens is cut once, where both parts fit (each with its EOS),
  # so the continuation is 1-7 tokens; in order, the segments are the text, whole.
  joined = []
  for x in examples:
    assert x["inputs"][-1] == x["targets"][-1] == eos_id
    assert 1 <= len(x["targets"]) - 1 <= 7 and len(x["inputs"]) <= 24
    segment = x["inputs"][:-1] + x["targets"][:-1]
    assert len(segment) == 23
    joined += segment
  assert joined == stream[: len(joined)]


def _interleaves(a: list[int], b: list[int], whole: list[int]) -> bool:
  """Whether `whole` is `a` and `b` merged, each kept in its order."""
  if len(a) + len(b) != len(whole):
    return False
  # reachable[j]: whole[: i + j] can be a[:i] merged with b[:j], for the current i.
  reachable = [True] + [False] * len(b)
  for j in range(1, len(b) + 1):
    reachable[j] = reachable[j - 1] and b[j - 1] == whole[j - 1]
  for i in range(1, len(a) + 1):
    reachable[0] = reachable[0] and a[i - 1] == whole[i - 1]
    for j in range(1, len(b) + 1):
      reachable[j] = (reachable[j] and a[i - 1] == whole[i + j - 1]) or (
        reachable[j - 1] and b[j - 1] == whole[i + j - 1]
      )
  return reachable[-1]


def test_the_corpus_under_the_iid_drop_tokens_objective(tmp_path, monkeypatch):
  """local_unlabeled_iid_drop_tokens: the T5 paper's "drop corrupted tokens" at the recipes'
  lengths (inputs 128 + targets 32, as span corruption), here 24 + 12."""
  assert not _interleaves([1, 2], [3], [1, 2, 2])
  assert _interleaves([1, 3], [2], [1, 2, 3]) and not _interleaves([3, 1], [2], [1, 2, 3])
  examples, stream, vocabulary = _corpus_under(
    "iid_drop_tokens", {"inputs": 24, "targets": 12}, tmp_path, monkeypatch
  )
  eos_id = vocabulary.eos_id
  # Each segment of 23 tokens loses some of its tokens, never its first: the inputs keep
  # the rest in order, the targets are the dropped ones in order; in order, the segments
  # are the text, whole.
  position, dropped = 0, 0
  for x in examples:
    assert x["inputs"][-1] == x["targets"][-1] == eos_id
    kept, removed = x["inputs"][:-1], x["targets"][:-1]
    segment = stream[position : position + 23]
    assert kept[0] == segment[0] and _interleaves(kept, removed, segment)
    position, dropped = position + 23, dropped + len(removed)
  # 880 tokens that may drop, each with probability 0.15: 132 expected, 11 the deviation.
  assert 88 <= dropped <= 176


def test_the_corpus_under_the_iid_replace_spans_objective(tmp_path, monkeypatch):
  """local_unlabeled_iid_replace_spans: the T5 paper's "replace corrupted spans" at the
  objectives table's lengths (inputs 104 + targets 56), here 24 + 14."""
  examples, stream, vocabulary = _corpus_under(
    "iid_replace_spans", {"inputs": 24, "targets": 14}, tmp_path, monkeypatch
  )
  eos_id = vocabulary.eos_id
  regular_ids = vocabulary.vocab_size - vocabulary.extra_ids
  # Each segment of 23 tokens has runs of tokens, never its first, each turned into one
  # sentinel in the inputs; the targets are each sentinel then the run it replaced, and
  # one sentinel more, alone, where the segment ends uncorrupted. Putting the runs back
  # gives the segment, and in order the segments are the text.
  position, corrupted = 0, 0
  for x in examples:
    assert x["inputs"][-1] == x["targets"][-1] == eos_id
    inputs, targets = x["inputs"][:-1], x["targets"][:-1]
    sentinels = [t for t in inputs if t >= regular_ids]
    assert inputs[0] < regular_ids and len(set(sentinels)) == len(sentinels)
    if inputs[-1] < regular_ids:
      assert targets[-1] >= regular_ids and targets[-1] not in sentinels
      targets = targets[:-1]
    assert [t for t in targets if t >= regular_ids] == sentinels
    # Every sentinel replaced at least one token.
    assert all(
      b < regular_ids for a, b in zip(targets, targets[1:] + [regular_ids]) if a >= regular_ids
    )
    segment = span_sentinels.put_back(inputs, targets, regular_ids)
    assert segment == stream[position : position + 23]
    position, corrupted = position + 23, corrupted + len(targets) - len(sentinels)
  # 880 tokens that may be corrupted, each with probability 0.15: 132 expected, 11 the
  # deviation.
  assert 88 <= corrupted <= 176


def _whole_segments(objective: str, tmp_path, monkeypatch):
  """([(inputs, targets) without EOS] of `local_unlabeled_<objective>` at 24 + 24, the
  vocabulary), for the objectives whose targets are the segment whole (the recipes' 80 +
  80 token slots): each checked to end in EOS and fill 24, and the targets in order
  checked to be the text, whole."""
  examples, stream, vocabulary = _corpus_under(
    objective, {"inputs": 24, "targets": 24}, tmp_path, monkeypatch
  )
  pairs, joined = [], []
  for x in examples:
    assert x["inputs"][-1] == x["targets"][-1] == vocabulary.eos_id
    assert len(x["inputs"]) == len(x["targets"]) == 24
    pairs.append((x["inputs"][:-1], x["targets"][:-1]))
    joined += x["targets"][:-1]
  assert joined == stream[: len(joined)]
  return pairs, vocabulary


def _masked_and_replaced(pairs, vocabulary) -> tuple[int, int]:
  """(tokens turned into the mask, tokens turned into another regular token) over the
  (inputs, segment) pairs of an i.i.d. masking objective, each replacement checked to be
  a regular token."""
  mask_id = vocabulary.vocab_size - 1
  regular_ids = vocabulary.vocab_size - vocabulary.extra_ids
  masked, replaced = 0, 0
  for inputs, segment in pairs:
    for corrupt, original in zip(inputs, segment):
      if corrupt == mask_id:
        masked += 1
      elif corrupt != original:
        assert corrupt < regular_ids, corrupt
        replaced += 1
  return masked, replaced


def test_the_corpus_under_the_bert_style_objective(tmp_path, monkeypatch):
  """local_unlabeled_bert_style: the T5 paper's BERT-style objective at the recipes' token
  slots (inputs 80 + targets 80, the segment whole in both), here 24 + 24."""
  # The inputs are each segment of 23 tokens with some tokens, chosen independently,
  # turned into the mask or into a random regular token.
  masked, replaced = _masked_and_replaced(*_whole_segments("bert_style", tmp_path, monkeypatch))
  # 920 tokens, each masked with probability 0.15 * 0.9: 124 expected, 10 the deviation;
  # each replaced with 0.015 (less when the random token is the original): 14 at most.
  assert 83 <= masked <= 166
  assert 1 <= replaced <= 29


def test_the_corpus_under_the_deshuffling_objective(tmp_path, monkeypatch):
  """local_unlabeled_deshuffling: the T5 paper's deshuffling objective at the recipes' token
  slots (inputs 80 + targets 80, the segment whole in both), here 24 + 24."""
  pairs, _ = _whole_segments("deshuffling", tmp_path, monkeypatch)
  # The inputs are each segment of 23 tokens in another order.
  kept_in_place = 0
  for shuffled, segment in pairs:
    assert sorted(shuffled) == sorted(segment)
    kept_in_place += sum(a == b for a, b in zip(shuffled, segment))
  # A uniform shuffle leaves one token of each segment where it was, on average (more
  # where a token repeats): 40 of 920 expected, where no shuffle would leave all 920.
  assert kept_in_place <= 200


def test_the_corpus_under_the_mass_style_objective(tmp_path, monkeypatch):
  """local_unlabeled_mass_style: the T5 paper's MASS-style objective at the recipes' token
  slots (inputs 80 + targets 80, the segment whole in both), here 24 + 24."""
  # The inputs are each segment of 23 tokens with some tokens, chosen independently,
  # turned into the mask; every other token stays as it was (no random replacements).
  masked, replaced = _masked_and_replaced(*_whole_segments("mass_style", tmp_path, monkeypatch))
  assert replaced == 0
  # 920 tokens, each masked with probability 0.15: 138 expected, 11 the deviation.
  assert 94 <= masked <= 182


def test_the_corpus_under_the_iid_denoising_objective(tmp_path, monkeypatch):
  """local_unlabeled_iid_denoising: BERT's own masking (80% mask, 10% random, 10% kept) at
  the recipes' token slots (inputs 80 + targets 80, the segment whole in both), here
  24 + 24."""
  masked, replaced = _masked_and_replaced(*_whole_segments("iid_denoising", tmp_path, monkeypatch))
  # 920 tokens, each masked with probability 0.15 * 0.8: 110 expected, 10 the deviation;
  # each replaced with 0.015 (less when the random token is the original): 14 at most.
  # Too few tokens to tell 0.8 from BERT-style's 0.9: tests/objectives_test.py measures
  # the fractions on about 70,000 tokens.
  assert 70 <= masked <= 150
  assert 1 <= replaced <= 29


def test_vocabulary_is_trained_once_and_again_when_the_data_changes(tmp_path):
  _write_corpus(tmp_path / "data")
  kwargs = dict(vocab_size=150, data_dir=str(tmp_path / "data"), directory=str(tmp_path / "cache"))
  path = unlabeled_text.corpus_vocabulary_path(**kwargs)
  assert os.path.isfile(path)
  stamp = os.stat(path).st_mtime_ns
  assert unlabeled_text.corpus_vocabulary_path(**kwargs) == path  # cached: not retrained
  assert os.stat(path).st_mtime_ns == stamp

  # German pieces come from the extra file: seen often enough, a German word takes fewer.
  def pieces(**settings) -> int:
    model_file = unlabeled_text.corpus_vocabulary_path(**{**kwargs, "vocab_size": 300, **settings})
    return len(spm.SentencePieceProcessor(model_file=model_file).encode("deutsch satz"))

  assert pieces(extra_repeats=20) < pieces(extra_files=())
  with gzip.open(tmp_path / "data/multi30k_en_de/train.de.gz", "at") as f:
    f.write("noch ein satz .\n")
  assert unlabeled_text.corpus_vocabulary_path(**kwargs) != path


def test_long_documents_are_cut_into_pieces_sentencepiece_keeps():
  document = " ".join(["word"] * 3000)  # 14,999 characters: over SentencePiece's limit
  pieces = list(unlabeled_text._pieces_of(document))
  assert all(len(p) <= 1000 for p in pieces) and " ".join(pieces) == document


# The commands of docs/recipes.md, verbatim (the test checks they are there), run in order.
PRETRAIN_COMMAND = (
  "python -m t5x_lite.train --gin_file=recipes/pretrain.gin --data_dir=../shared/data"
)
# The recipe's length until 2026-11-30, which the "3,000 steps" rows and the second
# cycle start from.
PRETRAIN_3K = " --gin.TRAIN_STEPS=3000 --gin.MODEL_DIR=./runs/recipes/pretrained_3k"
# The objectives at the recipes' size: the same recipe under the prefix LM objective.
PRETRAIN_PREFIX_LM = (
  " --gin.MIXTURE_OR_TASK_NAME=\"'local_unlabeled_prefix_lm'\" --gin.TRAIN_STEPS=3000"
  " --gin.MODEL_DIR=./runs/recipes/pretrained_prefix_lm_3k"
)
# ... and under the T5 paper's "drop corrupted tokens" (its unit test builds the task).
PRETRAIN_IID_DROP_TOKENS = (
  " --gin.MIXTURE_OR_TASK_NAME=\"'local_unlabeled_iid_drop_tokens'\" --gin.TRAIN_STEPS=3000"
  " --gin.MODEL_DIR=./runs/recipes/pretrained_iid_drop_tokens_3k"
)


def _pretrain_whole_segments(objective: str) -> str:
  """The objectives table's overrides for an objective whose targets are the whole segment
  (BERT-style, deshuffling, MASS-style, BERT's own masking): 80 + 80 token slots, as many
  as span corruption's 128 + 32 (each one's unit test builds its task)."""
  return (
    f" --gin.MIXTURE_OR_TASK_NAME=\"'local_unlabeled_{objective}'\" --gin.TRAIN_STEPS=3000"
    " --gin.TASK_FEATURE_LENGTHS=\"{'inputs': 80, 'targets': 80}\""
    f" --gin.MODEL_DIR=./runs/recipes/pretrained_{objective}_3k"
  )


# ... and under i.i.d. replace-spans, whose inputs keep a sentinel per run: 104 + 56 slots.
PRETRAIN_IID_REPLACE_SPANS = (
  " --gin.MIXTURE_OR_TASK_NAME=\"'local_unlabeled_iid_replace_spans'\" --gin.TRAIN_STEPS=3000"
  " --gin.TASK_FEATURE_LENGTHS=\"{'inputs': 104, 'targets': 56}\""
  " --gin.MODEL_DIR=./runs/recipes/pretrained_iid_replace_spans_3k"
)
# The architectures at the recipes' size: span corruption with the layers shared.
PRETRAIN_SHARED = (
  " --gin.TRAIN_STEPS=3000 --gin.T5Config.share_encoder_decoder=True"
  " --gin.MODEL_DIR=./runs/recipes/pretrained_shared_3k"
)


PRETRAIN_CONTINUED_COMMAND = (
  "python -m t5x_lite.train --gin_file=recipes/pretrain_continued.gin --data_dir=../shared/data"
)
SST2_COMMAND = "python -m t5x_lite.train --gin_file=recipes/sst2.gin --data_dir=../shared/data"
SCRATCH = " --gin.INITIAL_CHECKPOINT_PATH=None --gin.MODEL_DIR=./runs/recipes/multi30k_scratch"
MULTI30K_SCRATCH_COMMAND = (
  "python -m t5x_lite.train --gin_file=recipes/multi30k.gin --data_dir=../shared/data" + SCRATCH
)
NEW_TASK_COMMAND = "python -m t5x_lite.train --gin_file=my_task.gin --data_dir=my_data"
# What recipes.md adds to choose the best step on a slice held out of the training data.
HOLDOUT = ' --gin.TRAIN_SPLIT="\'train[:90%]\'" --gin.SELECTION_SPLIT="\'train[90%:]\'"'
PRETRAIN_ELECTRA_COMMAND = (
  "python -m t5x_lite.train --gin_file=recipes/pretrain_electra.gin --data_dir=../shared/data"
)
RTE_FROM_ELECTRA_COMMAND = (
  "python -m t5x_lite.train --gin_file=recipes/rte.gin --data_dir=../shared/data"
  " --gin.INITIAL_CHECKPOINT_PATH=./runs/recipes/pretrained_electra"
  " --gin.MODEL_DIR=./runs/recipes/rte_electra"
)
# A run of two steps warms up over one.
_FEW_STEPS = " --gin.TRAIN_STEPS=2 --gin.WARMUP_STEPS=1"
# A vocabulary the tiny files can fill, and a tiny model (the same for every run).
_TINY = (
  " --gin.corpus_vocabulary_path.vocab_size=150 --gin.T5Config.vocab_size=256"
  " --gin.T5Config.emb_dim=32 --gin.T5Config.num_heads=2 --gin.T5Config.head_dim=8"
  " --gin.T5Config.mlp_dim=64 --gin.T5Config.num_encoder_layers=1"
  " --gin.T5Config.num_decoder_layers=1 --gin.BATCH_SIZE=4 --gin.EVAL_STEPS=1"
)
_MY_TASK_GIN = """import my_tasks
include 'recipes/new_task.gin'
MODEL_DIR = './runs/my_task'
MIXTURE_OR_TASK_NAME = 'my_task'
TASK_FEATURE_LENGTHS = {'inputs': 64, 'targets': 8}
METRIC = 'my_task/accuracy'
"""
_MY_TASKS_PY = """import functools
import seqio
from t5x_lite.data import file_sources, preprocessors, task_metrics

LABELS = {"0": "negative", "1": "positive"}
seqio.TaskRegistry.add(
  "my_task",
  source=file_sources.TsvSource({"train": "train.tsv", "validation": "dev.tsv"}),
  preprocessors=preprocessors.supervised_preprocessors(
    functools.partial(
      preprocessors.text_to_text,
      prefix="sentiment",
      feature_names=("sentence",),
      label_names=LABELS,
    )
  ),
  output_features=preprocessors.text_to_text_features(),
  postprocess_fn=functools.partial(
    task_metrics.string_label_to_class_id, label_classes=list(LABELS.values())
  ),
  metric_fns=[task_metrics.accuracy],
)
"""


def _run(command: str, cwd: Path, cache: Path) -> str:
  """`command` through bash in `cwd`, this interpreter first on PATH (an activated venv)."""
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env["XLA_FLAGS"] = xla_flags()  # one CPU device, as a user's run
  env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
  env["T5X_LITE_CACHE"] = str(cache)
  result = subprocess.run(
    ["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
  )
  output = result.stdout + result.stderr
  assert result.returncode == 0 and "Traceback" not in output, f"{command}\n{output[-4000:]}"
  return output


def _params(model_dir: Path, step: int | None = None):
  ((_, step_dir),) = checkpoints.find_steps(model_dir, step="newest" if step is None else step)
  model = models.EncoderDecoderModel(
    network.Transformer(checkpoints.model_config(step_dir)), None, None
  )
  partitioner = partitioning.Partitioner(devices=jax.devices()[:1])
  return checkpoints.restore_params(step_dir, partitioner.abstract_params(model.init_params)[0])


def _records(path: Path) -> list[dict]:
  return [json.loads(line) for line in open(path)]


def test_docs_give_the_commands_this_test_runs():
  page = " ".join((REPO / "docs/recipes.md").read_text().replace("\\\n", " ").split())
  for command in (
    PRETRAIN_COMMAND,
    PRETRAIN_COMMAND + PRETRAIN_3K,
    PRETRAIN_CONTINUED_COMMAND,
    SST2_COMMAND,
    MULTI30K_SCRATCH_COMMAND,
    NEW_TASK_COMMAND,
    PRETRAIN_ELECTRA_COMMAND,
    RTE_FROM_ELECTRA_COMMAND,
    PRETRAIN_COMMAND + PRETRAIN_PREFIX_LM,
    PRETRAIN_COMMAND + PRETRAIN_IID_DROP_TOKENS,
    PRETRAIN_COMMAND + _pretrain_whole_segments("bert_style"),
    PRETRAIN_COMMAND + _pretrain_whole_segments("deshuffling"),
    PRETRAIN_COMMAND + _pretrain_whole_segments("mass_style"),
    PRETRAIN_COMMAND + _pretrain_whole_segments("iid_denoising"),
    PRETRAIN_COMMAND + PRETRAIN_IID_REPLACE_SPANS,
    PRETRAIN_COMMAND + PRETRAIN_SHARED,
  ):
    assert command in page, command
  assert NEW_TASK_COMMAND + HOLDOUT in page
  assert _MY_TASK_GIN.strip() in (REPO / "docs/recipes.md").read_text()


def _documented_groups(last_group: str) -> tuple[str, list[tuple[str, str, str, str]]]:
  """Runs the `recipe_results.py --groups` command of docs/recipes.md whose last group
  mentions `last_group`, as written, from the repository root; returns the page and
  each group's (label, runs, best mean ± SE, final mean ± SE), checking the table of
  differences has a row for every pair."""
  page = (REPO / "docs/recipes.md").read_text()
  command = re.search(
    r"^python tools/recipe_results\.py --groups \\\n(?:  .*\\\n)*  .*"
    + re.escape(last_group)
    + ".*$",
    page,
    flags=re.M,
  )
  assert command, f"docs/recipes.md lost its recipe_results command ending with {last_group}"
  result = subprocess.run(
    ["bash", "-c", command.group(0)], cwd=REPO, capture_output=True, text=True, timeout=300
  )
  assert result.returncode == 0, result.stderr[-2000:]
  groups = re.findall(
    r"^\| ([^|]+) \| (\d) \| [\w/]+ \| ([\d.]+ ± [\d.]+) \([^)]+\) \| ([\d.]+ ± [\d.]+) ",
    result.stdout,
    flags=re.M,
  )
  labels = re.findall(r'^  "([^"=]+)=', command.group(0), flags=re.M)
  assert [label for label, *_ in groups] == labels
  pairs = re.findall(r"^\| .+ - .+ \| [-+][\d.]+, [\d.]+ SE ", result.stdout, flags=re.M)
  metrics = re.findall(r"^\| [^|]+ \| \d \| ([\w/]+) \|", result.stdout, flags=re.M)
  same = sum(a == b for i, a in enumerate(metrics) for b in metrics[i + 1 :])
  assert len(pairs) == same > 0
  return page, groups


def _check_abc_table(section_title: str, last_group: str, num_groups: int) -> None:
  """Runs the section's `recipe_results.py --groups` command and checks each group's mean ±
  standard error is the one in the section's table row that names the group's runs."""
  page, groups = _documented_groups(last_group)
  assert len(groups) == num_groups
  section = page.split(f"## {section_title}")[1].split("\n## ")[0]
  table = [line for line in section.splitlines() if line.startswith("| ")]
  command = section.split("python tools/recipe_results.py --groups")[1].split("```")[0]
  assert last_group in command, f"{section_title}: the command is not this section's"
  patterns = re.findall(r'=docs/results/recipes/([^"]+)"', command)
  for (label, runs, best, _), pattern in zip(groups, patterns, strict=True):
    first_run = sorted((REPO / "docs/results/recipes").glob(pattern))[0].name
    rows = [line for line in table if f"`{first_run}`" in line]
    assert len(rows) == 1, (label, first_run)
    assert best in rows[0] and f"_s{int(runs) - 1}`" in rows[0], rows[0]


def test_the_objectives_tables_statistics_come_from_its_result_files():
  _check_abc_table("The objectives at the recipes' size", "abc_news_programme_scratch", 9)


def test_the_architectures_tables_statistics_come_from_its_result_files():
  _check_abc_table("The architectures at the recipes' size", "abc_news_programme_shared_3k", 4)


def test_the_results_tables_statistics_come_from_its_result_files():
  """Each group's final mean ± standard error is in a row of the results table for its
  task, and so is the best steps' where the validation split chose them."""
  page, groups = _documented_groups("scitldr_6k_s2")
  assert len(groups) == 16
  section = page.split("\n## Results")[1].split("\n## ")[0]
  table = [line for line in section.splitlines() if line.startswith("| ")]
  for label, _, best, final in groups:
    task = label.split()[0]
    rows = [line for line in table if line.startswith(f"| {task}")]
    assert any(final in row for row in rows), (label, final)
    if "held out" not in label:
      assert any(best in row and final in row for row in rows), (label, best)


class _SizedVocabulary:
  """What the models' FLOP counts read of a vocabulary."""

  eos_id = 1

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size


def _recipe_step_flops(gin_file: str) -> tuple[float, int]:
  """(training FLOPs of one step, TRAIN_STEPS) of a pre-training recipe, as it is bound."""
  import gin

  import t5x_lite.run.train_lib  # noqa: F401  (the configurables the recipes bind)
  from t5x_lite import electra
  from t5x_lite.core import gin_config

  gin.clear_config()
  try:
    gin_config.parse_gin([gin_file], [])
    config = network.T5Config()
    vocabulary = _SizedVocabulary(config.vocab_size)
    is_electra = gin.query_parameter("%MIXTURE_OR_TASK_NAME") == "local_unlabeled_electra"
    model = (electra.build_electra_model if is_electra else models.build_model)(config, vocabulary)
    lengths = gin.query_parameter("%TASK_FEATURE_LENGTHS")
    batch = gin.query_parameter("%BATCH_SIZE")
    flops = model.train_flops_per_step(batch, lengths["inputs"], lengths["targets"])
    return flops, gin.query_parameter("%TRAIN_STEPS")
  finally:
    gin.clear_config()


def test_the_recipes_pretraining_lengths():
  span_flops, span_steps = _recipe_step_flops("recipes/pretrain.gin")
  assert span_steps == 6000
  # The second cycle and ELECTRA are compared with the 3,000-step checkpoint: the
  # second cycle is 3,000 steps more, ELECTRA the FLOPs of 3,000 span-corruption steps.
  _, continued_steps = _recipe_step_flops("recipes/pretrain_continued.gin")
  assert continued_steps == 3000
  electra_flops, electra_steps = _recipe_step_flops("recipes/pretrain_electra.gin")
  assert electra_flops > span_flops  # the generator and the longer targets
  assert electra_steps == round(3000 * span_flops / electra_flops)


@pytest.mark.slow
def test_recipes_pretrain_then_train_each_kind_of_task(tmp_path):
  _write_corpus(tmp_path / "shared" / "data")
  work = tmp_path / "t5x_lite"
  (work / "runs").mkdir(parents=True)  # what the quickstart leaves
  cache = tmp_path / "cache"
  _run(PRETRAIN_COMMAND + _TINY + _FEW_STEPS, work, cache)
  # The vocabulary was trained on first use, into the cache.
  assert [p.name for p in cache.glob("corpus_spm_150_*.model")]
  # A second cycle starts from the 3,000-step cycle's parameters, with a fresh step
  # count. That cycle is the command above with PRETRAIN_3K, which (a few steps here)
  # would train the same tiny model again: its folder stands in for it.
  (work / "runs/recipes/pretrained_3k").symlink_to("pretrained")
  output = _run(PRETRAIN_CONTINUED_COMMAND + _TINY + _FEW_STEPS, work, cache)
  assert "Fine-tuning from ./runs/recipes/pretrained_3k (params)" in output
  continued = _records(work / "runs/recipes/pretrained_continued/metrics.jsonl")
  assert [r["step"] for r in continued if r["split"] == "eval"] == [2]
  # Learning rate 0: the fine-tuned parameters must be the pre-trained ones, bit for bit;
  # the validation metric is computed at every evaluation and the best step kept.
  output = _run(
    SST2_COMMAND + _TINY + _FEW_STEPS + " --gin.EVAL_PERIOD=1 --gin.LEARNING_RATE=0.0",
    work,
    cache,
  )
  assert "Fine-tuning from ./runs/recipes/pretrained (params)" in output
  pretrained = _params(work / "runs/recipes/pretrained")
  jax.tree.map(np.testing.assert_array_equal, _params(work / "runs/recipes/sst2"), pretrained)
  evals = [r for r in _records(work / "runs/recipes/sst2/metrics.jsonl") if r["split"] == "eval"]
  assert [r["step"] for r in evals if "local_glue_sst2/accuracy" in r] == [1, 2]
  assert all("elapsed_s" in r and "tokens_seen" in r for r in evals)
  best = json.loads((work / "runs/recipes/sst2/best.json").read_text())
  assert best["metric"] == "local_glue_sst2/accuracy" and best["best_step"] in (1, 2)
  # The same recipe under the prefix LM objective.
  _run(PRETRAIN_COMMAND + PRETRAIN_PREFIX_LM + _TINY + _FEW_STEPS, work, cache)
  prefix_lm = work / "runs/recipes/pretrained_prefix_lm_3k"
  assert (
    "MIXTURE_OR_TASK_NAME = 'local_unlabeled_prefix_lm'" in (prefix_lm / "config.gin").read_text()
  )
  assert [r["step"] for r in _records(prefix_lm / "metrics.jsonl") if r["split"] == "eval"] == [2]
  # ELECTRA-style pre-training, and a task fine-tuned from it without its generator.
  _run(PRETRAIN_ELECTRA_COMMAND + _TINY + _FEW_STEPS, work, cache)
  output = _run(RTE_FROM_ELECTRA_COMMAND + _TINY + _FEW_STEPS, work, cache)
  assert "Fine-tuning from ./runs/recipes/pretrained_electra (params)" in output
  assert re.search(r"Pre-training-only params of checkpoint \S+ dropped .*generator/", output)
  # From scratch: the test split is translated with beam search at the end.
  _run(MULTI30K_SCRATCH_COMMAND + _TINY + _FEW_STEPS + " --gin.EVAL_PERIOD=2", work, cache)
  final = json.loads((work / "runs/recipes/multi30k_scratch/final_metrics.json").read_text())
  assert final["split"] == "test" and "local_multi30k_ende/bleu" in final
  # A task of one's own: its length in epochs is counted from its data.
  my_data = work / "my_data"
  my_data.mkdir()
  rows = [f"{s}\t{i % 2}" for i, s in enumerate(nltk_fixtures.sentences("mine", 24))]
  for name in ("train.tsv", "dev.tsv"):
    (my_data / name).write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
  (work / "my_task.gin").write_text(_MY_TASK_GIN)
  (work / "my_tasks.py").write_text(_MY_TASKS_PY)
  # Trained on 90% of the training rows, the best step chosen on the other 10%, and
  # that step evaluated on validation at the end.
  output = _run(NEW_TASK_COMMAND + _TINY + " --gin.EPOCHS=2" + HOLDOUT, work, cache)
  counted = re.search(
    r"2 epochs of my_task \(train\[:90%\]\): (\d+) rows of .* per pass "
    r"\((\d+) examples; rows full: inputs \d+%, targets \d+%\), (\d+) steps",
    output,
  )
  assert counted, output[-3000:]
  rows, examples, steps = map(int, counted.groups())
  assert examples == 22 and rows <= examples  # round(24 * 0.9)
  assert re.search(r"Evaluating my_task \(train\[90%:\]\): 2 examples", output)
  assert re.search(r"Evaluating my_task \(validation\): 24 examples", output)
  final = json.loads((work / "runs/my_task/final_metrics.json").read_text())
  assert final["split"] == "validation"
  assert steps == max(1, round(2 * rows / 4))  # two passes in batches of 4 rows
  trained = max(r["step"] for r in _records(work / "runs/my_task/metrics.jsonl"))
  assert trained == steps
