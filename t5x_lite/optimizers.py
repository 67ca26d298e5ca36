"""Optax optimizers and learning-rate schedules, gin-configurable.

Factories return an `Optimizer`: an optax `GradientTransformation` (`tx`) together with
its learning-rate `schedule`, so the trainer can report the learning rate of each step
without reading it back from the optimizer state.

Adafactor follows T5's defaults (T5X `adafactor.Adafactor` / Mesh TensorFlow):
factored second moments for parameters whose two largest dims are >= 128, second-moment
decay `1 - t**-0.8` with t = step + 1 (optax's `_decay_rate_pow`), update clipping at
block RMS 1.0, updates scaled by max(RMS(param), 1e-3), no momentum, epsilon 1e-30 added
to squared gradients, no weight decay.

Sharding of the optimizer state (done by `trainer.opt_state_shardings`): optax keeps
per-parameter statistics in sub-trees with exactly the parameter tree's structure
(Adafactor's `v_row`, `v_col`, `v`; Adam's `mu`, `nu`). A leaf in such a sub-tree whose
shape equals its parameter's shape shards like that parameter; every other leaf (the
factored row/column vectors, (1,) placeholders, step counts) is replicated — they are
O(rows + cols) per matrix, negligible next to the parameters.
"""

import dataclasses
from typing import Any, Callable, Union

import gin
import jax
import jax.numpy as jnp
import optax

Schedule = Callable[[jax.Array], jax.Array]
ScalarOrSchedule = Union[float, Schedule]


@dataclasses.dataclass(frozen=True)
class Optimizer:
  """An optax transformation plus the learning-rate schedule it applies.

  Attributes:
    tx: the optax GradientTransformation (init/update as usual).
    schedule: step -> learning rate, the same schedule `tx` uses.
  """

  tx: optax.GradientTransformation
  schedule: Schedule

  def init(self, params: Any) -> optax.OptState:
    """Initial optimizer state for `params`."""
    return self.tx.init(params)

  def update(
    self, grads: Any, state: optax.OptState, params: Any = None
  ) -> tuple[Any, optax.OptState]:
    """Returns (updates, new_state); add updates to params with `optax.apply_updates`."""
    return self.tx.update(grads, state, params)

  def learning_rate(self, step: jax.Array) -> jax.Array:
    """The learning rate applied by the update at optimizer step `step`."""
    return jnp.asarray(self.schedule(step), jnp.float32)


def _as_schedule(learning_rate: ScalarOrSchedule) -> Schedule:
  if callable(learning_rate):
    return learning_rate
  return optax.constant_schedule(float(learning_rate))


def _with_clipping(
  tx: optax.GradientTransformation, clip_grad_norm: float | None
) -> optax.GradientTransformation:
  if clip_grad_norm is None:
    return tx
  return optax.chain(optax.clip_by_global_norm(clip_grad_norm), tx)


@gin.configurable
def rsqrt_with_warmup(base: float = 1.0, warmup_steps: int = 10000) -> Schedule:
  """T5's inverse-square-root schedule: `base / sqrt(max(step, warmup_steps))`.

  Constant at `base / sqrt(warmup_steps)` for the first `warmup_steps` steps.

  Args:
    base: multiplier (T5 uses 1.0).
    warmup_steps: steps of constant learning rate before the decay.

  Returns:
    A schedule step -> learning rate.
  """

  def schedule(step: jax.Array) -> jax.Array:
    step = jnp.asarray(step, jnp.float32)
    return base / jnp.sqrt(jnp.maximum(step, float(warmup_steps)))

  return schedule


@gin.configurable
def constant(value: float = 1e-3) -> Schedule:
  """A constant learning rate.

  Args:
    value: the learning rate.

  Returns:
    A schedule step -> value.
  """
  return optax.constant_schedule(value)


@gin.configurable
def warmup_cosine(
  peak_value: float = 1e-3,
  warmup_steps: int = 1000,
  decay_steps: int = gin.REQUIRED,
  init_value: float = 0.0,
  end_value: float = 0.0,
) -> Schedule:
  """Linear warmup from `init_value` to `peak_value`, then cosine decay to `end_value`.

  Args:
    peak_value: learning rate reached at the end of warmup.
    warmup_steps: length of the linear warmup.
    decay_steps: total steps, warmup included, at which `end_value` is reached.
    init_value: learning rate at step 0.
    end_value: final learning rate.

  Returns:
    A schedule step -> learning rate.
  """
  return optax.warmup_cosine_decay_schedule(
    init_value=init_value,
    peak_value=peak_value,
    warmup_steps=warmup_steps,
    decay_steps=decay_steps,
    end_value=end_value,
  )


@gin.configurable
def adafactor(
  learning_rate: ScalarOrSchedule = gin.REQUIRED,
  min_dim_size_to_factor: int = 128,
  decay_rate: float = 0.8,
  decay_offset: int = 0,
  multiply_by_parameter_scale: bool = True,
  clipping_threshold: float | None = 1.0,
  momentum: float | None = None,
  weight_decay_rate: float | None = None,
  epsilon: float = 1e-30,
  factored: bool = True,
  clip_grad_norm: float | None = None,
) -> Optimizer:
  """Adafactor with T5 defaults (see module docstring).

  Args:
    learning_rate: a float or a schedule (e.g. `rsqrt_with_warmup()`).
    min_dim_size_to_factor: factor second moments only if the two largest dims are
      at least this big.
    decay_rate: second-moment decay exponent: beta2_t = 1 - (t)**-decay_rate.
    decay_offset: step offset for the decay (fine-tuning from a pretrained state).
    multiply_by_parameter_scale: scale updates by max(RMS(param), 1e-3).
    clipping_threshold: clip each update to this block RMS (None: off).
    momentum: first-moment decay (None: no momentum, as in T5).
    weight_decay_rate: decoupled weight decay (None: off).
    epsilon: added to squared gradients.
    factored: use factored second moments.
    clip_grad_norm: clip gradients to this global norm first (None: off).

  Returns:
    An `Optimizer`.
  """
  schedule = _as_schedule(learning_rate)
  tx = optax.adafactor(
    learning_rate=schedule,
    min_dim_size_to_factor=min_dim_size_to_factor,
    decay_rate=decay_rate,
    decay_offset=decay_offset,
    multiply_by_parameter_scale=multiply_by_parameter_scale,
    clipping_threshold=clipping_threshold,
    momentum=momentum,
    weight_decay_rate=weight_decay_rate,
    eps=epsilon,
    factored=factored,
  )
  return Optimizer(tx=_with_clipping(tx, clip_grad_norm), schedule=schedule)


@gin.configurable
def adamw(
  learning_rate: ScalarOrSchedule = gin.REQUIRED,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  weight_decay: float = 1e-4,
  clip_grad_norm: float | None = None,
) -> Optimizer:
  """AdamW (decoupled weight decay), optionally with global-norm clipping.

  Args:
    learning_rate: a float or a schedule.
    b1: first-moment decay.
    b2: second-moment decay.
    eps: added to the root of the second moment.
    weight_decay: decoupled weight-decay coefficient.
    clip_grad_norm: clip gradients to this global norm first (None: off).

  Returns:
    An `Optimizer`.
  """
  schedule = _as_schedule(learning_rate)
  tx = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
  return Optimizer(tx=_with_clipping(tx, clip_grad_norm), schedule=schedule)
