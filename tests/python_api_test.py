"""Tests of the Python API (t5x_lite.run.interactive) and of the recorded vocabulary.

A tiny model is trained for two steps with its own SentencePiece vocabulary (not the
configured default), so loading it without gin must find that vocabulary in the
checkpoint. The API's predictions and scores are compared with what the infer
command's library (`infer_lib.infer`) writes for the same checkpoint, inputs and
options. `docs/python_api.md` is run as written by `test_the_docs_page_runs` (slow).
"""

import json
import os
import shutil
import subprocess
import sys

import gin
import numpy as np
import pytest
import seqio
import tensorflow as tf

from t5x_lite import models
from t5x_lite.checkpoint import checkpoints, stored_vocabulary
from t5x_lite.core.errors import ConfigError
from t5x_lite.data import pipeline, task_metrics, vocab
from t5x_lite.run import eval_lib, infer_lib, model_runner
from t5x_lite.run.interactive import InteractiveModel
from t5x_lite.run import train_lib
from t5x_lite.training import optimizers
from tiny_models import tiny_checkpoint_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK = "python_api_test_copy"
LENGTHS = {"inputs": 24, "targets": 12}
WORDS = "the cat sat on a mat while dogs ran far away from home every day".split()
PAIRS = [
  (" ".join(WORDS[i % 7 : i % 7 + 3 + i % 4]), " ".join(WORDS[i % 5 : i % 5 + 2]))
  for i in range(20)
]
pytestmark = pytest.mark.usefixtures("clean_gin")


def _source(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
  del split, shuffle_files, seed
  inputs, targets = zip(*PAIRS)
  return tf.data.Dataset.from_tensor_slices({"inputs": list(inputs), "targets": list(targets)})


if TASK not in seqio.TaskRegistry.names():
  seqio.TaskRegistry.add(
    TASK,
    source=seqio.FunctionDataSource(_source, splits=["train", "validation"]),
    preprocessors=[seqio.preprocessors.tokenize, seqio.preprocessors.append_eos_after_trim],
    output_features={
      "inputs": seqio.Feature(vocab.default_vocabulary()),
      "targets": seqio.Feature(vocab.default_vocabulary()),
    },
    metric_fns=[task_metrics.accuracy],
  )


def _write_vocabulary(path) -> str:
  sentences = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] * 4
  path.write_bytes(vocab.train_sentencepiece(sentences, vocab_size=32))
  return str(path)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """A MODEL_DIR trained for 2 steps with a SentencePiece vocabulary of its own."""
  root = tmp_path_factory.mktemp("api")
  spm = _write_vocabulary(root / "words.model")
  gin.clear_config()
  gin.bind_parameter("get_vocabulary.sentencepiece_model_file", spm)
  train_lib.train(
    model_dir=str(root / "run"),
    total_steps=2,
    model=models.build_model(tiny_checkpoint_config()),
    optimizer=optimizers.adafactor(learning_rate=0.01),
    train_dataset_cfg=pipeline.DatasetConfig(TASK, LENGTHS, batch_size=8, pack=False),
    log_period=1,
  )
  gin.clear_config()
  return root / "run"


def _infer(run_dir, tmp_path, mode: str, decode: model_runner.DecodeConfig) -> list[dict]:
  """What `python -m t5x_lite.infer` writes for PAIRS (gin binds no vocabulary)."""
  source = tmp_path / f"{mode}.jsonl"
  source.write_text("".join(json.dumps({"inputs": i, "targets": t}) + "\n" for i, t in PAIRS))
  output = tmp_path / f"{mode}_out.jsonl"
  infer_lib.infer(
    checkpoint_path=str(run_dir),
    output_file=str(output),
    task_feature_lengths=LENGTHS,
    input_file=str(source),
    mixture_or_task_name=None,
    split="validation",
    batch_size=16,
    mode=mode,
    decode=decode,
  )
  return [json.loads(line) for line in output.read_text().splitlines()]


def test_load_needs_no_gin_file_and_uses_the_recorded_vocabulary(run_dir):
  model = InteractiveModel.load(str(run_dir), lengths=LENGTHS, batch_size=8)
  assert not gin.config_str().strip()  # nothing bound before or by loading
  recorded = stored_vocabulary.recorded(run_dir / "2")
  assert model.vocabulary.sentencepiece_model_file == recorded["sentencepiece_model_file"]
  assert checkpoints.vocabulary_fingerprint(model.vocabulary) == recorded
  assert model.step == 2 and model.model.module.config == tiny_checkpoint_config()
  assert isinstance(model.predict(["the cat"])[0], str)
  with pytest.raises(TypeError, match=r"inputs must be a list of strings, got one string"):
    model.predict("the cat")


