"""T5 multi-head attention, with its decoding caches and the modes of a decoding call.

The math is the reference kernel's (`t5x_lite.kernels.reference.attention`): unscaled
logits query . key (the 1/sqrt(head_dim) factor is folded into the query kernel's
initialiser, as in T5 and T5X), plus the mask and relative position biases, a softmax
in `logits_dtype` (float32 by default), then the weighted values. The module's
`kernels` field computes it and says how the decode caches are laid out.
"""

import enum

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5x_lite.core.types import Array, DType, Initializer
from t5x_lite.kernels import reference
from t5x_lite.kernels.base import TOKENS_MAJOR, Kernels, PaddingLengths, to_layout
from t5x_lite.nn.layers import MASK_BIAS, Projection, attention_kernel_init


def causal_step_bias(distance_bias: Array, position: Array, length: int) -> Array:
  """Self-attention bias for one decode step at `position` against `length` cached keys.

  Args:
    distance_bias: [1, heads, 1, D] bias by causal distance d = query - key, where
      distances >= D - 1 share the last entry (T5's buckets saturate at max_distance).
    position: 0-d int32 index of the current query.
    length: number of cache slots.

  Returns:
    [1, heads, 1, length] float32: relative bias for keys <= position, MASK_BIAS after.
  """
  key_positions = jnp.arange(length, dtype=jnp.int32)  # [length]
  distance = jnp.clip(position - key_positions, 0, distance_bias.shape[-1] - 1)  # [length]
  bias = jnp.take(distance_bias.astype(jnp.float32), distance, axis=-1)  # [1, heads, 1, length]
  return jnp.where(key_positions <= position, bias, MASK_BIAS)


