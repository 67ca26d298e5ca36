"""The T5 encoder-decoder network (T5 1.0 and 1.1) as Flax linen modules.

Math only: no jit, no mesh, no optimizer. Pre-norm residual blocks with T5's
RMSNorm (`t5x_lite.nn.blocks`), unscaled attention with one relative position bias table
per stack, a final norm per stack, dropout where T5 applies it (after the embedding,
after each sublayer before the residual add, after the final norm). Optional
rematerialisation (`remat_policy`) and layer scanning (`scan_layers`, params stacked
on a leading 'layers' axis). Optional adapter layers (`adapter_dim`, T5 paper section
3.5.1) after every feed-forward sublayer.
"""

import dataclasses
from collections.abc import Callable
from typing import cast

import flax.linen as nn
import gin
from flax import traverse_util
import jax.numpy as jnp

from t5x_lite.core.errors import ConfigError
from t5x_lite.core.types import Array, PyTree
from t5x_lite.kernels import registry
from t5x_lite.kernels.base import PaddingLengths
from t5x_lite.nn import blocks, layers, param_init
from t5x_lite.nn.attention import CacheMode

# The names every dtype field of T5Config accepts.
DTYPES = ('float32', 'bfloat16', 'float16')
_REMAT_POLICIES = ('none', 'minimal', 'full')
ARCHITECTURES = ('encoder_decoder', 'decoder_only', 'prefix_lm')


