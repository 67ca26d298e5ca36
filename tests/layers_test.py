"""Tests of t5x_lite.nn.layers against hand-derived goldens and numpy references."""

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


def test_projection_declares_its_axes():
  """Projection(features, kernel_axes): the kernel is [*in, *features], the inputs'
  trailing len(kernel_axes) - len(features) axes contracted."""
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 4, 5))  # [batch, length, heads, kv]
  module = layers.Projection(features=(6,), kernel_axes=('heads', 'kv', 'embed'))
  params = module.init(jax.random.PRNGKey(1), x)['params']
  assert params['kernel'].names == ('heads', 'kv', 'embed')
  kernel = params['kernel'].unbox()
  assert kernel.shape == (4, 5, 6)
  out = module.apply({'params': params}, x)
  assert out.shape == (2, 3, 6)
  np.testing.assert_allclose(out, np.einsum('blhd,hde->ble', x, kernel), rtol=1e-5, atol=1e-6)
