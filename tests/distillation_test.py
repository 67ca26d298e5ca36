"""Distillation: the loss against hand computations and the plain loss, gradients that
reach the student only, and a student trained and resumed against a saved teacher."""

import json
import os

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf

from t5x_lite import distillation, models
from t5x_lite.core import errors, gin_config
from t5x_lite.nn import network
from t5x_lite.checkpoint import checkpoints
from t5x_lite.training import optimizers, partitioning, trainer
from text_tasks import VOCAB, register_text_task
from tiny_models import (
  random_batch,
  train_on_task,
  init_params,
  save_params_checkpoint,
  tiny_checkpoint_config,
)

TASK = "distillation_test_text"


def _source(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
  del shuffle_files, seed
  texts = [f"{split} sentence {i}: " + "xyz" * (i % 4) for i in range(32)]
  return tf.data.Dataset.from_tensor_slices({"inputs": texts, "targets": texts[::-1]})


register_text_task(TASK, _source, ["train", "validation"])
pytestmark = pytest.mark.usefixtures("clean_gin")


def _student(alpha: float, temperature: float, teacher_config: network.T5Config):
  kwargs = dict(z_loss=1e-4, label_smoothing=0.1, loss_normalizing_factor="NUM_REAL_TARGET_TOKENS")
  return distillation.DistillationModel(
    models.EncoderDecoderModel(
      network.Transformer(tiny_checkpoint_config()), VOCAB, VOCAB, **kwargs
    ),
    models.EncoderDecoderModel(network.Transformer(teacher_config), VOCAB, VOCAB),
    teacher_checkpoint="unused",
    alpha=alpha,
    temperature=temperature,
  ), models.EncoderDecoderModel(
    network.Transformer(tiny_checkpoint_config()), VOCAB, VOCAB, **kwargs
  )


def test_soft_target_kl_matches_a_hand_computation():
  rng = np.random.default_rng(0)
  student, teacher = rng.normal(size=(2, 3, 11)), 3 * rng.normal(size=(2, 3, 11))
  t = 2.5

  def log_softmax(x):
    x = x / t
    return (
      x
      - np.log(np.sum(np.exp(x - x.max(-1, keepdims=True)), -1, keepdims=True))
      - x.max(-1, keepdims=True)
    )

  p = np.exp(log_softmax(teacher))
  expected = np.sum(p * (log_softmax(teacher) - log_softmax(student)), axis=-1)
  got = distillation.soft_target_kl(jnp.asarray(student), jnp.asarray(teacher), t)
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(got) >= 0)


def test_alpha_zero_is_the_plain_loss_and_gradients():
  teacher_config = tiny_checkpoint_config(emb_dim=48, num_encoder_layers=2)  # any size
  model, plain = _student(0.0, 2.0, teacher_config)
  params, teacher = init_params(model.network_config, 0), init_params(teacher_config, 1)
  batch = random_batch(batch=3)
  distilled = jax.jit(
    lambda p, t: jax.value_and_grad(model.loss_fn, has_aux=True)(p, batch, None, aux_state=t)
  )
  (loss, sums), grads = distilled(params, teacher)
  (plain_loss, plain_sums), plain_grads = jax.jit(
    lambda p: jax.value_and_grad(plain.loss_fn, has_aux=True)(p, batch, None)
  )(params)
  np.testing.assert_allclose(loss, plain_loss, rtol=1e-6)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, plain_grads
  )
  assert float(sums["distill_kl"]) > 0.01  # a different teacher: the term is there, weighted 0
  for name, value in plain_sums.items():
    np.testing.assert_allclose(sums[name], value, rtol=1e-6, err_msg=name)


def test_objective_combines_both_terms_and_teacher_equal_to_student_gives_zero_kl():
  alpha, t = 0.3, 1.0
  model, plain = _student(alpha, t, tiny_checkpoint_config())
  params = init_params(model.network_config, 0)
  batch = random_batch(seed=1, batch=3)
  loss, sums = model.loss_fn(params, batch, None, aux_state=params)
  assert abs(float(sums["distill_kl"])) < 1e-6
  plain_loss, _ = plain.loss_fn(params, batch, None)
  np.testing.assert_allclose(loss, (1 - alpha) * plain_loss, rtol=1e-5)
  # With another teacher: loss = alpha T^2 KL + (1 - alpha) CE, KL normalised like CE.
  model, _ = _student(alpha, 3.0, tiny_checkpoint_config())
  teacher = init_params(model.network_config, 5)
  loss, sums = model.loss_fn(params, batch, None, aux_state=teacher)
  student_logits = model.student.teacher_forced_logits(params, batch, None)
  teacher_logits = model.teacher_logits(teacher, batch)
  weights = batch["decoder_loss_weights"]
  kl = np.sum(distillation.soft_target_kl(student_logits, teacher_logits, 3.0) * weights)
  kl /= weights.sum()  # NUM_REAL_TARGET_TOKENS
  np.testing.assert_allclose(sums["distill_kl"], kl, rtol=1e-5)
  np.testing.assert_allclose(loss, alpha * 9.0 * kl + (1 - alpha) * plain_loss, rtol=1e-5)
  # Eval (no teacher passed) is the student's plain loss.
  eval_loss, metrics = model.eval_fn(params, batch)
  np.testing.assert_allclose(eval_loss, plain_loss, rtol=1e-6)
  assert "distill_kl" not in metrics