@gin.configurable
@dataclasses.dataclass(frozen=True)
class T5Config:
  """Hyper-parameters of a T5 network; variants via `dataclasses.replace`.

  Gin binds fields as `T5Config.<field> = value` (see gin/models/).

  Attributes:
    vocab_size: vocabulary size (embedding rows and logits).
    emb_dim: model width.
    num_heads: attention heads.
    head_dim: width of each head.
    mlp_dim: feed-forward hidden width.
    num_encoder_layers: encoder depth.
    num_decoder_layers: decoder depth.
    mlp_activations: ('relu',) for T5 1.0, ('gelu', 'linear') for 1.1 gated GELU.
    dropout_rate: dropout rate everywhere T5 applies dropout.
    logits_via_embedding: tied logits (1.0) instead of decoder/logits_dense (1.1).
    relative_attention_num_buckets: buckets of the relative position bias.
    relative_attention_max_distance: distance at which the last bucket starts.
    dtype: activation (computation) dtype: one of `DTYPES`, e.g. 'float32', 'bfloat16'.
    param_dtype: parameter (storage) dtype, one of `DTYPES`.
    remat_policy: 'none', 'minimal' (save matmul outputs without batch dims) or 'full'.
    scan_layers: scan over layers with stacked parameters.
    layer_norm_epsilon: RMSNorm epsilon.
    adapter_dim: inner width of an adapter layer (`layers.Adapter`) after each
      feed-forward sublayer of every encoder and decoder block; 0: no adapters
      (the plain T5 network, same parameters).
    relpos_bias_per_layer: every layer owns its relative position bias table
      (`layers_{i}/relpos_bias`, as flaxformer's scanned T5 has it) instead of one
      table per stack (`relpos_bias`, the T5 paper's and HF's model).
    attention_logits_dtype: dtype of the attention logits and softmax, one of
      `DTYPES`: 'float32' (T5X's `float32_logits=True`), or 'bfloat16' (flaxformer's
      default with bfloat16 activations; halves the largest activations of
      training, the [batch, heads, q, k] logits and weights).
    architecture: the T5 paper's three (section 3.2.1): 'encoder_decoder'
      (`Transformer`); 'decoder_only', a causal language model over inputs and
      targets concatenated; 'prefix_lm', the same decoder with fully visible
      attention over the inputs (`decoder_only.DecoderOnlyTransformer` for both,
      which have no encoder: num_encoder_layers must be 0).
    share_encoder_decoder: the encoder-decoder whose decoder layers reuse the
      encoder layers' parameters (the paper's "encoder-decoder, shared":
      `shared_encoder_decoder.SharedTransformer`); needs as many decoder layers as
      encoder layers.
    kernels: the backend implementations the layers compute with
      (`t5x_lite.kernels.registry`): 'reference' (the plain math, every backend),
      'xla_cpu' (tuned for XLA:CPU), 'xla_gpu' (fused attention, cuDNN's on a GPU),
      or 'auto', the set for the backend jax runs on
      (`registry.AUTO`: XLA:CPU's on CPU, else the reference). Every set computes the
      same network to float rounding; the decode caches' layout is the set's.
  """

  vocab_size: int
  emb_dim: int
  num_heads: int
  head_dim: int
  mlp_dim: int
  num_encoder_layers: int
  num_decoder_layers: int
  mlp_activations: tuple[str, ...]
  dropout_rate: float
  logits_via_embedding: bool
  relative_attention_num_buckets: int = 32
  relative_attention_max_distance: int = 128
  dtype: str = 'float32'
  param_dtype: str = 'float32'
  remat_policy: str = 'none'
  scan_layers: bool = False
  layer_norm_epsilon: float = 1e-6
  adapter_dim: int = 0
  relpos_bias_per_layer: bool = False
  attention_logits_dtype: str = 'float32'
  architecture: str = 'encoder_decoder'
  share_encoder_decoder: bool = False
  kernels: str = 'auto'

  def __post_init__(self):
    # JSON round trips turn tuples into lists; keep the config hashable.
    object.__setattr__(self, 'mlp_activations', tuple(self.mlp_activations))
    for name in ('dtype', 'param_dtype', 'attention_logits_dtype'):
      if getattr(self, name) not in DTYPES:
        raise ConfigError(f'T5Config.{name} must be one of {DTYPES}, got {getattr(self, name)!r}')
    if self.kernels not in registry.NAMES:
      raise ConfigError(f'T5Config.kernels must be one of {registry.NAMES}, got {self.kernels!r}')
    if self.remat_policy not in _REMAT_POLICIES:
      raise ConfigError(
        f'T5Config.remat_policy must be one of {_REMAT_POLICIES}, got {self.remat_policy!r}'
      )
    if self.architecture not in ARCHITECTURES:
      raise ConfigError(
        f'T5Config.architecture must be one of {ARCHITECTURES}, got {self.architecture!r}'
      )
    if self.architecture != 'encoder_decoder' and self.num_encoder_layers:
      raise ConfigError(
        f'T5Config.num_encoder_layers must be 0 for architecture {self.architecture!r} '
        f'(no encoder), got {self.num_encoder_layers}'
      )
    if self.share_encoder_decoder and (
      self.architecture != 'encoder_decoder' or self.num_encoder_layers != self.num_decoder_layers
    ):
      raise ConfigError(
        'T5Config.share_encoder_decoder needs the encoder_decoder architecture with as many '
        f'decoder as encoder layers, got {self.architecture!r} with '
        f'{self.num_encoder_layers} + {self.num_decoder_layers} layers'
      )
    if self.adapter_dim < 0:
      raise ConfigError(
        f'T5Config.adapter_dim must be >= 0 (0: no adapters), got {self.adapter_dim}'
      )
    if self.relative_attention_max_distance <= self.relative_attention_num_buckets // 2:
      raise ConfigError(
        'T5Config.relative_attention_max_distance must exceed half the buckets '
        '(the exact range of the causal bucketing)'
      )


def _segment_mask(query_segments: Array | None, key_segments: Array | None) -> Array | None:
  """[batch, 1, q, k] mask of equal segment ids (packing), or None."""
  if query_segments is None or key_segments is None:
    return None
  return layers.make_attention_mask(query_segments, key_segments, jnp.equal)


def _padding_lengths(query_valid: Array, key_valid: Array) -> PaddingLengths:
  """The real queries and keys of each row, [batch] each, of [batch, q] and [batch, k]
  masks of real tokens: the lengths of the padding mask of unpacked rows, whose
  padding (token 0) follows their last real token as seqio's feature converters lay
  it out."""
  return PaddingLengths(
    query=jnp.sum(query_valid, axis=1, dtype=jnp.int32),
    key=jnp.sum(key_valid, axis=1, dtype=jnp.int32),
  )


def _encoder_padding_bias(encoder_input_tokens: Array) -> Array:
  """[batch, 1, 1, input_len] float32 bias masking the encoder's padding (token 0)."""
  return layers.mask_to_bias((encoder_input_tokens > 0)[:, None, None, :])


