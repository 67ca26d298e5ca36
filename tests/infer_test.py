"""Tests of batch inference (t5x_lite.run.infer_lib, t5x_lite.run.model_runner) and the infer entry.

In-process tests use a random tiny model with the byte vocabulary written as a
params-only checkpoint; the entry-point test runs `python -m t5x_lite.infer`
with gin/runs/infer.gin on a checkpoint sized for the offline vocabulary.
"""

import dataclasses
import functools
import json
import os
import subprocess
import sys

import flax.linen as nn
import gin
import jax
import numpy as np
import pytest
import seqio
import tensorflow as tf

from t5x_lite import models
from t5x_lite.nn import network
from t5x_lite.data import file_sources, preprocessors
from t5x_lite.checkpoint import checkpoints
from t5x_lite.training import partitioning
from t5x_lite.run import infer_lib, model_runner
from t5x_lite.core.errors import CheckpointError, ConfigError, UserError
from tiny_models import tiny_checkpoint_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = seqio.ByteVocabulary()
TASK = "infer_test_task"
LENGTHS = {"inputs": 16, "targets": 6}
INPUTS = [f"input number {i}" for i in range(11)]


def _source(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
  del split, shuffle_files, seed
  return tf.data.Dataset.from_tensor_slices({"inputs": INPUTS[:5], "targets": ["t"] * 5})


if TASK not in seqio.TaskRegistry.names():
  seqio.TaskRegistry.add(
    TASK,
    source=seqio.FunctionDataSource(_source, splits=["validation"]),
    preprocessors=[seqio.preprocessors.tokenize, seqio.preprocessors.append_eos_after_trim],
    output_features={"inputs": seqio.Feature(VOCAB), "targets": seqio.Feature(VOCAB)},
  )


@pytest.fixture(autouse=True)
def _clean_gin():
  gin.clear_config()
  gin.bind_parameter("build_model.vocabulary", VOCAB)  # infer builds its model
  yield
  gin.clear_config()


def _config(vocab_size: int = 320) -> network.T5Config:
  return tiny_checkpoint_config(vocab_size=vocab_size)


def _write_checkpoint(root, config: network.T5Config) -> None:
  params = network.init_params(config, jax.random.PRNGKey(0))
  stored = {
    k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()
  }
  checkpoints.write_params_checkpoint(root, nn.meta.unbox(params), config=stored)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  root = tmp_path_factory.mktemp("ckpt")
  _write_checkpoint(root, _config())
  return root


def _jsonl(path, records) -> str:
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  return str(path)


def _infer(ckpt, output, **overrides) -> dict[str, float]:
  kwargs = dict(
    checkpoint_path=str(ckpt),
    output_file=str(output),
    task_feature_lengths=LENGTHS,
    input_file=None,
    mixture_or_task_name=None,
    split="validation",
    batch_size=8,
    mode="predict",
    decode=model_runner.DecodeConfig(),
  )
  kwargs.update(overrides)
  return infer_lib.infer(**kwargs)


def _lines(path) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f]


def test_one_line_per_input_and_rerun_appends_only_missing_lines(ckpt, tmp_path):
  source = _jsonl(tmp_path / "in.jsonl", [{"inputs": t} for t in INPUTS])
  out = tmp_path / "out" / "predictions.jsonl"
  assert _infer(ckpt, out, input_file=source)["examples"] == len(INPUTS)
  lines = _lines(out)
  assert [r["input"] for r in lines] == INPUTS
  assert all(set(r) == {"input", "prediction", "score"} and r["score"] < 0 for r in lines)

  complete = out.read_bytes()
  cut = sum(len(line) + 1 for line in complete.decode().split("\n")[:4])
  out.write_bytes(complete[: cut + 10])  # 4 lines and a partly written 5th
  assert _infer(ckpt, out, input_file=source)["examples"] == len(INPUTS) - 4
  resumed = _lines(out)
  assert [r["prediction"] for r in resumed] == [r["prediction"] for r in lines]
  np.testing.assert_allclose([r["score"] for r in resumed], [r["score"] for r in lines], rtol=1e-5)
  assert out.read_bytes()[:cut] == complete[:cut]  # kept lines are not rewritten
  assert _infer(ckpt, out, input_file=source)["examples"] == 0

  other = _jsonl(tmp_path / "other.jsonl", [{"inputs": t + "!"} for t in INPUTS])
  with pytest.raises(ValueError, match=f"{out}:11 was written for a different input"):
    _infer(ckpt, out, input_file=other)


