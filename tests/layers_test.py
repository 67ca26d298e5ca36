"""Tests of t5x_lite.nn.layers against hand-derived goldens and numpy references."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_lite.nn import layers

# relative_position = key_position - query_position; positive = key after the query.
DISTANCES = [0, 1, -1, 7, -7, 8, -8, 15, -15, 16, -16, 100, -100, 127, -127, 128, -128, 1000, -1000]
# By hand, T5 formula, 32 buckets, max distance 128. Bidirectional: 16 buckets per
# direction (keys after the query +16), max_exact 8, then 8 + int(log(n/8)/log(16)*8).
BIDIRECTIONAL = [0, 17, 1, 23, 7, 24, 8, 25, 9, 26, 10, 31, 15, 31, 15, 31, 15, 31, 15]
# Causal: n = max(query - key, 0), max_exact 16, then 16 + int(log(n/16)/log(8)*16),
# clipped to 31.
CAUSAL = [0, 0, 1, 0, 7, 0, 8, 0, 15, 0, 16, 0, 30, 0, 31, 0, 31, 0, 31]


@pytest.mark.parametrize('bidirectional,expected', [(True, BIDIRECTIONAL), (False, CAUSAL)])
def test_relative_position_bucket_goldens(bidirectional, expected):
  buckets = layers.relative_position_bucket(np.array(DISTANCES), bidirectional, 32, 128)
  np.testing.assert_array_equal(np.asarray(buckets), expected)


def test_relative_position_biases_lookup():
  module = layers.RelativePositionBiases(num_buckets=32, max_distance=128, num_heads=3)
  relative = layers.relative_positions(4, 5)  # [1, 4, 5]
  variables = module.init(jax.random.PRNGKey(0), relative, bidirectional=True)
  table = np.asarray(nn.meta.unbox(variables)['params']['rel_embedding'])  # [heads, buckets]
  assert table.shape == (3, 32)
  bias = np.asarray(module.apply(variables, relative, bidirectional=True))
  assert bias.shape == (1, 3, 4, 5)
  # query 2, key 0: key before query by 2 -> bucket 2; query 0, key 3 -> bucket 16 + 3.
  np.testing.assert_allclose(bias[0, :, 2, 0], table[:, 2])
  np.testing.assert_allclose(bias[0, :, 0, 3], table[:, 19])


def test_relative_positions_are_index_differences():
  relative = np.asarray(layers.relative_positions(3, 4))
  assert relative.shape == (1, 3, 4)
  assert relative[0, 2, 0] == -2 and relative[0, 0, 3] == 3 and relative[0, 1, 1] == 0


def test_rms_norm_matches_numpy():
  x = np.random.RandomState(0).randn(2, 3, 8).astype(np.float32) * 3.0
  module = layers.RMSNorm(epsilon=1e-6)
  variables = module.init(jax.random.PRNGKey(0), x)
  scale = np.asarray(nn.meta.unbox(variables)['params']['scale'])
  np.testing.assert_array_equal(scale, np.ones(8, np.float32))
  new_scale = np.linspace(0.5, 2.0, 8).astype(np.float32)
  y = module.apply({'params': {'scale': new_scale}}, x)
  expected = x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + 1e-6) * new_scale
  np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-6)


def test_rms_norm_computes_in_float32_for_bfloat16():
  x = jnp.full((1, 4), 300.0, jnp.bfloat16)
  y = layers.RMSNorm(dtype=jnp.bfloat16).init_with_output(jax.random.PRNGKey(0), x)[0]
  assert y.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(y, np.float32), np.ones((1, 4)), rtol=1e-2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("recompute", [True, False])
def test_rms_norm_gradients_equal_autodiff_of_the_formula(dtype, recompute):
  x = (jax.random.normal(jax.random.PRNGKey(0), (3, 5, 16)) * 2.0).astype(dtype)
  scale = jnp.linspace(0.5, 2.0, 16, dtype=jnp.float32)
  cotangent = jax.random.normal(jax.random.PRNGKey(1), (3, 5, 16))
  module = layers.RMSNorm(dtype=dtype, recompute=recompute)

  def loss(scale, x):
    y = module.apply({"params": {"scale": scale}}, x)
    return jnp.vdot(y.astype(jnp.float32), cotangent)

  def reference(scale, x):  # the formula, differentiated by autodiff
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6) * scale
    return jnp.vdot(y.astype(dtype).astype(jnp.float32), cotangent)

  grads, expected = jax.grad(loss, (0, 1))(scale, x), jax.grad(reference, (0, 1))(scale, x)
  # The scale gradient sums 15 tokens in another order (a matmul on CPU).
  for got, want in zip(grads, expected):
    np.testing.assert_allclose(
      np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-6, atol=1e-6
    )
  # On CPU that sum is a [1, tokens] @ [tokens, embed] matmul; TPU keeps autodiff's reduce.
  matmul = "tensor<1x15xf32>"
  assert any(matmul in line for line in _lowered_dots(jax.grad(loss), scale, x, platform="cpu"))
  assert not any(matmul in line for line in _lowered_dots(jax.grad(loss), scale, x, platform="tpu"))


def _softmax(x):
  x = x - x.max(-1, keepdims=True)
  return np.exp(x) / np.exp(x).sum(-1, keepdims=True)


def test_attention_has_no_logit_scaling():
  rng = np.random.RandomState(0)
  q_in = rng.randn(2, 3, 16).astype(np.float32)
  kv_in = rng.randn(2, 5, 16).astype(np.float32)
  bias = rng.randn(1, 4, 3, 5).astype(np.float32)
  module = layers.MultiHeadAttention(num_heads=4, head_dim=8)
  variables = module.init(jax.random.PRNGKey(0), q_in, kv_in)
  params = jax.tree.map(np.asarray, nn.meta.unbox(variables)['params'])
  out = module.apply(variables, q_in, kv_in, position_bias=bias)
  q = np.einsum('bqe,ehd->bqhd', q_in, params['query']['kernel'])
  k = np.einsum('bke,ehd->bkhd', kv_in, params['key']['kernel'])
  v = np.einsum('bke,ehd->bkhd', kv_in, params['value']['kernel'])
  weights = _softmax(np.einsum('bqhd,bkhd->bhqk', q, k) + bias)  # no 1/sqrt(head_dim)
  expected = np.einsum('bhqk,bkhd,hde->bqe', weights, v, params['out']['kernel'])
  np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-4, atol=1e-5)


def test_query_init_folds_in_head_dim_scaling():
  emb, heads, head_dim = 256, 4, 64
  module = layers.MultiHeadAttention(num_heads=heads, head_dim=head_dim)
  x = jnp.ones((1, 1, emb))
  params = nn.meta.unbox(module.init(jax.random.PRNGKey(0), x, x))['params']
  query_std = float(np.std(params['query']['kernel']))
  key_std = float(np.std(params['key']['kernel']))
  out_std = float(np.std(params['out']['kernel']))
  np.testing.assert_allclose(query_std, 1.0 / np.sqrt(emb * head_dim), rtol=0.05)
  np.testing.assert_allclose(key_std, 1.0 / np.sqrt(emb), rtol=0.05)
  np.testing.assert_allclose(out_std, 1.0 / np.sqrt(heads * head_dim), rtol=0.05)


def test_attention_kernels_are_logically_partitioned():
  module = layers.MultiHeadAttention(num_heads=2, head_dim=4)
  x = jnp.ones((1, 3, 8))
  params = module.init(jax.random.PRNGKey(0), x, x)['params']
  assert params['query']['kernel'].names == ('embed', 'heads', 'kv')
  assert params['out']['kernel'].names == ('heads', 'kv', 'embed')
  assert params['out']['kernel'].value.shape == (2, 4, 8)


def _gelu_tanh(x):
  return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


@pytest.mark.parametrize('activations', [('relu',), ('gelu', 'linear')])
def test_mlp_matches_numpy(activations):
  x = np.random.RandomState(1).randn(2, 3, 8).astype(np.float32)
  module = layers.MlpBlock(mlp_dim=16, activations=activations)
  variables = module.init(jax.random.PRNGKey(0), x)
  params = jax.tree.map(np.asarray, nn.meta.unbox(variables)['params'])
  out = np.asarray(module.apply(variables, x))
  if activations == ('relu',):
    assert set(params) == {'wi', 'wo'}
    hidden = np.maximum(x @ params['wi']['kernel'], 0.0)
  else:
    assert set(params) == {'wi_0', 'wi_1', 'wo'}
    hidden = _gelu_tanh(x @ params['wi_0']['kernel']) * (x @ params['wi_1']['kernel'])
  np.testing.assert_allclose(out, hidden @ params['wo']['kernel'], rtol=1e-5, atol=1e-5)


def test_mlp_dropout_only_when_not_deterministic():
  x = np.ones((2, 3, 8), np.float32)
  module = layers.MlpBlock(mlp_dim=16, activations=('relu',), dropout_rate=0.5)
  variables = module.init(jax.random.PRNGKey(0), x)
  clean = module.apply(variables, x, deterministic=True)
  again = module.apply(variables, x, deterministic=True)
  dropped = module.apply(variables, x, deterministic=False, rngs={'dropout': jax.random.PRNGKey(1)})
  np.testing.assert_array_equal(np.asarray(clean), np.asarray(again))
  assert not np.allclose(np.asarray(clean), np.asarray(dropped))


def test_masks():
  causal = np.asarray(layers.make_causal_mask(3))[0, 0]
  np.testing.assert_array_equal(causal, [[1, 0, 0], [1, 1, 0], [1, 1, 1]])
  tokens = jnp.array([[5, 6, 0]])
  padding = np.asarray(layers.make_attention_mask(tokens > 0, tokens > 0))
  assert padding.shape == (1, 1, 3, 3)
  np.testing.assert_array_equal(padding[0, 0], [[1, 1, 0], [1, 1, 0], [0, 0, 0]])
  segments = jnp.array([[1, 1, 2]])
  packing = np.asarray(layers.make_attention_mask(segments, segments, jnp.equal))[0, 0]
  np.testing.assert_array_equal(packing, [[1, 1, 0], [1, 1, 0], [0, 0, 1]])
  combined = np.asarray(
    layers.combine_masks(
      layers.make_causal_mask(3), None, layers.make_attention_mask(segments, segments, jnp.equal)
    )
  )
  np.testing.assert_array_equal(combined[0, 0], [[1, 0, 0], [1, 1, 0], [0, 0, 1]])
  bias = np.asarray(layers.mask_to_bias(combined))
  assert bias.dtype == np.float32 and bias[0, 0, 0, 1] == layers.MASK_BIAS and bias[0, 0, 0, 0] == 0


def test_causal_step_bias():
  distance_bias = jnp.arange(4, dtype=jnp.float32)[None, None, None, :] + 10.0  # [1, 1, 1, 4]
  row = np.asarray(layers.causal_step_bias(distance_bias, jnp.array(5), 8))[0, 0, 0]
  # keys 0..5 are at distances 5,4,3,2,1,0 (saturating at 3); keys 6, 7 are masked.
  np.testing.assert_array_equal(row[:6], [13, 13, 13, 12, 11, 10])
  assert (row[6:] == layers.MASK_BIAS).all()


def test_embed_and_attend():
  module = layers.Embed(num_embeddings=10, features=4)
  ids = jnp.array([[1, 2, 9]])
  variables = module.init(jax.random.PRNGKey(0), ids)
  table = np.asarray(nn.meta.unbox(variables)['params']['embedding'])
  np.testing.assert_array_equal(np.asarray(module.apply(variables, ids)), table[[[1, 2, 9]]])
  query = np.ones((1, 2, 4), np.float32)
  logits = module.apply(variables, query, method=layers.Embed.attend)
  assert logits.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(logits), query @ table.T, rtol=1e-6)


def _lowered_dots(fn, *args, platform: str) -> list[str]:
  """The StableHLO dot_general lines of `fn(*args)` lowered for `platform`."""
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
  return [line for line in text.splitlines() if "stablehlo.dot_general" in line]


def test_projection_merges_batch_and_length_into_tokens_on_cpu_only():
  proj = layers.Projection((4, 5), "...e,em->...m", ("embed", "mlp"))
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 4))  # [batch, length, embed]
  params = proj.init(jax.random.PRNGKey(1), x)
  kernel = params["params"]["kernel"].unbox()

  def loss(params, x):
    return jnp.sum(jnp.sin(proj.apply(params, x)))

  def reference(kernel, x):
    return jnp.sum(jnp.sin(jnp.einsum("...e,em->...m", x, kernel)))

  np.testing.assert_allclose(
    proj.apply(params, x), jnp.einsum("...e,em->...m", x, kernel), rtol=1e-6
  )
  grads = jax.grad(loss, argnums=(0, 1))(params, x)
  ref = jax.grad(reference, argnums=(0, 1))(kernel, x)
  np.testing.assert_allclose(grads[0]["params"]["kernel"].unbox(), ref[0], rtol=1e-6)
  np.testing.assert_allclose(grads[1], ref[1], rtol=1e-6)

  # On CPU every matmul, the kernel gradient's included, runs over 6 tokens; a TPU
  # lowering keeps the [batch, length] einsum (there a merge can be a relayout).
  cpu = _lowered_dots(jax.grad(loss), params, x, platform="cpu")
  assert cpu and all("tensor<6x" in line and "2x3x" not in line for line in cpu), cpu
  tpu = _lowered_dots(jax.grad(loss), params, x, platform="tpu")
  assert tpu and all("tensor<2x3x" in line for line in tpu), tpu


@pytest.mark.parametrize(
  "equation, x_shape, kernel_shape, out_dtype",
  [
    ("...e,em->...m", (2, 24, 32), (32, 48), None),
    ("...e,ehd->...hd", (2, 24, 32), (32, 4, 8), None),
    ("...hd,hde->...e", (2, 24, 4, 8), (4, 8, 32), None),
    ("...e,ev->...v", (2, 24, 32), (32, 40), jnp.float32),  # untied logits
    ("...e,em->...m", (16, 1, 32), (32, 48), None),  # one decode step of 16 rows
  ],
)
def test_bfloat16_projection_runs_every_cpu_matmul_in_bfloat16(
  equation, x_shape, kernel_shape, out_dtype
):
  """On CPU a bfloat16 projection and both products of its gradient are plain
  row-major bfloat16 x bfloat16 -> float32 matmuls (XLA:CPU converted transposed-operand
  ones to float32 first, at half the speed), with autodiff's values to bfloat16
  rounding."""
  x = jax.random.normal(jax.random.PRNGKey(0), x_shape, jnp.bfloat16)
  kernel = jax.random.normal(jax.random.PRNGKey(1), kernel_shape) * 0.2  # float32 param

  def loss(einsum, x, kernel):
    out = einsum(equation, x, kernel.astype(jnp.bfloat16), out_dtype)
    assert out.dtype == (out_dtype or jnp.bfloat16)
    return jnp.sum(jnp.sin(out.astype(jnp.float32)))

  def autodiff(equation, x, k, out_dtype):
    return jnp.einsum(equation, x, k, preferred_element_type=out_dtype or jnp.float32).astype(
      out_dtype or jnp.bfloat16
    )

  ours = jax.jit(jax.value_and_grad(lambda *a: loss(layers._einsum_over_tokens, *a), (0, 1)))
  reference = jax.value_and_grad(lambda *a: loss(autodiff, *a), (0, 1))
  (value, (dx, dk)), (ref_value, (ref_dx, ref_dk)) = ours(x, kernel), reference(x, kernel)
  assert dx.dtype == jnp.bfloat16 and dk.dtype == jnp.float32
  np.testing.assert_allclose(value, ref_value, rtol=2e-2)
  for got, want in ((dx, ref_dx), (dk, ref_dk)):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max())

  _assert_plain_bfloat16_dots(ours.lower(x, kernel).compile().as_text(), 3)


def _assert_plain_bfloat16_dots(compiled: str, count: int) -> None:
  """`compiled` (CPU HLO) has `count` dots, all bf16 x bf16 with row-major operands."""
  dots = 0
  for block in compiled.split("\n\n"):  # one HLO computation each
    for line in block.splitlines():
      if " dot(" not in line:
        continue
      dots += 1
      for name in re.search(r"dot\(%([\w.\-]+), %([\w.\-]+)\)", line).groups():
        assert re.search(rf"%{re.escape(name)} = bf16\[", block), (name, line)
      lhs, rhs = re.search(
        r"lhs_contracting_dims=\{(\d)\}.*rhs_contracting_dims=\{(\d)\}", line
      ).groups()
      rank = len(re.search(r"= \w+\[([\d,]*)\]", line).group(1).split(","))
      assert (int(lhs), int(rhs)) == (rank - 1, rank - 2), line
  assert dots == count, compiled


def test_bfloat16_attention_runs_every_cpu_matmul_in_bfloat16():
  """On CPU, bfloat16 attention's two matmuls and the four of their gradient are plain
  row-major bf16 x bf16 -> f32 batched matmuls, with autodiff's values to bfloat16
  rounding (the float32 softmax cotangent is rounded to bfloat16, as T5X's is)."""
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q, k, v = (jax.random.normal(key, (2, 16, 3, 8), jnp.bfloat16) for key in keys[:3])
  bias = jax.random.normal(keys[3], (1, 3, 16, 16))  # [1, heads, q, k]

  def ours(q, k, v):
    out = layers.dot_product_attention(q, k, v, [bias], 0.0, True, None, jnp.bfloat16)
    return jnp.sum(jnp.sin(out.astype(jnp.float32)))

  def reference(q, k, v):
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    weights = jax.nn.softmax(logits + bias, axis=-1).astype(jnp.bfloat16)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v, preferred_element_type=jnp.float32)
    return jnp.sum(jnp.sin(out.astype(jnp.bfloat16).astype(jnp.float32)))

  fn = jax.jit(jax.value_and_grad(ours, (0, 1, 2)))
  (value, grads), (ref_value, ref_grads) = (
    fn(q, k, v),
    jax.value_and_grad(reference, (0, 1, 2))(q, k, v),
  )
  np.testing.assert_allclose(value, ref_value, rtol=2e-2)
  for got, want in zip(grads, ref_grads):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max())
  _assert_plain_bfloat16_dots(fn.lower(q, k, v).compile().as_text(), 6)
