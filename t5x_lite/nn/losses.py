"""Cross-entropy with z-loss and label smoothing, loss normalization, metric sums.

Pure functions (no jit, no mesh), following T5X's `t5x/losses.py`:

* `cross_entropy_with_integer_labels` is T5X's `cross_entropy_with_logits` (soft
  targets, plus the z-loss `z_loss * log(Z)**2` that keeps the softmax normaliser
  near 1) for label-smoothed one-hot targets given as ids, with a hand-written
  gradient; no [..., vocab] target array is ever built.
* `compute_weighted_cross_entropy` applies T5X label smoothing (confidence `1 - ls`,
  every other class `ls / (vocab - 1)`, the entropy of that target distribution
  subtracted so a perfect model scores 0), per-token weights and a normalizing factor.
* `get_loss_normalizing_factor_and_weights` turns a normalizing mode (None, a number,
  'NUM_REAL_TARGET_TOKENS', 'NUM_TOTAL_TARGET_TOKENS', 'AVERAGE_PER_SEQUENCE') into a
  factor and per-token weights for a whole batch. The trainer computes them once for
  the full batch so that gradient accumulation over microbatches stays exact.
* `chunked_cross_entropy` is the same loss computed from the output layer's input a
  few target positions at a time, so the [batch, length, vocab] logits and their
  gradient never exist whole (`EncoderDecoderModel.loss_chunk_length`).
* `metric_sums` / `finalize_metrics`: metrics are carried as sums (they add across
  microbatches and devices) and turned into ratios once at the end.
"""

from typing import Callable, Mapping, Union

import jax
import jax.numpy as jnp
import numpy as np

from t5x_lite.kernels import reference
from t5x_lite.kernels.base import ArgmaxFn

LossNormalizingFactor = Union[None, float, int, str]
SPECIAL_LOSS_NORMALIZING_FACTORS = (
  "NUM_REAL_TARGET_TOKENS",
  "NUM_TOTAL_TARGET_TOKENS",
  "AVERAGE_PER_SEQUENCE",
)


def _cross_entropy_with_integer_labels(
  logits: jax.Array, targets: jax.Array, confidence: float, low_confidence: float, z_loss: float
) -> tuple[jax.Array, jax.Array]:
  """Cross-entropy against label-smoothed one-hot targets, plus the z-loss.

  The loss against `soft = one_hot(targets) * (confidence - low_confidence) +
  low_confidence` without building `soft`: the loss reads the target's logit and the
  row's sum (masked reductions that fuse with the logits), and the gradient forms
  `softmax - soft` in one pass over the logits. The
  backward pass keeps only the logits and log Z, where T5X's soft-target form keeps
  three [..., vocab] arrays (the targets, exp(logits - max) and the log-softmax).

  Args:
    logits: [..., vocab] unnormalised log-probabilities.
    targets: [...] integer class ids.
    confidence: probability of the target class.
    low_confidence: probability of every other class.
    z_loss: coefficient of the squared log-partition-function penalty.

  Returns:
    (loss, z_loss_term), both [...]; `loss` already includes `z_loss_term`.
  """
  loss, total_z_loss, _ = _integer_label_cross_entropy(
    logits, targets, confidence, low_confidence, z_loss
  )
  return loss, total_z_loss


# A custom_vjp object (its own docstring is the function's above); its gradient below.
cross_entropy_with_integer_labels = jax.custom_vjp(
  _cross_entropy_with_integer_labels, nondiff_argnums=(2, 3, 4)
)


def _is_target(targets: jax.Array, logits: jax.Array) -> jax.Array:
  """[..., vocab] bool, true at each row's target id (a fused compare, never stored)."""
  return targets[..., None] == jnp.arange(logits.shape[-1], dtype=targets.dtype)


def _integer_label_cross_entropy(logits, targets, confidence, low_confidence, z_loss):
  log_z = jax.nn.logsumexp(logits, axis=-1)  # [...]
  # A masked sum, not a gather, so that logits sharded over the vocabulary stay sharded.
  target_logit = jnp.sum(jnp.where(_is_target(targets, logits), logits, 0.0), axis=-1)  # [...]
  total_z_loss = z_loss * jnp.square(log_z)
  # -sum_v soft_v (logit_v - log_z) with soft = low + (confidence - low) * onehot.
  loss = -(confidence - low_confidence) * (target_logit - log_z) + total_z_loss
  if low_confidence:
    loss = loss - low_confidence * jnp.sum(logits - log_z[..., None], axis=-1)
  return loss, total_z_loss, log_z