def test_greedy_score_equals_score_of_the_greedy_tokens(ckpt):
  model = models.build_model(_config())
  partitioner = partitioning.Partitioner()
  abstract, shardings = partitioner.abstract_params(model.init_params)
  params = checkpoints.restore_params(ckpt, abstract)
  runner = model_runner.ModelRunner(model, partitioner, shardings, model_runner.DecodeConfig(), 8)
  examples = infer_lib.file_examples(
    _jsonl(ckpt.parent / "greedy.jsonl", [{"inputs": t} for t in INPUTS[:8]]), model, LENGTHS
  )
  tokens, scores = runner.predict(params, infer_lib.make_batch(examples, LENGTHS))
  rescored = [dataclasses.replace(ex, target_ids=row[row > 0]) for ex, row in zip(examples, tokens)]
  rescores = runner.score(params, infer_lib.make_batch(rescored, LENGTHS))
  # A decoded pad id (0) before the end is scored by decoding but not by score_batch.
  clean = np.array(
    [bool((row[np.argmax(row == 0) :] == 0).all()) if (row == 0).any() else True for row in tokens]
  )
  assert clean.sum() >= 4
  np.testing.assert_allclose(rescores[clean], scores[clean], rtol=1e-4)


def test_score_mode_tsv_and_task_split_inputs(ckpt, tmp_path):
  tsv = tmp_path / "in.tsv"
  tsv.write_text("inputs\ttargets\n" + "".join(f"{t}\tyes\n" for t in INPUTS[:3]))
  _infer(ckpt, tmp_path / "scores.jsonl", input_file=str(tsv), mode="score")
  scores = _lines(tmp_path / "scores.jsonl")
  assert [set(r) for r in scores] == [{"input", "target", "score"}] * 3
  assert all(r["target"] == "yes" and r["score"] < 0 for r in scores)

  _infer(ckpt, tmp_path / "task.jsonl", mixture_or_task_name=TASK)
  assert [(r["input"], r["target"]) for r in _lines(tmp_path / "task.jsonl")] == [
    (t, "t") for t in INPUTS[:5]
  ]


@pytest.mark.parametrize(
  "decode",
  [
    model_runner.DecodeConfig(decode_fn="beam", num_decodes=4, alpha=0.6),
    model_runner.DecodeConfig(decode_fn="sample", num_decodes=2, temperature=0.7, topk=5, topp=0.9),
  ],
  ids=["beam", "sample"],
)
def test_beam_and_sampling(ckpt, tmp_path, decode):
  source = _jsonl(tmp_path / "in.jsonl", [{"inputs": t} for t in INPUTS[:3]])
  _infer(ckpt, tmp_path / "out.jsonl", input_file=source, decode=decode)
  lines = _lines(tmp_path / "out.jsonl")
  assert len(lines) == 3 and all(np.isfinite(r["score"]) for r in lines)


