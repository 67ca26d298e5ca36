"""Tests of `param_init`: the batched draw gives flax's own initial parameters, from a
program with a fraction of the threefry hashes, and refuses what it cannot batch."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from t5x_lite import models
from t5x_lite.nn import network, param_init
from tiny_models import tiny_config

TINY = tiny_config()
CONFIGS = {
  'encoder_decoder_adapters_relpos_per_layer': dataclasses.replace(
    TINY, adapter_dim=8, relpos_bias_per_layer=True
  ),
  't5_1_0_bfloat16_params': dataclasses.replace(
    TINY, mlp_activations=('relu',), logits_via_embedding=True, param_dtype='bfloat16'
  ),
  'shared_encoder_decoder': dataclasses.replace(TINY, share_encoder_decoder=True),
  'prefix_lm': dataclasses.replace(TINY, architecture='prefix_lm', num_encoder_layers=0),
}


def _flax_init(config: network.T5Config, rng: jax.Array):
  """Flax's own `Module.init`, one draw per parameter."""
  tokens = jnp.ones((1, 1), jnp.int32)  # [batch, length]
  inputs = (tokens,) * (2 if config.architecture != 'encoder_decoder' else 3)
  module = models.network_module(config)
  return module.init({'params': rng, 'dropout': rng}, *inputs, enable_dropout=False)['params']


def _hashes(jaxpr: jax.extend.core.Jaxpr) -> int:
  """The PRNG hashes (fold-ins and bit draws) a program computes, sub-programs counted
  at each call; the recording key's fold-ins only keep their data."""
  count = 0
  for eqn in jaxpr.eqns:
    recording = any('param_init_recording' in str(v.aval) for v in eqn.invars)
    if eqn.primitive.name in ('random_bits', 'random_fold_in', 'threefry2x32') and not recording:
      count += 1
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          count += _hashes(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          count += _hashes(sub)
  return count


@pytest.mark.parametrize('name', sorted(CONFIGS))
def test_batched_init_gives_flax_values_with_few_hashes(name):
  config = CONFIGS[name]
  rng = jax.random.PRNGKey(3)
  batched_hashes = _hashes(jax.make_jaxpr(lambda r: models.init_params(config, r))(rng).jaxpr)
  per_parameter = _hashes(jax.make_jaxpr(lambda r: _flax_init(config, r))(rng).jaxpr)
  drawn = sum(
    leaf.size > 0 and leaf_name != 'scale'
    for (*_, leaf_name), leaf in traverse_util.flatten_dict(
      nn.meta.unbox(jax.eval_shape(lambda r: _flax_init(config, r), rng))
    ).items()
  )
  assert per_parameter >= 2 * drawn  # flax: a fold-in and a draw each
  assert batched_hashes * 4 < per_parameter, (batched_hashes, per_parameter)
  batched = traverse_util.flatten_dict(
    jax.jit(lambda r: nn.meta.unbox(models.init_params(config, r)))(rng)
  )
  reference = traverse_util.flatten_dict(
    jax.jit(lambda r: nn.meta.unbox(_flax_init(config, r)))(rng)
  )
  assert batched.keys() == reference.keys()
  for path, expected in reference.items():
    got = batched[path]
    assert got.shape == expected.shape and got.dtype == expected.dtype, path
    expected = np.asarray(expected, np.float32)
    # Equal bit for bit at XLA's default CPU settings; the suite's compile flags
    # (tests/xla_flags.py) round the normal samples' float math a little differently
    # in the two programs' fusions. A wrong key or initialiser moves every value by
    # its whole scale.
    np.testing.assert_allclose(
      np.asarray(got, np.float32),
      expected,
      rtol=0,
      atol=1e-6 * np.abs(expected).max(),
      err_msg='/'.join(path),
    )


@pytest.mark.parametrize('lifted', ['scan_layers', 'remat_policy'])
def test_lifted_transforms_take_flaxs_per_parameter_path(lifted):
  # Their layers' parameters are created in traces of their own, where a placeholder
  # would reach the tree as the transform's output, out of the draw's reach.
  config = dataclasses.replace(TINY, **{lifted: True if lifted == 'scan_layers' else 'full'})
  got, expected = jax.jit(
    lambda r: (nn.meta.unbox(models.init_params(config, r)), nn.meta.unbox(_flax_init(config, r)))
  )(jax.random.PRNGKey(1))
  jax.tree.map(np.testing.assert_array_equal, got, expected)


class _Bypass(nn.Module):
  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    weight = self.param('weight', nn.initializers.normal(), (x.shape[-1],))
    return x * weight


def test_a_parameter_outside_deferrable_initialisers_raises():
  for transform in (lambda f: f, jax.jit):
    with pytest.raises(param_init.RecordingKeyDrawError, match='partitioned_param'):
      transform(lambda r: param_init.init_params(_Bypass(), r, jnp.ones((2, 3))))(
        jax.random.PRNGKey(0)
      )
  params = param_init.init_params(_Bypass(), jax.random.PRNGKey(0), jnp.ones((2, 3)), batched=False)
  assert params['weight'].shape == (3,)


def test_initialisers_group_only_when_they_compute_alike():
  signature = param_init._signature
  shape = ((4, 8), jnp.float32)
  fan_in = nn.initializers.variance_scaling
  assert signature(fan_in(1.0, 'fan_in', 'normal'), shape, {}) == signature(
    fan_in(1.0, 'fan_in', 'normal'), shape, {}
  )
  assert signature(fan_in(1.0, 'fan_in', 'normal'), shape, {}) != signature(
    fan_in(0.5, 'fan_in', 'normal'), shape, {}
  )
  assert signature(fan_in(1.0, 'fan_in', 'normal'), shape, {}) != signature(
    fan_in(1.0, 'fan_in', 'normal'), ((8, 4), jnp.float32), {}
  )

  # Closed over an array, an initialiser is compared by its traced program and constants.
  def offset_by(values):
    return lambda key, shape, dtype: jax.random.normal(key, shape, dtype) + values

  ones, twos = np.ones((4, 8), np.float32), np.full((4, 8), 2.0, np.float32)
  assert signature(offset_by(ones), shape, {}) == signature(offset_by(ones.copy()), shape, {})
  assert signature(offset_by(ones), shape, {}) != signature(offset_by(twos), shape, {})
