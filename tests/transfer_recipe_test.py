"""The transfer recipe: its pre-training corpus, and its gin files run as the README says.

README "Pre-training transfers" trains a vocabulary on the raw text of
`local_unlabeled_span_corruption`,
pre-trains with gin/transfer/pretrain.gin and fine-tunes with gin/transfer/<task>.gin,
from the repository root with relative paths. The subprocess test runs three of those
commands, verbatim (the README is checked to hold them), from a working directory beside
tiny data files laid out like ../shared/data, with a smaller vocabulary, a tiny model and
a few steps appended.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from xla_flags import xla_flags

from t5x_lite import models
from t5x_lite.nn import network
from t5x_lite.data import file_sources, unlabeled_text
from t5x_lite.checkpoint import checkpoints
from t5x_lite.training import partitioning

REPO = Path(__file__).resolve().parents[1]

_WORDS = (
  "river stone light garden music winter harbor village letter window morning candle "
  "mountain forest bridge market summer ocean silver thunder meadow castle lantern orchard"
).split()


def _sentences(tag: str, n: int) -> list[str]:
  """`n` distinct sentences that name their file (`tag`)."""
  return [
    f"{tag} {_WORDS[i % len(_WORDS)]} and the {_WORDS[(3 * i + 1) % len(_WORDS)]} {i} ."
    for i in range(n)
  ]


def _write_corpus(data_dir: Path) -> None:
  """Every file of `unlabeled_text.LOCAL_DATA_READERS`, and SST-2's dev set, tiny."""
  for sub in ("wikitext2", "tinyshakespeare", "multi30k_en_de", "scitldr_a", "glue/SST-2"):
    (data_dir / sub).mkdir(parents=True, exist_ok=True)
  (data_dir / "glue/RTE").mkdir(parents=True, exist_ok=True)
  for split in ("valid", "test"):
    lines = [" = Heading of wikitext = ", ""]
    lines += [f"{s} more wiki words follow here ." for s in _sentences(f"wiki{split}", 30)]
    (data_dir / f"wikitext2/{split}.txt").write_text("\n".join(lines) + "\n")
  speeches = _sentences("shakespeare", 40)
  blocks = ["FIRST:\n" + a + "\n" + b for a, b in zip(speeches[::2], speeches[1::2])]
  (data_dir / "tinyshakespeare/input.txt").write_text("\n\n".join(blocks) + "\n")
  with gzip.open(data_dir / "multi30k_en_de/train.en.gz", "wt") as f:
    f.write("\n".join(_sentences("caption", 30)) + "\n")
  with gzip.open(data_dir / "multi30k_en_de/train.de.gz", "wt") as f:
    f.write("\n".join(f"deutsch satz {i} ." for i in range(30)) + "\n")
  with open(data_dir / "scitldr_a/train.jsonl", "w") as f:
    for i, s in enumerate(_sentences("abstract", 20)):
      f.write(json.dumps({"source": [s, "we study it ."], "target": [f"tldr summary {i}"]}) + "\n")
  sst2 = [f"{s}\t{i % 2}" for i, s in enumerate(_sentences("review", 40))]
  for name in ("train.tsv", "dev.tsv"):
    (data_dir / f"glue/SST-2/{name}").write_text("sentence\tlabel\n" + "\n".join(sst2) + "\n")
  rte = [
    f"{i}\t{a}\t{b}\tentailment"
    for i, (a, b) in enumerate(zip(_sentences("premise", 20), _sentences("hypothesis", 20)))
  ]
  for name in ("train.tsv", "dev.tsv"):
    (data_dir / f"glue/RTE/{name}").write_text(
      "index\tsentence1\tsentence2\tlabel\n" + "\n".join(rte) + "\n"
    )


def _write_evaluation_splits(data_dir: Path) -> None:
  """The validation files the multi-task recipe decodes (the corpus test reads none)."""
  for language, lines in (("en", _sentences("caption", 5)), ("de", ["satz ."] * 5)):
    with gzip.open(data_dir / f"multi30k_en_de/val.{language}.gz", "wt") as f:
      f.write("\n".join(lines) + "\n")
  with open(data_dir / "scitldr_a/dev.jsonl", "w") as f:
    for i, s in enumerate(_sentences("abstract", 5)):
      f.write(json.dumps({"source": [s], "target": [f"tldr summary {i}"]}) + "\n")


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
  # Labels, targets and headings stay out.
  for absent in ("deutsch", "tldr", "entailment", "Heading", "\t"):
    assert absent not in text, absent
  assert not any(d in ("0", "1") for d in documents)
  # The split of a document is a function of its text alone.
  again = unlabeled_text.UnlabeledTextSource(include_cpython_prose=False, data_dir=str(tmp_path))
  assert again.records("validation")["text"] == validation