def _integer_label_fwd(logits, targets, confidence, low_confidence, z_loss):
  loss, total_z_loss, log_z = _integer_label_cross_entropy(
    logits, targets, confidence, low_confidence, z_loss
  )
  return (loss, total_z_loss), (logits, targets, log_z)


def _integer_label_bwd(confidence, low_confidence, z_loss, residuals, grads):
  g = grads[0]  # [...]; only the total loss is differentiated
  logits, targets, log_z = residuals
  vocab = logits.shape[-1]
  softmax = jnp.exp(logits - log_z[..., None])  # [..., vocab]
  target_mass = confidence + (vocab - 1) * low_confidence
  soft = jnp.where(_is_target(targets, logits), confidence, low_confidence)  # [..., vocab]
  # d/dlogits [-sum(soft * log_softmax) + z * log_z^2] = (sum(soft) + 2 z log_z) softmax - soft.
  scale = (target_mass + 2.0 * z_loss * log_z)[..., None]  # [..., 1]
  g_logits = g[..., None] * (scale * softmax - soft)
  return g_logits.astype(logits.dtype), None


cross_entropy_with_integer_labels.defvjp(_integer_label_fwd, _integer_label_bwd)


def label_smoothing_constants(
  vocab_size: int, label_smoothing: float
) -> tuple[float, float, float]:
  """T5X label-smoothing constants.

  Args:
    vocab_size: number of classes.
    label_smoothing: probability mass moved off the true class.

  Returns:
    (confidence, low_confidence, normalizing_constant) where the normalizing constant
    is the entropy of the smoothed target distribution (0 without smoothing).
  """
  confidence = 1.0 - label_smoothing
  low_confidence = (1.0 - confidence) / (vocab_size - 1)
  normalizing_constant = -(
    confidence * np.log(confidence)
    + (vocab_size - 1) * low_confidence * np.log(low_confidence + 1e-20)
  )
  return confidence, low_confidence, float(normalizing_constant)


