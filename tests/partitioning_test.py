"""Sharding of the T5 network on 8 fake CPU devices (mesh data=4, model=2)."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from t5x_lite.nn import network
from t5x_lite.training import partitioning
from t5x_lite.core.errors import ConfigError
from tiny_models import tiny_config

TINY = tiny_config()
TOKENS = jnp.array([[3, 4, 5, 1]] * 4, jnp.int32)


def _abstract_variables(config):
  model = network.Transformer(config)
  init = functools.partial(model.init, enable_dropout=False)
  return model, init, jax.eval_shape(init, jax.random.PRNGKey(0), TOKENS, TOKENS, TOKENS)


def test_create_mesh():
  assert jax.device_count() == 8
  mesh = partitioning.create_mesh(data=4, model=2)
  assert mesh.axis_names == ('data', 'model')
  assert dict(mesh.shape) == {'data': 4, 'model': 2}
  assert dict(partitioning.create_mesh(num_partitions=2).shape) == {'data': 4, 'model': 2}
  assert dict(partitioning.create_mesh().shape) == {'data': 8, 'model': 1}
  assert dict(partitioning.create_mesh(devices=jax.devices()[:2]).shape) == {'data': 2, 'model': 1}
  with pytest.raises(ValueError, match='does not match'):
    partitioning.create_mesh(data=3, model=2)


def test_initialised_params_are_sharded_by_logical_axes():
  mesh = partitioning.create_mesh(data=4, model=2)
  rules = partitioning.standard_logical_axis_rules()
  _, init, abstract = _abstract_variables(TINY)
  shardings = partitioning.logical_shardings(abstract, mesh, rules)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    variables = jax.jit(init, out_shardings=shardings)(
      jax.random.PRNGKey(0), TOKENS, TOKENS, TOKENS
    )
  params = nn.meta.unbox(variables['params'])
  wi = params['encoder']['layers_0']['mlp']['wi_0']['kernel']
  assert wi.sharding.spec == P(None, 'model')
  assert wi.addressable_shards[0].data.shape == (32, 32)  # mlp 64 split over model=2
  embedding = params['token_embedder']['embedding']
  assert embedding.sharding.spec == P('model', None)
  assert embedding.addressable_shards[0].data.shape == (32, 32)  # vocab 64 split
  query = params['decoder']['layers_1']['self_attention']['query']['kernel']
  assert query.sharding.spec == P(None, 'model', None)
  assert params['decoder']['logits_dense']['kernel'].sharding.spec == P(None, 'model')
  assert params['encoder']['relpos_bias']['rel_embedding'].sharding.spec == P('model', None)
  assert params['encoder']['encoder_norm']['scale'].sharding.spec == P(None)


def test_fsdp_shards_embed_over_data():
  mesh = partitioning.create_mesh(data=4, model=2)
  rules = partitioning.standard_logical_axis_rules(fsdp=True)
  _, _, abstract = _abstract_variables(TINY)
  shardings = partitioning.logical_shardings(abstract, mesh, rules)['params']
  assert shardings['token_embedder']['embedding'].spec == P('model', 'data')
  assert shardings['encoder']['layers_0']['mlp']['wo']['kernel'].spec == P('model', 'data')
  assert shardings['encoder']['layers_0']['attention']['out']['kernel'].spec == P(
    'model', None, 'data'
  )
  assert shardings['encoder']['encoder_norm']['scale'].spec == P('data')
  params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), nn.meta.unbox(abstract['params']))
  placed = jax.device_put(params, shardings)
  wo = placed['encoder']['layers_0']['mlp']['wo']['kernel']
  assert wo.addressable_shards[0].data.shape == (32, 8)  # [mlp/2, embed/4]


def test_scanned_layers_axis_is_replicated():
  mesh = partitioning.create_mesh(data=4, model=2)
  _, _, abstract = _abstract_variables(dataclasses.replace(TINY, scan_layers=True))
  shardings = partitioning.logical_shardings(
    abstract, mesh, partitioning.standard_logical_axis_rules()
  )
  layers = shardings['params']['decoder']['layers']
  assert layers['mlp']['wi_1']['kernel'].spec == P(None, None, 'model')
  assert layers['self_attention']['out']['kernel'].spec == P(None, 'model', None, None)


def test_optimizer_state_and_plain_leaves():
  mesh = partitioning.create_mesh(data=4, model=2)
  rules = partitioning.standard_logical_axis_rules(fsdp=True)
  _, _, abstract = _abstract_variables(TINY)
  opt_state = jax.eval_shape(optax.adamw(1e-3).init, abstract['params'])
  tree = {
    'opt_state': opt_state,
    'step': jnp.zeros((), jnp.int32),
    'plain': np.ones((3, 2)),
    'scalar': 1.5,
  }
  shardings = partitioning.logical_shardings(tree, mesh, rules)
  adam = shardings['opt_state'][0]
  assert adam.mu['encoder']['layers_0']['mlp']['wi_0']['kernel'].spec == P('data', 'model')
  assert adam.nu['token_embedder']['embedding'].spec == P('model', 'data')
  assert adam.count.spec == P()
  for name in ('step', 'plain', 'scalar'):
    assert shardings[name].spec == P() and shardings[name].mesh == mesh


def test_sharded_forward_matches_unsharded():
  mesh = partitioning.create_mesh(data=4, model=2)
  rules = partitioning.standard_logical_axis_rules()
  model, _, abstract = _abstract_variables(TINY)
  rng = np.random.RandomState(0)
  params = jax.tree.map(
    lambda s: jnp.asarray(0.3 * rng.randn(*s.shape), jnp.float32), nn.meta.unbox(abstract['params'])
  )
  apply = functools.partial(model.apply, enable_dropout=False)
  expected = jax.jit(apply)({'params': params}, TOKENS, TOKENS, TOKENS)
  param_shardings = partitioning.logical_shardings(abstract, mesh, rules)['params']
  batch = partitioning.batch_sharding(mesh)
  assert batch.spec == P('data', None)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    sharded = jax.jit(apply, in_shardings=({'params': param_shardings}, batch, batch, batch))
    logits = sharded({'params': params}, TOKENS, TOKENS, TOKENS)
  # The logits constraint ('batch', 'length', 'vocab') decides the output layout.
  assert logits.sharding.spec == P('data', None, 'model')
  np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), atol=1e-5)


def test_partitioner_carries_mesh_rules_and_abstract_params():
  partitioner = partitioning.Partitioner(num_partitions=2, fsdp=True)
  assert dict(partitioner.mesh.shape) == {'data': 4, 'model': 2}
  assert partitioner.data_size == 4
  assert partitioner.rules == partitioning.standard_logical_axis_rules(fsdp=True)

  def init(key):  # a PRNG key would fail on compile-only devices: only its shape is used
    assert isinstance(key, jax.core.Tracer)
    kernel = nn.initializers.normal()(key, (16, 8))
    return {'kernel': nn.LogicallyPartitioned(kernel, ('embed', 'mlp'))}

  abstract, shardings = partitioner.abstract_params(init)
  assert abstract['kernel'].shape == (16, 8)
  assert abstract['kernel'].sharding.spec == P('data', 'model')
  assert shardings['kernel'] == abstract['kernel'].sharding


def test_partitioner_jit_runs_and_lowers_the_same_function_in_its_context():
  partitioner = partitioning.Partitioner(num_partitions=2)

  def double(x):  # the logical constraint resolves only under the partitioner's rules
    return 2 * nn.with_logical_constraint(x, ('batch', 'mlp'))

  fn = partitioner.jit(double, partitioner.batch_sharding, partitioner.batch_sharding)
  x = jnp.arange(32.0).reshape(8, 4)
  np.testing.assert_array_equal(fn(x), 2 * x)
  lowered = fn.lower(jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=partitioner.batch_sharding))
  assert 'sharding_constraint' in lowered.as_text()  # lowered under the partitioner's rules


def test_partitioner_rejects_num_partitions_that_do_not_divide_devices():
  with pytest.raises(ConfigError, match='Partitioner.num_partitions=3: .*does not match 8 devices'):
    partitioning.Partitioner(num_partitions=3)
