"""Optax optimizers and learning-rate schedules, gin-configurable.

Factories return an `Optimizer`: an optax `GradientTransformation` (`tx`) together with
its learning-rate `schedule`, so the trainer can report the learning rate of each step
without reading it back from the optimizer state.

Adafactor follows T5's defaults and T5X's `adafactor.Adafactor` with its standard
logical factor rules: second-moment decay `1 - t**-0.8` with t = step + 1, update
clipping at block RMS 1.0, updates scaled by max(RMS(param), 1e-3), no momentum,
epsilon 1e-30 added to squared gradients, no weight decay. Second moments are factored
as T5X factors them, by the parameters' logical axes (`FACTOR_RULES`): a parameter of
rank 3 or more is split into row axes ('embed') and column axes ('heads', 'kv', 'mlp',
'vocab'), so an attention kernel [embed, heads, kv] keeps a row vector [embed] and a
column matrix [heads, kv] instead of a full [embed, heads, kv] second moment; a
parameter of rank 1 or 2 falls back to factoring its two largest dims when both are >=
`min_dim_size_to_factor` (128). A 'layers' axis (scanned layers) is a batch axis:
statistics, clipping and parameter scale are computed per layer, as for unscanned
layers. The logical axes reach the optimizer through `Optimizer.with_param_axes`
(`t5x_lite.training.trainer` calls it with `EncoderDecoderModel.param_axes()`); without them
every parameter uses the rank-1/2 rule and higher ranks stay unfactored. The
factoring itself is `t5x_lite.training.factored_moments`.

Sharding of the optimizer state (done by `trainer.opt_state_shardings`): optax keeps
per-parameter statistics in sub-trees with exactly the parameter tree's structure
(Adafactor's `v_row`, `v_col`, `v`; Adam's `mu`, `nu`). A leaf in such a sub-tree whose
shape equals its parameter's shape shards like that parameter; every other leaf (the
factored row/column vectors, (1,) placeholders, step counts) is replicated — they are
O(rows + cols) per matrix, negligible next to the parameters.
"""

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any, Callable, TypeAlias

import gin
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np
import optax

from t5x_lite.core.errors import ConfigError
from t5x_lite.core.types import GIN_REQUIRED
from t5x_lite.training.factored_moments import (
  FACTOR_RULES,
  Factoring,
  factoring,
  scale_by_factored_rms,
)

# optax's: a step -> learning rate function; a learning rate or such a function.
Schedule: TypeAlias = optax.Schedule
ScalarOrSchedule: TypeAlias = optax.ScalarOrSchedule


@dataclasses.dataclass(frozen=True)
class Optimizer:
  """An optax transformation plus the learning-rate schedule it applies.

  Attributes:
    tx: the optax GradientTransformation (init/update as usual).
    schedule: step -> learning rate, the same schedule `tx` uses.
  """

  tx: optax.GradientTransformation
  schedule: Schedule
  # param_axes -> tx, for optimizers whose update depends on logical axes (Adafactor).
  build: Callable[[Any], optax.GradientTransformation] | None = None
  # Regular expressions over parameter paths that train; None: all (`with_trainable`).
  trainable: tuple[str, ...] | None = None
  # Steps between unfreezing one more block per stack; None: off (`with_gradual_unfreezing`).
  unfreeze_every: int | None = None

  def with_gradual_unfreezing(self, every_steps: int | None) -> "Optimizer":
    """This optimizer with the T5 paper's gradual unfreezing (section 3.5.1).

    Encoder and decoder blocks unfreeze from the top, both stacks in parallel: at step
    s the top `1 + s // every_steps` blocks of each stack train, the others get zero
    updates. Parameters outside the blocks (embeddings, output projection, final
    norms, relative position biases) train throughout, as in the paper, where the
    shared embedding and output matrices are updated from the start.

    Raises:
      ConfigError: if `every_steps` is not positive.
    """
    if every_steps is not None and every_steps < 1:
      raise ConfigError(f"Gradual unfreezing needs a positive step count, got {every_steps}.")
    return dataclasses.replace(self, unfreeze_every=every_steps)

  def with_trainable(self, patterns: Sequence[str] | None) -> "Optimizer":
    """This optimizer updating only parameters whose path fully matches a pattern.

    Paths join the parameter tree's keys with '/', e.g.
    'encoder/layers_0/attention/query/kernel'. The other parameters are frozen: their
    updates are zero (they stay bitwise unchanged) and they get no optimizer state.

    Args:
      patterns: regular expressions (`re.fullmatch`); None trains everything.

    Raises:
      ConfigError: naming a pattern that is not a regular expression.
    """
    if patterns is None:
      return dataclasses.replace(self, trainable=None)
    if isinstance(patterns, str):
      patterns = [patterns]
    for pattern in patterns:
      try:
        re.compile(pattern)
      except re.error as e:
        raise ConfigError(f"Trainable-parameter pattern {pattern!r} is not a regex: {e}") from e
    return dataclasses.replace(self, trainable=tuple(patterns))

  def _transform(self) -> optax.GradientTransformation:
    """`tx`, with frozen parameters masked out (`trainable`, `unfreeze_every`)."""
    tx = self.tx
    if self.trainable is not None:
      patterns = self.trainable

      def labels(params: Any) -> Any:
        return jax.tree_util.tree_map_with_path(
          lambda path, _: "train" if is_trainable(param_path(path), patterns) else "freeze",
          params,
        )

      tx = optax.multi_transform({"train": tx, "freeze": optax.set_to_zero()}, labels)
    if self.unfreeze_every is not None:
      tx = optax.chain(tx, unfreeze_top_down(self.unfreeze_every))
    return tx

  def with_param_axes(self, param_axes: Any) -> "Optimizer":
    """This optimizer for parameters with these logical axes.

    Args:
      param_axes: the params' tree with a tuple of logical axis names per leaf
        (e.g. a `PartitionSpec` from `EncoderDecoderModel.param_axes()`).

    Returns:
      An optimizer whose `tx` uses the axes (Adafactor's factoring); `self` when
      the optimizer does not depend on them.
    """
    if self.build is None:
      return self
    return dataclasses.replace(self, tx=self.build(param_axes), build=None)

  def init(self, params: Any) -> optax.OptState:
    """Initial optimizer state for `params`."""
    return self._transform().init(params)

  def update(
    self, grads: Any, state: optax.OptState, params: Any = None
  ) -> tuple[Any, optax.OptState]:
    """Returns (updates, new_state); add updates to params with `optax.apply_updates`."""
    return self._transform().update(grads, state, params)

  def learning_rate(self, step: jax.Array) -> jax.Array:
    """The learning rate applied by the update at optimizer step `step`."""
    return jnp.asarray(self.schedule(step), jnp.float32)


