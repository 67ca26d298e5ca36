"""Tests of t5x_lite.kernels.xla_gpu: attention through `jax.nn.dot_product_attention`
equals the reference attention, forward and gradients (implementation='xla', what runs
on the CPU), and hands cuDNN what it takes on a GPU.

The whole network with these kernels (loss, gradients, greedy and beam decodes with
caches) is checked against the reference in tests/kernels_test.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_lite.kernels import reference, xla_gpu
from t5x_lite.kernels.base import PaddingLengths
from t5x_lite.nn import attention as attention_lib
from t5x_lite.nn import layers

BATCH, LENGTH_Q, LENGTH_K, HEADS, HEAD_DIM = 2, 6, 8, 3, 8


def _operands(dtype, length_q=LENGTH_Q, length_k=LENGTH_K):
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q = jax.random.normal(keys[0], (BATCH, length_q, HEADS, HEAD_DIM)).astype(dtype)
  k = jax.random.normal(keys[1], (BATCH, length_k, HEADS, HEAD_DIM)).astype(dtype)
  v = jax.random.normal(keys[2], (BATCH, length_k, HEADS, HEAD_DIM)).astype(dtype)
  position = jax.random.normal(keys[3], (1, HEADS, length_q, length_k)).astype(dtype)
  return q, k, v, position


def _padding_bias(length_q=LENGTH_Q, length_k=LENGTH_K):
  """[batch, 1, q, k]: row 0 has its last 3 keys and queries padded."""
  valid_q = jnp.arange(length_q)[None, :] < jnp.array([[length_q - 3], [length_q]])
  valid_k = jnp.arange(length_k)[None, :] < jnp.array([[length_k - 3], [length_k]])
  return layers.mask_to_bias(layers.make_attention_mask(valid_q, valid_k))


def _causal_bias(length):
  return layers.mask_to_bias(layers.make_causal_mask(length))  # [1, 1, q, k]


def _loss(kernels, q, k, v, position, mask, dtype, cotangent):
  out = kernels.attention(
    q,
    k,
    v,
    [mask, position],
    key_axes="bkhd",
    value_axes="bkhd",
    dtype=dtype,
    logits_dtype=jnp.float32,
    dropout_rate=0.0,
    dropout_rng=None,
  )
  return jnp.vdot(out.astype(jnp.float32), cotangent), out


@pytest.mark.parametrize(
  "dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)], ids=["float32", "bfloat16"]
)
@pytest.mark.parametrize("mask", ["padding", "causal"])
def test_attention_and_its_gradients_equal_the_reference(dtype, tol, mask):
  length_k = LENGTH_Q if mask == "causal" else LENGTH_K
  q, k, v, position = _operands(dtype, length_k=length_k)
  bias = _causal_bias(LENGTH_Q) if mask == "causal" else _padding_bias()
  cotangent = jax.random.normal(jax.random.PRNGKey(5), q.shape)
  valid = np.ones((BATCH, LENGTH_Q), bool)
  if mask == "padding":
    valid[0, -3:] = False  # padded queries attend to nothing: their outputs are unused

  results = {}
  for kernels in (xla_gpu.KERNELS, reference.KERNELS):

    def loss(q, k, v, position, kernels=kernels):
      return _loss(kernels, q, k, v, position, bias, dtype, cotangent)

    (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))(
      q, k, v, position
    )
    results[kernels.name] = (out, grads)
  out, grads = results["xla_gpu"]
  ref_out, ref_grads = results["reference"]
  assert out.dtype == ref_out.dtype == dtype
  np.testing.assert_allclose(
    np.asarray(out, np.float32)[valid], np.asarray(ref_out, np.float32)[valid], atol=tol, rtol=tol
  )
  for name, got, want in zip(("query", "key", "value", "position bias"), grads, ref_grads):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, atol=tol * scale, rtol=tol, err_msg=name)


def test_a_decode_step_against_a_cache_equals_the_reference():
  """One query against 7 cache slots, the bias by causal distance masking slots after it."""
  q, k, v, _ = _operands(jnp.float32, length_q=1, length_k=7)
  distance_bias = jax.random.normal(jax.random.PRNGKey(3), (1, HEADS, 1, 4))
  step_bias = attention_lib.causal_step_bias(distance_bias, jnp.int32(4), 7)  # [1, h, 1, 7]
  cross_padding = _padding_bias(1, 7)[:, :, :1]  # [batch, 1, 1, 7]
  outs = [
    kernels.attention(
      q,
      k,
      v,
      [cross_padding, step_bias],
      key_axes="bkhd",
      value_axes="bkhd",
      dtype=jnp.float32,
      logits_dtype=jnp.float32,
      dropout_rate=0.0,
      dropout_rng=None,
    )
    for kernels in (xla_gpu.KERNELS, reference.KERNELS)
  ]
  np.testing.assert_allclose(outs[0], outs[1], atol=1e-6, rtol=1e-6)


def test_dropout_and_other_layouts_run_the_reference_attention():
  q, k, v, position = _operands(jnp.float32)
  rng = jax.random.PRNGKey(7)
  kwargs = dict(dtype=jnp.float32, logits_dtype=jnp.float32, dropout_rate=0.5, dropout_rng=rng)
  got, want = (
    kernels.attention(q, k, v, [position], key_axes="bkhd", value_axes="bkhd", **kwargs)
    for kernels in (xla_gpu.KERNELS, reference.KERNELS)
  )
  np.testing.assert_array_equal(got, want)  # the same dropout mask: the same function
  heads_major = jnp.swapaxes(k, 1, 2)  # [batch, heads, k, kv]
  kwargs.update(dropout_rate=0.0, dropout_rng=None)
  got = xla_gpu.attention(
    q, heads_major, v, [position], key_axes="bhkd", value_axes="bkhd", **kwargs
  )
  want = reference.attention(q, k, v, [position], key_axes="bkhd", value_axes="bkhd", **kwargs)
  np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)


def test_on_a_gpu_the_call_asks_for_cudnn_with_a_bias_in_the_query_dtype(monkeypatch):
  """On the CPU cuDNN cannot run; the call it would make is recorded, then run by XLA."""
  calls = []
  real = jax.nn.dot_product_attention

  def record(query, key, value, bias=None, mask=None, *, scale=None, implementation=None, **kw):
    calls.append(dict(implementation=implementation, bias=bias, scale=scale, mask=mask, **kw))
    return real(query, key, value, bias=bias, scale=scale, implementation="xla", **kw)

  monkeypatch.setattr(jax.nn, "dot_product_attention", record)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  q, k, v, position = _operands(jnp.bfloat16)
  out = xla_gpu.attention(
    q,
    k,
    v,
    [_padding_bias(), position],
    key_axes="bkhd",
    value_axes="bkhd",
    dtype=jnp.bfloat16,
    logits_dtype=jnp.float32,
    dropout_rate=0.0,
    dropout_rng=None,
  )
  [call] = calls
  assert call["implementation"] == "cudnn" and call["scale"] == 1.0 and call["mask"] is None
  assert call["query_seq_lengths"] is None and call["key_value_seq_lengths"] is None
  assert call["bias"].dtype == jnp.bfloat16 and call["bias"].shape == (BATCH, HEADS, 6, 8)
  assert out.shape == q.shape and out.dtype == jnp.bfloat16


def _shaped(dtype, length_q=512, length_k=512, head_dim=64):
  return (
    jax.ShapeDtypeStruct((2, length_q, 12, head_dim), dtype),
    jax.ShapeDtypeStruct((2, length_k, 12, head_dim), dtype),
  )


@pytest.mark.parametrize(
  "dtype, lengths, head_dim, bias, backend, want",
  [
    (jnp.bfloat16, (512, 512), 64, True, "gpu", "cudnn"),  # T5 encoder self-attention
    (jnp.bfloat16, (114, 512), 64, True, "gpu", "cudnn"),  # cross-attention
    (jnp.float16, (114, 114), 64, False, "gpu", "cudnn"),
    (jnp.bfloat16, (1, 63), 64, True, "gpu", "cudnn"),  # a decode step: no gradient
    (jnp.bfloat16, (113, 512), 64, True, "gpu", "xla"),  # odd length with a bias gradient
    (jnp.bfloat16, (113, 513), 64, False, "gpu", "cudnn"),  # no bias: any length
    (jnp.float32, (512, 512), 64, True, "gpu", "xla"),  # cuDNN takes 16-bit floats only
    (jnp.bfloat16, (512, 512), 12, True, "gpu", "xla"),  # head size not a multiple of 8
    (jnp.bfloat16, (512, 512), 256, True, "gpu", "xla"),  # above 128
    (jnp.bfloat16, (512, 512), 64, True, "cpu", "xla"),
    (jnp.bfloat16, (512, 512), 64, True, "tpu", "xla"),
  ],
)
def test_implementation(dtype, lengths, head_dim, bias, backend, want):
  query, key = _shaped(dtype, *lengths, head_dim)
  summed = jax.ShapeDtypeStruct((2, 12, *lengths), jnp.float32) if bias else None
  assert xla_gpu.implementation(query, key, summed, backend) == want


def test_summed_bias_broadcasts_to_whole_query_and_key_axes():
  padding = jnp.zeros((2, 1, 1, 8))  # [batch, 1, 1, k]: cross-attention padding
  position = jnp.ones((1, 3, 6, 8), jnp.bfloat16)  # [1, heads, q, k]
  total = xla_gpu.summed_bias([padding, position], 6)
  assert total.shape == (2, 3, 6, 8) and total.dtype == jnp.float32
  assert xla_gpu.summed_bias([padding], 6).shape == (2, 1, 6, 8)
  assert xla_gpu.summed_bias([], 6) is None


def test_where_jax_finds_no_cudnn_xla_runs_and_a_warning_says_so(monkeypatch, caplog):
  real = jax.nn.dot_product_attention
  asked = []

  def no_cudnn(query, key, value, bias=None, mask=None, *, scale=None, implementation=None, **kw):
    asked.append(implementation)
    if implementation == "cudnn":
      raise RuntimeError("cuDNN is not detected.")
    return real(query, key, value, bias, mask, scale=scale, implementation=implementation, **kw)

  monkeypatch.setattr(jax.nn, "dot_product_attention", no_cudnn)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  q, k, v, position = _operands(jnp.bfloat16)
  kwargs = dict(key_axes="bkhd", value_axes="bkhd", dtype=jnp.bfloat16, logits_dtype=jnp.float32)
  kwargs.update(dropout_rate=0.0, dropout_rng=None)
  with caplog.at_level("WARNING"):
    got = xla_gpu.attention(q, k, v, [position], **kwargs)
  assert asked == ["cudnn", "xla"]
  assert "cuDNN's fused attention refused" in caplog.text and "cuDNN is not detected" in caplog.text
  want = reference.attention(q, k, v, [position], **kwargs)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2)


def _lengths():
  """The lengths of `_padding_bias`'s mask: row 0 has 3 real queries and 5 real keys."""
  return PaddingLengths(
    query=jnp.array([LENGTH_Q - 3, LENGTH_Q]), key=jnp.array([LENGTH_K - 3, LENGTH_K])
  )


