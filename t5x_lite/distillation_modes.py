"""Distillation beyond one frozen teacher: several teachers, and the student's own EMA.

Both are `distillation.DistillationModel`s (same loss, metrics, evaluation and
checkpoints: the student's params only) whose auxiliary state is something else:

* `MultiTeacherDistillationModel`: a list of frozen teacher checkpoints with weights;
  the soft term is the weighted sum of the per-teacher KLs,

    loss = alpha * T**2 * sum_i w_i * KL(softmax(teacher_i / T) || softmax(student / T))
         + (1 - alpha) * cross_entropy(student, targets),

  so one teacher with weight 1 is exactly `DistillationModel`. The teachers may differ in
  size but share the student's vocabulary (size and, where the checkpoints record it,
  the SentencePiece model).

  A teacher per task of a mixture (`teacher_tasks`): teacher i teaches only the target
  tokens of its tasks, which the batch marks (`train_task_ids`, the feature
  `decoder_task_ids` of `t5x_lite.data.pipeline`). Each token's soft target is then
  the mean KL over the teachers of its task (or, with explicit weights, their weighted
  sum); tokens of a task no teacher names get the hard term alone. Every teacher still
  runs on the whole batch (packing puts several tasks in one row), so a step costs
  what it costs with every teacher teaching every token.
* `SelfDistillationModel`: the teacher is an exponential moving average of the student's
  own params (a "mean teacher"): it starts as a copy of the starting params and after
  every update becomes `decay * teacher + (1 - decay) * params` (`update_aux_state`);
  gradients never reach it. Each checkpoint saves the average beside the student
  (`<step>/aux_state`), so a resumed run continues it exactly. Self-distillation from an
  earlier checkpoint of the student is plain `DistillationModel` with that checkpoint as
  the teacher.

  python -m t5x_lite.train --gin_file=quickstart.gin --gin_file=runs/self_distill.gin
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

import gin
import jax
import jax.numpy as jnp
import seqio
from absl import logging
from etils import epath

from t5x_lite import distillation, models
from t5x_lite.checkpoint import checkpoints, stored_vocabulary
from t5x_lite.core.errors import ConfigError
from t5x_lite.core.types import GIN_REQUIRED, PyTree
from t5x_lite.data import pipeline
from t5x_lite.nn import flops, network

Batch = Mapping[str, jax.Array]


class MultiTeacherDistillationModel(distillation.DistillationModel):
  """A student following the weighted soft targets of several frozen teachers.

  The auxiliary state is the tuple of the teachers' params, in the order of
  `teachers`; training logs `distill_kl` (the soft term) and `distill_kl_<i>` per
  teacher (over the tokens it teaches).

  Args:
    student: the model that trains.
    teachers: the teacher models (any sizes, the student's vocabulary).
    teacher_checkpoints: their step directories, in the same order.
    weights: w_i >= 0 per teacher; None: 1 / (number of teachers), or with
      `teacher_tasks` the mean over the teachers of each token's task.
    alpha: weight of the soft-target term, in [0, 1].
    temperature: softmax temperature T > 0.
    teacher_tasks: per teacher, the seqio tasks whose tokens it teaches; None: every
      teacher teaches every token.
  """

  def __init__(
    self,
    student: models.BaseTransformerModel,
    teachers: Sequence[models.BaseTransformerModel],
    *,
    teacher_checkpoints: Sequence[os.PathLike[str] | str],
    weights: Sequence[float] | None,
    alpha: float,
    temperature: float,
    teacher_tasks: Sequence[Sequence[str]] | None = None,
  ):
    super().__init__(
      student,
      teachers[0],
      teacher_checkpoint=teacher_checkpoints[0],
      alpha=alpha,
      temperature=temperature,
    )
    self.teachers = tuple(teachers)
    self.teacher_checkpoints = tuple(teacher_checkpoints)
    if weights is None and teacher_tasks is None:
      weights = [1.0 / len(self.teachers)] * len(self.teachers)
    self.weights = None if weights is None else tuple(float(w) for w in weights)
    self.teacher_tasks = None
    self.teacher_task_ids: tuple[tuple[int, ...], ...] = ()
    if teacher_tasks is not None:
      self.teacher_tasks = tuple(tuple(tasks) for tasks in teacher_tasks)
      # The batch numbers the tasks 1.. in this order (`decoder_task_ids`).
      self.train_task_ids = tuple(sorted({t for tasks in self.teacher_tasks for t in tasks}))
      self.teacher_task_ids = tuple(
        tuple(self.train_task_ids.index(t) + 1 for t in tasks) for tasks in self.teacher_tasks
      )

  def init_aux_state(self, rng: jax.Array) -> PyTree:
    """Boxed params of every teacher (restore targets only)."""
    return tuple(teacher.init_params(rng) for teacher in self.teachers)

  def start_aux_state(self, abstract: PyTree, params: PyTree) -> PyTree:
    """Every teacher's params from its checkpoint, sharded like `abstract`."""
    del params
    restored = []
    for path, target in zip(self.teacher_checkpoints, abstract):
      logging.info("Restoring a distillation teacher from %s", path)
      restored.append(checkpoints.restore_params(path, target))
    return tuple(restored)

  def train_flops_per_step(self, batch_size: int, input_length: int, target_length: int) -> float:
    """The student's training FLOPs plus every teacher's forward pass."""
    student = self.student.train_flops_per_step(batch_size, input_length, target_length)
    return student + batch_size * sum(
      flops.forward_flops(t.network_config, input_length, target_length) for t in self.teachers
    )

  def soft_term(
    self,
    logits: jax.Array,
    aux_state: PyTree,
    batch: Batch,
    weights: jax.Array,
    factor: float | jax.Array,
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """sum_i w_i * KL_i, each KL_i normalised like the cross-entropy over the tokens
    teacher i teaches; with `teacher_tasks` and no weights, each token's mean KL over its
    task's teachers. The KL_i are the extra sums."""
    per_teacher, kls, masks = {}, [], []
    for i, (teacher, params) in enumerate(zip(self.teachers, aux_state)):
      teacher_logits = jax.lax.stop_gradient(teacher.teacher_forced_logits(params, batch, None))
      kl = distillation.soft_target_kl(logits, teacher_logits, self.temperature)  # [batch, len]
      mask = self._taught_tokens(i, batch, weights.dtype)  # [batch, len] or None
      taught = weights if mask is None else weights * mask
      per_teacher[f"distill_kl_{i}"] = jnp.sum(kl * taught) / factor
      kls.append(kl)
      masks.append(mask)
    if self.weights is None:  # the mean over the teachers of each token's task
      count = sum(masks)  # [batch, len]: how many teachers teach each token
      summed = sum(kl * mask for kl, mask in zip(kls, masks))
      mean = summed / jnp.maximum(count, 1.0)  # [batch, len]; 0 where no teacher
      return jnp.sum(mean * weights) / factor, per_teacher
    terms = [w * per_teacher[f"distill_kl_{i}"] for i, w in enumerate(self.weights)]
    soft = terms[0]  # one teacher: exactly its term, as DistillationModel's
    for term in terms[1:]:
      soft = soft + term
    return soft, per_teacher

  def _taught_tokens(self, teacher: int, batch: Batch, dtype: jnp.dtype) -> jax.Array | None:
    """[batch, length] 1 on the tokens of `teacher`'s tasks, else 0; None: every token."""
    if self.teacher_tasks is None:
      return None
    if pipeline.DECODER_TASK_IDS not in batch:
      raise ValueError(
        f"Per-task teachers need the batch feature {pipeline.DECODER_TASK_IDS!r}: build "
        "the training data with DatasetConfig.task_ids = model.train_task_ids (train does)."
      )
    ids = batch[pipeline.DECODER_TASK_IDS]  # [batch, length]
    return jnp.isin(ids, jnp.asarray(self.teacher_task_ids[teacher])).astype(dtype)


class SelfDistillationModel(distillation.DistillationModel):
  """A student following the soft targets of an exponential moving average of itself.

  Args:
    student: the model that trains (and, with the averaged params, teaches).
    ema_decay: the average's decay in [0, 1]; 1 keeps the starting params as the teacher.
    alpha: weight of the soft-target term, in [0, 1].
    temperature: softmax temperature T > 0.
  """

  checkpoint_aux_state = True  # the average continues across a resume

  def __init__(
    self,
    student: models.BaseTransformerModel,
    *,
    ema_decay: float,
    alpha: float,
    temperature: float,
  ):
    super().__init__(student, student, teacher_checkpoint="", alpha=alpha, temperature=temperature)
    self.ema_decay = ema_decay

  def init_aux_state(self, rng: jax.Array) -> PyTree:
    """Boxed params of the student's shapes and axes: the average."""
    return self.student.init_params(rng)

  def start_aux_state(self, abstract: PyTree, params: PyTree) -> PyTree:
    """A copy of the starting params (its own buffers: the step donates both)."""
    return jax.tree.map(lambda p, a: jax.device_put(jnp.copy(p), a.sharding), params, abstract)

  def update_aux_state(self, aux_state: PyTree, params: PyTree, step: jax.Array) -> PyTree:
    """teacher <- decay * teacher + (1 - decay) * params, leaf by leaf."""
    del step
    decay = self.ema_decay
    return jax.tree.map(
      lambda t, p: (decay * t + (1.0 - decay) * p).astype(t.dtype), aux_state, params
    )


def _same_vocabulary(
  paths: Sequence[str], step_dirs: Sequence[os.PathLike[str] | str], binding: str
) -> None:
  """Raises a ConfigError when two teachers record different SentencePiece models."""
  seen = None
  for i, (path, step_dir) in enumerate(zip(paths, step_dirs)):
    record = stored_vocabulary.recorded(epath.Path(step_dir))
    if record is None:
      continue
    record = (record["sha256"], record["extra_ids"])
    if seen is not None and record != seen[1]:
      raise ConfigError(
        f"{binding}: teachers {seen[0]} ({paths[seen[0]]}) and {i} ({path}) were trained "
        "with different vocabularies; distillation needs the same vocabulary."
      )
    seen = seen or (i, record)


@gin.configurable
def build_multi_teacher_distillation_model(
  teacher_checkpoint_paths: Sequence[str] = GIN_REQUIRED,
  teacher_weights: Sequence[float] | None = None,
  alpha: float = 0.5,
  temperature: float = 2.0,
  config: network.T5Config | None = None,
  vocabulary: seqio.Vocabulary | None = None,
  teacher_tasks: Sequence[str | Sequence[str]] | None = None,
) -> MultiTeacherDistillationModel:
  """The student of `models.build_model(config, vocabulary)` distilled from several teachers.

  Args:
    teacher_checkpoint_paths: the teachers' checkpoint roots or step directories.
    teacher_weights: w_i >= 0 per teacher, not all 0; default equal weights summing to 1
      (with `teacher_tasks`: each token's mean over the teachers of its task).
    alpha: weight of the soft-target term in [0, 1].
    temperature: softmax temperature > 0.
    config: the student's network config; default `T5Config()` with its gin bindings.
    vocabulary: the shared vocabulary; default `vocab.get_vocabulary()`.
    teacher_tasks: per teacher, the registered seqio task (or list of tasks) of the
      training mixture whose tokens it teaches; None: every teacher teaches every token.

  Raises:
    ConfigError: bad alpha, temperature, weights or teacher tasks, no teachers, or a
      teacher of another vocabulary or architecture (each names its binding).
  """
  binding = "build_multi_teacher_distillation_model"
  distillation.check_settings(binding, alpha, temperature)
  paths = (
    [teacher_checkpoint_paths]
    if isinstance(teacher_checkpoint_paths, str)
    else list(teacher_checkpoint_paths)
  )
  if not paths:
    raise ConfigError(f"{binding}.teacher_checkpoint_paths names no teacher.")
  tasks = None if teacher_tasks is None else _teacher_tasks(teacher_tasks, len(paths), binding)
  weights = None if teacher_weights is None else list(teacher_weights)
  if weights is not None:
    _check_weights(weights, len(paths), binding)
  student = distillation.build_student(config, vocabulary)
  loaded = [
    distillation.load_teacher(path, student, f"{binding}.teacher_checkpoint_paths[{i}]")
    for i, path in enumerate(paths)
  ]
  step_dirs = [step_dir for step_dir, _ in loaded]
  _same_vocabulary(paths, step_dirs, f"{binding}.teacher_checkpoint_paths")
  model = MultiTeacherDistillationModel(
    student=student,
    teachers=[teacher for _, teacher in loaded],
    teacher_checkpoints=step_dirs,
    weights=weights,
    alpha=alpha,
    temperature=temperature,
    teacher_tasks=tasks,
  )
  logging.info(
    "Distilling from %d teachers %s, weights %s, alpha %g, T %g",
    len(paths),
    [str(d) for d in step_dirs],
    "the mean over each token's task's teachers" if model.weights is None else model.weights,
    alpha,
    temperature,
  )
  for i, teacher_task_names in enumerate(tasks or ()):
    logging.info("Teacher %d teaches the tokens of %s", i, ", ".join(teacher_task_names))
  return model


def _check_weights(weights: Sequence[float], count: int, binding: str) -> None:
  """Raises a ConfigError unless there are `count` weights, >= 0 and not all 0."""
  if len(weights) != count:
    raise ConfigError(
      f"{binding}.teacher_weights has {len(weights)} weights for {count} "
      f"teacher_checkpoint_paths; give one weight per teacher."
    )
  if any(not w >= 0 for w in weights) or not any(w > 0 for w in weights):
    raise ConfigError(
      f"{binding}.teacher_weights must be >= 0 and not all 0, got {tuple(weights)}."
    )


def _teacher_tasks(
  teacher_tasks: Sequence[str | Sequence[str]], count: int, binding: str
) -> list[tuple[str, ...]]:
  """`teacher_tasks` as one tuple of registered task names per teacher.

  Raises:
    ConfigError: another count than the teachers', an empty entry, or a name that is
      no registered seqio task (listing the closest) or a mixture.
  """
  entries = [teacher_tasks] if isinstance(teacher_tasks, str) else list(teacher_tasks)
  if len(entries) != count:
    raise ConfigError(
      f"{binding}.teacher_tasks has {len(entries)} entries for {count} "
      "teacher_checkpoint_paths; give one task (or list of tasks) per teacher."
    )
  resolved = []
  for i, entry in enumerate(entries):
    names = (entry,) if isinstance(entry, str) else tuple(entry)
    if not names:
      raise ConfigError(f"{binding}.teacher_tasks[{i}] names no task.")
    for name in names:
      try:
        provider = pipeline.get_mixture_or_task(name)  # unknown: lists the closest names
      except ConfigError as e:
        raise ConfigError(f"{binding}.teacher_tasks[{i}]: {e}") from None
      if not isinstance(provider, seqio.Task):
        raise ConfigError(f"{binding}.teacher_tasks[{i}]: {name!r} is a mixture; name its tasks.")
    resolved.append(names)
  return resolved


@gin.configurable
def build_self_distillation_model(
  ema_decay: float = 0.99,
  alpha: float = 0.5,
  temperature: float = 2.0,
  config: network.T5Config | None = None,
  vocabulary: seqio.Vocabulary | None = None,
) -> SelfDistillationModel:
  """The student of `models.build_model(config, vocabulary)` taught by its own EMA.

  Args:
    ema_decay: the average's decay in [0, 1].
    alpha: weight of the soft-target term in [0, 1].
    temperature: softmax temperature > 0.
    config: the student's network config; default `T5Config()` with its gin bindings.
    vocabulary: the vocabulary; default `vocab.get_vocabulary()`.

  Raises:
    ConfigError: ema_decay, alpha or temperature out of range, or a student
      distillation cannot train (see `distillation.build_student`).
  """
  binding = "build_self_distillation_model"
  distillation.check_settings(binding, alpha, temperature)
  if not 0.0 <= ema_decay <= 1.0:
    raise ConfigError(f"{binding}.ema_decay must be in [0, 1], got {ema_decay}.")
  student = distillation.build_student(config, vocabulary)
  logging.info("Self-distillation: EMA decay %g, alpha %g, T %g", ema_decay, alpha, temperature)
  return SelfDistillationModel(
    student=student, ema_decay=ema_decay, alpha=alpha, temperature=temperature
  )
