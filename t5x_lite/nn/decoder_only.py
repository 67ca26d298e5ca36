"""Decoder-only T5 networks: a causal language model and a prefix LM (T5 paper section 3.2).

Math only, like `t5x_lite.nn.network`, whose `Decoder` stack this reuses without its
cross-attention: a token embedding, pre-norm layers of causal self-attention + MLP
with one causal relative position bias table, a final norm, logits. The model reads
seqio's decoder features (`seqio.DecoderFeatureConverter`): inputs and targets
concatenated in `decoder_target_tokens`, shifted right in `decoder_input_tokens`.

* `architecture='decoder_only'`: every position sees only itself and earlier ones.
* `architecture='prefix_lm'`: positions where `decoder_causal_attention` is 1 (the
  inputs, the "prefix") also see each other in full; targets stay causal.

Parameters are `token_embedder` and `decoder/...`, named as in the encoder-decoder's
decoder (without `pre_cross_attention_layer_norm` and `encoder_decoder_attention`).
"""

import flax.linen as nn
import jax.numpy as jnp

from t5x_lite.core.types import Array, PyTree
from t5x_lite.nn import param_init
from t5x_lite.nn.network import Decoder, T5Config, token_embedder


class DecoderOnlyTransformer(nn.Module):
  """A decoder-only T5: language model or prefix LM (per `config.architecture`).

  Attributes:
    config: the network config; `architecture` is 'decoder_only' or 'prefix_lm'.
  """

  config: T5Config

  def setup(self):
    cfg = self.config
    if cfg.architecture not in ('decoder_only', 'prefix_lm'):
      raise ValueError(
        f'DecoderOnlyTransformer needs a decoder-only config, got {cfg.architecture!r}'
      )
    self.token_embedder = token_embedder(cfg)
    self.decoder = Decoder(config=cfg, shared_embedding=self.token_embedder)

  def __call__(
    self,
    decoder_input_tokens: Array,
    decoder_target_tokens: Array | None,
    decoder_segment_ids: Array | None = None,
    decoder_positions: Array | None = None,
    decoder_causal_attention: Array | None = None,
    enable_dropout: bool = True,
    decode: bool = False,
    prefill: bool = False,
    max_decode_length: int | None = None,
    output_hidden: bool = False,
  ) -> Array:
    """Float32 logits [batch, length, vocab] (length 1 in a decode step).

    Args:
      decoder_input_tokens: [batch, length] tokens, shifted right (column 0 is BOS 0).
      decoder_target_tokens: [batch, length] targets (hides padding from attention);
        None in decoding calls.
      decoder_segment_ids: [batch, length] packing segments, or None.
      decoder_positions: [batch, length] packing positions (not needed, see
        `layers.relative_positions`).
      decoder_causal_attention: [batch, length], 1 over a prefix LM's inputs; ignored
        by the causal language model.
      enable_dropout: apply dropout.
      decode: with mutable=['cache']: the first call creates zero caches sized by
        decoder_input_tokens [batch, max_len] (or max_decode_length); with
        `prefill=True` a call writes the prompt decoder_input_tokens [batch, prompt_len]
        (column 0 the BOS, zeros after the prompt) to the caches' first slots, so that
        the decoding steps over the prompt keep those keys and values (a prefix LM's
        prompt sees itself in full); every other call is one step of one token per
        row, attending to the cache.
      prefill: see `decode`.
      max_decode_length: cache length in the cache-creating call.
      output_hidden: return the final hidden states [batch, length, embed] instead of
        the logits (`network.apply_logits_head` maps them to logits).
    """
    cfg = self.config
    if cfg.architecture == 'decoder_only':
      decoder_causal_attention = None
    return self.decoder(
      None,
      None,
      decoder_input_tokens,
      decoder_target_tokens,
      decoder_segment_ids=decoder_segment_ids,
      decoder_positions=decoder_positions,
      deterministic=not enable_dropout,
      decode=decode,
      max_decode_length=max_decode_length,
      decoder_causal_attention=decoder_causal_attention,
      prefill=prefill,
      output_hidden=output_hidden,
    )


def init_params(config: T5Config, rng: Array) -> PyTree:
  """Boxed initial params of `DecoderOnlyTransformer(config)` (`nn.LogicallyPartitioned` leaves)."""
  tokens = jnp.ones((1, 1), jnp.int32)  # [batch, length]
  return param_init.init_params(
    DecoderOnlyTransformer(config=config), rng, tokens, tokens, enable_dropout=False
  )
