"""Tests for t5x_lite.nn.losses against numpy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_lite.nn import losses


def _np_log_softmax(logits: np.ndarray) -> np.ndarray:
  m = logits.max(-1, keepdims=True)
  return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))


def _np_logsumexp(logits: np.ndarray) -> np.ndarray:
  m = logits.max(-1)
  return m + np.log(np.exp(logits - m[..., None]).sum(-1))


def _random_case(seed: int = 0, batch: int = 3, length: int = 5, vocab: int = 11):
  rng = np.random.RandomState(seed)
  logits = rng.randn(batch, length, vocab).astype(np.float32) * 3.0
  targets = rng.randint(1, vocab, size=(batch, length)).astype(np.int32)
  return logits, targets


def test_cross_entropy_matches_numpy():
  logits, targets = _random_case()
  loss, z, weight_sum = losses.compute_weighted_cross_entropy(
    jnp.asarray(logits), jnp.asarray(targets), z_loss=0.0
  )
  expected = -np.take_along_axis(_np_log_softmax(logits), targets[..., None], -1).sum()
  np.testing.assert_allclose(loss, expected, rtol=1e-5)
  assert float(z) == 0.0
  assert float(weight_sum) == targets.size


def test_z_loss_value():
  logits, targets = _random_case(1)
  z_coef = 1e-2
  loss, z, _ = losses.compute_weighted_cross_entropy(
    jnp.asarray(logits), jnp.asarray(targets), z_loss=z_coef
  )
  expected_z = z_coef * (_np_logsumexp(logits) ** 2).sum()
  ce = -np.take_along_axis(_np_log_softmax(logits), targets[..., None], -1).sum()
  np.testing.assert_allclose(z, expected_z, rtol=1e-5)
  np.testing.assert_allclose(loss, ce + expected_z, rtol=1e-5)


def test_label_smoothing_formula():
  logits, targets = _random_case(2)
  ls, vocab = 0.1, logits.shape[-1]
  loss, _, _ = losses.compute_weighted_cross_entropy(
    jnp.asarray(logits), jnp.asarray(targets), label_smoothing=ls
  )
  confidence, low = 1.0 - ls, ls / (vocab - 1)
  soft = np.full(logits.shape, low, np.float64)
  np.put_along_axis(soft, targets[..., None], confidence, -1)
  const = -(confidence * np.log(confidence) + (vocab - 1) * low * np.log(low))
  expected = (-(soft * _np_log_softmax(logits)).sum(-1) - const).sum()
  np.testing.assert_allclose(loss, expected, rtol=1e-5)
  # With perfect (one-hot like) logits matching the smoothed targets the loss is ~0.
  perfect = np.log(soft).astype(np.float32)
  loss0, _, _ = losses.compute_weighted_cross_entropy(
    jnp.asarray(perfect), jnp.asarray(targets), label_smoothing=ls
  )
  assert abs(float(loss0)) < 1e-4


@pytest.mark.parametrize("ls, z_coef", [(0.1, 1e-3), (0.0, 0.0), (0.0, 1e-4), (0.2, 0.0)])
def test_custom_gradient_matches_autodiff(ls, z_coef):
  logits, targets = _random_case(3)
  weights = (np.random.RandomState(0).rand(*targets.shape) > 0.3).astype(np.float32)
  vocab = logits.shape[-1]

  def custom(lg):
    return losses.compute_weighted_cross_entropy(
      lg, jnp.asarray(targets), jnp.asarray(weights), ls, z_coef, 7.0
    )[0]

  def plain(lg):
    confidence, low = 1.0 - ls, ls / (vocab - 1)
    soft = jax.nn.one_hot(targets, vocab) * (confidence - low) + low
    log_z = jax.nn.logsumexp(lg, axis=-1)
    per_token = -jnp.sum(soft * jax.nn.log_softmax(lg), -1) + z_coef * log_z**2
    return jnp.sum(per_token * weights) / 7.0

  g_custom = jax.grad(custom)(jnp.asarray(logits))
  g_plain = jax.grad(plain)(jnp.asarray(logits))
  np.testing.assert_allclose(g_custom, g_plain, rtol=1e-4, atol=1e-6)
  assert float(jnp.abs(g_plain).max()) > 1e-3


def _batch():
  targets = np.array([[5, 6, 7, 1, 0, 0], [8, 1, 9, 9, 1, 0]], np.int32)
  segments = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 2, 2, 2, 0]], np.int32)
  return {"decoder_target_tokens": jnp.asarray(targets)}, segments


def test_normalizing_factor_modes():
  batch, segments = _batch()
  weights = np.asarray(batch["decoder_target_tokens"] > 0, np.float32)

  factor, w = losses.get_loss_normalizing_factor_and_weights(None, batch)
  assert factor is None
  np.testing.assert_array_equal(w, weights)

  factor, w = losses.get_loss_normalizing_factor_and_weights(3.5, batch)
  assert factor == 3.5

  factor, w = losses.get_loss_normalizing_factor_and_weights("NUM_REAL_TARGET_TOKENS", batch)
  assert float(factor) == 9.0

  factor, w = losses.get_loss_normalizing_factor_and_weights("NUM_TOTAL_TARGET_TOKENS", batch)
  assert float(factor) == 12.0

  # Unpacked: each row averaged over its own tokens.
  factor, w = losses.get_loss_normalizing_factor_and_weights("AVERAGE_PER_SEQUENCE", batch)
  np.testing.assert_allclose(w[0], [0.25] * 4 + [0, 0])
  np.testing.assert_allclose(w[1], [0.2] * 5 + [0])
  assert float(factor) == pytest.approx(2.0)

  # Packed: row 1 holds two sequences of 2 and 3 tokens.
  packed = dict(batch, decoder_segment_ids=jnp.asarray(segments))
  factor, w = losses.get_loss_normalizing_factor_and_weights("AVERAGE_PER_SEQUENCE", packed)
  np.testing.assert_allclose(w[1], [0.5, 0.5, 1 / 3, 1 / 3, 1 / 3, 0], rtol=1e-6)
  assert float(factor) == pytest.approx(3.0)

  with pytest.raises(ValueError):
    losses.get_loss_normalizing_factor_and_weights("NOT_A_MODE", batch)


def test_average_per_sequence_loss_is_mean_of_sequence_means():
  logits, _ = _random_case(4, batch=2, length=6, vocab=11)
  batch, segments = _batch()
  packed = dict(batch, decoder_segment_ids=jnp.asarray(segments))
  factor, w = losses.get_loss_normalizing_factor_and_weights("AVERAGE_PER_SEQUENCE", packed)
  loss, _, _ = losses.compute_weighted_cross_entropy(
    jnp.asarray(logits), batch["decoder_target_tokens"], w, loss_normalizing_factor=factor
  )
  targets = np.asarray(batch["decoder_target_tokens"])
  tok = -np.take_along_axis(_np_log_softmax(logits), targets[..., None], -1)[..., 0]
  means = [tok[0, :4].mean(), tok[1, :2].mean(), tok[1, 2:5].mean()]
  np.testing.assert_allclose(loss, np.mean(means), rtol=1e-5)


def test_metric_sums_and_finalize():
  batch, segments = _batch()
  targets = np.asarray(batch["decoder_target_tokens"])
  vocab = 12
  logits = np.zeros(targets.shape + (vocab,), np.float32)
  predictions = targets.copy()
  predictions[0, 0] = 3  # one wrong non-padding prediction
  np.put_along_axis(logits, predictions[..., None], 5.0, -1)
  full = dict(batch, encoder_input_tokens=jnp.asarray([[3, 1, 0], [4, 4, 1]]))
  weights = jnp.asarray(targets > 0, jnp.float32)
  correct = losses.token_correct(jnp.asarray(logits), jnp.asarray(targets))
  sums = losses.metric_sums(correct, full, weights, jnp.array(2.0), jnp.array(0.5))
  metrics = losses.finalize_metrics(sums)
  assert float(metrics["accuracy"]) == pytest.approx(8 / 9)
  assert float(metrics["nonpadding_fraction"]) == pytest.approx(9 / 12)
  assert float(metrics["num_sequences"]) == 2.0
  assert float(metrics["num_tokens"]) == 9.0
  assert float(metrics["num_input_tokens"]) == 5.0
  assert float(metrics["cross_ent_loss"]) == pytest.approx(1.5)
  packed = dict(full, decoder_segment_ids=jnp.asarray(segments))
  assert float(losses.count_sequences(packed)) == 3.0


@pytest.mark.parametrize("chunk_length", [1, 3, 5, 8])
def test_chunked_cross_entropy_equals_the_whole_logits_loss_and_gradients(chunk_length):
  rng = np.random.RandomState(3)
  batch, length, embed, vocab = 3, 5, 6, 11
  hidden = jnp.asarray(rng.randn(batch, length, embed), jnp.float32)
  kernel = jnp.asarray(rng.randn(embed, vocab), jnp.float32)
  targets = jnp.asarray(rng.randint(1, vocab, size=(batch, length)), jnp.int32)
  weights = jnp.asarray(rng.rand(batch, length) * (rng.rand(batch, length) > 0.3), jnp.float32)
  options = dict(label_smoothing=0.1, z_loss=1e-3, loss_normalizing_factor=7.0)

  def whole(h, k):
    logits = h @ k  # [batch, length, vocab]
    loss, z, _ = losses.compute_weighted_cross_entropy(logits, targets, weights, **options)
    return loss, (z, losses.token_correct(logits, targets))

  def chunked(h, k):
    loss, z, correct = losses.chunked_cross_entropy(
      lambda x: x @ k, h, targets, weights, chunk_length, **options
    )
    return loss, (z, correct)

  (loss, (z, correct)), grads = jax.value_and_grad(whole, (0, 1), has_aux=True)(hidden, kernel)
  (loss_c, (z_c, correct_c)), grads_c = jax.jit(jax.value_and_grad(chunked, (0, 1), has_aux=True))(
    hidden, kernel
  )
  np.testing.assert_allclose(loss_c, loss, rtol=1e-6)
  np.testing.assert_allclose(z_c, z, rtol=1e-6)
  np.testing.assert_array_equal(correct_c, correct)
  for g_c, g in zip(grads_c, grads):
    np.testing.assert_allclose(g_c, g, rtol=1e-5, atol=1e-6)


def test_chunked_cross_entropy_never_holds_the_whole_logits():
  """The compiled gradient's temporaries stay below one [batch, length, vocab] array."""
  batch, length, embed, vocab = 4, 64, 16, 8192
  hidden = jax.ShapeDtypeStruct((batch, length, embed), jnp.float32)
  kernel = jax.ShapeDtypeStruct((embed, vocab), jnp.float32)
  targets = jnp.ones((batch, length), jnp.int32)
  weights = jnp.ones((batch, length), jnp.float32)
  logits_bytes = batch * length * vocab * 4  # 8 MiB

  def temp_bytes(loss_fn) -> int:
    compiled = jax.jit(jax.grad(loss_fn, (0, 1))).lower(hidden, kernel).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  def whole(h, k):
    return losses.compute_weighted_cross_entropy(h @ k, targets, weights)[0]

  def chunked(h, k):
    return losses.chunked_cross_entropy(lambda x: x @ k, h, targets, weights, 8)[0]

  assert temp_bytes(whole) >= logits_bytes
  assert temp_bytes(chunked) < logits_bytes / 2
