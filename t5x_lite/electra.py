"""ELECTRA-style pre-training of the T5 encoder-decoder (METRO-T5, Gong et al. 2023).

A small generator, an encoder-only Transformer sharing the discriminator's token
embedding (ELECTRA, Clark et al. 2020), fills i.i.d.-masked positions of the input text
with tokens sampled from its masked-language-model softmax. The T5 encoder reads the
corrupted text; a dense replaced-token-detection (RTD) head on its output gives one
logit per token ("replaced?"); the decoder reconstructs the original text (corrective
language modelling, CLM). Per batch:

  original   = encoder_input_tokens                   [batch, input_len]
  masked     = i.i.d. Bernoulli(mask_rate) over the non-padding, non-EOS positions
  generator  : original with masked -> mask_id        -> MLM logits [batch, input_len, vocab]
  corrupted  = where(masked, sample(stop_gradient(MLM logits)), original)
  replaced   = corrupted != original                  (a sample equal to the original
                                                       is labelled original)
  loss = mlm_weight * MLM + rtd_weight * RTD + clm_weight * CLM

  MLM = sum over masked positions of CE(generator, original) / (factor * mask_rate)
  RTD = sum over non-padding inputs of BCE(rtd logit, replaced) / factor
  CLM = the discriminator's own cross-entropy (z-loss, label smoothing) against
        decoder_target_tokens, the original text, / factor

`factor` is the discriminator's loss normalizing factor (`EncoderDecoderModel.
loss_normalizing_factor`, per target token in gin/runs/pretrain.gin), the same for
every microbatch of a step, so accumulated losses equal the full batch's. Dividing the
MLM sum by mask_rate as well makes it (in expectation) a mean over masked positions,
on the scale of the per-token RTD term, which ELECTRA's weights (1 and 50) assume.
Sampling happens on stop-gradient logits and gives integer ids, so the RTD and CLM
terms send no gradient into the generator; the shared embedding learns from all three.

The generator and the RTD head are trained params (subtrees `generator/` and
`rtd_head/`, named in `checkpoints.PRETRAINING_ONLY_PARAMS`), sharded by their logical
axes and updated by the same optimizer; the rest of the tree is exactly the
discriminator's T5 network. Its checkpoints store the discriminator's config, so eval,
infer and fine-tuning (`train.initial_checkpoint_path`) build a plain
`EncoderDecoderModel` and drop the two subtrees with one warning. Evaluation
(`eval_fn`, no dropout RNG) masks and samples with a fixed key, so the eval loss is the
same objective, deterministic; scores and predictions are the discriminator's.

The features are seqio's encoder-decoder ones, inputs and targets both the text
(`objectives.electra_text`, the `cpython_electra` task); masking happens in the graph.

  python -m t5x_lite.train --gin_file=quickstart_electra.gin   # or add runs/electra.gin
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Mapping, cast

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp

from t5x_lite import base_model, models
from t5x_lite.checkpoint import checkpoints
from t5x_lite.core.errors import ConfigError
from t5x_lite.core.types import Array, PyTree
from t5x_lite.nn import blocks, flops, layers, losses, network

if TYPE_CHECKING:
  import seqio

Batch = Mapping[str, jax.Array]
# Masking and sampling key of evaluation (no dropout RNG): the eval loss is deterministic.
_EVAL_KEY = 0
_METRICS = ("electra_mlm", "electra_rtd", "electra_clm")


class _ProjectedEmbedding(nn.Module):
  """The shared token embedding, projected to the generator's width (ELECTRA's
  embedding projection of a smaller generator).

  Attributes:
    embedder: the discriminator's `network.token_embedder`.
    config: the generator's config (its `emb_dim` is the output width).
  """

  embedder: nn.Module
  config: network.T5Config

  @nn.compact
  def __call__(self, ids: Array) -> Array:
    """ids [batch, length] -> [batch, length, generator width]."""
    cfg = self.config
    x = self.embedder(ids)  # [batch, length, embed]
    return layers.Projection(
      features=(cfg.emb_dim,),
      kernel_axes=("embed", "mlp"),
      kernels=blocks.kernels(cfg),
      dtype=cfg.dtype,
      param_dtype=cfg.param_dtype,
      name="projection",
    )(x)  # [batch, length, generator width]


class ElectraHeads(nn.Module):
  """The generator (a T5 encoder stack over the shared embedding, with a tied MLM head)
  and the RTD head. Its `token_embedder` params are the discriminator's.

  Attributes:
    config: the discriminator's config.
    generator_config: the generator's (same vocabulary, smaller width).
  """

  config: network.T5Config
  generator_config: network.T5Config

  def setup(self):
    cfg, gen = self.config, self.generator_config
    self.token_embedder = network.token_embedder(cfg)
    self.generator = _Generator(config=gen, embed_dim=cfg.emb_dim, embedder=self.token_embedder)
    # One logit per token: its output axis is named 'kv', which every rule table leaves
    # unsharded (and Adafactor treats as a column).
    self.rtd_head = layers.Projection(
      features=(1,),
      kernel_axes=("embed", "kv"),
      kernels=blocks.kernels(cfg),
      dtype=cfg.dtype,
      param_dtype=cfg.param_dtype,
      out_dtype=jnp.float32,
    )

  def __call__(self, tokens: Array, encoded: Array) -> tuple[Array, Array]:
    """Both heads (initialisation): (MLM logits, RTD logits)."""
    return self.mlm_logits(tokens, None, True), self.rtd_logits(encoded)

  def mlm_logits(self, tokens: Array, segment_ids: Array | None, deterministic: bool) -> Array:
    """Generator tokens [batch, length] -> float32 MLM logits [batch, length, vocab]."""
    return self.generator(tokens, segment_ids, deterministic)

  def rtd_logits(self, encoded: Array) -> Array:
    """Encoder output [batch, length, embed] -> float32 "replaced" logits [batch, length]."""
    return self.rtd_head(encoded)[..., 0]


class _Generator(nn.Module):
  """Embedding projection, T5 encoder layers, then dense -> GELU -> RMSNorm -> tied logits."""

  config: network.T5Config
  embed_dim: int
  embedder: nn.Module

  @nn.compact
  def __call__(self, tokens: Array, segment_ids: Array | None, deterministic: bool) -> Array:
    cfg = self.config
    embed = _ProjectedEmbedding(embedder=self.embedder, config=cfg, name="embed")
    x = network.Encoder(config=cfg, shared_embedding=embed, name="encoder")(
      tokens, segment_ids, None, deterministic
    )  # [batch, length, generator width]
    x = layers.Projection(
      features=(self.embed_dim,),
      kernel_axes=("mlp", "embed"),
      kernels=blocks.kernels(cfg),
      dtype=cfg.dtype,
      param_dtype=cfg.param_dtype,
      name="mlm_dense",
    )(x)  # [batch, length, embed]
    x = blocks.norm(cfg, "mlm_norm", in_layer=False)(nn.gelu(x, approximate=True))
    # Tied to the shared embedding, scaled as T5 1.0's tied logits: [batch, length, vocab]
    return self.embedder.attend(x / jnp.sqrt(self.embed_dim).astype(x.dtype))


def generator_config(
  config: network.T5Config, width_fraction: float, num_layers: int | None
) -> network.T5Config:
  """The generator's config: the discriminator's encoder, `width_fraction` as wide
  (embedding, attention and MLP widths scaled alike) and `num_layers` deep (default: as
  deep as the discriminator's encoder). The heads get narrower, not fewer, so the
  generator's 'heads' axis shards over the mesh wherever the discriminator's does."""
  return dataclasses.replace(
    config,
    emb_dim=max(1, round(config.emb_dim * width_fraction)),
    head_dim=max(1, round(config.head_dim * width_fraction)),
    mlp_dim=max(1, round(config.mlp_dim * width_fraction)),
    num_encoder_layers=config.num_encoder_layers if num_layers is None else num_layers,
    num_decoder_layers=0,
    adapter_dim=0,
    share_encoder_decoder=False,
  )


def rtd_labels(corrupted: jax.Array, original: jax.Array) -> jax.Array:
  """Replaced-token labels [batch, length] float32: exactly `corrupted != original`."""
  return (corrupted != original).astype(jnp.float32)


class ElectraModel(base_model.DelegatingModel):
  """The T5 encoder-decoder pre-trained with a generator, RTD and corrective LM
  (see the module docstring); it evaluates, scores and predicts as the discriminator.

  Args:
    discriminator: the T5 model that is pre-trained (and later fine-tuned).
    generator: the generator's config (`generator_config`).
    mask_rate: probability that a non-padding, non-EOS input token is masked.
    mask_id: the id masked positions take in the generator's input (the top sentinel).
    mlm_weight, rtd_weight, clm_weight: the three terms' weights.
  """

  def __init__(
    self,
    discriminator: models.EncoderDecoderModel,
    generator: network.T5Config,
    *,
    mask_rate: float,
    mask_id: int,
    mlm_weight: float,
    rtd_weight: float,
    clm_weight: float,
  ):
    super().__init__(discriminator)
    self.discriminator = discriminator
    self.generator = generator
    self.heads = ElectraHeads(config=discriminator.network_config, generator_config=generator)
    self.mask_rate = mask_rate
    self.mask_id = mask_id
    self.weights = {"electra_mlm": mlm_weight, "electra_rtd": rtd_weight, "electra_clm": clm_weight}

  def init_params(self, rng: jax.Array) -> PyTree:
    """The discriminator's boxed params plus `generator/` and `rtd_head/`."""
    network_rng, heads_rng = jax.random.split(rng)
    params = dict(self.discriminator.init_params(network_rng))
    tokens = jnp.ones((1, 1), jnp.int32)  # [batch, length]
    encoded = jnp.ones((1, 1, self.network_config.emb_dim), jnp.float32)
    heads = self.heads.init({"params": heads_rng, "dropout": heads_rng}, tokens, encoded)
    params.update({k: heads["params"][k] for k in checkpoints.PRETRAINING_ONLY_PARAMS})
    return params

  def inner_params(self, params: PyTree) -> PyTree:
    """The T5 network's params: `params` without the generator and the RTD head."""
    return {k: v for k, v in params.items() if k not in checkpoints.PRETRAINING_ONLY_PARAMS}

  def _heads(self, params: PyTree) -> dict[str, PyTree]:
    names = ("token_embedder", *checkpoints.PRETRAINING_ONLY_PARAMS)
    return {"params": {k: params[k] for k in names}}

  def train_flops_per_step(self, batch_size: int, input_length: int, target_length: int) -> float:
    """The discriminator's training FLOPs plus the generator's forward and backward
    (its encoder, embedding projection, MLM dense and tied logits) and the RTD head's."""
    gen, width = self.generator, self.network_config.emb_dim
    generator = flops.forward_flops(gen, input_length, 0)
    generator += 2.0 * input_length * width * gen.emb_dim * 2  # embedding projection, MLM dense
    generator += 2.0 * input_length * width * gen.vocab_size  # tied MLM logits
    rtd = 2.0 * input_length * width
    network_flops = self.discriminator.train_flops_per_step(batch_size, input_length, target_length)
    return network_flops + 3.0 * (generator + rtd) * batch_size

  def corrupt(
    self, params: PyTree, batch: Batch, rng: jax.Array, dropout_rng: jax.Array | None
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Masks, runs the generator and fills the masked positions with its samples.

    Returns:
      (masked [batch, length] bool, MLM logits [batch, length, vocab] float32,
      corrupted [batch, length] int32: the encoder's input).
    """
    original = batch["encoder_input_tokens"]  # [batch, length]
    mask_rng, sample_rng = jax.random.split(rng)
    maskable = (original > 0) & (original != self.input_vocabulary.eos_id)
    masked = maskable & (jax.random.uniform(mask_rng, original.shape) < self.mask_rate)
    generator_input = jnp.where(masked, self.mask_id, original)
    mlm_logits = cast(  # flax's apply is typed as returning (output, variables) too
      jax.Array,
      self.heads.apply(
        self._heads(params),
        generator_input,
        batch.get("encoder_segment_ids"),
        dropout_rng is None,
        method="mlm_logits",
        rngs=None if dropout_rng is None else {"dropout": dropout_rng},
      ),
    )  # [batch, length, vocab]
    # Never sample padding (it would hide the position from the encoder) or ids past the
    # vocabulary (the embedding's unused rows).
    ids = jnp.arange(mlm_logits.shape[-1])
    allowed = (ids > 0) & (ids < self.input_vocabulary.vocab_size)
    sample_logits = jnp.where(allowed, jax.lax.stop_gradient(mlm_logits), -jnp.inf)
    samples = jax.random.categorical(sample_rng, sample_logits, axis=-1)  # [batch, length]
    corrupted = jnp.where(masked, samples.astype(original.dtype), original)
    return masked, mlm_logits, corrupted

  def _discriminate(
    self, params: PyTree, batch: Batch, corrupted: jax.Array, dropout_rng: jax.Array | None
  ) -> tuple[jax.Array, jax.Array]:
    """The T5 network on the corrupted inputs [batch, input_len].

    Returns:
      (RTD logits [batch, input_len], the decoder's logits [batch, target_len, vocab]).
    """
    module, enable_dropout = self.discriminator.module, dropout_rng is not None
    variables = {"params": self.inner_params(params)}
    rngs = None if dropout_rng is None else {"dropout": dropout_rng}
    encoded = module.apply(
      variables,
      corrupted,
      encoder_segment_ids=batch.get("encoder_segment_ids"),
      encoder_positions=batch.get("encoder_positions"),
      enable_dropout=enable_dropout,
      method="encode",
      rngs=rngs,
    )  # [batch, input_len, embed]
    rtd_logits = self.heads.apply(self._heads(params), encoded, method="rtd_logits")
    logits = module.apply(
      variables,
      encoded,
      corrupted,
      batch["decoder_input_tokens"],
      batch["decoder_target_tokens"],
      batch.get("encoder_segment_ids"),
      batch.get("decoder_segment_ids"),
      batch.get("decoder_positions"),
      enable_dropout,
      method="decode",
      rngs=rngs,
    )  # [batch, target_len, vocab]
    return cast(jax.Array, rtd_logits), cast(jax.Array, logits)

  def loss_fn(
    self,
    params: PyTree,
    batch: Batch,
    dropout_rng: jax.Array | None,
    *,
    normalization: base_model.Normalization | None = None,
    aux_state: PyTree = None,
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The ELECTRA objective (module docstring) and metric sums.

    Returns:
      (loss, sums): `losses.metric_sums` of the decoder's corrective LM, with `loss`
      the weighted objective, plus each term (`electra_mlm`, `electra_rtd`,
      `electra_clm`, before their weights) and the RTD counts.
    """
    del aux_state
    factor, weights = normalization or self.loss_normalization(batch)
    if dropout_rng is None:
      rng, generator_rng, discriminator_rng = jax.random.PRNGKey(_EVAL_KEY), None, None
    else:
      rng, generator_rng, discriminator_rng = jax.random.split(dropout_rng, 3)
    original = batch["encoder_input_tokens"]
    masked, mlm_logits, corrupted = self.corrupt(params, batch, rng, generator_rng)
    mlm_ce, _ = losses.cross_entropy_with_integer_labels(mlm_logits, original, 1.0, 0.0, 0.0)
    mlm = jnp.sum(mlm_ce * masked) / (factor * self.mask_rate)

    rtd_logits, logits = self._discriminate(params, batch, corrupted, discriminator_rng)
    replaced = rtd_labels(corrupted, original)  # [batch, input_len]
    inputs = (original > 0).astype(jnp.float32)
    rtd = jnp.sum(sigmoid_bce(rtd_logits, replaced) * inputs) / factor
    disc = self.discriminator
    clm, z_loss = disc.cross_entropy(logits, batch, weights, factor)
    terms = {"electra_mlm": mlm, "electra_rtd": rtd, "electra_clm": clm}
    loss = (
      self.weights["electra_mlm"] * mlm
      + self.weights["electra_rtd"] * rtd
      + self.weights["electra_clm"] * clm
    )
    correct = disc.token_correct(logits, batch["decoder_target_tokens"])
    sums = losses.metric_sums(correct, batch, weights, clm, z_loss)
    rtd_counts = {
      "rtd_correct": jnp.sum(((rtd_logits > 0) == (replaced > 0)) * inputs),
      "rtd_positions": jnp.sum(inputs),
      "rtd_replaced": jnp.sum(replaced * inputs),
      "rtd_masked": jnp.sum(masked.astype(jnp.float32)),
    }
    return loss, {**sums, **terms, **rtd_counts, "loss": loss}

  def finalize_metrics(self, sums: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """The discriminator's metrics (of its corrective LM), the weighted objective as
    `loss`, each term, `rtd_accuracy` and `replaced_fraction` (of the masked positions,
    how many samples differ from the original)."""
    metrics = self.discriminator.finalize_metrics(sums)
    metrics.update({name: sums[name] for name in _METRICS})
    metrics["rtd_accuracy"] = sums["rtd_correct"] / jnp.maximum(sums["rtd_positions"], 1.0)
    metrics["replaced_fraction"] = sums["rtd_replaced"] / jnp.maximum(sums["rtd_masked"], 1.0)
    return metrics


def sigmoid_bce(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Binary cross-entropy of logits against 0/1 labels, elementwise, float32 and stable:
  softplus(logits) - labels * logits."""
  logits = logits.astype(jnp.float32)
  return jax.nn.softplus(logits) - labels * logits


@gin.configurable
def build_electra_model(
  config: network.T5Config | None = None,
  vocabulary: seqio.Vocabulary | None = None,
  generator_width_fraction: float = 0.25,
  generator_num_layers: int | None = None,
  mask_rate: float = 0.15,
  mlm_weight: float = 1.0,
  rtd_weight: float = 50.0,
  clm_weight: float = 1.0,
) -> ElectraModel:
  """The `ElectraModel` of `models.build_model(config, vocabulary)` as discriminator.

  Args:
    config: the discriminator's network config; default `T5Config()` with its gin
      bindings (an encoder-decoder).
    vocabulary: default `vocab.get_vocabulary()`.
    generator_width_fraction: the generator's width over the discriminator's, in
      (0, 1] (ELECTRA: 1/4 to 1/3).
    generator_num_layers: the generator's depth, at most the discriminator encoder's;
      None: the same depth.
    mask_rate: in (0, 1).
    mlm_weight, rtd_weight, clm_weight: the terms' weights, >= 0 (ELECTRA: 1, 50).

  Raises:
    ConfigError: naming the binding that is out of range, a decoder-only config, or a
      chunked discriminator loss.
  """
  name = "build_electra_model"
  weights = {"mlm_weight": mlm_weight, "rtd_weight": rtd_weight, "clm_weight": clm_weight}
  for field, value in weights.items():
    if value < 0:
      raise ConfigError(f"{name}.{field} must be >= 0, got {value}.")
  if not 0.0 < mask_rate < 1.0:
    raise ConfigError(f"{name}.mask_rate must be in (0, 1), got {mask_rate}.")
  if not 0.0 < generator_width_fraction <= 1.0:
    raise ConfigError(
      f"{name}.generator_width_fraction must be in (0, 1] (the generator may not be wider "
      f"than the discriminator), got {generator_width_fraction}."
    )
  discriminator = models.build_model(config, vocabulary)
  cfg = discriminator.network_config
  if cfg.architecture != "encoder_decoder":
    raise ConfigError(
      f"ELECTRA pre-training needs an encoder-decoder; T5Config.architecture is "
      f"{cfg.architecture!r}."
    )
  assert isinstance(discriminator, models.EncoderDecoderModel)  # the architecture's model
  if generator_num_layers is not None and not 0 < generator_num_layers <= cfg.num_encoder_layers:
    raise ConfigError(
      f"{name}.generator_num_layers must be in [1, {cfg.num_encoder_layers}] (the "
      f"discriminator's encoder layers), got {generator_num_layers}."
    )
  if discriminator.loss_chunk_length:
    raise ConfigError(
      "ELECTRA pre-training computes whole logits; unset "
      f"EncoderDecoderModel.loss_chunk_length (it is {discriminator.loss_chunk_length})."
    )
  vocab = discriminator.input_vocabulary
  return ElectraModel(
    discriminator=discriminator,
    generator=generator_config(cfg, generator_width_fraction, generator_num_layers),
    mask_rate=mask_rate,
    mask_id=vocab.vocab_size - 1,
    mlm_weight=mlm_weight,
    rtd_weight=rtd_weight,
    clm_weight=clm_weight,
  )