def test_padding_lengths_in_place_of_the_mask_give_the_reference_on_real_queries():
  """With `padding`, the lengths replace the mask: the same outputs and gradients where
  queries are real, zeros where they are padding (which no loss reads)."""
  q, k, v, position = _operands(jnp.float32)
  real = (jnp.arange(LENGTH_Q)[None, :] < _lengths().query[:, None])[:, :, None, None]
  cotangent = jnp.where(real, jax.random.normal(jax.random.PRNGKey(1), q.shape), 0.0)
  kwargs = dict(key_axes="bkhd", value_axes="bkhd", dtype=jnp.float32)
  kwargs.update(logits_dtype=jnp.float32, dropout_rate=0.0, dropout_rng=None)

  def loss(fn, padding):
    def f(q, k, v, position):
      out = fn(q, k, v, [_padding_bias(), position], padding=padding, **kwargs)
      return jnp.vdot(out, cotangent), out

    return jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, position)

  (got_loss, got_out), got_grads = loss(xla_gpu.attention, _lengths())
  (want_loss, want_out), want_grads = loss(reference.attention, None)
  np.testing.assert_allclose(
    np.where(real, got_out, 0.0), np.where(real, want_out, 0.0), rtol=1e-5, atol=1e-6
  )
  assert not np.asarray(jnp.where(real, 0.0, got_out)).any()  # padded queries: zeros
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
  for got, want in zip(got_grads, want_grads):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_on_a_gpu_padding_goes_to_cudnn_as_lengths_beside_the_position_bias(monkeypatch):
  calls = []
  real = jax.nn.dot_product_attention

  def record(
    query, key, value, bias=None, mask=None, *, scale=None, implementation=None, **lengths
  ):
    calls.append(dict(implementation=implementation, bias=bias, **lengths))
    return real(query, key, value, bias=bias, scale=scale, implementation="xla", **lengths)

  monkeypatch.setattr(jax.nn, "dot_product_attention", record)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  q, k, v, position = _operands(jnp.bfloat16)
  for biases, bias_shape in (
    ([_padding_bias(), position], (1, HEADS, 6, 8)),
    ([_padding_bias()], None),
  ):
    calls.clear()
    xla_gpu.attention(
      q,
      k,
      v,
      biases,
      key_axes="bkhd",
      value_axes="bkhd",
      dtype=jnp.bfloat16,
      logits_dtype=jnp.float32,
      dropout_rate=0.0,
      dropout_rng=None,
      padding=_lengths(),
    )
    [call] = calls
    assert call["implementation"] == "cudnn"
    # Only the position bias, broadcast over the batch (cross-attention: no bias at all).
    assert (call["bias"] is None) if bias_shape is None else (call["bias"].shape == bias_shape)
    np.testing.assert_array_equal(call["query_seq_lengths"], _lengths().query)
    np.testing.assert_array_equal(call["key_value_seq_lengths"], _lengths().key)