def test_gradients_reach_the_student_only_and_the_step_keeps_the_teacher():
  teacher_config = tiny_checkpoint_config(emb_dim=48)
  model, _ = _student(0.7, 2.0, teacher_config)
  params, teacher = init_params(model.network_config, 0), init_params(teacher_config, 1)
  batch = random_batch(seed=2, batch=8)  # divisible by the 4-way data axis below
  teacher_grads = jax.jit(jax.grad(lambda tp: model.loss_fn(params, batch, None, aux_state=tp)[0]))(
    teacher
  )
  assert all(not np.any(g) for g in jax.tree.leaves(teacher_grads))

  partitioner = partitioning.Partitioner(num_partitions=2)
  optimizer = optimizers.adafactor(learning_rate=0.01)
  state, shardings = trainer.init_train_state(model, optimizer, jax.random.PRNGKey(0), partitioner)
  assert state.aux_state is None
  abstract, _ = trainer.abstract_train_state(model, optimizer, partitioner)
  teacher = jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), teacher, abstract.aux_state)
  kernel = teacher["decoder"]["logits_dense"]["kernel"]  # [embed, vocab]: vocab over 'model'
  assert kernel.sharding.spec == shardings.aux_state["decoder"]["logits_dense"]["kernel"].spec
  before = jax.device_get(teacher)
  state = state.replace(aux_state=teacher)
  step = trainer.make_train_step(model, optimizer, partitioner, shardings)
  new_state, metrics = step(state, {k: v for k, v in batch.items()}, jax.random.PRNGKey(1))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(new_state.aux_state), before)
  assert float(metrics["distill_kl"]) > 0
  assert not np.array_equal(
    jax.device_get(new_state.params["decoder"]["logits_dense"]["kernel"]),
    jax.device_get(init_params(model.network_config, 0)["decoder"]["logits_dense"]["kernel"]),
  )


def test_student_trains_and_resumes_against_a_saved_teacher_of_another_size(tmp_path):
  teacher_config = tiny_checkpoint_config(emb_dim=48, num_decoder_layers=2)
  save_params_checkpoint(tmp_path / "teacher", teacher_config)
  # The student's own T5Config bindings do not leak into the teacher's stored config.
  gin.bind_parameter("T5Config.emb_dim", 16)
  student = distillation.build_distillation_model(
    teacher_checkpoint_path=str(tmp_path / "teacher"),
    alpha=0.5,
    temperature=2.0,
    config=tiny_checkpoint_config(),
    vocabulary=VOCAB,
  )
  assert student.teacher.network_config == teacher_config
  state = train_on_task(TASK, tmp_path / "student", 2, student, length=40)
  with open(os.path.join(tmp_path / "student", "metrics.jsonl")) as f:
    records = [r for r in map(json.loads, f) if r["split"] == "train"]
  assert [r["step"] for r in records] == [1, 2]
  assert all(r["distill_kl"] > 0 for r in records)
  # The checkpoint holds the student only, and a restart resumes it with the teacher.
  saved = checkpoints.saved_shapes(tmp_path / "student" / "2" / checkpoints.PARAMS)
  assert saved["token_embedder/embedding"] == (320, 32)
  assert saved == checkpoints.flat_shapes(jax.device_get(state.params))
  resumed = train_on_task(TASK, tmp_path / "student", 3, student, length=40)
  assert int(resumed.step) == 3
  expected_teacher = checkpoints.restore_params(
    tmp_path / "teacher",
    jax.eval_shape(lambda: init_params(teacher_config, 0)),
  )
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.aux_state), expected_teacher)


def test_bad_teacher_or_settings_are_one_line_errors(tmp_path):
  save_params_checkpoint(tmp_path / "teacher", tiny_checkpoint_config(vocab_size=384))
  build = dict(config=tiny_checkpoint_config(), vocabulary=VOCAB)
  cases = [
    (dict(teacher_checkpoint_path=str(tmp_path / "teacher")), "vocab_size 384"),
    (dict(teacher_checkpoint_path=str(tmp_path / "teacher"), alpha=1.5), "alpha must be in"),
    (dict(teacher_checkpoint_path=str(tmp_path / "teacher"), temperature=0.0), "temperature"),
    (dict(teacher_checkpoint_path=str(tmp_path / "none")), "none"),
  ]
  for kwargs, message in cases:
    with pytest.raises(errors.UserError, match=message) as e:
      distillation.build_distillation_model(**kwargs, **build)
    lines = [line for line in str(e.value).splitlines() if "In call to configurable" not in line]
    assert len(lines) == 1, str(e.value)  # gin's note is dropped by `errors.fail`
  gin.bind_parameter("EncoderDecoderModel.loss_chunk_length", 16)
  save_params_checkpoint(tmp_path / "same_vocab", tiny_checkpoint_config())
  with pytest.raises(errors.ConfigError, match="unset EncoderDecoderModel.loss_chunk_length"):
    distillation.build_distillation_model(
      teacher_checkpoint_path=str(tmp_path / "same_vocab"), **build
    )
  gin.clear_config()
  decoder_only = tiny_checkpoint_config(
    vocab_size=384, architecture="decoder_only", num_encoder_layers=0
  )
  with pytest.raises(
    errors.ConfigError, match="the student is T5Config.architecture 'decoder_only'"
  ):
    distillation.build_distillation_model(
      teacher_checkpoint_path=str(tmp_path / "teacher"), config=decoder_only, vocabulary=VOCAB
    )


def test_distill_gin_binds_the_model_and_its_macros():
  gin_config.parse_gin(["runs/distill.gin"], ["TEACHER_CHECKPOINT_PATH = './runs/teacher'"])

  def bound(name: str):
    value = gin.query_parameter(f"distillation.build_distillation_model.{name}")
    return gin_config.resolved_macro(value)

  assert (bound("alpha"), bound("temperature")) == (0.5, 2.0)
  assert bound("teacher_checkpoint_path") == "./runs/teacher"
  assert gin.query_parameter("train.model").selector == "distillation.build_distillation_model"
