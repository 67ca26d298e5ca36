"""The tiny T5 network the tests share: small enough for CPU, shaped like T5 1.1."""

import dataclasses

import jax

from t5x_lite.nn import network
from t5x_lite.training import optimizers, partitioning, trainer

# vocab 64, d_model 32, 4 heads of 8, MLP 64, 2 + 2 layers, gated GELU, untied
# logits, no dropout. Tests override what they need (vocabulary size, depth, ...).
_TINY = network.T5Config(
  vocab_size=64,
  emb_dim=32,
  num_heads=4,
  head_dim=8,
  mlp_dim=64,
  num_encoder_layers=2,
  num_decoder_layers=2,
  mlp_activations=("gelu", "linear"),
  dropout_rate=0.0,
  logits_via_embedding=False,
)


def tiny_config(**overrides) -> network.T5Config:
  """The shared tiny config with `overrides` (T5Config field -> value)."""
  return dataclasses.replace(_TINY, **overrides)


def tiny_checkpoint_config(**overrides) -> network.T5Config:
  """One layer per stack, 2 heads of 16, a 320-id vocabulary (bytes and sentinels):
  the model the checkpoint, eval, infer and train tests save and restore."""
  fields = dict(
    vocab_size=320, num_heads=2, head_dim=16, num_encoder_layers=1, num_decoder_layers=1
  )
  return tiny_config(**{**fields, **overrides})


def train_losses(model, batch, partitioner: partitioning.Partitioner, steps: int = 3) -> list:
  """Losses of `steps` Adafactor steps of `model` on one `batch` under `partitioner`
  (the sharded-equals-single-device tests compare two partitioners' lists)."""
  optimizer = optimizers.adafactor(learning_rate=0.05)
  state, shardings = trainer.init_train_state(model, optimizer, jax.random.PRNGKey(0), partitioner)
  step = trainer.make_train_step(model, optimizer, partitioner, shardings, 1)
  losses = []
  for _ in range(steps):
    state, metrics = step(state, batch, jax.random.PRNGKey(1))
    losses.append(float(metrics["loss"]))
  return losses
