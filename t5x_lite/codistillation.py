"""Co-distillation (online distillation): two models trained together, each following the
other's soft targets, in one jitted step (Anil et al. 2018; Zhang et al. 2018, deep
mutual learning).

Two networks of the same config, initialised from different keys, are one params tree
`{'model_a': ..., 'model_b': ...}`, so the optimizer, the shardings (each leaf by its
logical axes), gradient accumulation and checkpoints work unchanged. The objective is

  loss   = loss_a + loss_b
  loss_a = alpha * T**2 * KL(softmax(sg(b) / T) || softmax(a / T)) + (1 - alpha) * CE(a)
  loss_b = alpha * T**2 * KL(softmax(sg(a) / T) || softmax(b / T)) + (1 - alpha) * CE(b)

with `sg` = `jax.lax.stop_gradient`: each model's KL term follows the other's logits as
fixed targets, so model_a's parameters get gradients from loss_a only and model_b's
from loss_b only. Each KL and CE is weighted and normalised like the plain loss.

The trained model is model_a: `network_config`, evaluation (`eval_fn`: model_a's plain
cross-entropy), scoring and predictions are model_a's. Training logs `loss` (the sum
above), model_a's `cross_ent_loss` and accuracy, and `distill_kl` (model_a's KL).
A checkpoint holds both models under `model_a/` and `model_b/`; to fine-tune or
continue model_a as a plain model, start from it with `runs/from_codistill.gin`
(`RestoreConfig.assignment_map` reads `model_a/<path>`; model_b is listed in one warning
and dropped).

  python -m t5x_lite.train --gin_file=quickstart.gin --gin_file=runs/codistill.gin
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

import gin
import jax
import jax.numpy as jnp
from absl import logging

from t5x_lite import base_model, distillation, models
from t5x_lite.core.types import PyTree
from t5x_lite.nn import losses, network

if TYPE_CHECKING:
  import seqio

Batch = Mapping[str, jax.Array]
MODEL_A, MODEL_B = "model_a", "model_b"


class CoDistillationModel(base_model.DelegatingModel):
  """Two models of one config, each distilling the other; model_a is the trained model.

  Args:
    model: the network and loss settings both models share.
    alpha: weight of each model's soft-target term, in [0, 1]; 0 trains two
      independent models.
    temperature: softmax temperature T > 0 of the soft terms.
  """

  def __init__(self, model: models.BaseTransformerModel, *, alpha: float, temperature: float):
    super().__init__(model)
    self.model = model
    self.alpha = alpha
    self.temperature = temperature

  def inner_params(self, params: PyTree) -> PyTree:
    """model_a's params: model_a evaluates, scores, predicts and is fine-tuned."""
    return params[MODEL_A]

  def init_params(self, rng: jax.Array) -> PyTree:
    """{'model_a': boxed params, 'model_b': boxed params}, from two keys split off `rng`."""
    rng_a, rng_b = jax.random.split(rng)
    return {MODEL_A: self.model.init_params(rng_a), MODEL_B: self.model.init_params(rng_b)}

  def train_flops_per_step(self, batch_size: int, input_length: int, target_length: int) -> float:
    """Two models' training FLOPs."""
    return 2 * self.model.train_flops_per_step(batch_size, input_length, target_length)

  def loss_terms(
    self,
    params: PyTree,
    batch: Batch,
    dropout_rng: jax.Array | None,
    normalization: base_model.Normalization | None = None,
  ) -> dict[str, dict[str, jax.Array]]:
    """Each model's objective and its parts.

    Returns:
      {'model_a': {loss, hard, z_loss, kl, logits}, 'model_b': {...}}: `loss` is the
      model's term of the module docstring's objective; `hard` its cross-entropy
      (z-loss included); `kl` its normalised soft-target KL against the other model's
      stopped logits; `logits` its own [batch, length, vocab].
    """
    factor, weights = normalization or self.model.loss_normalization(batch)
    keys = (None, None) if dropout_rng is None else tuple(jax.random.split(dropout_rng))
    logits = {
      name: self.model.teacher_forced_logits(params[name], batch, key)  # [batch, len, vocab]
      for name, key in zip((MODEL_A, MODEL_B), keys)
    }
    terms = {}
    for name, other in ((MODEL_A, MODEL_B), (MODEL_B, MODEL_A)):
      hard, z_loss = self.model.cross_entropy(logits[name], batch, weights, factor)
      target = jax.lax.stop_gradient(logits[other])
      kl = distillation.soft_target_kl(logits[name], target, self.temperature)  # [batch, len]
      kl = jnp.sum(kl * weights) / factor
      loss = self.alpha * self.temperature**2 * kl + (1.0 - self.alpha) * hard
      terms[name] = {"loss": loss, "hard": hard, "z_loss": z_loss, "kl": kl, "logits": logits[name]}
    return terms

  def loss_fn(
    self,
    params: PyTree,
    batch: Batch,
    dropout_rng: jax.Array | None,
    *,
    normalization: base_model.Normalization | None = None,
    aux_state: PyTree = None,
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """loss_a + loss_b (there is no auxiliary state; `eval_fn` evaluates model_a alone).

    Returns:
      (loss, metric sums): model_a's `losses.metric_sums` with `loss` replaced by the
      joint objective, and `distill_kl` (model_a's KL) and `model_b_cross_ent_loss` added.
    """
    del aux_state
    factor, weights = normalization or self.model.loss_normalization(batch)
    terms = self.loss_terms(params, batch, dropout_rng, (factor, weights))
    a, b = terms[MODEL_A], terms[MODEL_B]
    loss = a["loss"] + b["loss"]
    correct = self.model.token_correct(a["logits"], batch["decoder_target_tokens"])
    sums = losses.metric_sums(correct, batch, weights, a["hard"], a["z_loss"])
    extra = {"distill_kl": a["kl"], "model_b_cross_ent_loss": b["hard"] - b["z_loss"]}
    return loss, {**sums, **extra, "loss": loss}

  def finalize_metrics(self, sums: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """model_a's metrics, plus `distill_kl` and `model_b_cross_ent_loss` in training."""
    metrics = self.model.finalize_metrics(sums)
    for name in ("distill_kl", "model_b_cross_ent_loss"):
      if name in sums:
        metrics[name] = sums[name]
    return metrics

  def eval_fn(self, params: PyTree, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
    """model_a's plain loss and metrics, comparable with a run without co-distillation."""
    return self.model.eval_fn(params[MODEL_A], batch)


@gin.configurable
def build_codistillation_model(
  alpha: float = 0.5,
  temperature: float = 2.0,
  config: network.T5Config | None = None,
  vocabulary: seqio.Vocabulary | None = None,
) -> CoDistillationModel:
  """Two models of `models.build_model(config, vocabulary)`, each distilling the other.

  Args:
    alpha: weight of each soft-target term in [0, 1].
    temperature: softmax temperature > 0.
    config: the network config of both; default `T5Config()` with its gin bindings.
    vocabulary: the vocabulary; default `vocab.get_vocabulary()`.

  Raises:
    ConfigError: alpha or temperature out of range, or a model distillation cannot
      train (see `distillation.build_student`).
  """
  distillation.check_settings("build_codistillation_model", alpha, temperature)
  model = distillation.build_student(config, vocabulary)
  logging.info("Co-distillation of two models, alpha %g, T %g", alpha, temperature)
  return CoDistillationModel(model=model, alpha=alpha, temperature=temperature)
