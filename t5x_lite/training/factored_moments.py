"""Adafactor's factored second moments as T5X computes them, by logical axes.

T5X (`t5x.adafactor` with `standard_logical_factor_rules`) decides per parameter
which dims form the rows and which the columns of its factored second moment from
the parameter's logical axis names (`FACTOR_RULES`), where optax's Adafactor only
looks at the two largest dims and so leaves 3-D attention kernels unfactored.
`factoring` makes that decision; `scale_by_factored_rms` is the update before the
learning rate (second-moment estimate, update clipping, parameter scale), which
`t5x_lite.training.optimizers.adafactor` chains with the schedule.
"""

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from t5x_lite.core.errors import ConfigError

# T5X's standard logical factor rules (`t5x.adafactor.standard_logical_factor_rules`).
ROW, COLUMN, BATCH, NONE = "row", "column", "batch", "none"
FACTOR_RULES: Mapping[str, str] = {
  "vocab": COLUMN,
  "embed": ROW,
  "mlp": COLUMN,
  "heads": COLUMN,
  "kv": COLUMN,
  "relpos_buckets": NONE,
  "layers": BATCH,
}


class Factoring(NamedTuple):
  """How Adafactor treats one parameter.

  Attributes:
    averaging_dims: dims that the RMS of clipping and parameter scale averages over
      (all but batch dims).
    rows: row dims of a factored second moment (empty: not factored).
    cols: column dims.
  """

  averaging_dims: tuple[int, ...]
  rows: tuple[int, ...]
  cols: tuple[int, ...]

  @property
  def factored(self) -> bool:
    return bool(self.rows) and bool(self.cols)


def factoring(
  shape: tuple[int, ...],
  axes: tuple[str | None, ...] | None,
  min_dim_size_to_factor: int = 128,
  rules: Mapping[str, str] = FACTOR_RULES,
) -> Factoring:
  """T5X's factoring of one parameter from its shape and logical axes.

  Rank <= 2 without a batch axis (or without axes): the two largest dims, when the
  smaller of them is >= `min_dim_size_to_factor` (T5X's heuristic). Otherwise the
  axes' rules: ROW dims against COLUMN dims, BATCH dims kept apart, NONE dims averaged.

  Raises:
    ConfigError: for a logical axis name missing from `rules`.
  """
  ndim = len(shape)
  everything = tuple(range(ndim))
  if axes is not None and len(axes) == ndim:
    unknown = [name for name in axes if name not in rules]
    if unknown:
      raise ConfigError(
        f"Adafactor has no factor rule for logical axis {unknown[0]!r} (of a parameter "
        f"shaped {shape}); known axes: {sorted(rules)}."
      )
    kinds = [rules[name] for name in axes if name is not None]  # none is None: checked above
    batch = tuple(d for d in everything if kinds[d] == BATCH)
    if ndim > 2 or batch:
      rows = tuple(d for d in everything if kinds[d] == ROW)
      cols = tuple(d for d in everything if kinds[d] == COLUMN)
      averaging = tuple(d for d in everything if d not in batch)
      return Factoring(averaging, rows, cols) if rows and cols else Factoring(averaging, (), ())
  if ndim < 2 or (ndim > 2 and axes is None):
    return Factoring(everything, (), ())
  by_size = np.argsort(shape, kind="stable")
  if shape[by_size[-2]] < min_dim_size_to_factor:
    return Factoring(everything, (), ())
  return Factoring(everything, (int(by_size[-2]),), (int(by_size[-1]),))


class FactoredRmsState(NamedTuple):
  """Adafactor statistics; unused entries of a parameter are (1,) placeholders.

  Attributes:
    count: number of updates so far (int32).
    v_row: params-shaped tree: EMA of squared gradients averaged over column dims.
    v_col: the same averaged over row dims.
    v: the full EMA for unfactored parameters.
  """

  count: jax.Array
  v_row: Any
  v_col: Any
  v: Any