def test_missing_corpus_file_is_named(tmp_path):
  _write_corpus(tmp_path)
  os.remove(tmp_path / "scitldr_a/train.jsonl")
  source = unlabeled_text.UnlabeledTextSource(data_dir=str(tmp_path))
  with pytest.raises(file_sources.DataFileError, match=r"scitldr_a/train\.jsonl"):
    source.records("train")


# The README's commands, verbatim (the test checks they are there), run in this order.
VOCAB_COMMAND = (
  "python tools/train_vocab.py --task=local_unlabeled_span_corruption --text_field=text "
  "--gin_bindings=\"local_data_dir.path = '../shared/data'\" --vocab_size=8000 "
  "--output=runs/transfer/spm.model"
)
PRETRAIN_COMMAND = (
  "python -m t5x_lite.train --gin_file=transfer/pretrain.gin --data_dir=../shared/data"
)
SST2_COMMAND = "python -m t5x_lite.train --gin_file=transfer/sst2.gin --data_dir=../shared/data"
MULTITASK_COMMAND = (
  "python -m t5x_lite.train --gin_file=transfer/multitask.gin --data_dir=../shared/data"
)
# A vocabulary the tiny files can fill, and a tiny model (the same for both runs).
_TINY_VOCAB = "--vocab_size=150"
_TINY_MODEL = (
  " --gin.T5Config.emb_dim=32 --gin.T5Config.num_heads=2 --gin.T5Config.head_dim=8"
  " --gin.T5Config.mlp_dim=64 --gin.T5Config.num_encoder_layers=1"
  " --gin.T5Config.num_decoder_layers=1 --gin.T5Config.vocab_size=256"
  " --gin.BATCH_SIZE=4 --gin.EVAL_STEPS=1"
)


def _run(command: str, cwd: Path) -> str:
  """`command` through bash in `cwd`, this interpreter first on PATH (an activated venv)."""
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env["XLA_FLAGS"] = xla_flags()  # one CPU device, as a user's run
  env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
  result = subprocess.run(
    ["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
  )
  output = result.stdout + result.stderr
  assert result.returncode == 0 and "Traceback" not in output, f"{command}\n{output[-4000:]}"
  return output


def _params(model_dir: Path):
  ((_, step_dir),) = checkpoints.find_steps(model_dir)
  model = models.EncoderDecoderModel(
    network.Transformer(checkpoints.model_config(step_dir)), None, None
  )
  partitioner = partitioning.Partitioner(devices=jax.devices()[:1])
  return checkpoints.restore_params(step_dir, partitioner.abstract_params(model.init_params)[0])


def test_readme_gives_the_commands_this_test_runs():
  section = (REPO / "README.md").read_text().split("## Pre-training transfers", 1)[1]
  section = section.split("\n## ", 1)[0]
  for command in (VOCAB_COMMAND, PRETRAIN_COMMAND, SST2_COMMAND, MULTITASK_COMMAND):
    assert command in " ".join(section.replace("\\\n", " ").split()), command


@pytest.mark.slow
def test_recipe_pretrains_then_finetunes_from_every_pretrained_parameter(tmp_path):
  _write_corpus(tmp_path / "shared" / "data")
  _write_evaluation_splits(tmp_path / "shared" / "data")
  work = tmp_path / "t5x_lite"
  (work / "runs").mkdir(parents=True)  # what the quickstart leaves
  (work / "tools").symlink_to(REPO / "tools")
  _run(VOCAB_COMMAND.replace("--vocab_size=8000", _TINY_VOCAB), work)
  _run(PRETRAIN_COMMAND + _TINY_MODEL + " --gin.TRAIN_STEPS=2", work)
  # Learning rate 0: the fine-tuned parameters must be the pre-trained ones, bit for bit.
  output = _run(
    SST2_COMMAND + _TINY_MODEL + " --gin.TRAIN_STEPS=1 --gin.optimizers.constant.value=0.0", work
  )
  assert "Fine-tuning from ./runs/transfer/pretrained (params)" in output
  pretrained = _params(work / "runs/transfer/pretrained")
  finetuned = _params(work / "runs/transfer/sst2")
  jax.tree.map(np.testing.assert_array_equal, finetuned, pretrained)
  records = [json.loads(line) for line in open(work / "runs/transfer/sst2/metrics.jsonl")]
  assert any("local_glue_sst2/accuracy" in r for r in records), records
  # Multi-task training starts from the same checkpoint, samples all four tasks and
  # decodes each one's validation split with its own metric.
  output = _run(MULTITASK_COMMAND + _TINY_MODEL + " --gin.TRAIN_STEPS=1", work)
  assert "Fine-tuning from ./runs/transfer/pretrained (params)" in output
  [final] = [
    r
    for r in map(json.loads, open(work / "runs/transfer/multitask/metrics.jsonl"))
    if "local_glue_rte/accuracy" in r
  ]
  for key in ("local_glue_sst2/accuracy", "local_multi30k_ende/bleu", "local_scitldr_a/rouge1"):
    assert key in final, final