@pytest.mark.parametrize(
  "options",
  [{}, {"decode_fn": "beam", "num_decodes": 3, "alpha": 0.6}],
  ids=["greedy", "beam"],
)
def test_predict_and_score_equal_the_infer_command(run_dir, tmp_path, options):
  model = InteractiveModel.load(str(run_dir), lengths=LENGTHS, batch_size=8)
  expected = _infer(run_dir, tmp_path, "predict", model_runner.DecodeConfig(**options))
  inputs = [i for i, _ in PAIRS]
  predicted = model.predict_with_scores(inputs, **options)
  assert [text for text, _ in predicted] == [r["prediction"] for r in expected]
  np.testing.assert_allclose(
    [s for _, s in predicted], [r["score"] for r in expected], rtol=1e-5, atol=1e-5
  )
  assert model.predict(inputs[:3], **options) == [r["prediction"] for r in expected[:3]]
  if not options:
    scored = _infer(run_dir, tmp_path, "score", model_runner.DecodeConfig())
    np.testing.assert_allclose(
      model.score(inputs, [t for _, t in PAIRS]),
      [r["score"] for r in scored],
      rtol=1e-5,
      atol=1e-5,
    )


def test_train_step_then_predict_changes_the_output(run_dir):
  model = InteractiveModel.load(
    str(run_dir),
    lengths=LENGTHS,
    batch_size=8,
    optimizer=optimizers.adafactor(learning_rate=optimizers.constant(0.05)),
  )
  prompt, target = "the cat sat", "dogs ran"  # fits LENGTHS["targets"]
  before, before_score = model.predict([prompt]), model.score([prompt], [target])[0]
  losses = [model.train_step([(prompt, target)] * 3)["loss"] for _ in range(10)]
  assert model.step == 2 + 10
  assert losses[-1] < 0.5 * losses[0], losses
  assert model.score([prompt], [target])[0] > before_score + 1.0
  assert model.predict([prompt]) != before
  assert model.predict([prompt]) == [target]


def test_evaluate_equals_the_eval_command(run_dir, tmp_path):
  model = InteractiveModel.load(str(run_dir), lengths=LENGTHS, batch_size=8)
  metrics = model.evaluate(TASK, task_feature_lengths=LENGTHS)
  assert set(metrics) == {TASK} and set(metrics[TASK]) == {"accuracy"}
  assert model.evaluate(TASK, task_feature_lengths=LENGTHS) == metrics  # cached, same result
  dataset = pipeline.DatasetConfig(
    TASK, LENGTHS, batch_size=8, split="validation", shuffle=False, pack=False
  )
  expected = eval_lib.evaluate_checkpoints(
    checkpoint_path=str(run_dir / "2"),
    output_dir=str(tmp_path / "eval"),
    dataset_cfg=dataset,
    decode=model_runner.DecodeConfig(),
    num_examples=None,
    watch=False,
    final_step=None,
    timeout_s=0,
    poll_s=0,
  )
  assert expected == {2: metrics}
  predictions = [
    json.loads(line)["output"]
    for line in open(tmp_path / "eval" / "inferences" / f"{TASK}-step_2.jsonl")
  ]
  assert predictions == model.predict([i for i, _ in PAIRS])


def test_a_missing_recorded_vocabulary_is_one_line_naming_it(run_dir, tmp_path):
  copy = tmp_path / "run"
  shutil.copytree(run_dir, copy)
  metadata = copy / "2" / checkpoints.TRAIN_META / "metadata"  # orbax JsonSave's file
  recorded = stored_vocabulary.recorded(copy / "2")
  gone = str(tmp_path / "gone.model")
  metadata.write_text(metadata.read_text().replace(recorded["sentencepiece_model_file"], gone))
  os.remove(copy / "2" / "files.json")  # its manifest no longer matches the edited file
  expected = rf"was trained with the vocabulary {gone} \(100 extra ids\), which does not exist here"
  with pytest.raises(ConfigError, match=expected):
    InteractiveModel.load(str(copy))
  with pytest.raises(ConfigError, match=expected):
    stored_vocabulary.adopt(copy / "2")
  moved = seqio.SentencePieceVocabulary(recorded["sentencepiece_model_file"], extra_ids=100)
  assert InteractiveModel.load(str(copy), vocabulary=moved).vocabulary is moved


@pytest.mark.slow
def test_the_docs_page_runs(tmp_path):
  """docs/python_api.md's Python blocks, in order, as one script from the repository root
  after the quickstart (shortened as the documentation test shortens it) made
  ./runs/quickstart."""
  from readme_flow_test import SHORTENING, _not_copied, _user_env, markdown_blocks

  root = tmp_path / "t5x_lite"
  shutil.copytree(REPO, root, ignore=_not_copied)
  (root / "runs").mkdir()
  env = _user_env()
  train = "python -m t5x_lite.train"
  quickstart = f"{train} --gin_file=quickstart.gin {SHORTENING[train]}"
  result = subprocess.run(
    ["bash", "-c", quickstart], cwd=root, env=env, capture_output=True, text=True, timeout=900
  )
  assert result.returncode == 0, result.stderr[-3000:]
  page = open(os.path.join(REPO, "docs", "python_api.md"), encoding="utf-8").read()
  blocks = [b.text for b in markdown_blocks(page) if b.lang == "python"]
  assert len(blocks) >= 5
  (root / "python_api_page.py").write_text("\n".join(blocks))
  result = subprocess.run(
    [sys.executable, "python_api_page.py"],
    cwd=root,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
  )
  output = result.stdout + result.stderr
  assert result.returncode == 0 and "Traceback" not in output, output[-4000:]
  assert "InteractiveModel(encoder_decoder, step 3" in result.stdout
  assert "'cpython_code_to_docstring': {'rouge1'" in result.stdout
