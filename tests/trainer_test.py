"""Tests for t5x_lite.training.trainer: learning, sharding parity, accumulation, donation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import seqio
from jax.sharding import PartitionSpec

from t5x_lite import models
from t5x_lite.nn import network
from t5x_lite.training import factored_moments, optimizers, partitioning, trainer
from t5x_lite.core.errors import ConfigError
from tiny_models import tiny_config

VOCAB = 64
BATCH, INPUT_LEN, TARGET_LEN = 8, 8, 6


def tiny_model(dropout_rate: float = 0.0, **kwargs) -> models.EncoderDecoderModel:
  config = tiny_config(
    vocab_size=VOCAB, num_encoder_layers=1, num_decoder_layers=1, dropout_rate=dropout_rate
  )
  vocab = seqio.PassThroughVocabulary(VOCAB, eos_id=1)
  return models.EncoderDecoderModel(network.Transformer(config), vocab, vocab, **kwargs)


def make_batch(seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.RandomState(seed)
  inputs = rng.randint(2, VOCAB, size=(BATCH, INPUT_LEN)).astype(np.int32)
  targets = rng.randint(2, VOCAB, size=(BATCH, TARGET_LEN)).astype(np.int32)
  for row in range(BATCH):
    end = TARGET_LEN - 1 - row % 3
    targets[row, end] = 1
    targets[row, end + 1 :] = 0
    inputs[row, INPUT_LEN - row % 4 :] = 0
  return {
    "encoder_input_tokens": inputs,
    "decoder_input_tokens": np.pad(targets[:, :-1], ((0, 0), (1, 0))),
    "decoder_target_tokens": targets,
    "decoder_loss_weights": (targets > 0).astype(np.float32),
  }


def setup(partitioner, optimizer=None, num_microbatches=1, **model_kwargs):
  model = tiny_model(**model_kwargs)
  optimizer = optimizer or optimizers.adafactor(learning_rate=0.05)
  state, shardings = trainer.init_train_state(model, optimizer, jax.random.PRNGKey(0), partitioner)
  step = trainer.make_train_step(model, optimizer, partitioner, shardings, num_microbatches)
  return model, state, shardings, step


def single_device():
  return partitioning.Partitioner(devices=jax.devices()[:1])


def run_losses(partitioner, steps: int) -> list[float]:
  _, state, _, step = setup(partitioner)
  batch, rng, result = make_batch(), jax.random.PRNGKey(1), []
  for _ in range(steps):
    state, metrics = step(state, batch, rng)
    result.append(metrics["loss"])
  return [float(x) for x in result]


@pytest.fixture(scope="module")
def reference_losses():
  return run_losses(single_device(), 3)


def test_loss_falls_on_repeated_batch():
  _, state, _, step = setup(single_device(), optimizers.adamw(learning_rate=1e-2, weight_decay=0.0))
  batch, rng, losses = make_batch(), jax.random.PRNGKey(1), []
  for _ in range(30):
    state, metrics = step(state, batch, rng)
    losses.append(float(metrics["loss"]))
  assert losses[-1] < 0.5 * losses[0], losses
  assert int(state.step) == 30
  assert float(metrics["learning_rate"]) == pytest.approx(1e-2)
  assert float(metrics["grad_norm"]) > 0
  assert float(metrics["num_sequences"]) == BATCH
  assert float(metrics["accuracy"]) > 0.5


@pytest.mark.parametrize("model,fsdp", [(1, False), (2, False), (2, True)])
def test_sharded_runs_match_single_device(reference_losses, model, fsdp):
  partitioner = partitioning.Partitioner(num_partitions=model, fsdp=fsdp)  # data = 8 / model
  np.testing.assert_allclose(run_losses(partitioner, 3), reference_losses, rtol=1e-4)
  assert reference_losses[2] < reference_losses[0]


def test_state_shardings_follow_logical_axes():
  partitioner = partitioning.Partitioner(num_partitions=2, fsdp=True)  # data=4 x model=2
  _, state, shardings, _ = setup(partitioner, optimizers.adamw(learning_rate=1e-3))
  wi = ("decoder", "layers_0", "mlp", "wi_0", "kernel")

  def get(tree, path):
    for key in path:
      tree = tree[key]
    return tree

  assert get(state.params, wi).sharding.spec == PartitionSpec("data", "model")
  adam = state.opt_state[0]
  assert isinstance(adam, optax.ScaleByAdamState)
  assert get(adam.mu, wi).sharding.spec == PartitionSpec("data", "model")
  assert adam.count.sharding.spec == PartitionSpec()
  assert state.step.sharding.spec == PartitionSpec()
  assert shardings.params["token_embedder"]["embedding"].spec == PartitionSpec("model", "data")
  model = tiny_model()
  abstract, abstract_shardings = trainer.abstract_train_state(
    model, optimizers.adamw(learning_rate=1e-3), partitioner
  )
  assert abstract_shardings == shardings
  assert jax.tree.map(lambda x: (x.shape, x.sharding), abstract) == jax.tree.map(
    lambda x: (x.shape, x.sharding), state
  )

  # Activations get sharding constraints only with the mesh and rules in scope.
  def trace():
    loss_fn = functools.partial(model.loss_fn, dropout_rng=None)
    jaxpr = jax.make_jaxpr(loss_fn)(abstract.params, make_batch())
    return str(jaxpr)

  with partitioner.context():
    assert "sharding_constraint" in trace()
  assert "sharding_constraint" not in trace()


def test_adafactor_factored_statistics_shardings():
  params = {
    "big": jax.ShapeDtypeStruct((256, 128), jnp.float32),
    "vec": jax.ShapeDtypeStruct((256,), jnp.float32),
  }
  mesh = partitioning.create_mesh(data=4, model=2)
  param_shardings = {
    "big": jax.sharding.NamedSharding(mesh, PartitionSpec("data", "model")),
    "vec": jax.sharding.NamedSharding(mesh, PartitionSpec("data")),
  }
  opt = optimizers.adafactor(learning_rate=0.01)
  abstract = jax.eval_shape(opt.init, params)
  shardings = trainer.opt_state_shardings(abstract, params, param_shardings, mesh)
  factored = shardings[0]  # chain -> scale_by_factored_rms state
  assert isinstance(factored, factored_moments.FactoredRmsState)
  assert factored.v_row["big"].spec == PartitionSpec()
  assert factored.v["big"].spec == PartitionSpec()  # (1,) placeholder
  assert factored.v["vec"].spec == PartitionSpec("data")  # unfactored: follows its param


@pytest.mark.parametrize("normalizer", ["NUM_REAL_TARGET_TOKENS", "AVERAGE_PER_SEQUENCE"])
def test_microbatches_give_the_same_update(normalizer):
  # Per-microbatch normalization would differ here: rows have different lengths.
  partitioner = partitioning.Partitioner(devices=jax.devices()[:2])  # data=2 x model=1
  batch, rng = make_batch(3), jax.random.PRNGKey(2)
  results = []
  for num_microbatches in (1, 2):
    # Plain SGD: the update is -lr * grads (Adam's first step is ~sign(grads), which
    # amplifies rounding in near-zero gradients).
    sgd = optimizers.Optimizer(tx=optax.sgd(0.5), schedule=optax.constant_schedule(0.5))
    _, state, _, step = setup(
      partitioner, sgd, num_microbatches, loss_normalizing_factor=normalizer
    )
    state, metrics = step(state, batch, rng)
    results.append((jax.device_get(state.params), jax.device_get(metrics)))
  (params1, metrics1), (params2, metrics2) = results
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), params1, params2
  )
  for name in metrics1:
    np.testing.assert_allclose(metrics2[name], metrics1[name], rtol=1e-5, err_msg=name)


def test_donation_resume_determinism_and_eval_step():
  partitioner = partitioning.Partitioner(num_partitions=2)  # data=4 x model=2
  model, state, shardings, step = setup(partitioner, dropout_rate=0.1)
  batch, rng = make_batch(), jax.random.PRNGKey(5)
  first, _ = step(state, batch, rng)
  assert jax.tree.leaves(state.params)[0].is_deleted()  # donated
  saved = jax.tree.map(jnp.copy, first)  # a device copy (a host view would pin buffers)
  second, metrics = step(first, batch, rng)
  assert jax.tree.leaves(first.params)[0].is_deleted()
  assert int(second.step) == 2
  # Dropout keys come from (rng, step): a restored step-1 state repeats step 2 exactly.
  _, resumed_metrics = step(jax.device_put(saved, shardings), batch, rng)
  assert float(resumed_metrics["loss"]) == float(metrics["loss"])
  eval_step = trainer.make_eval_step(model, partitioner, shardings.params)
  eval_metrics = eval_step(second.params, batch)
  expected_loss, _ = jax.jit(model.eval_fn)(jax.device_get(second.params), batch)
  np.testing.assert_allclose(eval_metrics["loss"], expected_loss, rtol=1e-5)
  assert set(eval_metrics) | {"learning_rate", "grad_norm"} == set(metrics)


def test_frozen_parameters_stay_bitwise_unchanged_and_have_no_optimizer_state():
  trainable = [r"decoder/.*", r"token_embedder/.*"]
  optimizer = optimizers.adafactor(learning_rate=0.05).with_trainable(trainable)
  model, state, _, step = setup(single_device(), optimizer)
  before = jax.device_get(state.params)
  batch, rng = make_batch(), jax.random.PRNGKey(1)
  for _ in range(2):
    state, _ = step(state, batch, rng)
  after = jax.device_get(state.params)
  np.testing.assert_equal(after["encoder"], before["encoder"])  # bitwise
  changed = jax.tree.map(lambda a, b: bool(np.any(a != b)), after["decoder"], before["decoder"])
  assert all(jax.tree.leaves(changed))
  assert np.any(after["token_embedder"]["embedding"] != before["token_embedder"]["embedding"])

  full_state = trainer.abstract_train_state(
    model, optimizers.adafactor(learning_rate=0.05), single_device()
  )[0].opt_state

  def size(tree):
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))

  encoder_params = size(before["encoder"])
  assert size(state.opt_state) < size(full_state) - encoder_params // 2
  assert optimizers.trainable_counts(before, trainable) == (
    size(before) - encoder_params,
    size(before),
  )


def test_a_trainable_pattern_that_matches_nothing_is_named():
  params = {"encoder": {"layers_0": {"mlp": {"wi": {"kernel": jnp.zeros((2, 3))}}}}}
  assert optimizers.trainable_counts(params, None) == (6, 6)
  with pytest.raises(ConfigError, match=r"'adapter' matches no parameter; paths look like "):
    optimizers.trainable_counts(params, ["adapter"])
  with pytest.raises(ConfigError, match=r"pattern '\(' is not a regex"):
    optimizers.adafactor(learning_rate=0.1).with_trainable(["("])