def compute_weighted_cross_entropy(
  logits: jax.Array,
  targets: jax.Array,
  weights: jax.Array | None = None,
  label_smoothing: float = 0.0,
  z_loss: float = 0.0,
  loss_normalizing_factor: float | jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Weighted, label-smoothed cross-entropy with z-loss, summed over tokens.

  Args:
    logits: [batch, length, vocab] float logits.
    targets: [batch, length] int target ids.
    weights: [batch, length] per-token weights; None weighs every position by 1.
    label_smoothing: T5X label smoothing amount.
    z_loss: z-loss coefficient.
    loss_normalizing_factor: the summed loss is divided by this (None: no division).

  Returns:
    (loss, z_loss_sum, weight_sum): scalar loss (including z-loss), scalar z-loss part,
    and the sum of the weights.
  """
  vocab_size = logits.shape[-1]
  confidence, low_confidence, normalizing_constant = label_smoothing_constants(
    vocab_size, label_smoothing
  )
  total_loss, total_z_loss = cross_entropy_with_integer_labels(
    logits, targets, confidence, low_confidence, z_loss
  )  # [batch, length] each
  total_loss = total_loss - normalizing_constant  # [batch, length]
  if weights is None:
    weight_sum = jnp.asarray(np.prod(targets.shape), jnp.float32)
  else:
    total_loss = total_loss * weights
    total_z_loss = total_z_loss * weights
    weight_sum = jnp.sum(weights)
  if loss_normalizing_factor is not None:
    total_loss = total_loss / loss_normalizing_factor
    total_z_loss = total_z_loss / loss_normalizing_factor
  return jnp.sum(total_loss), jnp.sum(total_z_loss), weight_sum


def chunked_cross_entropy(
  logits_fn: Callable[[jax.Array], jax.Array],
  hidden: jax.Array,
  targets: jax.Array,
  weights: jax.Array,
  chunk_length: int,
  label_smoothing: float = 0.0,
  z_loss: float = 0.0,
  loss_normalizing_factor: float | jax.Array | None = None,
  argmax: ArgmaxFn = reference.argmax,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`compute_weighted_cross_entropy` of `logits_fn(hidden)`, `chunk_length` positions
  at a time, without ever holding the whole [batch, length, vocab] logits.

  A scan over chunks of the length axis; each chunk's logits are recomputed in the
  backward pass (`jax.checkpoint`), so the forward keeps only the hidden states and
  the backward holds one chunk's logits and their gradient at a time. The batch axis
  stays whole, so a batch sharded over devices stays sharded. The tail chunk is padded
  with weight-0 positions.

  Args:
    logits_fn: hidden [batch, chunk_length, embed] -> float32 logits
      [batch, chunk_length, vocab] (the output layer; it may close over params).
    hidden: [batch, length, embed] the output layer's input.
    targets: [batch, length] int target ids.
    weights: [batch, length] per-token weights.
    chunk_length: target positions per chunk, >= 1.
    label_smoothing, z_loss, loss_normalizing_factor: as `compute_weighted_cross_entropy`.
    argmax: `token_correct`'s.

  Returns:
    (loss, z_loss_sum, correct): the scalar loss and z-loss part as
    `compute_weighted_cross_entropy` returns them, and `token_correct` [batch, length].
  """
  batch, length = targets.shape
  chunks = -(-length // chunk_length)
  pad = chunks * chunk_length - length

  def split(x: jax.Array) -> jax.Array:
    """[batch, length, ...] -> [chunks, batch, chunk_length, ...]"""
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape((batch, chunks, chunk_length) + x.shape[2:])
    return jnp.swapaxes(x, 0, 1)

  @jax.checkpoint
  def chunk_loss(h: jax.Array, t: jax.Array, w: jax.Array) -> tuple[jax.Array, ...]:
    logits = logits_fn(h)  # [batch, chunk_length, vocab]
    loss, z, _ = compute_weighted_cross_entropy(
      logits, t, w, label_smoothing, z_loss, loss_normalizing_factor
    )
    return loss, z, token_correct(logits, t, argmax)

  def body(totals: tuple[jax.Array, jax.Array], xs: tuple[jax.Array, ...]):
    loss, z, correct = chunk_loss(*xs)
    return (totals[0] + loss, totals[1] + z), correct

  zero = jnp.zeros((), jnp.float32)
  (loss, z), correct = jax.lax.scan(
    body, (zero, zero), (split(hidden), split(targets), split(weights.astype(jnp.float32)))
  )  # correct: [chunks, batch, chunk_length]
  correct = jnp.swapaxes(correct, 0, 1).reshape(batch, chunks * chunk_length)[:, :length]
  return loss, z, correct


def token_correct(
  logits: jax.Array, targets: jax.Array, argmax: ArgmaxFn = reference.argmax
) -> jax.Array:
  """[batch, length] bool: the logits' argmax is the target.

  `argmax` is the network's kernels' (`Kernels.argmax`); every set's gives the same ids.
  """
  return argmax(logits) == targets


def sum_weights_per_segment(segment_ids: jax.Array, weights: jax.Array) -> jax.Array:
  """For every position, the summed weight of the packed segment it belongs to.

  Args:
    segment_ids: [batch, length] int segment ids (0 = padding).
    weights: [batch, length] token weights.

  Returns:
    [batch, length] per-position segment totals (padding positions get the total of
    segment 0, which callers zero out through their own zero weight).
  """
  length = segment_ids.shape[-1]

  def per_row(seg: jax.Array, w: jax.Array) -> jax.Array:
    totals = jax.ops.segment_sum(w, seg, num_segments=length + 1)  # [length + 1]
    return totals[seg]  # [length]

  return jax.vmap(per_row)(segment_ids.astype(jnp.int32), weights)


def get_loss_normalizing_factor_and_weights(
  loss_normalizing_factor: LossNormalizingFactor,
  batch: Mapping[str, jax.Array],
) -> tuple[float | jax.Array | None, jax.Array]:
  """Resolves a normalizing mode into (factor, weights) for one batch (T5X semantics).

  Weights are `decoder_loss_weights` when present, else `decoder_target_tokens > 0`.

  Args:
    loss_normalizing_factor: None (per-token sum), a number, or one of
      'NUM_REAL_TARGET_TOKENS' (sum of weights), 'NUM_TOTAL_TARGET_TOKENS' (all target
      positions), 'AVERAGE_PER_SEQUENCE' (each sequence, or packed segment, averaged
      over its own tokens, then summed; factor = number of sequences with weight).
    batch: features with at least `decoder_target_tokens` [batch, length]; with
      packing also `decoder_segment_ids`.

  Returns:
    (factor, weights [batch, length] float32); factor is None, a Python number or a
    scalar array.

  Raises:
    ValueError: for an unknown special mode.
  """
  targets = batch["decoder_target_tokens"]
  weights = batch.get("decoder_loss_weights")
  if weights is None:
    weights = targets > 0
  weights = jnp.asarray(weights, jnp.float32)
  if loss_normalizing_factor is None or not isinstance(loss_normalizing_factor, str):
    return loss_normalizing_factor, weights
  if loss_normalizing_factor == "NUM_REAL_TARGET_TOKENS":
    return jnp.sum(weights), weights
  if loss_normalizing_factor == "NUM_TOTAL_TARGET_TOKENS":
    return float(np.prod(targets.shape)), weights
  if loss_normalizing_factor == "AVERAGE_PER_SEQUENCE":
    if "decoder_segment_ids" in batch:
      norm = sum_weights_per_segment(batch["decoder_segment_ids"], weights)
    else:
      norm = jnp.sum(weights, axis=-1, keepdims=True)  # [batch, 1]
    safe_norm = jnp.where(norm > 0, norm, 1.0)
    weights = jnp.where(norm > 0, weights / safe_norm, 0.0)
    return jnp.sum(weights), weights
  raise ValueError(
    f"Unknown loss_normalizing_factor {loss_normalizing_factor!r}; expected None, a "
    f"number or one of {SPECIAL_LOSS_NORMALIZING_FACTORS}."
  )


def input_tokens(batch: Mapping[str, jax.Array]) -> jax.Array:
  """[batch, length] bool: the non-padding input tokens of a batch.

  Encoder-decoder: `encoder_input_tokens` > 0. Decoder-only: the inputs (prefix) in
  `decoder_input_tokens`, where `decoder_causal_attention` is 1 (seqio's
  PrefixLMFeatureConverter); none for a plain language model.
  """
  if "encoder_input_tokens" in batch:
    return batch["encoder_input_tokens"] > 0
  prefix = batch.get("decoder_causal_attention")
  if prefix is None:
    return jnp.zeros_like(batch["decoder_input_tokens"], jnp.bool_)
  return (batch["decoder_input_tokens"] > 0) & (prefix > 0)


def count_sequences(batch: Mapping[str, jax.Array]) -> jax.Array:
  """Number of target sequences in a batch, counting every packed segment.

  Args:
    batch: features with `decoder_target_tokens` and optionally `decoder_segment_ids`.

  Returns:
    Scalar float32 count: rows with any non-padding target when unpacked; the number
    of segment starts (non-zero id differing from its left neighbour) when packed.
  """
  if "decoder_segment_ids" not in batch:
    return jnp.sum(jnp.any(batch["decoder_target_tokens"] > 0, axis=-1)).astype(jnp.float32)
  seg = batch["decoder_segment_ids"]
  previous = jnp.pad(seg[:, :-1], ((0, 0), (1, 0)))  # [batch, length]
  starts = (seg != 0) & (seg != previous)
  return jnp.sum(starts).astype(jnp.float32)


def metric_sums(
  correct: jax.Array,
  batch: Mapping[str, jax.Array],
  weights: jax.Array,
  loss: jax.Array,
  z_loss: jax.Array,
) -> dict[str, jax.Array]:
  """Additive metric statistics for one (micro)batch; see `finalize_metrics`.

  Args:
    correct: [batch, length] bool, `token_correct` of the teacher-forced logits.
    batch: the features (`decoder_target_tokens`, `encoder_input_tokens`, ...).
    weights: [batch, length] loss weights actually used.
    loss: scalar normalised loss (including z-loss).
    z_loss: scalar normalised z-loss part.

  Returns:
    Dict of float32 scalars that can be summed over microbatches.
  """
  targets = batch["decoder_target_tokens"]
  correct = correct.astype(jnp.float32)  # [batch, length]
  nonpadding = (targets > 0).astype(jnp.float32)
  return {
    "loss": loss,
    "z_loss": z_loss,
    "cross_ent_loss": loss - z_loss,
    "correct_weighted": jnp.sum(correct * (weights > 0)),
    "num_weighted_tokens": jnp.sum((weights > 0).astype(jnp.float32)),
    "num_tokens": jnp.sum(nonpadding),
    "num_target_positions": jnp.asarray(targets.size, jnp.float32),
    "num_input_tokens": jnp.sum(input_tokens(batch)).astype(jnp.float32),
    "num_sequences": count_sequences(batch),
  }


def finalize_metrics(sums: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
  """Turns summed statistics from `metric_sums` into reported metrics.

  Args:
    sums: output of `metric_sums`, possibly summed over microbatches.

  Returns:
    {loss, cross_ent_loss, z_loss, accuracy (over tokens with non-zero weight),
     nonpadding_fraction (non-padding targets / target positions), num_sequences,
     num_tokens (non-padding targets), num_input_tokens (non-padding inputs)}.
  """
  return {
    "loss": sums["loss"],
    "cross_ent_loss": sums["cross_ent_loss"],
    "z_loss": sums["z_loss"],
    "accuracy": sums["correct_weighted"] / jnp.maximum(sums["num_weighted_tokens"], 1.0),
    "nonpadding_fraction": sums["num_tokens"] / jnp.maximum(sums["num_target_positions"], 1.0),
    "num_sequences": sums["num_sequences"],
    "num_tokens": sums["num_tokens"],
    "num_input_tokens": sums["num_input_tokens"],
  }