def param_path(path: Sequence[Any]) -> str:
  """'encoder/layers_0/attention/query/kernel' from a pytree key path."""
  return "/".join(str(getattr(key, "key", getattr(key, "name", key))) for key in path)


def is_trainable(path: str, patterns: Sequence[str] | None) -> bool:
  """Whether a parameter path fully matches one of `patterns` (None: everything trains)."""
  return patterns is None or any(re.fullmatch(pattern, path) for pattern in patterns)


def trainable_counts(params: Any, patterns: Sequence[str] | None) -> tuple[int, int]:
  """(trainable, total) parameter counts of a params tree (arrays or ShapeDtypeStructs).

  Raises:
    ConfigError: naming a pattern that matches no parameter.
  """
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  paths = [(param_path(path), int(np.prod(leaf.shape))) for path, leaf in leaves]
  for pattern in patterns or ():
    if not any(re.fullmatch(pattern, path) for path, _ in paths):
      raise ConfigError(
        f"Trainable-parameter pattern {pattern!r} matches no parameter; paths look like "
        f"{paths[0][0]!r} (the full path must match)."
      )
  trainable = sum(size for path, size in paths if is_trainable(path, patterns))
  return trainable, sum(size for _, size in paths)


_BLOCK = re.compile(r"(encoder|decoder)/layers_(\d+)/")
_SCANNED_BLOCKS = re.compile(r"(encoder|decoder)/layers/")