def _dot_operand_dtypes(fn, *args):
  """The operand dtypes of every dot_general in fn's jaxpr (custom_vjp bodies included)."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
      for param in eqn.params.values():
        for sub in param if isinstance(param, (list, tuple)) else [param]:
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            walk(inner)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


def test_float32_logits_of_bfloat16_operands_take_a_bfloat16_cotangent_backward():
  """The output layer's backward: the float32 cotangent cast to bfloat16 before both
  gradient matmuls (the reference's runs them in float32); the forward is the same."""
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(keys[0], (4, 5, 16)).astype(jnp.bfloat16)  # [batch, length, embed]
  w = (0.3 * jax.random.normal(keys[1], (16, 40))).astype(jnp.bfloat16)  # [embed, vocab]
  g = jax.random.normal(keys[2], (4, 5, 40))  # float32 cotangent of the logits

  def grads(dense):
    def f(x, w):
      return jnp.sum(dense(x, w, (0,), jnp.float32) * g)  # no dot_general of its own

    return jax.grad(f, argnums=(0, 1)), f

  ours, ref = grads(xla_gpu.dense), grads(reference.dense)
  np.testing.assert_array_equal(
    xla_gpu.dense(x, w, (0,), jnp.float32), reference.dense(x, w, (0,), jnp.float32)
  )
  backward = _dot_operand_dtypes(ours[0], x, w)[1:]  # after the forward's
  assert backward and all(dtypes == ("bfloat16", "bfloat16") for dtypes in backward), backward
  assert any("float32" in d for d in _dot_operand_dtypes(ref[0], x, w)[1:])
  for got, want in zip(ours[0](x, w), ref[0](x, w)):
    assert got.dtype == want.dtype == jnp.bfloat16
    np.testing.assert_allclose(
      np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2
    )
  # Float32 operands, or 16-bit out: the reference's projection, backward included.
  x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
  assert _dot_operand_dtypes(ours[0], x32, w32) == _dot_operand_dtypes(ref[0], x32, w32)
  assert xla_gpu.dense(x, w, (0,)).dtype == jnp.bfloat16