def _fold_decodes(query: Array, kv_batch: int, cross_attention: bool) -> Array:
  """[batch * d, q, heads, kv] -> [batch, d * q, heads, kv] for keys with `kv_batch` rows.

  The d decodes of a batch row (consecutive rows, see `decoding.expand_to_beams`) attend
  to the same encoder keys, so they are that row's d * q queries.
  """
  rows, length_q = query.shape[:2]
  if not cross_attention or rows % kv_batch:
    raise ValueError(
      f'attention queries have {rows} rows and keys {kv_batch}: only cross-attention may '
      'share one key row among several (a whole multiple of) query rows'
    )
  return query.reshape(kv_batch, rows // kv_batch * length_q, *query.shape[2:])


class CacheMode(enum.Enum):
  """What a network call does with the decoding caches.

  NONE: whole sequences, no cache (training, scoring). INIT: creates the caches (self-
  attention: zeros; cross-attention: the projected encoder output); its outputs are
  meaningless. PREFILL: writes a whole prompt's keys and values to the self-attention
  caches' first slots (decoder-only models). STEP: one token per row, attending to the
  caches and writing its own key and value at the decode position.
  """

  NONE = 'none'
  INIT = 'init'
  PREFILL = 'prefill'
  STEP = 'step'


class MultiHeadAttention(nn.Module):
  """T5 multi-head attention with 3-D kernels and an optional single-step decoding cache.

  Kernels: query/key/value [embed, heads, kv], out [heads, kv, embed]. The 'cache'
  collection holds `cached_key` and `cached_value`, laid out as `kernels.cache` says
  (batch leading, so that beam search can expand or gather them); the step index lives
  with the caller (the Decoder's 0-d `cache_index`). Self-attention writes one
  key/value per step, so a step costs O(cache_length). Cross-attention
  (`cross_attention=True`) projects the encoder output once, in the cache-creating
  call, and only reads it in the steps (no per-step branch or copy: inside a decoding
  loop the cached projection is loop-invariant). Its inputs_kv may have batch rows
  where inputs_q has batch * d (the d samples or beams of each row, consecutive): the
  encoder output is then projected, cached and read once per batch row, not once per
  decode.

  Attributes:
    num_heads: number of heads.
    head_dim: size of each head.
    dropout_rate: dropout on attention weights.
    cross_attention: whether keys/values come from a fixed encoder output.
    kernels: the backend's primitives (projections, `kernels.attention`, cache layouts).
    dtype: computation dtype.
    param_dtype: storage dtype of the kernels.
    logits_dtype: dtype of the attention logits and softmax: float32 (T5X's
      `float32_logits=True`), or bfloat16 (flaxformer's default with bfloat16
      activations), which halves the [batch, heads, q, k] buffers.
  """

  num_heads: int
  head_dim: int
  dropout_rate: float = 0.0
  cross_attention: bool = False
  kernels: Kernels = reference.KERNELS
  dtype: DType = jnp.float32
  param_dtype: DType = jnp.float32
  logits_dtype: DType = jnp.float32

  def _projection(
    self, name: str, features: tuple[int, ...], kernel_axes: tuple[str, ...], init: Initializer
  ) -> Projection:
    return Projection(
      features=features,
      kernel_axes=kernel_axes,
      kernel_init=init,
      kernels=self.kernels,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      name=name,
    )

  def _in_projection(self, name: str, scale: float) -> Projection:
    """[batch, length, embed] -> [batch, length, heads, kv]."""
    heads = (self.num_heads, self.head_dim)
    init = attention_kernel_init(scale, 'in')
    return self._projection(name, heads, ('embed', 'heads', 'kv'), init)

  def _layouts(self) -> tuple[str, str]:
    """The (key, value) cache layouts of this attention."""
    cache = self.kernels.cache
    if self.cross_attention:
      return cache.cross_key, cache.cross_value
    return cache.self_key, cache.self_value

  def _project_kv(self, inputs_kv: Array) -> tuple[Array, Array]:
    """inputs_kv [batch, k, embed] -> key, value [batch, k, heads, kv]."""
    key = self._in_projection('key', 1.0)(inputs_kv)  # [batch, k, heads, kv]
    value = self._in_projection('value', 1.0)(inputs_kv)  # [batch, k, heads, kv]
    axes = ('batch', 'length', 'heads', 'kv')
    return nn.with_logical_constraint(key, axes), nn.with_logical_constraint(value, axes)

  def _init_cache(self, key: Array, value: Array, cache_length: int | None) -> None:
    """Creates the key/value caches from key/value [batch, k, heads, kv].

    Self-attention caches start as zeros of `cache_length` slots (default: the input
    length); cross-attention caches hold `key`/`value`, the projected encoder output.
    """
    for name, new, axes in zip(('cached_key', 'cached_value'), (key, value), self._layouts()):
      if self.cross_attention:
        self.variable('cache', name, lambda n=new, a=axes: to_layout(n, a).astype(self.dtype))
        continue
      batch, length = new.shape[:2]
      sizes = {'b': batch, 'k': length if cache_length is None else cache_length}
      sizes.update(h=self.num_heads, d=self.head_dim)
      self.variable('cache', name, jnp.zeros, tuple(sizes[a] for a in axes), self.dtype)

  def _prefill_cache(self, key: Array, value: Array) -> None:
    """Writes a whole prompt's key/value [batch, k, heads, kv] to cache slots [0, k)."""
    for name, new, axes in zip(('cached_key', 'cached_value'), (key, value), self._layouts()):
      cache = self.variable('cache', name)
      new = to_layout(new, axes).astype(self.dtype)
      cache.value = jax.lax.dynamic_update_slice(cache.value, new, (0, 0, 0, 0))

  def _decode_step_kv(
    self, inputs_kv: Array, decode_position: Array, prefilled: Array | None
  ) -> tuple[Array, Array]:
    """Updates the caches for one step; returns all keys and values, in their layouts.

    Self-attention writes this step's key/value at decode_position, except in the
    rows where `prefilled` [batch] says that slot holds a prefilled prompt's;
    cross-attention reads the projection cached when the cache was created (inputs_kv
    is unused).
    """
    caches = (self.variable('cache', 'cached_key'), self.variable('cache', 'cached_value'))
    if self.cross_attention:
      return caches[0].value, caches[1].value
    news = self._project_kv(inputs_kv)  # [batch, 1, heads, kv] each
    for cache, new, axes in zip(caches, news, self._layouts()):
      new = to_layout(new, axes).astype(self.dtype)  # one slot, in the cache's layout
      start = tuple(decode_position if a == 'k' else 0 for a in axes)
      if prefilled is not None:
        keep = prefilled[:, None, None, None]  # [batch, 1, 1, 1]
        new = jnp.where(keep, jax.lax.dynamic_slice(cache.value, start, new.shape), new)
      cache.value = jax.lax.dynamic_update_slice(cache.value, new, start)
    return caches[0].value, caches[1].value

  @nn.compact
  def __call__(
    self,
    inputs_q: Array,
    inputs_kv: Array,
    mask_bias: Array | None = None,
    position_bias: Array | None = None,
    *,
    deterministic: bool = True,
    mode: CacheMode = CacheMode.NONE,
    decode_position: Array | None = None,
    cache_length: int | None = None,
    prefilled: Array | None = None,
    padding: PaddingLengths | None = None,
  ) -> Array:
    """Attends from inputs_q [batch, q, embed] to inputs_kv [batch, k, embed].

    Args:
      inputs_q: query-side inputs [batch, q, embed].
      inputs_kv: key/value-side inputs [batch, k, embed]; for cross-attention also
        [batch / d, k, embed], shared by each d consecutive query rows.
      mask_bias: additive float32 mask bias broadcastable to [batch, heads, q, k]
        ([batch / d, heads, 1, k] when inputs_kv is shared, see above).
      position_bias: additive relative-position bias [batch|1, heads, q, k]; in a
        self-attention STEP it is the bias by causal distance [1, heads, 1, D]
        (see `causal_step_bias`).
      deterministic: disables dropout.
      mode: what the call does with the caches (`CacheMode`).
      decode_position: STEP: the 0-d int32 step index.
      cache_length: INIT: self-attention cache slots; defaults to the input length.
      prefilled: STEP, self-attention: [batch] bool, rows whose cache slot at
        decode_position holds a prefilled prompt's key/value, kept as it is.
      padding: where `mask_bias` is only the right padding of unpacked rows, their
        query and key lengths (`base.PaddingLengths`), for kernels that take lengths
        in place of the bias; whole-sequence calls only.

    Returns:
      [batch, q, embed].
    """
    emb_dim = inputs_q.shape[-1]
    # [batch, q, embed] -> [batch, q, heads, kv]
    query = self._in_projection('query', 1.0 / self.head_dim)(inputs_q)
    query = nn.with_logical_constraint(query, ('batch', 'length', 'heads', 'kv'))
    biases = [mask_bias]
    if mask_bias is None or mode is CacheMode.STEP:
      padding = None  # it stands for the mask bias (base.AttentionFn), of whole sequences
    if mode is CacheMode.STEP:
      if decode_position is None:
        raise ValueError('a decode step needs its decode_position')
      key, value = self._decode_step_kv(inputs_kv, decode_position, prefilled)
      key_axes, value_axes = self._layouts()
      if not self.cross_attention:
        if position_bias is None:
          raise ValueError('a self-attention decode step needs the bias by causal distance')
        length = key.shape[key_axes.index('k')]
        biases.append(causal_step_bias(position_bias, decode_position, length))
    else:
      key, value = self._project_kv(inputs_kv)  # [batch, k, heads, kv]
      key_axes = value_axes = TOKENS_MAJOR
      biases.append(position_bias)
      if mode is CacheMode.PREFILL and not self.cross_attention:
        self._prefill_cache(key, value)
      elif mode is CacheMode.INIT:
        self._init_cache(key, value, cache_length)
    rows, length_q = query.shape[:2]
    if key.shape[0] != rows:
      # Decodes sharing their batch row's encoder output: fold them into the query axis.
      query = _fold_decodes(query, key.shape[0], self.cross_attention)  # [batch, d * q, ...]
      padding = None
    dropout_rng = None
    if not deterministic and self.dropout_rate > 0.0:
      dropout_rng = self.make_rng('dropout')
    out = self.kernels.attention(
      query,
      key,
      value,
      [b for b in biases if b is not None],
      key_axes=key_axes,
      value_axes=value_axes,
      dtype=self.dtype,
      logits_dtype=self.logits_dtype,
      dropout_rate=self.dropout_rate,
      dropout_rng=dropout_rng,
      padding=padding,
    ).reshape(rows, length_q, self.num_heads, self.head_dim)  # [batch, q, heads, kv]
    # [batch, q, heads, kv] -> [batch, q, embed]
    out_init = attention_kernel_init(1.0, 'out')
    return self._projection('out', (emb_dim,), ('heads', 'kv', 'embed'), out_init)(out)