class Encoder(nn.Module):
  """Embedding, dropout, encoder layers, final norm, dropout.

  Attributes:
    config: the network config.
    shared_embedding: the token embedder shared with the decoder.
  """

  config: T5Config
  shared_embedding: nn.Module

  @nn.compact
  def __call__(
    self,
    encoder_input_tokens: Array,
    encoder_segment_ids: Array | None = None,
    encoder_positions: Array | None = None,
    deterministic: bool = True,
  ) -> Array:
    """tokens [batch, input_len] -> encoded [batch, input_len, embed].

    `encoder_positions` (packing) are accepted and not needed: see
    `layers.relative_positions`.
    """
    del encoder_positions
    cfg = self.config
    length = encoder_input_tokens.shape[1]
    valid = encoder_input_tokens > 0  # [batch, input_len]
    mask = layers.combine_masks(
      layers.make_attention_mask(valid, valid),
      _segment_mask(encoder_segment_ids, encoder_segment_ids),
    )
    # Unpacked rows: the mask is only padding, which kernels may take as lengths.
    padding = _padding_lengths(valid, valid) if encoder_segment_ids is None else None
    relative = layers.relative_positions(length, length)  # [1, q, k]
    # [1, heads, q, k] (per-layer tables: the relative positions [1, q, k])
    position_bias = blocks.stack_position_bias(cfg, relative, bidirectional=True)
    x = self.shared_embedding(encoder_input_tokens)  # [batch, input_len, embed]
    x = nn.Dropout(rate=cfg.dropout_rate, broadcast_dims=(-2,))(x, deterministic=deterministic)
    x = nn.with_logical_constraint(x, ('batch', 'length', 'embed'))
    x = blocks.apply_layers(
      cfg,
      blocks.EncoderLayer,
      cfg.num_encoder_layers,
      x,
      layers.mask_to_bias(mask),
      position_bias,
      padding,
      deterministic=deterministic,
    )
    x = blocks.norm(cfg, 'encoder_norm', in_layer=False)(x)
    x = nn.Dropout(rate=cfg.dropout_rate, broadcast_dims=(-2,))(x, deterministic=deterministic)
    return nn.with_logical_constraint(x, ('batch', 'length', 'embed'))


def token_embedder(config: T5Config) -> layers.Embed:
  """The token embedding shared by the encoder, the decoder and tied logits."""
  return layers.Embed(
    num_embeddings=config.vocab_size,
    features=config.emb_dim,
    kernels=blocks.kernels(config),
    dtype=config.dtype,
    param_dtype=config.param_dtype,
  )


def _logits_dense(config: T5Config, name: str | None = None) -> layers.Projection:
  """The untied output layer (T5 1.1): [..., embed] -> float32 [..., vocab]."""
  return layers.Projection(
    features=(config.vocab_size,),
    kernel_axes=('embed', 'vocab'),
    kernel_init=layers.mlp_kernel_init(),
    kernels=blocks.kernels(config),
    dtype=config.dtype,
    param_dtype=config.param_dtype,
    out_dtype=jnp.float32,
    name=name,
  )


def apply_logits_head(config: T5Config, params: PyTree, hidden: Array) -> Array:
  """The decoder's output layer on its final hidden states, outside the network.

  Computes what the decoder's last step computes (`_output_layer`), from the params
  of any of the networks (`Transformer`, its shared-layer variant, or
  `decoder_only.DecoderOnlyTransformer`: all keep `token_embedder` and
  `decoder/logits_dense` at these paths). `EncoderDecoderModel.loss_chunk_length`
  applies it to a few target positions at a time.

  Args:
    config: the network config.
    params: the network's params (plain or boxed).
    hidden: [..., length, embed] the decoder's output (`output_hidden=True`).

  Returns:
    float32 logits [..., length, vocab].
  """

  def attend(query: Array) -> Array:
    variables = {'params': params['token_embedder']}
    return cast(Array, token_embedder(config).apply(variables, query, method='attend'))

  def logits_dense(h: Array) -> Array:
    variables = {'params': params['decoder']['logits_dense']}
    return cast(Array, _logits_dense(config).apply(variables, h))

  return _output_layer(config, hidden, attend=attend, logits_dense=logits_dense)


def _output_layer(
  config: T5Config,
  x: Array,
  attend: Callable[[Array], Array],
  logits_dense: Callable[[Array], Array],
) -> Array:
  """Final hidden states [..., length, embed] -> float32 logits [..., length, vocab].

  Tied (T5 1.0): the token embedding's `attend` on x / sqrt(emb_dim); untied (T5 1.1):
  the `logits_dense` projection.
  """
  if config.logits_via_embedding:
    logits = attend(x / jnp.sqrt(config.emb_dim).astype(x.dtype))
  else:
    logits = logits_dense(x)
  return nn.with_logical_constraint(logits, ('batch', 'length', 'vocab'))


