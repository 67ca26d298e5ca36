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
free): `build_distillation_model` builds its model from the config the checkpoint
stores. Its parameters are the `DistillationModel`'s auxiliary state
(`t5x_lite.base_model`; `TrainState.aux_state`), sharded by their logical axes like the
student's, and its forward pass runs inside the same jitted train step; `jax.grad`
differentiates the student's parameters only (and the teacher's logits pass through
`stop_gradient`), so the teacher gets no gradients, no optimizer state and no checkpoint
of its own: a resumed run restores it again from its path.

Evaluation (`eval_fn`, the periodic eval loss) reports the student's plain
cross-entropy, comparable with runs without a teacher.

  python -m t5x_lite.train --gin_file=<student training config> \\
    --gin_file=runs/distill.gin --gin.TEACHER_CHECKPOINT_PATH=./runs/teacher
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Mapping

import gin
import jax
import jax.numpy as jnp
from absl import logging
from etils import epath

from t5x_lite import base_model, models
from t5x_lite.nn import flops, losses, network
from t5x_lite.checkpoint import checkpoints
from t5x_lite.core.errors import ConfigError
from t5x_lite.core.types import GIN_REQUIRED, PyTree

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


def teacher_config(step_dir: epath.Path) -> network.T5Config:
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


class DistillationModel(base_model.DelegatingModel):
  """A student model whose training loss follows a frozen teacher model's soft targets.

  The student is what trains, evaluates, scores, predicts and is saved; the teacher's
  params are this model's auxiliary state (`base_model.BaseModel`): restored from
  `teacher_checkpoint` at every start, read by `loss_fn`, never updated or saved.

  Args:
    student: the model that trains.
    teacher: the model whose logits the student follows (any size, same vocabulary).
    teacher_checkpoint: the teacher's step directory (restored by `start_aux_state`).
    alpha: weight of the soft-target term, in [0, 1]; 0 trains on the targets only.
    temperature: softmax temperature T > 0 of both distributions in the soft term.
  """

  def __init__(
    self,
    student: models.BaseTransformerModel,
    teacher: models.BaseTransformerModel,
    *,
    teacher_checkpoint: os.PathLike[str] | str,
    alpha: float,
    temperature: float,
  ):
    super().__init__(student)
    self.student = student
    self.teacher = teacher
    self.teacher_checkpoint = teacher_checkpoint
    self.alpha = alpha
    self.temperature = temperature

  def init_params(self, rng: jax.Array) -> PyTree:
    """The student's boxed initial params."""
    return self.student.init_params(rng)

  def init_aux_state(self, rng: jax.Array) -> PyTree:
    """Boxed teacher params of the right shapes and axes (restore target only)."""
    return self.teacher.init_params(rng)

  def start_aux_state(self, abstract: PyTree, params: PyTree) -> PyTree:
    """The teacher's params from its checkpoint, sharded like `abstract`."""
    del params
    logging.info("Restoring the distillation teacher from %s", self.teacher_checkpoint)
    return checkpoints.restore_params(self.teacher_checkpoint, abstract)

  def train_flops_per_step(self, batch_size: int, input_length: int, target_length: int) -> float:
    """The student's training FLOPs plus the teacher's forward passes."""
    teacher = flops.forward_flops(self.teacher.network_config, input_length, target_length)
    student = self.student.train_flops_per_step(batch_size, input_length, target_length)
    return student + teacher * batch_size

  def teacher_logits(self, teacher_params: PyTree, batch: Batch) -> jax.Array:
    """The teacher's teacher-forced logits [batch, length, vocab], no dropout, no gradient."""
    logits = self.teacher.teacher_forced_logits(teacher_params, batch, None)
    return jax.lax.stop_gradient(logits)

  def loss_fn(
    self,
    params: PyTree,
    batch: Batch,
    dropout_rng: jax.Array | None,
    *,
    normalization: base_model.Normalization | None = None,
    aux_state: PyTree = None,
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The distillation loss against the teacher params `aux_state`, or the student's
    plain loss when `aux_state` is None (evaluation).

    Returns:
      (loss, metric sums): `loss` is the module docstring's objective; the sums are
      `losses.metric_sums` of the student's own cross-entropy, with `loss` replaced
      by the objective and `distill_kl` (the normalised soft-target KL, before
      alpha * T**2) added.
    """
    student = self.student
    if aux_state is None:
      return student.loss_fn(params, batch, dropout_rng, normalization=normalization)
    factor, weights = normalization or student.loss_normalization(batch)
    logits = student.teacher_forced_logits(params, batch, dropout_rng)
    hard, z_loss = student.cross_entropy(logits, batch, weights, factor)
    soft, soft_sums = self.soft_term(logits, aux_state, batch, weights, factor)
    loss = self.alpha * self.temperature**2 * soft + (1.0 - self.alpha) * hard
    correct = student.token_correct(logits, batch["decoder_target_tokens"])
    sums = losses.metric_sums(correct, batch, weights, hard, z_loss)
    return loss, {**sums, **soft_sums, "loss": loss, "distill_kl": soft}

  def soft_term(
    self,
    logits: jax.Array,
    aux_state: PyTree,
    batch: Batch,
    weights: jax.Array,
    factor: float | jax.Array,
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The normalised soft-target KL against the teacher(s) in `aux_state`.

    Args:
      logits: the student's [batch, length, vocab].
      aux_state: this model's auxiliary state (the teacher's params).
      batch: the features.
      weights: [batch, length] loss weights.
      factor: the loss normalising factor.

    Returns:
      (KL summed over weighted tokens / factor, extra metric sums: none here).
    """
    kl = soft_target_kl(logits, self.teacher_logits(aux_state, batch), self.temperature)
    return jnp.sum(kl * weights) / factor, {}

  def finalize_metrics(self, sums: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """The student's metrics, plus `distill_kl` (and any `distill_kl_*`) in training."""
    metrics = self.student.finalize_metrics(sums)
    metrics.update({name: value for name, value in sums.items() if name.startswith("distill_kl")})
    return metrics


def check_settings(binding: str, alpha: float, temperature: float) -> None:
  """Raises a ConfigError naming `binding.alpha` / `binding.temperature` when out of range."""
  if not 0.0 <= alpha <= 1.0:
    raise ConfigError(f"{binding}.alpha must be in [0, 1], got {alpha}.")
  if temperature <= 0:
    raise ConfigError(f"{binding}.temperature must be positive, got {temperature}.")


def check_architecture(role: str, config: network.T5Config) -> None:
  """Raises a ConfigError unless `config` is an encoder-decoder (`role`: who it is)."""
  if config.architecture != "encoder_decoder":
    raise ConfigError(
      f"Distillation needs encoder-decoder models; the {role} is T5Config.architecture "
      f"{config.architecture!r}."
    )


def build_student(
  config: network.T5Config | None, vocabulary: seqio.Vocabulary | None
) -> models.EncoderDecoderModel:
  """`models.build_model(config, vocabulary)`, checked for distillation.

  Raises:
    ConfigError: a decoder-only student, or a chunked loss
      (`EncoderDecoderModel.loss_chunk_length`).
  """
  student = models.build_model(config, vocabulary)
  check_architecture("student", student.network_config)
  assert isinstance(student, models.EncoderDecoderModel)  # the architecture's model
  if student.loss_chunk_length:
    raise ConfigError(
      "Distillation compares the student's whole logits with the teacher's; unset "
      f"EncoderDecoderModel.loss_chunk_length (it is {student.loss_chunk_length})."
    )
  return student


def load_teacher(
  path: str, student: models.EncoderDecoderModel, binding: str
) -> tuple[epath.Path, models.EncoderDecoderModel]:
  """The teacher checkpoint's step directory and its model over the student's vocabulary.

  Args:
    path: checkpoint root (newest intact step) or step directory.
    student: the student (its vocabulary size must be the teacher's).
    binding: the gin binding that named `path`, for error messages.

  Raises:
    ConfigError: a decoder-only teacher, another vocabulary size, or another recorded
      vocabulary (`checkpoints.check_vocabulary`).
    CheckpointNotFoundError / CorruptCheckpointError: a bad path.
  """
  [(_, step_dir)] = checkpoints.find_steps(path)
  config = teacher_config(step_dir)
  check_architecture("teacher", config)
  if config.vocab_size != student.network_config.vocab_size:
    raise ConfigError(
      f"The teacher {path} ({binding}) has vocab_size {config.vocab_size} and the "
      f"student T5Config.vocab_size {student.network_config.vocab_size}; distillation needs "
      "the same vocabulary."
    )
  try:
    checkpoints.check_vocabulary(step_dir, student.output_vocabulary)
  except ConfigError as e:
    raise ConfigError(f"The teacher {path} ({binding}): {e}") from e
  teacher = models.EncoderDecoderModel(
    module=models.network_module(config),
    input_vocabulary=student.input_vocabulary,
    output_vocabulary=student.output_vocabulary,
  )
  return step_dir, teacher


@gin.configurable
def build_distillation_model(
  teacher_checkpoint_path: str = GIN_REQUIRED,
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
  check_settings("build_distillation_model", alpha, temperature)
  student = build_student(config, vocabulary)
  step_dir, teacher = load_teacher(
    teacher_checkpoint_path, student, "build_distillation_model.teacher_checkpoint_path"
  )
  logging.info(
    "Distilling from %s (%s), alpha %g, T %g", step_dir, teacher.network_config, alpha, temperature
  )
  return DistillationModel(
    student=student,
    teacher=teacher,
    teacher_checkpoint=step_dir,
    alpha=alpha,
    temperature=temperature,
  )
