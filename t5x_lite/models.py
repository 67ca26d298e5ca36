"""The transformer members of the model contract: EncoderDecoderModel, DecoderOnlyModel.

The model layer owns what T5X's `models.py` owns: the loss (with z-loss, label
smoothing and a loss normalizing mode), metric statistics, per-example scores and
autoregressive predictions through `t5x_lite.nn.decoding`. It never jits and never
touches a mesh; `t5x_lite.training.partitioning.Partitioner` does both.

`EncoderDecoderModel` and `DecoderOnlyModel` are siblings under `BaseTransformerModel`
(the shared loss, scoring and decoding loop), a `t5x_lite.base_model.BaseModel`: each
says how its network reads a batch (`teacher_forced_logits`) and how decoding starts and
ends (`_decoding_inputs`, `_generated`). Gin configures each under its own name
(`EncoderDecoderModel.z_loss`, `DecoderOnlyModel.z_loss`, ...). `build_model` is the one
place a model is built from a network config and the vocabulary.

Importing this module loads no TensorFlow (seqio and `t5x_lite.data.vocab` load only when
`build_model` needs the configured vocabulary), so a host with JAX alone can build,
train and decode a model over any object with `eos_id` and `vocab_size`.
"""

from __future__ import annotations

import abc
import functools
from typing import TYPE_CHECKING, Any, Mapping

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp

from t5x_lite import base_model
from t5x_lite.nn import decoder_only, decoding, layers, losses, network, shared_encoder_decoder
from t5x_lite.core.errors import ConfigError
from t5x_lite.kernels import registry
from t5x_lite.core.types import PyTree

if TYPE_CHECKING:
  import seqio

Batch = Mapping[str, jax.Array]
_DECODER_PARAM_KEYS = ("temperature", "topk", "topp", "alpha", "max_decode_len", "min_decode_len")