class Decoder(nn.Module):
  """Embedding, dropout, decoder layers, final norm, dropout, logits.

  In decode mode the decoder keeps a 0-d int32 `cache_index` (the next step's
  position) next to the per-layer key/value caches. The first decode call only
  creates the caches; every later call is one step of one token per row.

  Attributes:
    config: the network config.
    shared_embedding: the token embedder shared with the encoder.
  """

  config: T5Config
  shared_embedding: nn.Module

  def _full_biases(
    self,
    encoder_input_tokens: Array | None,
    decoder_input_tokens: Array,
    decoder_target_tokens: Array | None,
    encoder_segment_ids: Array | None,
    decoder_segment_ids: Array | None,
    decoder_causal_attention: Array | None,
  ) -> tuple[Array, Array, Array | None, PaddingLengths | None]:
    """(self mask bias, relative position bias, cross mask bias or None, the cross mask's
    lengths where it is only padding or None) for whole sequences.

    `decoder_causal_attention` [batch, length] marks a prefix LM's inputs: positions
    where it is 1 see each other in full (seqio's PrefixLMFeatureConverter feature).
    """
    length = decoder_input_tokens.shape[1]
    if decoder_target_tokens is None:
      # Right padding sits after every real token, so the causal mask already hides it.
      valid = jnp.ones(decoder_input_tokens.shape, jnp.bool_)
      self_padding = None
    else:
      valid = decoder_target_tokens > 0  # [batch, target_len]
      self_padding = layers.make_attention_mask(valid, valid)
    visible = layers.make_causal_mask(length)  # [1, 1, q, k]
    if decoder_causal_attention is not None:
      prefix = decoder_causal_attention > 0  # [batch, length]
      visible = visible | layers.make_attention_mask(prefix, prefix)  # [batch, 1, q, k]
    self_mask = layers.combine_masks(
      visible, self_padding, _segment_mask(decoder_segment_ids, decoder_segment_ids)
    )
    cross_mask_bias = cross_padding = None
    if encoder_input_tokens is not None and encoder_input_tokens.shape[0] != valid.shape[0]:
      # The cache-creating call of decodes that share their row's encoder output
      # (see attention.MultiHeadAttention): no target padding, no packing.
      cross_mask_bias = _encoder_padding_bias(encoder_input_tokens)
    elif encoder_input_tokens is not None:
      cross_mask = layers.combine_masks(
        layers.make_attention_mask(valid, encoder_input_tokens > 0),
        _segment_mask(decoder_segment_ids, encoder_segment_ids),
      )
      cross_mask_bias = layers.mask_to_bias(cross_mask)
      if decoder_segment_ids is None and encoder_segment_ids is None:
        cross_padding = _padding_lengths(valid, encoder_input_tokens > 0)
    relative = layers.relative_positions(length, length)
    position_bias = blocks.stack_position_bias(self.config, relative, bidirectional=False)
    return layers.mask_to_bias(self_mask), position_bias, cross_mask_bias, cross_padding

  def _logits(self, x: Array) -> Array:
    """Final hidden states [batch, length, embed] -> float32 logits [batch, length, vocab]."""
    return _output_layer(
      self.config,
      x,
      attend=self.shared_embedding.attend,
      logits_dense=lambda h: _logits_dense(self.config, name='logits_dense')(h),
    )

  def _decode_state(
    self, decoder_input_tokens: Array, decoder_only: bool, decode: bool, prefill: bool
  ) -> tuple[CacheMode, Array | None, Array | None]:
    """The call's `CacheMode`; advances the caches' bookkeeping.

    Returns:
      (mode, decode_position, prefilled). In a STEP, decode_position is its 0-d
      position and prefilled [batch] (decoder-only models) marks the rows whose slot
      at decode_position holds their prefilled prompt, which the step must not
      overwrite; both None in the other modes. A prefill moves `cache_index` to the
      shortest prompt's last position: every row is forced up to there, so decoding
      starts there (`decoding`'s `initial_step`).
    """
    if not decode:
      if prefill:
        raise ValueError('prefill=True needs decode=True (and a created cache).')
      return CacheMode.NONE, None, None
    initialized = self.has_variable('cache', 'cache_index')
    cache_index = self.variable('cache', 'cache_index', lambda: jnp.array(0, jnp.int32))
    prefill_length = None
    if decoder_only:
      rows = decoder_input_tokens.shape[0]
      # [batch] int32: prompt positions written by the prefill call
      prefill_length = self.variable('cache', 'prefill_length', jnp.zeros, (rows,), jnp.int32)
    if prefill:
      if prefill_length is None or not initialized:
        raise ValueError('prefill needs a decoder-only model whose cache was created.')
      prefill_length.value = layers.prompt_end(decoder_input_tokens) + 1  # [batch]
      cache_index.value = jnp.min(prefill_length.value) - 1
      return CacheMode.PREFILL, None, None
    if not initialized:
      return CacheMode.INIT, None, None
    decode_position = cache_index.value
    cache_index.value = decode_position + 1
    prefilled = None if prefill_length is None else decode_position < prefill_length.value
    return CacheMode.STEP, decode_position, prefilled

  @nn.compact
  def __call__(
    self,
    encoded: Array | None,
    encoder_input_tokens: Array | None,
    decoder_input_tokens: Array,
    decoder_target_tokens: Array | None = None,
    encoder_segment_ids: Array | None = None,
    decoder_segment_ids: Array | None = None,
    decoder_positions: Array | None = None,
    deterministic: bool = True,
    decode: bool = False,
    max_decode_length: int | None = None,
    decoder_causal_attention: Array | None = None,
    prefill: bool = False,
    output_hidden: bool = False,
  ) -> Array:
    """Returns float32 logits [batch, target_len, vocab] (target_len 1 in a decode step).

    With `output_hidden` it stops before the output layer and returns the final hidden
    states [batch, target_len, embed] (after the final norm and dropout), the input of
    `apply_logits_head`.

    Without `encoded` and `encoder_input_tokens` it is a decoder-only model's stack
    (no cross-attention); `decoder_causal_attention` then marks a prefix LM's
    fully visible inputs, and `prefill=True` (with decode=True, after the
    cache-creating call) writes a prompt [batch, prompt_len] to the caches' first slots
    in one pass. `decoder_positions` (packing) are accepted and not needed: see
    `layers.relative_positions`.
    """
    del decoder_positions
    cfg = self.config
    mode, decode_position, prefilled = self._decode_state(
      decoder_input_tokens, encoded is None, decode, prefill
    )
    if mode is not CacheMode.STEP:
      self_mask_bias, position_bias, cross_mask_bias, cross_padding = self._full_biases(
        encoder_input_tokens,
        decoder_input_tokens,
        decoder_target_tokens,
        encoder_segment_ids,
        decoder_segment_ids,
        decoder_causal_attention,
      )
    else:
      self_mask_bias = None  # the attention masks keys after decode_position itself
      distance = jnp.arange(cfg.relative_attention_max_distance + 1, dtype=jnp.int32)  # [D]
      # [1, heads, 1, D] (per-layer tables: the distances [1, 1, D])
      position_bias = blocks.stack_position_bias(cfg, -distance[None, None, :], bidirectional=False)
      cross_mask_bias = cross_padding = None
      if encoder_input_tokens is not None:
        cross_mask_bias = _encoder_padding_bias(encoder_input_tokens)
    x = self.shared_embedding(decoder_input_tokens)  # [batch, target_len, embed]
    x = nn.Dropout(rate=cfg.dropout_rate, broadcast_dims=(-2,))(x, deterministic=deterministic)
    x = nn.with_logical_constraint(x, ('batch', 'length', 'embed'))
    x = blocks.apply_layers(
      cfg,
      blocks.DecoderLayer,
      cfg.num_decoder_layers,
      x,
      encoded,
      self_mask_bias,
      position_bias,
      cross_mask_bias,
      decode_position,
      prefilled,
      cross_padding,
      deterministic=deterministic,
      mode=mode,
      cache_length=max_decode_length if mode is CacheMode.INIT else None,
    )
    x = blocks.norm(cfg, 'decoder_norm', in_layer=False)(x)
    x = nn.Dropout(rate=cfg.dropout_rate, broadcast_dims=(-2,))(x, deterministic=deterministic)
    return x if output_hidden else self._logits(x)


