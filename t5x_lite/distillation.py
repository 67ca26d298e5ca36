"""Knowledge distillation: a student trained against a frozen teacher's soft targets.

The student's loss per target token is (Hinton et al. 2015, with T5X's loss weights
and normalisation):

  loss = alpha * T**2 * KL(softmax(teacher / T) || softmax(student / T))
       + (1 - alpha) * cross_entropy(student, targets)

T is the temperature; T**2 keeps the soft term's gradients on the scale of the
hard one as T grows. Both terms are weighted by the batch's loss weights and
divided by the same normalising factor as the plain loss, so alpha = 0 is exactly
the plain objective (z-loss and label smoothing included).

The teacher is any checkpoint over the same vocabulary (its size and depth are
free): `DistillationModel` builds its network from the config the checkpoint
stores. Its parameters travel in `TrainState.teacher_params`, sharded by their
logical axes like the student's, and its forward pass runs inside the same jitted
train step; `jax.grad` differentiates the student's parameters only (and the teacher's
logits pass through `stop_gradient`), so the teacher gets no gradients, no optimizer
state and no checkpoint of its own: a resumed run restores it again from its path.

Evaluation (`eval_fn`, the periodic eval loss) reports the student's plain
cross-entropy, comparable with runs without a teacher.

  python -m t5x_lite.train --gin_file=<student training config> \\
    --gin_file=runs/distill.gin --gin.TEACHER_CHECKPOINT_PATH=./runs/teacher
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any, Mapping

import gin
import jax
import jax.numpy as jnp
from absl import logging

from t5x_lite import models
from t5x_lite.nn import losses, network
from t5x_lite.checkpoint import checkpoints
from t5x_lite.core.errors import ConfigError
from t5x_lite.kernels import registry
from t5x_lite.core.types import PyTree

if TYPE_CHECKING:
  import seqio

Batch = Mapping[str, jax.Array]


def soft_target_kl(
  student_logits: jax.Array, teacher_logits: jax.Array, temperature: float
) -> jax.Array:
  """KL(softmax(teacher / T) || softmax(student / T)) per position.

  Args:
    student_logits: [batch, length, vocab].
    teacher_logits: [batch, length, vocab], same vocabulary.
    temperature: T > 0.

  Returns:
    [batch, length] float32, >= 0.
  """
  student = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
  teacher = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, axis=-1)
  return jnp.sum(jnp.exp(teacher) * (teacher - student), axis=-1)


def teacher_config(step_dir: os.PathLike[str] | str) -> network.T5Config:
  """The T5Config a teacher checkpoint stores, with no gin bindings applied.

  The student's `T5Config.*` bindings describe the student only: every field is
  passed explicitly (stored value, else the dataclass default), so gin supplies none.

  Raises:
    ConfigError: the checkpoint stores no model config.
  """
  stored = checkpoints.stored_config_fields(step_dir)
  if not stored:
    raise ConfigError(
      f"Teacher checkpoint {step_dir} stores no model config (train_meta or config item); "
      "distill from a t5x_lite training checkpoint or a tools/convert_hf_checkpoint.py output."
    )
  fields = {}
  for field in dataclasses.fields(network.T5Config):
    if field.name in stored:
      value = stored[field.name]
      fields[field.name] = tuple(value) if isinstance(value, list) else value
    elif field.default is not dataclasses.MISSING:
      fields[field.name] = field.default
    elif field.default_factory is not dataclasses.MISSING:
      fields[field.name] = field.default_factory()
    else:
      raise ConfigError(f"Teacher checkpoint {step_dir} stores no T5Config.{field.name}.")
  return network.T5Config(**fields)


class DistillationModel(models.EncoderDecoderModel):
  """An EncoderDecoderModel (the student) whose training loss follows a teacher.

  Args:
    module: the student network.
    input_vocabulary / output_vocabulary: the student's (and teacher's) vocabularies.
    teacher_module: the teacher network (`network.Transformer` of its stored config).
    teacher_checkpoint: the teacher's step directory (restored by `restore_teacher`).
    alpha: weight of the soft-target term, in [0, 1]; 0 trains on the targets only.
    temperature: softmax temperature T > 0 of both distributions in the soft term.
    **kwargs: `EncoderDecoderModel` options (z_loss, label_smoothing, ...).
  """

  def __init__(
    self,
    module: network.Transformer,
    input_vocabulary: seqio.Vocabulary,
    output_vocabulary: seqio.Vocabulary,
    *,
    teacher_module: network.Transformer,
    teacher_checkpoint: os.PathLike[str] | str,
    alpha: float,
    temperature: float,
    **kwargs: Any,
  ):
    super().__init__(module, input_vocabulary, output_vocabulary, **kwargs)
    self.teacher_module = teacher_module
    self.teacher_checkpoint = teacher_checkpoint
    self.alpha = alpha
    self.temperature = temperature

  def init_teacher_params(self, rng: jax.Array) -> PyTree:
    """Boxed teacher params of the right shapes and axes (restore target only)."""
    return models.init_params(self.teacher_module.config, rng)

  def restore_teacher(self, abstract: PyTree) -> PyTree:
    """The teacher's params from its checkpoint, sharded like `abstract`."""
    logging.info("Restoring the distillation teacher from %s", self.teacher_checkpoint)
    return checkpoints.restore_params(self.teacher_checkpoint, abstract)

  def _teacher_logits(self, teacher_params: PyTree, batch: Batch) -> jax.Array:
    """The teacher's teacher-forced logits [batch, length, vocab], no dropout."""
    logits = models.teacher_forced_logits(self.teacher_module, teacher_params, batch, None)
    return jax.lax.stop_gradient(logits)

  def loss_fn(
    self,
    params: PyTree,
    batch: Batch,
    dropout_rng: jax.Array | None,
    *,
    normalization: tuple[float | jax.Array, jax.Array] | None = None,
    teacher_params: PyTree | None = None,
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The distillation loss, or the plain loss when `teacher_params` is None (eval).

    Returns:
      (loss, metric sums): `loss` is the module docstring's objective; the sums are
      `losses.metric_sums` of the student's own cross-entropy, with `loss` replaced
      by the objective and `distill_kl` (the normalised soft-target KL, before
      alpha * T**2) added.
    """
    if teacher_params is None:
      return super().loss_fn(params, batch, dropout_rng, normalization=normalization)
    factor, weights = normalization or self.loss_normalization(batch)
    logits = self._logits(params, batch, dropout_rng)
    hard, z_loss = self._cross_entropy(logits, batch, weights, factor)
    kl = soft_target_kl(logits, self._teacher_logits(teacher_params, batch), self.temperature)
    soft = jnp.sum(kl * weights) / factor
    loss = self.alpha * self.temperature**2 * soft + (1.0 - self.alpha) * hard
    argmax = registry.select(self.module.config.kernels).argmax
    correct = losses.token_correct(logits, batch["decoder_target_tokens"], argmax)
    sums = losses.metric_sums(correct, batch, weights, hard, z_loss)
    return loss, {**sums, "loss": loss, "distill_kl": soft}

  @staticmethod
  def finalize_metrics(sums: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """`losses.finalize_metrics`, plus `distill_kl` in training."""
    metrics = losses.finalize_metrics(sums)
    if "distill_kl" in sums:
      metrics["distill_kl"] = sums["distill_kl"]
    return metrics


@gin.configurable
def build_distillation_model(
  teacher_checkpoint_path: str = gin.REQUIRED,
  alpha: float = 0.5,
  temperature: float = 2.0,
  config: network.T5Config | None = None,
  vocabulary: seqio.Vocabulary | None = None,
) -> DistillationModel:
  """The student of `models.build_model(config, vocabulary)` distilled from a checkpoint.

  Args:
    teacher_checkpoint_path: the teacher's checkpoint root (newest intact step) or
      step directory; relative to the working directory.
    alpha: weight of the soft-target term in [0, 1].
    temperature: softmax temperature > 0.
    config: the student's network config; default `T5Config()` with its gin bindings.
    vocabulary: the shared vocabulary; default `vocab.get_vocabulary()`.

  Raises:
    ConfigError: alpha or temperature out of range, a decoder-only student or
      teacher, the teacher's vocabulary size differs from the student's, or the
      student's loss is chunked (`EncoderDecoderModel.loss_chunk_length`).
    CheckpointNotFoundError / CorruptCheckpointError: a bad teacher path.
  """
  if not 0.0 <= alpha <= 1.0:
    raise ConfigError(f"build_distillation_model.alpha must be in [0, 1], got {alpha}.")
  if temperature <= 0:
    raise ConfigError(f"build_distillation_model.temperature must be positive, got {temperature}.")
  student = models.build_model(config, vocabulary)
  [(_, step_dir)] = checkpoints.find_steps(teacher_checkpoint_path)
  teacher = teacher_config(step_dir)
  for role, architecture in (
    ("student", student.module.config.architecture),
    ("teacher", teacher.architecture),
  ):
    if architecture != "encoder_decoder":
      raise ConfigError(
        f"Distillation needs encoder-decoder models; the {role} is T5Config.architecture "
        f"{architecture!r}."
      )
  if student.loss_chunk_length:
    raise ConfigError(
      "Distillation compares the student's whole logits with the teacher's; unset "
      f"EncoderDecoderModel.loss_chunk_length (it is {student.loss_chunk_length})."
    )
  if teacher.vocab_size != student.module.config.vocab_size:
    raise ConfigError(
      f"The teacher {teacher_checkpoint_path} has vocab_size {teacher.vocab_size} and the "
      f"student T5Config.vocab_size {student.module.config.vocab_size}; distillation needs "
      "the same vocabulary."
    )
  logging.info("Distilling from %s (%s), alpha %g, T %g", step_dir, teacher, alpha, temperature)
  return DistillationModel(
    student.module,
    student.input_vocabulary,
    student.output_vocabulary,
    teacher_module=models.network_module(teacher),
    teacher_checkpoint=step_dir,
    alpha=alpha,
    temperature=temperature,
    z_loss=student.z_loss,
    label_smoothing=student.label_smoothing,
    loss_normalizing_factor=student.loss_normalizing_factor,
  )
