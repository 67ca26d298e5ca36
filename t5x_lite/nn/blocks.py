"""T5's residual blocks: the encoder and decoder layers, and how a stack runs them.

Math only, like `t5x_lite.nn.network`, whose stacks (and `decoder_only`'s) use these:
pre-norm sublayers (T5's RMSNorm, then attention or the MLP, dropout, the residual
add), the adapter after each feed-forward sublayer when configured, one relative
position bias per stack or per layer, and the plain loop or `nn.scan` over layers with
optional rematerialisation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5x_lite.core.types import Array
from t5x_lite.kernels import registry
from t5x_lite.kernels.base import Kernels, PaddingLengths
from t5x_lite.nn import attention as attention_lib
from t5x_lite.nn import layers
from t5x_lite.nn.attention import CacheMode

if TYPE_CHECKING:
  from t5x_lite.nn.network import T5Config


def kernels(cfg: T5Config) -> Kernels:
  """The kernels every layer of the network computes with: `T5Config.kernels`' set."""
  return registry.select(cfg.kernels)


def norm(cfg: T5Config, name: str, in_layer: bool = True) -> layers.RMSNorm:
  """T5's RMSNorm (no bias, no mean subtraction) named `name`.

  `in_layer`: inside a layer, which `apply_layers` rematerialises as a whole unless
  remat_policy is 'none'; then the norm does not checkpoint itself as well.
  """
  return layers.RMSNorm(
    epsilon=cfg.layer_norm_epsilon,
    kernels=kernels(cfg),
    dtype=cfg.dtype,
    param_dtype=cfg.param_dtype,
    recompute=not in_layer or cfg.remat_policy == 'none',
    name=name,
  )


def attention(cfg: T5Config, name: str, cross: bool = False) -> attention_lib.MultiHeadAttention:
  """Multi-head attention named `name` (`cross`: keys and values from the encoder)."""
  return attention_lib.MultiHeadAttention(
    num_heads=cfg.num_heads,
    head_dim=cfg.head_dim,
    dropout_rate=cfg.dropout_rate,
    cross_attention=cross,
    kernels=kernels(cfg),
    dtype=cfg.dtype,
    param_dtype=cfg.param_dtype,
    logits_dtype=cfg.attention_logits_dtype,
    name=name,
  )


def mlp(cfg: T5Config) -> layers.MlpBlock:
  """The feed-forward block ('relu' for T5 1.0, gated GELU for 1.1), named 'mlp'."""
  return layers.MlpBlock(
    mlp_dim=cfg.mlp_dim,
    activations=cfg.mlp_activations,
    dropout_rate=cfg.dropout_rate,
    kernels=kernels(cfg),
    dtype=cfg.dtype,
    param_dtype=cfg.param_dtype,
    recompute=cfg.remat_policy == 'none',  # else the whole layer is rematerialised
    name='mlp',
  )


def residual(cfg: T5Config, y: Array, x: Array, deterministic: bool) -> Array:
  """dropout(y) + x, constrained to ('batch', 'length', 'embed')."""
  y = nn.Dropout(rate=cfg.dropout_rate, broadcast_dims=(-2,))(y, deterministic=deterministic)
  return nn.with_logical_constraint(y + x, ('batch', 'length', 'embed'))


def feed_forward(cfg: T5Config, x: Array, deterministic: bool) -> Array:
  """The pre-norm MLP sublayer with its residual, then the adapter when configured.

  x [batch, length, embed] -> same.
  """
  y = norm(cfg, 'pre_mlp_layer_norm')(x)
  y = mlp(cfg)(y, deterministic)
  x = residual(cfg, y, x, deterministic)
  if cfg.adapter_dim:
    adapter = layers.Adapter(
      adapter_dim=cfg.adapter_dim,
      kernels=kernels(cfg),
      dtype=cfg.dtype,
      param_dtype=cfg.param_dtype,
      name='adapter',
    )
    x = adapter(x)
    x = nn.with_logical_constraint(x, ('batch', 'length', 'embed'))
  return x


class EncoderLayer(nn.Module):
  """Pre-norm self-attention + MLP block (+ adapter).

  Attributes:
    config: the network config.
    deterministic: disables dropout.
  """

  config: T5Config
  deterministic: bool = True

  @nn.compact
  def __call__(
    self,
    x: Array,
    mask_bias: Array,
    position_bias: Array,
    padding: PaddingLengths | None = None,
  ) -> Any:
    """x [batch, length, embed] -> same; returns (x, None) when scanned.

    `padding`: where `mask_bias` is only right padding, its lengths (see
    `attention.MultiHeadAttention`).
    """
    cfg = self.config
    position_bias = layer_position_bias(cfg, position_bias, bidirectional=True)
    y = norm(cfg, 'pre_attention_layer_norm')(x)
    y = attention(cfg, 'attention')(
      y, y, mask_bias, position_bias, deterministic=self.deterministic, padding=padding
    )
    x = residual(cfg, y, x, self.deterministic)
    x = feed_forward(cfg, x, self.deterministic)
    return (x, None) if cfg.scan_layers else x


