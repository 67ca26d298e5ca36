"""Tests of t5x_lite.nn.attention: T5's unscaled attention, its kernels and caches."""

import jax
import jax.numpy as jnp
import flax.linen as nn
import numpy as np
import pytest

from t5x_lite.kernels import reference, xla_cpu
from t5x_lite.nn import attention, layers


def _softmax(x):
  x = x - x.max(-1, keepdims=True)
  return np.exp(x) / np.exp(x).sum(-1, keepdims=True)


@pytest.mark.parametrize('kernels', [reference.KERNELS, xla_cpu.KERNELS], ids=lambda k: k.name)
def test_attention_has_no_logit_scaling(kernels):
  rng = np.random.RandomState(0)
  q_in = rng.randn(2, 3, 16).astype(np.float32)
  kv_in = rng.randn(2, 5, 16).astype(np.float32)
  bias = rng.randn(1, 4, 3, 5).astype(np.float32)
  module = attention.MultiHeadAttention(num_heads=4, head_dim=8, kernels=kernels)
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
  module = attention.MultiHeadAttention(num_heads=heads, head_dim=head_dim)
  x = jnp.ones((1, 1, emb))
  params = nn.meta.unbox(module.init(jax.random.PRNGKey(0), x, x))['params']
  query_std = float(np.std(params['query']['kernel']))
  key_std = float(np.std(params['key']['kernel']))
  out_std = float(np.std(params['out']['kernel']))
  np.testing.assert_allclose(query_std, 1.0 / np.sqrt(emb * head_dim), rtol=0.05)
  np.testing.assert_allclose(key_std, 1.0 / np.sqrt(emb), rtol=0.05)
  np.testing.assert_allclose(out_std, 1.0 / np.sqrt(heads * head_dim), rtol=0.05)


def test_attention_kernels_are_logically_partitioned():
  module = attention.MultiHeadAttention(num_heads=2, head_dim=4)
  x = jnp.ones((1, 3, 8))
  params = module.init(jax.random.PRNGKey(0), x, x)['params']
  assert params['query']['kernel'].names == ('embed', 'heads', 'kv')
  assert params['out']['kernel'].names == ('heads', 'kv', 'embed')
  assert params['out']['kernel'].value.shape == (2, 4, 8)


def test_causal_step_bias():
  distance_bias = jnp.arange(4, dtype=jnp.float32)[None, None, None, :] + 10.0  # [1, 1, 1, 4]
  row = np.asarray(attention.causal_step_bias(distance_bias, jnp.array(5), 8))[0, 0, 0]
  # keys 0..5 are at distances 5,4,3,2,1,0 (saturating at 3); keys 6, 7 are masked.
  np.testing.assert_array_equal(row[:6], [13, 13, 13, 12, 11, 10])
  assert (row[6:] == layers.MASK_BIAS).all()


def test_a_decode_step_needs_its_position():
  module = attention.MultiHeadAttention(num_heads=2, head_dim=4)
  x = jnp.ones((1, 3, 8))
  variables = module.init(jax.random.PRNGKey(0), x, x, mode=attention.CacheMode.INIT)
  with pytest.raises(ValueError, match='decode_position'):
    module.apply(variables, x[:, :1], x[:, :1], mode=attention.CacheMode.STEP, mutable=['cache'])


@pytest.mark.parametrize('kernels', [reference.KERNELS, xla_cpu.KERNELS], ids=lambda k: k.name)
def test_decode_steps_equal_the_full_causal_pass(kernels):
  """INIT, then one STEP per position, gives what one causal pass over the whole
  sequence gives, whatever the kernels' cache layout."""
  length = 5
  x = jax.random.normal(jax.random.PRNGKey(0), (2, length, 8))
  bias_table = jax.random.normal(jax.random.PRNGKey(1), (1, 2, 1, length))  # [1, heads, 1, D]
  module = attention.MultiHeadAttention(num_heads=2, head_dim=4, kernels=kernels)
  distance = jnp.arange(length)[:, None] - jnp.arange(length)[None, :]  # [q, k]
  full_bias = jnp.take(bias_table, jnp.clip(distance, 0, length - 1), axis=-1)[:, :, 0]
  mask = layers.mask_to_bias(layers.make_causal_mask(length))  # [1, 1, q, k]
  variables = module.init(jax.random.PRNGKey(2), x, x)
  full = module.apply(variables, x, x, mask, full_bias)  # [batch, length, embed]
  _, cache = module.apply(variables, x, x, mode=attention.CacheMode.INIT, mutable=['cache'])
  steps = []
  for position in range(length):
    out, cache = module.apply(
      {**variables, **cache},
      x[:, position : position + 1],
      x[:, position : position + 1],
      None,
      bias_table,
      mode=attention.CacheMode.STEP,
      decode_position=jnp.array(position),
      mutable=['cache'],
    )
    steps.append(out)
  np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5)