def scale_by_factored_rms(
  factorings: Any,
  decay_rate: float,
  decay_offset: int,
  epsilon: float,
  clipping_threshold: float | None,
  multiply_by_parameter_scale: bool,
) -> optax.GradientTransformation:
  """T5X's Adafactor update before the learning rate: y = g / sqrt(v), clipped, scaled.

  Args:
    factorings: params-shaped tree of `Factoring` (or a callable params -> that tree).
    decay_rate: second-moment decay exponent (beta2_t = 1 - t**-decay_rate).
    decay_offset: step offset of the decay.
    epsilon: added to squared gradients.
    clipping_threshold: clip each parameter's update to this RMS (None: off).
    multiply_by_parameter_scale: multiply by max(RMS(param), 1e-3).
  """

  def resolve(params: Any) -> Any:
    return factorings(params) if callable(factorings) else factorings

  def is_factoring(x: Any) -> bool:
    return isinstance(x, Factoring)

  def init(params: Any) -> FactoredRmsState:
    plan = resolve(params)
    placeholder = jnp.zeros((1,), jnp.float32)

    def rows(f: Factoring, p: jax.Array) -> jax.Array:
      if not f.factored:
        return placeholder
      return jnp.zeros(np.delete(p.shape, f.cols), jnp.float32)  # [shape without cols]

    def cols(f: Factoring, p: jax.Array) -> jax.Array:
      if not f.factored:
        return placeholder
      return jnp.zeros(np.delete(p.shape, f.rows), jnp.float32)  # [shape without rows]

    def full(f: Factoring, p: jax.Array) -> jax.Array:
      return placeholder if f.factored else jnp.zeros(p.shape, jnp.float32)

    return FactoredRmsState(
      count=jnp.zeros((), jnp.int32),
      v_row=jax.tree.map(rows, plan, params, is_leaf=is_factoring),
      v_col=jax.tree.map(cols, plan, params, is_leaf=is_factoring),
      v=jax.tree.map(full, plan, params, is_leaf=is_factoring),
    )

  def update(grads: Any, state: FactoredRmsState, params: Any = None):
    if params is None:
      raise ValueError("Adafactor needs the params (multiply_by_parameter_scale).")
    plan = resolve(params)
    t = jnp.asarray(state.count - decay_offset + 1, jnp.float32)
    decay = 1.0 - t ** (-decay_rate)

    def one(f: Factoring, g: jax.Array, p: jax.Array, vr: jax.Array, vc: jax.Array, v: jax.Array):
      g = g.astype(jnp.float32)
      g2 = g * g + epsilon
      if f.factored:
        vr = decay * vr + (1 - decay) * jnp.mean(g2, axis=f.cols)  # [shape without cols]
        vc = decay * vc + (1 - decay) * jnp.mean(g2, axis=f.rows)  # [shape without rows]
        rows_in_vr = tuple(d - sum(c < d for c in f.cols) for d in f.rows)
        row_factor = (vr / jnp.mean(vr, axis=rows_in_vr, keepdims=True)) ** -0.5
        y = g * jnp.expand_dims(row_factor, f.cols) * jnp.expand_dims(vc**-0.5, f.rows)
      else:
        v = decay * v + (1 - decay) * g2
        y = g * v**-0.5
      if clipping_threshold is not None:
        rms = jnp.sqrt(jnp.mean(y * y, axis=f.averaging_dims, keepdims=True))
        y = y / jnp.maximum(1.0, rms / clipping_threshold)
      if multiply_by_parameter_scale:
        p = p.astype(jnp.float32)
        scale = jnp.sqrt(jnp.mean(p * p, axis=f.averaging_dims, keepdims=True))
        y = y * jnp.maximum(scale, 1e-3)
      return y.astype(g.dtype), vr, vc, v

    treedef = jax.tree.structure(params)
    results = [
      one(*args)
      for args in zip(
        treedef.flatten_up_to(plan),
        treedef.flatten_up_to(grads),
        treedef.flatten_up_to(params),
        treedef.flatten_up_to(state.v_row),
        treedef.flatten_up_to(state.v_col),
        treedef.flatten_up_to(state.v),
      )
    ]
    updates, v_row, v_col, v = (treedef.unflatten(list(r)) for r in zip(*results))
    return updates, FactoredRmsState(state.count + 1, v_row, v_col, v)

  # (optax's protocol takes any OptState as the state, so no update fn types its own.)
  return optax.GradientTransformation(init, update)  # pyright: ignore[reportArgumentType]