class DecoderLayer(nn.Module):
  """Pre-norm causal self-attention + cross-attention + MLP block (+ adapter).

  Attributes:
    config: the network config.
    deterministic: disables dropout.
    mode: what the call does with the decoding caches.
    cache_length: self-attention cache length when initialising the cache.
  """

  config: T5Config
  deterministic: bool = True
  mode: CacheMode = CacheMode.NONE
  cache_length: int | None = None

  @nn.compact
  def __call__(
    self,
    x: Array,
    encoded: Array,
    self_mask_bias: Array | None,
    position_bias: Array,
    cross_mask_bias: Array | None,
    decode_position: Array | None,
    prefilled: Array | None = None,
    cross_padding: PaddingLengths | None = None,
  ) -> Any:
    """x [batch, target_len, embed] -> same; returns (x, None) when scanned.

    Without `encoded` (decoder-only models) the layer has no cross-attention.
    `prefilled` [batch]: see `attention.MultiHeadAttention`. `cross_padding`: where
    `cross_mask_bias` is only right padding, its lengths (the same docstring's `padding`).
    """
    cfg = self.config
    position_bias = layer_position_bias(cfg, position_bias, bidirectional=False)
    y = norm(cfg, 'pre_self_attention_layer_norm')(x)
    y = attention(cfg, 'self_attention')(
      y,
      y,
      self_mask_bias,
      position_bias,
      deterministic=self.deterministic,
      mode=self.mode,
      decode_position=decode_position,
      cache_length=self.cache_length,
      prefilled=prefilled,
    )
    x = residual(cfg, y, x, self.deterministic)
    if encoded is not None:
      y = norm(cfg, 'pre_cross_attention_layer_norm')(x)
      y = attention(cfg, 'encoder_decoder_attention', cross=True)(
        y,
        encoded,
        cross_mask_bias,
        deterministic=self.deterministic,
        mode=self.mode,
        decode_position=decode_position,
        padding=cross_padding,
      )
      x = residual(cfg, y, x, self.deterministic)
    x = feed_forward(cfg, x, self.deterministic)
    return (x, None) if cfg.scan_layers else x


def apply_layers(
  cfg: T5Config,
  layer_cls: type[nn.Module],
  num_layers: int,
  x: Array,
  *args: Any,
  **layer_kwargs: Any,
) -> Array:
  """Runs num_layers layers (plain loop or nn.scan), rematerialised per cfg.remat_policy.

  Must be called inside a compact method: layers are named `layers_{i}`, or `layers`
  when scanned (params stacked on a leading 'layers' axis, caches on axis 1 so
  batch stays leading).
  """
  if cfg.remat_policy != 'none':
    policy = (
      jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims
      if cfg.remat_policy == 'minimal'
      else None
    )
    layer_cls = nn.remat(layer_cls, prevent_cse=not cfg.scan_layers, policy=policy)
  if cfg.scan_layers:
    scanned = nn.scan(
      layer_cls,
      variable_axes={'params': 0, 'cache': 1},
      split_rngs={'params': True, 'dropout': True},
      # (flax leaves in_axes unannotated, so its default 0 types it as int.)
      in_axes=(nn.broadcast,) * len(args),  # pyright: ignore[reportArgumentType]
      length=num_layers,
      metadata_params={nn.PARTITION_NAME: 'layers'},
    )
    x, _ = scanned(config=cfg, name='layers', **layer_kwargs)(x, *args)
    return x
  for i in range(num_layers):
    x = layer_cls(config=cfg, name=f'layers_{i}', **layer_kwargs)(x, *args)
  return x


def layer_position_bias(cfg: T5Config, position_bias: Array, bidirectional: bool) -> Array:
  """A layer's relative position bias [1, heads, q, k].

  `position_bias` is the stack's bias, or with `relpos_bias_per_layer` the relative
  positions [1, q, k] that this layer's own table turns into one.
  """
  if not cfg.relpos_bias_per_layer:
    return position_bias
  return relpos(cfg)(position_bias, bidirectional=bidirectional)


def stack_position_bias(cfg: T5Config, relative: Array, bidirectional: bool) -> Array:
  """What a stack passes its layers: the bias of its table, or (per-layer tables) `relative`."""
  if cfg.relpos_bias_per_layer:
    return relative
  return relpos(cfg)(relative, bidirectional=bidirectional)


def relpos(cfg: T5Config) -> layers.RelativePositionBiases:
  """The bucketed relative position bias table, named 'relpos_bias'."""
  return layers.RelativePositionBiases(
    num_buckets=cfg.relative_attention_num_buckets,
    max_distance=cfg.relative_attention_max_distance,
    num_heads=cfg.num_heads,
    dtype=jnp.float32,
    param_dtype=cfg.param_dtype,
    name='relpos_bias',
  )