def test_bad_inputs_are_named(ckpt, tmp_path):
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"inputs": "fine"}\n{"inputs": "broken\n')
  with pytest.raises(file_sources.DataFileError, match=f"{bad}:2: invalid JSON"):
    _infer(ckpt, tmp_path / "out.jsonl", input_file=str(bad))
  no_inputs = tmp_path / "no_inputs.tsv"
  no_inputs.write_text("sentence\tlabel\nhi\t1\n")
  with pytest.raises(file_sources.DataFileError, match="needs an 'inputs' column"):
    _infer(ckpt, tmp_path / "out.jsonl", input_file=str(no_inputs))
  plain = _jsonl(tmp_path / "plain.jsonl", [{"inputs": "a"}])
  with pytest.raises(ValueError, match="mode 'score' needs targets"):
    _infer(ckpt, tmp_path / "out.jsonl", input_file=plain, mode="score")
  with pytest.raises(CheckpointError, match=f"No checkpoint at {tmp_path}/missing: it does not"):
    _infer(tmp_path / "missing", tmp_path / "out.jsonl", input_file=plain)
  assert not (tmp_path / "out.jsonl").exists()


def test_relative_paths_and_unusable_files_are_named(ckpt, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  os.symlink(ckpt, tmp_path / "ckpt")
  _jsonl(tmp_path / "in.jsonl", [{"inputs": t} for t in INPUTS[:2]])
  assert _infer("./ckpt", "out/predictions.jsonl", input_file="in.jsonl")["examples"] == 2
  assert [r["input"] for r in _lines(tmp_path / "out" / "predictions.jsonl")] == INPUTS[:2]
  with pytest.raises(
    UserError, match=f"Input file does not exist: nope.jsonl \\({tmp_path}/nope.jsonl\\)"
  ):
    _infer("ckpt", "x.jsonl", input_file="nope.jsonl")
  with pytest.raises(ConfigError, match=f"OUTPUT_FILE out \\({tmp_path}/out\\) is a directory"):
    _infer("ckpt", "out", input_file="in.jsonl")
  with pytest.raises(
    ConfigError, match=f"OUTPUT_FILE's directory in.jsonl \\({tmp_path}/in.jsonl\\) is a file"
  ):
    _infer("ckpt", "in.jsonl/x.jsonl", input_file="in.jsonl")
  (tmp_path / "garbage.jsonl").write_text("not json\n")
  with pytest.raises(
    ConfigError, match=f"{tmp_path}/garbage.jsonl:1 was written for a different input"
  ):
    _infer("ckpt", "garbage.jsonl", input_file="in.jsonl")
  with pytest.raises(ConfigError, match="DecodeConfig.decode_fn must be one of"):
    model_runner.DecodeConfig(decode_fn="nucleus")


@pytest.mark.slow
def test_infer_entry_point(tmp_path):
  _write_checkpoint(tmp_path / "ckpt", _config(vocab_size=8192))  # the offline vocabulary
  source = _jsonl(tmp_path / "in.jsonl", [{"inputs": t, "targets": "x"} for t in INPUTS[:3]])
  out = tmp_path / "out.jsonl"
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "t5x_lite.infer",
      "--gin_file=runs/infer.gin",
      f"--gin.CHECKPOINT_PATH={tmp_path / 'ckpt'}",
      f"--gin.INPUT_FILE={source}",
      f"--gin.OUTPUT_FILE={out}",
      "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 4}",
      "--gin.BATCH_SIZE=8",
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert [(r["input"], r["target"]) for r in _lines(out)] == [(t, "x") for t in INPUTS[:3]]
  assert "3/3" in result.stderr  # the progress bar


def test_task_split_names_an_unknown_task_and_a_missing_feature():
  name = "infer_test_missing_feature"
  if name not in seqio.TaskRegistry.names():
    seqio.TaskRegistry.add(
      name,
      source=seqio.FunctionDataSource(
        lambda split, shuffle_files, seed=None: tf.data.Dataset.from_tensors(
          {"sentence": "a film", "lbl": "1"}
        ),
        splits=["validation"],
      ),
      preprocessors=[
        functools.partial(preprocessors.text_to_text, prefix="x", feature_names=("sentence",))
      ],
      output_features=preprocessors.text_to_text_features(),
    )
  with pytest.raises(
    ConfigError,
    match=rf"No seqio task or mixture named 'infer_test_missing_featur'"
    rf" \(closest: {name}[,)]",
  ):
    infer_lib.task_examples(name[:-1], "validation", {"inputs": 8, "targets": 4})
  with pytest.raises(
    ConfigError,
    match=rf"Task {name}: preprocessor text_to_text asks for "
    r"feature 'label', but the source has columns",
  ):
    infer_lib.task_examples(name, "validation", {"inputs": 8, "targets": 4})