def unfreeze_top_down(every_steps: int) -> optax.GradientTransformation:
  """Zeroes the updates of blocks not yet unfrozen (see `Optimizer.with_gradual_unfreezing`).

  Blocks are `<stack>/layers_<i>/...` parameters, or index i of the leading 'layers'
  axis of scanned `<stack>/layers/...` parameters; a stack of L blocks trains block i
  from step (L - 1 - i) * every_steps.
  """

  def init(params: Any) -> optax.ScaleByScheduleState:
    del params
    return optax.ScaleByScheduleState(count=jnp.zeros((), jnp.int32))

  def update(updates: Any, state: optax.ScaleByScheduleState, params: Any = None):
    del params
    # Blocks per stack, from the top. (optax types count as any ArrayLike, complex
    # included, which has no //.)
    unfrozen = 1 + state.count // every_steps  # pyright: ignore[reportOperatorIssue]
    paths = [param_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(updates)[0]]
    depth: dict[str, int] = {}
    for path in paths:
      if match := _BLOCK.match(path):
        depth[match[1]] = max(depth.get(match[1], 0), int(match[2]) + 1)

    def mask(path: Any, update: jax.Array) -> jax.Array:
      name = param_path(path)
      if match := _BLOCK.match(name):
        trains = int(match[2]) >= depth[match[1]] - unfrozen
        return jnp.where(trains, update, jnp.zeros_like(update))
      if _SCANNED_BLOCKS.match(name):
        layers = update.shape[0]
        trains = jnp.arange(layers) >= layers - unfrozen  # [layers]
        trains = trains.reshape((layers,) + (1,) * (update.ndim - 1))
        return jnp.where(trains, update, jnp.zeros_like(update))
      return update

    masked = jax.tree_util.tree_map_with_path(mask, updates)
    return masked, optax.ScaleByScheduleState(count=state.count + 1)

  # (optax's protocol takes any OptState as the state, so no update fn types its own.)
  return optax.GradientTransformation(init, update)  # pyright: ignore[reportArgumentType]


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

  def schedule(step: ArrayLike) -> jax.Array:
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
  decay_steps: int = GIN_REQUIRED,
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

  Raises:
    ConfigError: if the warm-up is longer than the whole schedule.
  """
  if warmup_steps > decay_steps:
    raise ConfigError(
      f"warmup_cosine.warmup_steps ({warmup_steps}) is longer than warmup_cosine.decay_steps "
      f"({decay_steps}, the run's length in the recipes): set WARMUP_STEPS at most TRAIN_STEPS."
    )
  if warmup_steps == decay_steps:  # all warm-up: optax refuses a cosine of no steps
    return optax.linear_schedule(init_value, peak_value, warmup_steps)
  return optax.warmup_cosine_decay_schedule(
    init_value=init_value,
    peak_value=peak_value,
    warmup_steps=warmup_steps,
    decay_steps=decay_steps,
    end_value=end_value,
  )


@gin.configurable
def adafactor(
  learning_rate: ScalarOrSchedule = GIN_REQUIRED,
  min_dim_size_to_factor: int = 128,
  decay_rate: float = 0.8,
  decay_offset: int = 0,
  multiply_by_parameter_scale: bool = True,
  clipping_threshold: float | None = 1.0,
  momentum: float | None = None,
  weight_decay_rate: float | None = None,
  epsilon: float = 1e-30,
  factored: bool = True,
  factor_rules: Mapping[str, str] = FACTOR_RULES,
  clip_grad_norm: float | None = None,
) -> Optimizer:
  """Adafactor with T5 defaults, factored as T5X factors it (see module docstring).

  Args:
    learning_rate: a float or a schedule (e.g. `rsqrt_with_warmup()`).
    min_dim_size_to_factor: a rank-1/2 parameter is factored only if its two largest
      dims are at least this big.
    decay_rate: second-moment decay exponent: beta2_t = 1 - (t)**-decay_rate.
    decay_offset: step offset for the decay (fine-tuning from a pretrained state).
    multiply_by_parameter_scale: scale updates by max(RMS(param), 1e-3).
    clipping_threshold: clip each update to this block RMS (None: off).
    momentum: first-moment decay (None: no momentum, as in T5).
    weight_decay_rate: decoupled weight decay (None: off).
    epsilon: added to squared gradients.
    factored: use factored second moments (False: full second moments everywhere).
    factor_rules: logical axis name -> 'row', 'column', 'batch' or 'none'
      (default T5X's standard rules, `FACTOR_RULES`).
    clip_grad_norm: clip gradients to this global norm first (None: off).

  Returns:
    An `Optimizer`; `with_param_axes` gives it the parameters' logical axes.
  """
  schedule = _as_schedule(learning_rate)

  def build(param_axes: Any) -> optax.GradientTransformation:
    # By path, so a tree with frozen (masked) parameters finds the same axes.
    axes_of = {
      param_path(path): tuple(axes)
      for path, axes in jax.tree_util.tree_flatten_with_path(
        param_axes, is_leaf=lambda x: isinstance(x, tuple)
      )[0]
    }

    def plan(params: Any) -> Any:
      def one(path: Any, p: Any) -> Factoring:
        if not factored:
          return Factoring(tuple(range(p.ndim)), (), ())
        return factoring(p.shape, axes_of.get(param_path(path)), min_dim_size_to_factor, rules)

      return jax.tree_util.tree_map_with_path(one, params)

    rules = dict(factor_rules)
    tx = [
      scale_by_factored_rms(
        plan, decay_rate, decay_offset, epsilon, clipping_threshold, multiply_by_parameter_scale
      ),
      optax.scale_by_learning_rate(schedule, flip_sign=False),
    ]
    if momentum is not None:
      tx.append(optax.ema(momentum, debias=False))
    if weight_decay_rate is not None:
      tx.append(optax.add_decayed_weights(weight_decay_rate))
    tx.append(optax.scale(-1))
    return _with_clipping(optax.chain(*tx), clip_grad_norm)

  return Optimizer(tx=build(None), schedule=schedule, build=build)


@gin.configurable
def adamw(
  learning_rate: ScalarOrSchedule = GIN_REQUIRED,
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