class Transformer(nn.Module):
  """T5 encoder-decoder with a shared token embedding.

  Attributes:
    config: the network config.
  """

  config: T5Config

  def setup(self):
    cfg = self.config
    if cfg.architecture != 'encoder_decoder':
      raise ValueError(f'Transformer is the encoder-decoder; got architecture {cfg.architecture!r}')
    self.token_embedder = token_embedder(cfg)
    self.encoder = Encoder(config=cfg, shared_embedding=self.token_embedder)
    self.decoder = Decoder(config=cfg, shared_embedding=self.token_embedder)

  def encode(
    self,
    encoder_input_tokens: Array,
    encoder_segment_ids: Array | None = None,
    encoder_positions: Array | None = None,
    enable_dropout: bool = True,
  ) -> Array:
    """Encodes tokens [batch, input_len] -> [batch, input_len, embed]."""
    return self.encoder(
      encoder_input_tokens, encoder_segment_ids, encoder_positions, deterministic=not enable_dropout
    )

  def decode(
    self,
    encoded: Array,
    encoder_input_tokens: Array,
    decoder_input_tokens: Array,
    decoder_target_tokens: Array | None = None,
    encoder_segment_ids: Array | None = None,
    decoder_segment_ids: Array | None = None,
    decoder_positions: Array | None = None,
    enable_dropout: bool = True,
    decode: bool = False,
    max_decode_length: int | None = None,
    output_hidden: bool = False,
  ) -> Array:
    """Decodes to float32 logits [batch, target_len, vocab] (`output_hidden`: the final
    hidden states [batch, target_len, embed] instead, see `Decoder`).

    With decode=True and mutable=['cache']: the first call (no cache yet) creates
    the caches: zero self-attention caches sized by decoder_input_tokens
    [batch, max_len] (or max_decode_length), and cross-attention caches holding the
    projection of `encoded` (pass the same `encoded` to every later call); its
    logits are meaningless. Every later call takes decoder_input_tokens [batch, 1],
    attends to the cache and advances the decoder's `cache_index`. In decode mode
    `encoded` and `encoder_input_tokens` may also have batch / d rows, each shared by
    d consecutive decoder rows (samples or beams): the cross-attention caches then
    hold one projection per batch row (see `attention.MultiHeadAttention`).
    """
    return self.decoder(
      encoded,
      encoder_input_tokens,
      decoder_input_tokens,
      decoder_target_tokens,
      encoder_segment_ids,
      decoder_segment_ids,
      decoder_positions,
      deterministic=not enable_dropout,
      decode=decode,
      max_decode_length=max_decode_length,
      output_hidden=output_hidden,
    )

  def __call__(
    self,
    encoder_input_tokens: Array,
    decoder_input_tokens: Array,
    decoder_target_tokens: Array,
    encoder_segment_ids: Array | None = None,
    decoder_segment_ids: Array | None = None,
    encoder_positions: Array | None = None,
    decoder_positions: Array | None = None,
    enable_dropout: bool = True,
    output_hidden: bool = False,
  ) -> Array:
    """Teacher-forced logits [batch, target_len, vocab] (float32); `output_hidden`: the
    decoder's final hidden states [batch, target_len, embed] instead."""
    encoded = self.encode(
      encoder_input_tokens, encoder_segment_ids, encoder_positions, enable_dropout
    )
    return self.decode(
      encoded,
      encoder_input_tokens,
      decoder_input_tokens,
      decoder_target_tokens,
      encoder_segment_ids,
      decoder_segment_ids,
      decoder_positions,
      enable_dropout,
      output_hidden=output_hidden,
    )


def init_params(config: T5Config, rng: Array) -> PyTree:
  """Boxed initial params of `Transformer(config)` (`nn.LogicallyPartitioned` leaves).

  No parameter depends on sequence lengths, so one-token inputs initialise them all.
  """
  tokens = jnp.ones((1, 1), jnp.int32)  # [batch, length]
  return param_init.init_params(
    Transformer(config=config), rng, tokens, tokens, tokens, enable_dropout=False
  )


def adapter_params(params: PyTree) -> dict[str, PyTree]:
  """The adapter parameters of a params tree, nested as there (empty without adapters).

  They are what a checkpoint of the same network without adapters lacks
  (`checkpoints.restore_params`' `fallback`).
  """
  flat = traverse_util.flatten_dict(params)
  return traverse_util.unflatten_dict({k: v for k, v in flat.items() if 'adapter' in k})
