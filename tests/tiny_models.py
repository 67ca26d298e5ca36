"""The tiny T5 network the tests share: small enough for CPU, shaped like T5 1.1."""

import dataclasses
import os

import flax.linen as nn
import jax
import numpy as np

from t5x_lite.checkpoint import checkpoints
from t5x_lite.data import pipeline
from t5x_lite.nn import network
from t5x_lite.run import train_lib
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


def random_batch(seed: int = 0, batch: int = 4, inputs: int = 7, targets: int = 5) -> dict:
  """An encoder-decoder batch of random ids in [2, 300) (fits `tiny_checkpoint_config`);
  the first row's last two targets are padding (zero loss weight)."""
  rng = np.random.default_rng(seed)
  decoder_target_tokens = rng.integers(2, 300, (batch, targets)).astype(np.int32)
  decoder_target_tokens[0, -2:] = 0
  decoder_input_tokens = np.pad(decoder_target_tokens[:, :-1], ((0, 0), (1, 0)))
  return {
    "encoder_input_tokens": rng.integers(2, 300, (batch, inputs)).astype(np.int32),
    "decoder_input_tokens": decoder_input_tokens,
    "decoder_target_tokens": decoder_target_tokens,
    "decoder_loss_weights": (decoder_target_tokens > 0).astype(np.float32),
  }


def init_params(config: network.T5Config, seed: int) -> dict:
  """Unboxed initial params of a T5 network of `config`."""
  return nn.meta.unbox(network.init_params(config, jax.random.PRNGKey(seed)))


def save_params_checkpoint(root: str | os.PathLike, config: network.T5Config, seed: int = 7):
  """A params-only checkpoint with its config at `root` (what
  tools/convert_hf_checkpoint.py writes): a teacher for the distillation tests."""
  checkpoints.write_params_checkpoint(
    root, jax.device_get(init_params(config, seed)), config=dataclasses.asdict(config)
  )


def train_on_task(task: str, model_dir, steps: int, model, length: int = 32, **kwargs):
  """`train_lib.train` of `model` on `task` (unpacked rows of `length` input and target
  tokens, 8 a step, Adafactor at 0.01, a record every step)."""
  dataset = pipeline.DatasetConfig(
    mixture_or_task_name=task,
    task_feature_lengths={"inputs": length, "targets": length},
    batch_size=8,
    pack=False,
  )
  return train_lib.train(
    model_dir=str(model_dir),
    total_steps=steps,
    model=model,
    optimizer=optimizers.adafactor(learning_rate=0.01),
    train_dataset_cfg=dataset,
    log_period=1,
    **kwargs,
  )
