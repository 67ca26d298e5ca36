"""Co-distillation: each model's gradient comes only through its own loss, the objective
matches a hand computation, the run trains through the real loop, and its checkpoint
starts a plain model from model_a; bad settings are one-line errors."""

import json
import os

import flax.linen as nn
import gin
import jax
import numpy as np
import pytest
import tensorflow as tf

from t5x_lite import codistillation, distillation, models
from t5x_lite.checkpoint import checkpoints, partial_restore
from t5x_lite.core import errors, gin_config
from t5x_lite.nn import network
from text_tasks import VOCAB, register_text_task
from tiny_models import random_batch, train_on_task, tiny_checkpoint_config

TASK = "codistillation_test_text"


def _source(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
  del shuffle_files, seed
  texts = [f"{split} row {i}: " + "cd" * (i % 3) for i in range(32)]
  return tf.data.Dataset.from_tensor_slices({"inputs": texts, "targets": texts[::-1]})


register_text_task(TASK, _source, ["train", "validation"])
pytestmark = pytest.mark.usefixtures("clean_gin")
KWARGS = dict(z_loss=1e-4, label_smoothing=0.1, loss_normalizing_factor="NUM_REAL_TARGET_TOKENS")


def _plain() -> models.EncoderDecoderModel:
  return models.EncoderDecoderModel(
    network.Transformer(tiny_checkpoint_config()), VOCAB, VOCAB, **KWARGS
  )


def _codistill(alpha: float = 0.5, temperature: float = 2.0):
  return codistillation.CoDistillationModel(_plain(), alpha=alpha, temperature=temperature)


def _params(model, seed: int = 0):
  return nn.meta.unbox(model.init_params(jax.random.PRNGKey(seed)))


def _is_zero(tree) -> bool:
  return all(not np.any(leaf) for leaf in jax.tree.leaves(tree))


def test_each_model_gets_gradients_only_through_its_own_loss():
  model = _codistill(alpha=0.7)
  params, batch = _params(model), random_batch(batch=4)
  assert set(params) == {"model_a", "model_b"}

  def term(name):
    return jax.jit(jax.grad(lambda p: model.loss_terms(p, batch, None)[name]["loss"]))(params)

  grads_a, grads_b = term("model_a"), term("model_b")
  # model_b's KL term reads model_a's logits through stop_gradient (and vice versa).
  assert _is_zero(grads_b["model_a"]) and _is_zero(grads_a["model_b"])
  assert not _is_zero(grads_a["model_a"]) and not _is_zero(grads_b["model_b"])
  total = jax.jit(jax.grad(lambda p: model.loss_fn(p, batch, None)[0]))(params)
  for name, own in (("model_a", grads_a), ("model_b", grads_b)):
    jax.tree.map(
      lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-8), total[name], own[name]
    )


def test_objective_matches_a_hand_computation_and_eval_is_model_a():
  alpha, t = 0.3, 1.5
  model, plain = _codistill(alpha, t), _plain()
  params, batch = _params(model, 1), random_batch(seed=2, batch=4)
  loss, sums = model.loss_fn(params, batch, None)
  logits = {n: plain.teacher_forced_logits(params[n], batch, None) for n in params}
  w = batch["decoder_loss_weights"]

  def kl(student, teacher):
    return np.sum(distillation.soft_target_kl(logits[student], logits[teacher], t) * w) / w.sum()

  ce = {n: float(plain.loss_fn(params[n], batch, None)[0]) for n in params}
  kl_a, kl_b = kl("model_a", "model_b"), kl("model_b", "model_a")
  assert kl_a > 1e-4 and kl_b > 1e-4  # two different initialisations
  expected = alpha * t**2 * (kl_a + kl_b) + (1 - alpha) * (ce["model_a"] + ce["model_b"])
  np.testing.assert_allclose(loss, expected, rtol=1e-5)
  np.testing.assert_allclose(sums["distill_kl"], kl_a, rtol=1e-5)
  plain_loss, plain_metrics = plain.eval_fn(params["model_a"], batch)
  eval_loss, metrics = model.eval_fn(params, batch)
  np.testing.assert_array_equal(eval_loss, plain_loss)
  np.testing.assert_array_equal(metrics["accuracy"], plain_metrics["accuracy"])
  np.testing.assert_array_equal(
    model.score_batch(params, batch), plain.score_batch(params["model_a"], batch)
  )
  finalized = model.finalize_metrics(sums)
  np.testing.assert_allclose(finalized["cross_ent_loss"], float(sums["cross_ent_loss"]))
  assert {"distill_kl", "model_b_cross_ent_loss"} <= set(finalized)


def test_codistillation_trains_and_its_checkpoint_starts_a_plain_model_a(tmp_path):
  model = codistillation.build_codistillation_model(
    alpha=0.5, config=tiny_checkpoint_config(), vocabulary=VOCAB
  )
  state = train_on_task(TASK, tmp_path / "codistill", 2, model)
  with open(os.path.join(tmp_path / "codistill", "metrics.jsonl")) as f:
    records = [r for r in map(json.loads, f) if r["split"] == "train"]
  assert [r["step"] for r in records] == [1, 2] and records[-1]["distill_kl"] > 0
  saved = checkpoints.saved_shapes(tmp_path / "codistill" / "2" / checkpoints.PARAMS)
  assert saved["model_a/token_embedder/embedding"] == saved["model_b/token_embedder/embedding"]
  params = jax.device_get(state.params)
  assert not np.array_equal(
    params["model_a"]["token_embedder"]["embedding"],
    params["model_b"]["token_embedder"]["embedding"],
  )
  # runs/from_codistill.gin starts a plain model from model_a (no update at 0 steps).
  gin_config.parse_gin(["runs/from_codistill.gin"], [])
  plain = models.EncoderDecoderModel(network.Transformer(tiny_checkpoint_config()), VOCAB, VOCAB)
  started = train_on_task(
    TASK, tmp_path / "student", 0, plain, initial_checkpoint_path=str(tmp_path / "codistill")
  )
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(started.params), params["model_a"])
  assert partial_restore.RestoreConfig().assignment_map == (("(.*)", r"model_a/\1"),)


def test_bad_settings_are_one_line_errors_and_the_gin_file_binds_the_model():
  build = dict(config=tiny_checkpoint_config(), vocabulary=VOCAB)
  for kwargs, message in [
    (dict(alpha=-0.5), "build_codistillation_model.alpha must be in"),
    (dict(temperature=-1.0), "build_codistillation_model.temperature must be positive"),
  ]:
    with pytest.raises(errors.UserError, match=message) as e:
      codistillation.build_codistillation_model(**kwargs, **build)
    lines = [line for line in str(e.value).splitlines() if "In call to configurable" not in line]
    assert len(lines) == 1, str(e.value)  # gin's note is dropped by `errors.fail`
  gin_config.parse_gin(["runs/codistill.gin"], ["DISTILL_ALPHA = 0.25"])
  assert gin.query_parameter("train.model").selector == "codistillation.build_codistillation_model"
  alpha = gin.query_parameter("codistillation.build_codistillation_model.alpha")
  assert gin_config.resolved_macro(alpha) == 0.25