class BaseTransformerModel(base_model.BaseModel):
  """A T5 network's teacher-forced loss, scores and decoding (T5X's BaseTransformerModel).

  Members say how their network reads a batch (`teacher_forced_logits`) and how decoding
  starts and ends (`_decoding_inputs`, `_generated`).

  Attributes:
    module: the flax network.
    input_vocabulary: vocabulary of the inputs.
    output_vocabulary: vocabulary of the targets (its `eos_id` ends decoding).
    z_loss: z-loss coefficient.
    label_smoothing: T5X label smoothing amount.
    loss_normalizing_factor: None (sum over tokens), a number, or one of
      `losses.SPECIAL_LOSS_NORMALIZING_FACTORS`.
    loss_chunk_length: None computes the loss from the whole teacher-forced logits
      [batch, target_len, vocab]; a number n computes logits and loss n target
      positions at a time (`losses.chunked_cross_entropy`), recomputing each chunk's
      logits in the backward pass, so that neither the float32 logits nor their
      gradient is ever held whole: 14 MiB per target row at 114 positions and T5's
      32128 ids. The same loss and gradients up to float rounding, for one more
      output-layer matmul per step.
  """

  def __init__(
    self,
    module: nn.Module,
    input_vocabulary: seqio.Vocabulary,
    output_vocabulary: seqio.Vocabulary,
    z_loss: float = 1e-4,
    label_smoothing: float = 0.0,
    loss_normalizing_factor: losses.LossNormalizingFactor = None,
    loss_chunk_length: int | None = None,
  ):
    if loss_chunk_length is not None and (
      isinstance(loss_chunk_length, bool)
      or not isinstance(loss_chunk_length, int)
      or loss_chunk_length < 1
    ):
      raise ConfigError(
        f"{type(self).__name__}.loss_chunk_length must be None or a positive integer, got "
        f"{loss_chunk_length!r}."
      )
    self.module = module
    self.input_vocabulary = input_vocabulary
    self.output_vocabulary = output_vocabulary
    self.z_loss = z_loss
    self.label_smoothing = label_smoothing
    self.loss_normalizing_factor = loss_normalizing_factor
    self.loss_chunk_length = loss_chunk_length

  @property
  def network_config(self) -> network.T5Config:
    """`module.config`."""
    return self.module.config

  def init_params(self, rng: jax.Array) -> PyTree:
    """Boxed initial params (`nn.LogicallyPartitioned` leaves) from one PRNG key."""
    return init_params(self.module.config, rng)

  @abc.abstractmethod
  def teacher_forced_logits(
    self,
    params: PyTree,
    batch: Batch,
    dropout_rng: jax.Array | None,
    *,
    output_hidden: bool = False,
  ) -> jax.Array:
    """The network's float32 logits [batch, target_len, vocab] on a batch, packed ones
    included; dropout iff `dropout_rng`. `output_hidden`: the decoder's final hidden
    states [batch, target_len, embed] instead, the input of `network.apply_logits_head`."""

  def cross_entropy(
    self, logits: jax.Array, batch: Batch, weights: jax.Array, factor: float | jax.Array
  ) -> tuple[jax.Array, jax.Array]:
    """(loss, z_loss) of `logits` against the batch's targets, with this model's settings."""
    loss, z_loss, _ = losses.compute_weighted_cross_entropy(
      logits,
      batch["decoder_target_tokens"],
      weights,
      label_smoothing=self.label_smoothing,
      z_loss=self.z_loss,
      loss_normalizing_factor=factor,
    )
    return loss, z_loss

  def token_correct(self, logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Whether each position's most likely id [batch, target_len] is its target (the
    argmax of this model's kernel set)."""
    return losses.token_correct(logits, targets, registry.select(self.module.config.kernels).argmax)

  def loss_normalization(self, batch: Batch) -> base_model.Normalization:
    """See `BaseModel.loss_normalization` (the mode of `loss_normalizing_factor`)."""
    factor, weights = losses.get_loss_normalizing_factor_and_weights(
      self.loss_normalizing_factor, batch
    )
    return (1.0 if factor is None else factor), weights

  def loss_fn(
    self,
    params: PyTree,
    batch: Batch,
    dropout_rng: jax.Array | None,
    *,
    normalization: base_model.Normalization | None = None,
    aux_state: PyTree = None,
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Loss and metric sums of a teacher-forced pass (see `BaseModel.loss_fn`; these
    models keep no auxiliary state)."""
    del aux_state
    factor, weights = normalization or self.loss_normalization(batch)
    targets = batch["decoder_target_tokens"]
    if self.loss_chunk_length:
      hidden = self.teacher_forced_logits(params, batch, dropout_rng, output_hidden=True)
      loss, z_loss, correct = losses.chunked_cross_entropy(
        functools.partial(network.apply_logits_head, self.module.config, params),
        hidden,
        targets,
        weights,
        self.loss_chunk_length,
        label_smoothing=self.label_smoothing,
        z_loss=self.z_loss,
        loss_normalizing_factor=factor,
        argmax=registry.select(self.module.config.kernels).argmax,
      )
    else:
      logits = self.teacher_forced_logits(params, batch, dropout_rng)
      loss, z_loss = self.cross_entropy(logits, batch, weights, factor)
      correct = self.token_correct(logits, targets)
    return loss, losses.metric_sums(correct, batch, weights, loss, z_loss)

  def score_batch(self, params: PyTree, batch: Batch) -> jax.Array:
    """Per-example sum of target log-likelihoods.

    Tokens are weighted by `decoder_loss_weights` when present, else target > 0.

    Returns:
      [batch] float32 scores (log-probabilities, <= 0).
    """
    logits = self.teacher_forced_logits(params, batch, None).astype(jnp.float32)
    targets = batch["decoder_target_tokens"]
    weights = batch.get("decoder_loss_weights")
    weights = targets > 0 if weights is None else weights
    log_probs = jax.nn.log_softmax(logits, axis=-1)  # [batch, length, vocab]
    # [batch, length, 1] -> [batch, length]
    token_scores = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(token_scores * weights, axis=-1)

  @abc.abstractmethod
  def _decoding_inputs(
    self,
    params: PyTree,
    batch: Batch,
    num_decodes: int,
    max_decode_len: int | None,
    min_decode_len: int,
  ) -> tuple[jax.Array, PyTree, decoding.TokensToLogits, jax.Array | int]:
    """(prompt [batch, max_len], cache for batch * num_decodes rows, tokens_to_logits,
    initial step) for `t5x_lite.nn.decoding`."""

  @abc.abstractmethod
  def _generated(
    self, tokens: jax.Array, prompt: jax.Array, max_decode_len: int | None
  ) -> jax.Array:
    """The generated part of decoded tokens [batch, decodes, len]."""

  def predict_batch_with_aux(
    self,
    params: PyTree,
    batch: Batch,
    rng: jax.Array | None = None,
    *,
    decoder_params: Mapping[str, Any] | None = None,
    return_all_decodes: bool = False,
    num_decodes: int = 1,
    decode_fn: str = "greedy",
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Autoregressive predictions with their scores.

    Args:
      params: model params.
      batch: the inputs (`encoder_input_tokens`; a decoder-only model's prompts, see
        `DecoderOnlyModel`); the output length is `decoder_params['max_decode_len']` if
        given, else the length of `decoder_input_tokens`.
      rng: PRNG key for sampling (default PRNGKey(0)).
      decoder_params: optional temperature, topk, topp (sampling), alpha (beam),
        max_decode_len, min_decode_len.
      return_all_decodes: return all `num_decodes` sequences instead of the best.
      num_decodes: samples or beams per example.
      decode_fn: 'greedy' (temperature 0), 'sample' or 'beam'.

    Returns:
      (tokens [batch, len] or [batch, num_decodes, len] int32 without BOS, 0 after
      EOS; {'scores': [batch] or [batch, num_decodes]}), best first.

    Raises:
      ValueError: for an unknown decode_fn or decoder param.
    """
    decoder_params = dict(decoder_params or {})
    unknown = set(decoder_params) - set(_DECODER_PARAM_KEYS)
    if unknown or decode_fn not in ("greedy", "sample", "beam"):
      raise ValueError(f"Bad decode_fn {decode_fn!r} or decoder_params {sorted(unknown)}.")
    max_len = decoder_params.pop("max_decode_len", None)
    min_len = decoder_params.pop("min_decode_len", 0)
    prompt, cache, tokens_to_logits, initial_step = self._decoding_inputs(
      params, batch, num_decodes, max_len, min_len
    )
    eos_id = self.output_vocabulary.eos_id
    if eos_id is None:
      raise ValueError("The output vocabulary has no EOS id, which ends decoding.")
    if decode_fn == "beam":
      tokens, scores = decoding.beam_search(
        prompt,
        cache,
        tokens_to_logits,
        eos_id,
        num_decodes=num_decodes,
        alpha=decoder_params.get("alpha", 0.6),
        min_decode_len=min_len,
        initial_step=initial_step,
      )
    else:
      sampling: dict[str, Any] = {k: v for k, v in decoder_params.items() if k != "alpha"}
      if decode_fn == "greedy":
        sampling = {"temperature": 0.0}
      tokens, scores = decoding.temperature_sample(
        prompt,
        cache,
        tokens_to_logits,
        eos_id,
        jax.random.PRNGKey(0) if rng is None else rng,
        num_decodes=num_decodes,
        min_decode_len=min_len,
        initial_step=initial_step,
        argmax=registry.select(self.module.config.kernels).argmax,
        **sampling,
      )
    tokens = _zero_after_eos(self._generated(tokens, prompt, max_len), eos_id)
    if return_all_decodes:
      return tokens, {"scores": scores}
    return tokens[:, 0], {"scores": scores[:, 0]}


@gin.configurable
class EncoderDecoderModel(BaseTransformerModel):
  """T5 encoder-decoder model (T5X's `EncoderDecoderModel`) over EncDecFeatureConverter
  features; `module` is a `network.Transformer` or a
  `shared_encoder_decoder.SharedTransformer`.

  Attributes: those of `BaseTransformerModel` (gin: `EncoderDecoderModel.z_loss`, ...).
  """

  def teacher_forced_logits(
    self,
    params: PyTree,
    batch: Batch,
    dropout_rng: jax.Array | None,
    *,
    output_hidden: bool = False,
  ) -> jax.Array:
    """See `BaseTransformerModel.teacher_forced_logits`."""
    # (flax types apply's result as the output or, with `mutable`, (output, state).)
    return self.module.apply(  # pyright: ignore[reportReturnType]
      {"params": params},
      batch["encoder_input_tokens"],
      batch["decoder_input_tokens"],
      batch["decoder_target_tokens"],
      encoder_segment_ids=batch.get("encoder_segment_ids"),
      decoder_segment_ids=batch.get("decoder_segment_ids"),
      encoder_positions=batch.get("encoder_positions"),
      decoder_positions=batch.get("decoder_positions"),
      enable_dropout=dropout_rng is not None,
      output_hidden=output_hidden,
      rngs=None if dropout_rng is None else {"dropout": dropout_rng},
    )

  def _decoding_inputs(
    self,
    params: PyTree,
    batch: Batch,
    num_decodes: int,
    max_decode_len: int | None,
    min_decode_len: int,
  ) -> tuple[jax.Array, PyTree, decoding.TokensToLogits, jax.Array | int]:
    """Encodes once and initialises a cache for batch * num_decodes rows.

    The encoder output is not repeated per decode: the cross-attention caches hold one
    projection per batch row, which the row's decodes share (batch rows, constant in
    the loop; see `decoding`).

    Returns:
      (decoder prompt [batch, max_len] of zeros, cache, tokens_to_logits, initial
      step 0) for `t5x_lite.nn.decoding`.
    """
    del min_decode_len  # the decoding loop enforces it
    max_len = max_decode_len or batch["decoder_input_tokens"].shape[1]
    inputs = batch["encoder_input_tokens"]
    encoded = self.module.apply(
      {"params": params},
      inputs,
      encoder_segment_ids=batch.get("encoder_segment_ids"),
      encoder_positions=batch.get("encoder_positions"),
      enable_dropout=False,
      method="encode",
    )  # [batch, input_len, emb]
    rows = inputs.shape[0] * num_decodes

    def decode(variables: PyTree, ids: jax.Array) -> tuple[jax.Array, PyTree]:
      logits, new_vars = self.module.apply(
        variables,
        encoded,
        inputs,
        ids,
        enable_dropout=False,
        decode=True,
        max_decode_length=max_len,
        mutable=["cache"],
        method="decode",
      )
      return logits, new_vars["cache"]

    # The first decode=True apply only creates zeroed caches.
    _, cache = decode({"params": params}, jnp.ones((rows, max_len), jnp.int32))

    def tokens_to_logits(ids: jax.Array, step_cache: PyTree) -> tuple[jax.Array, PyTree]:
      # [rows, 1, vocab]
      logits, new_cache = decode({"params": params, "cache": step_cache}, ids)
      return logits[:, 0, :].astype(jnp.float32), new_cache  # [rows, vocab]

    prompt = jnp.zeros((batch["encoder_input_tokens"].shape[0], max_len), jnp.int32)
    return prompt, cache, tokens_to_logits, 0

  def _generated(
    self, tokens: jax.Array, prompt: jax.Array, max_decode_len: int | None
  ) -> jax.Array:
    """The generated part of decoded tokens [batch, decodes, len] (here: all of it)."""
    del prompt, max_decode_len  # the decoding buffer is max_decode_len wide already
    return tokens


@gin.configurable
class DecoderOnlyModel(BaseTransformerModel):
  """Decoder-only language model or prefix LM (T5X's `DecoderOnlyModel`).

  Same loss, metrics and scoring as `EncoderDecoderModel`, over seqio's decoder
  features (`seqio.DecoderFeatureConverter`: inputs and targets concatenated, loss on
  the targets only). Decoding continues each row's prompt (the inputs: the
  `decoder_input_tokens` where `decoder_causal_attention` is 1; none for a plain
  language model's batch): one prefill pass writes the prompt's keys and values to the
  cache (a prefix LM's prompt sees itself in full), the decoding loop forces the
  prompt's tokens and then generates, and the prompt is cut off the result. Scores count
  only generated tokens; a beam's length penalty counts the prompt's length too.

  Attributes: those of `BaseTransformerModel` (gin: `DecoderOnlyModel.z_loss`, ...);
  `module` is a `decoder_only.DecoderOnlyTransformer`.
  """

  def teacher_forced_logits(
    self,
    params: PyTree,
    batch: Batch,
    dropout_rng: jax.Array | None,
    *,
    output_hidden: bool = False,
  ) -> jax.Array:
    """See `BaseTransformerModel.teacher_forced_logits` (DecoderFeatureConverter features)."""
    # (flax types apply's result as the output or, with `mutable`, (output, state).)
    return self.module.apply(  # pyright: ignore[reportReturnType]
      {"params": params},
      batch["decoder_input_tokens"],
      batch["decoder_target_tokens"],
      decoder_segment_ids=batch.get("decoder_segment_ids"),
      decoder_positions=batch.get("decoder_positions"),
      decoder_causal_attention=batch.get("decoder_causal_attention"),
      enable_dropout=dropout_rng is not None,
      output_hidden=output_hidden,
      rngs=None if dropout_rng is None else {"dropout": dropout_rng},
    )

  def _decoding_inputs(
    self,
    params: PyTree,
    batch: Batch,
    num_decodes: int,
    max_decode_len: int | None,
    min_decode_len: int,
  ) -> tuple[jax.Array, PyTree, decoding.TokensToLogits, jax.Array]:
    """Prompt, prefilled cache, step function and first step for `t5x_lite.nn.decoding`.

    The decoding buffer is as wide as `decoder_input_tokens`, plus `max_decode_len`
    if given (then the output is cut to that many tokens). Decoding starts at the
    shortest prompt's end: before it every row only replays its prefilled prompt.
    `min_decode_len` is refused: the loop would count the prompt's tokens.

    Returns:
      (prompt [batch, max_len]: BOS then the inputs, zeros after; cache with
      batch * num_decodes rows; tokens_to_logits; the 0-d initial step).
    """
    if min_decode_len:
      raise ValueError("min_decode_len is not supported by decoder-only models.")
    tokens = batch["decoder_input_tokens"]  # [batch, length]
    prefix = batch.get("decoder_causal_attention")
    prompt = tokens * prefix if prefix is not None else jnp.zeros_like(tokens)
    if max_decode_len:
      widen = ((0, 0), (0, max_decode_len))
      prompt = jnp.pad(prompt, widen)  # [batch, length + max_decode_len]
      prefix = None if prefix is None else jnp.pad(prefix, widen)
    prompt = prompt.astype(jnp.int32)
    max_len = prompt.shape[1]

    def decode(variables: PyTree, ids: jax.Array, **kwargs: Any) -> tuple[jax.Array, PyTree]:
      logits, new_vars = self.module.apply(
        variables, ids, None, enable_dropout=False, decode=True, mutable=["cache"], **kwargs
      )
      return logits, new_vars["cache"]

    # The first decode=True apply only creates zeroed caches; the second prefills them.
    _, cache = decode({"params": params}, jnp.ones((prompt.shape[0], max_len), jnp.int32))
    _, cache = decode(
      {"params": params, "cache": cache}, prompt, decoder_causal_attention=prefix, prefill=True
    )
    cache = decoding.expand_to_beams(cache, num_decodes)

    def tokens_to_logits(ids: jax.Array, step_cache: PyTree) -> tuple[jax.Array, PyTree]:
      logits, new_cache = decode({"params": params, "cache": step_cache}, ids)  # [rows, 1, vocab]
      return logits[:, 0, :].astype(jnp.float32), new_cache  # [rows, vocab]

    return prompt, cache, tokens_to_logits, jnp.min(layers.prompt_end(prompt))

  def _generated(
    self, tokens: jax.Array, prompt: jax.Array, max_decode_len: int | None
  ) -> jax.Array:
    """Cuts each row's prompt off decoded tokens [batch, decodes, len] (zeros after),
    and the continuation to `max_decode_len` tokens if given."""
    width = tokens.shape[-1]
    prompt_length = layers.prompt_end(prompt)  # [batch]
    source = jnp.arange(width)[None, :] + prompt_length[:, None]  # [batch, len]
    source = jnp.broadcast_to(source[:, None, :], tokens.shape)  # [batch, decodes, len]
    shifted = jnp.take_along_axis(tokens, jnp.minimum(source, width - 1), axis=-1)
    generated = jnp.where(source < width, shifted, 0)
    return generated[..., :max_decode_len] if max_decode_len else generated


def _zero_after_eos(tokens: jax.Array, eos_id: int) -> jax.Array:
  """Zeroes every position after the first EOS of each sequence ([..., length])."""
  eos_seen = jnp.cumsum(tokens == eos_id, axis=-1)  # [..., length]
  after_first = (eos_seen - (tokens == eos_id)) > 0
  return jnp.where(after_first, 0, tokens)


def network_module(config: network.T5Config) -> nn.Module:
  """The network of `config.architecture` (and `share_encoder_decoder`)."""
  if config.architecture != "encoder_decoder":
    return decoder_only.DecoderOnlyTransformer(config=config)
  if config.share_encoder_decoder:
    return shared_encoder_decoder.SharedTransformer(config=config)
  return network.Transformer(config=config)


def init_params(config: network.T5Config, rng: jax.Array) -> PyTree:
  """Boxed initial params of `network_module(config)`."""
  if config.architecture != "encoder_decoder":
    return decoder_only.init_params(config, rng)
  if config.share_encoder_decoder:
    return shared_encoder_decoder.init_params(config, rng)
  return network.init_params(config, rng)


@gin.configurable
def build_model(
  config: network.T5Config | None = None, vocabulary: seqio.Vocabulary | None = None
) -> BaseTransformerModel:
  """The model of `config.architecture` over its network and the configured vocabulary.

  'encoder_decoder': `EncoderDecoderModel` over `network.Transformer(config)` (or
  `shared_encoder_decoder.SharedTransformer(config)` with `share_encoder_decoder`);
  'decoder_only' and 'prefix_lm': `DecoderOnlyModel` over
  `decoder_only.DecoderOnlyTransformer(config)`.

  Train, eval and infer build their model here: train from `T5Config()` with its
  gin bindings (gin/models/...), eval and infer from the checkpoint's stored config
  (`checkpoints.model_config`).

  Args:
    config: network config; default: `T5Config()` with its gin bindings.
    vocabulary: of inputs and targets; default `vocab.get_vocabulary()`
      (gin: `get_vocabulary.sentencepiece_model_file`), e.g.
      `build_model.vocabulary = @seqio.ByteVocabulary()` for a byte-level model.

  Raises:
    ConfigError: if the vocabulary has more ids than the network's embedding.
  """
  from t5x_lite.data import vocab  # TensorFlow only when a model is configured

  config = config or network.T5Config()  # pyright: ignore[reportCallIssue]  # gin binds it
  vocabulary = vocabulary or vocab.get_vocabulary()
  if vocabulary.vocab_size > config.vocab_size:
    raise ConfigError(
      f"The vocabulary has {vocabulary.vocab_size} ids but T5Config.vocab_size is "
      f"{config.vocab_size}; set T5Config.vocab_size >= {vocabulary.vocab_size}."
    )
  model_cls = EncoderDecoderModel if config.architecture == "encoder_decoder" else DecoderOnlyModel
  return model_cls(
    module=network_module(config), input_vocabulary=vocabulary, output_vocabulary=vocabulary
  )
