"""Tests of the T5 network: packing, cached decoding, scan/remat equivalence, dropout,
adapters."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_lite.nn import network
from t5x_lite.core.errors import ConfigError
from tiny_models import tiny_config

TINY = tiny_config()
TINY_V1_0 = dataclasses.replace(TINY, mlp_activations=('relu',), logits_via_embedding=True)

ENCODER_TOKENS = jnp.array([[3, 4, 5, 6, 1, 0], [7, 8, 9, 10, 11, 1]])
TARGETS = jnp.array([[12, 13, 14, 15, 16, 1, 17], [18, 19, 20, 21, 22, 23, 1]])


def _shift_right(targets):
  return jnp.concatenate([jnp.zeros_like(targets[:, :1]), targets[:, :-1]], axis=1)


def _init(config, seed=0):
  """Random params of the network's exact tree, without compiling the initialisers.

  Real initialisers are covered in layers_test; here any well-scaled values do.
  """
  model = network.Transformer(config)
  abstract = jax.eval_shape(
    functools.partial(model.init, enable_dropout=False),
    jax.random.PRNGKey(0),
    ENCODER_TOKENS,
    _shift_right(TARGETS),
    TARGETS,
  )
  rng = np.random.RandomState(seed)

  def sample(path, leaf):
    name = path[-1].key
    if name == 'scale':
      return jnp.asarray(1.0 + 0.1 * rng.randn(*leaf.shape), jnp.float32)
    std = 1.0 if name == 'embedding' else 0.2
    return jnp.asarray(std * rng.randn(*leaf.shape), jnp.float32)

  params = jax.tree_util.tree_map_with_path(sample, nn.meta.unbox(abstract['params']))
  return model, params


@functools.cache
def _jitted_apply(config, static_items):
  model = network.Transformer(config)
  return jax.jit(functools.partial(model.apply, **dict(static_items)))


def _logits(
  model, params, encoder_tokens=ENCODER_TOKENS, targets=TARGETS, rngs=None, **static_kwargs
):
  """Jitted Transformer.__call__; static_kwargs (enable_dropout, mutable, ...) are static."""
  apply = _jitted_apply(model.config, tuple(sorted(static_kwargs.items())))
  return apply({'params': params}, encoder_tokens, _shift_right(targets), targets, rngs=rngs)


def test_config_is_frozen_and_replaceable():
  with pytest.raises(dataclasses.FrozenInstanceError):
    TINY.emb_dim = 4  # type: ignore[misc]
  assert dataclasses.replace(TINY, emb_dim=16).emb_dim == 16
  assert network.T5Config(
    **{**dataclasses.asdict(TINY), 'mlp_activations': ['relu']}
  ) == dataclasses.replace(TINY, mlp_activations=('relu',))
  with pytest.raises(ValueError, match='remat_policy'):
    dataclasses.replace(TINY, remat_policy='some')
  with pytest.raises(ValueError, match='max_distance'):
    dataclasses.replace(TINY, relative_attention_num_buckets=8, relative_attention_max_distance=4)


@pytest.mark.parametrize('config', [TINY, TINY_V1_0], ids=['v1_1', 'v1_0'])
def test_param_tree_names(config):
  _, params = _init(config)
  assert set(params) == {'token_embedder', 'encoder', 'decoder'}
  assert set(params['encoder']['layers_0']) == {
    'pre_attention_layer_norm',
    'attention',
    'pre_mlp_layer_norm',
    'mlp',
  }
  assert set(params['decoder']['layers_1']) == {
    'pre_self_attention_layer_norm',
    'self_attention',
    'pre_cross_attention_layer_norm',
    'encoder_decoder_attention',
    'pre_mlp_layer_norm',
    'mlp',
  }
  assert params['decoder']['relpos_bias']['rel_embedding'].shape == (4, 32)
  assert ('logits_dense' in params['decoder']) == (not config.logits_via_embedding)


def test_tied_logits_are_scaled_embedding_attend():
  model, params = _init(TINY_V1_0)
  logits, state = _logits(
    model, params, enable_dropout=False, capture_intermediates=True, mutable=('intermediates',)
  )
  hidden = state['intermediates']['decoder']['decoder_norm']['__call__'][0]
  expected = np.asarray(hidden) / np.sqrt(32) @ np.asarray(params['token_embedder']['embedding']).T
  np.testing.assert_allclose(np.asarray(logits), expected, rtol=1e-4, atol=1e-4)


def test_packed_examples_match_unpacked():
  """Two examples packed in one row give the same logits as each alone."""
  model, params = _init(TINY)
  enc_a, tgt_a = [3, 4, 5, 1], [6, 7, 1]
  enc_b, tgt_b = [8, 9, 1], [10, 1]
  packed = dict(
    encoder_input_tokens=jnp.array([enc_a + enc_b + [0]]),
    encoder_segment_ids=jnp.array([[1, 1, 1, 1, 2, 2, 2, 0]]),
    encoder_positions=jnp.array([[0, 1, 2, 3, 0, 1, 2, 0]]),
    decoder_target_tokens=jnp.array([tgt_a + tgt_b + [0]]),
    decoder_input_tokens=jnp.array([[0, 6, 7, 0, 10, 0]]),
    decoder_segment_ids=jnp.array([[1, 1, 1, 2, 2, 0]]),
    decoder_positions=jnp.array([[0, 1, 2, 0, 1, 0]]),
  )
  apply = jax.jit(functools.partial(model.apply, enable_dropout=False))
  packed_logits = apply({'params': params}, **packed)

  def alone(enc, tgt):
    enc = jnp.array([enc + [0] * (8 - len(enc))])
    tgt = jnp.array([tgt + [0] * (6 - len(tgt))])
    return apply({'params': params}, enc, _shift_right(tgt), tgt)

  np.testing.assert_allclose(packed_logits[0, :3], alone(enc_a, tgt_a)[0, :3], atol=1e-5)
  np.testing.assert_allclose(packed_logits[0, 3:5], alone(enc_b, tgt_b)[0, :2], atol=1e-5)


def _restack(params, config):
  """Plain per-layer params -> scan layout (layers stacked on a leading axis)."""
  params = jax.tree.map(lambda x: x, params)  # copy the dict structure
  for stack, num in (
    ('encoder', config.num_encoder_layers),
    ('decoder', config.num_decoder_layers),
  ):
    per_layer = [params[stack].pop(f'layers_{i}') for i in range(num)]
    params[stack]['layers'] = jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)
  return params


def _encode_and_init_cache(model, params, cache_tokens, max_decode_length=None):
  """Encodes ENCODER_TOKENS and creates the zero decoding cache (jitted)."""

  @jax.jit
  def run(params):
    encoded = model.apply(
      {'params': params}, ENCODER_TOKENS, enable_dropout=False, method=network.Transformer.encode
    )
    _, variables = model.apply(
      {'params': params},
      encoded,
      ENCODER_TOKENS,
      cache_tokens,
      decode=True,
      max_decode_length=max_decode_length,
      enable_dropout=False,
      mutable=['cache'],
      method=network.Transformer.decode,
    )
    return encoded, variables

  return run(params)


def _decode_with_cache(model, params, max_len):
  """Teacher forcing through the single-step cache path, one token per call."""
  encoded, variables = _encode_and_init_cache(model, params, jnp.ones((2, max_len)))
  cache = variables['cache']

  @jax.jit
  def step(cache, tokens):
    logits, variables = model.apply(
      {'params': params, 'cache': cache},
      encoded,
      ENCODER_TOKENS,
      tokens,
      decode=True,
      enable_dropout=False,
      mutable=['cache'],
      method=network.Transformer.decode,
    )
    return logits, variables['cache']

  inputs = _shift_right(TARGETS)
  outputs = []
  for i in range(TARGETS.shape[1]):
    logits, cache = step(cache, inputs[:, i : i + 1])
    outputs.append(logits)
  return jnp.concatenate(outputs, axis=1), cache


@pytest.mark.parametrize(
  'variant',
  [
    dict(),
    dict(scan_layers=True),
    dict(scan_layers=True, remat_policy='full'),
    dict(scan_layers=True, adapter_dim=8),
    dict(relpos_bias_per_layer=True),
    dict(scan_layers=True, relpos_bias_per_layer=True),
  ],
  ids=['loop', 'scan', 'scan_remat', 'scan_adapters', 'relpos_per_layer', 'scan_relpos_per_layer'],
)
def test_cached_decoding_matches_teacher_forcing(variant):
  # max_distance 5 < target length 7, so saturated relative buckets are exercised too.
  config = dataclasses.replace(
    TINY, relative_attention_num_buckets=8, relative_attention_max_distance=5, **variant
  )
  model, params = _init(config)
  full = _logits(model, params, enable_dropout=False)
  stepped, cache = _decode_with_cache(model, params, max_len=TARGETS.shape[1])
  valid = np.asarray(TARGETS > 0)
  np.testing.assert_allclose(np.asarray(stepped)[valid], np.asarray(full)[valid], atol=1e-5)
  for path, leaf in jax.tree_util.tree_leaves_with_path(cache):
    if path[-1].key == 'cache_index':
      assert leaf.shape == () and leaf.dtype == jnp.int32
      assert int(leaf) == TARGETS.shape[1]
    else:
      assert leaf.shape[0] == 2, (path, leaf.shape)


def test_cache_longer_than_steps_via_max_decode_length():
  model, params = _init(TINY)
  _, variables = _encode_and_init_cache(
    model, params, jnp.ones((2, 1), jnp.int32), max_decode_length=11
  )
  cached_key = variables['cache']['decoder']['layers_0']['self_attention']['cached_key']
  assert cached_key.shape == (2, 4, 11, 8)  # [batch, heads, length, kv]
  cross = variables['cache']['decoder']['layers_0']['encoder_decoder_attention']
  input_len = ENCODER_TOKENS.shape[1]
  assert cross['cached_key'].shape == (2, 4, 8, input_len)  # [batch, heads, kv, input_len]
  assert cross['cached_value'].shape == (2, 4, input_len, 8)  # [batch, heads, input_len, kv]


def test_scan_and_remat_match_plain_network():
  model, params = _init(TINY)
  plain = _logits(model, params, enable_dropout=False)

  def loss(model, params):
    return lambda p: jnp.sum(_logits(model, p, enable_dropout=False) ** 2) * 1e-3

  plain_grads = jax.jit(jax.grad(loss(model, params)))(params)
  # Remat only changes the backward pass, so its variants also compare gradients.
  variants = [
    (dict(scan_layers=True), False),
    (dict(remat_policy='minimal'), True),
    (dict(remat_policy='full', scan_layers=True), True),
  ]
  for variant, check_grads in variants:
    config = dataclasses.replace(TINY, **variant)
    variant_model = network.Transformer(config)
    variant_params = _restack(params, config) if config.scan_layers else params
    logits = _logits(variant_model, variant_params, enable_dropout=False)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(plain), atol=1e-5, err_msg=variant)
    if check_grads:
      grads = jax.jit(jax.grad(loss(variant_model, variant_params)))(variant_params)
      expected = _restack(plain_grads, config) if config.scan_layers else plain_grads
      jax.tree.map(
        lambda a, b, msg=variant: np.testing.assert_allclose(a, b, atol=1e-5, err_msg=msg),
        grads,
        expected,
      )


def test_scanned_params_have_layers_axis():
  model = network.Transformer(dataclasses.replace(TINY, scan_layers=True))
  variables = jax.eval_shape(
    lambda: model.init(
      jax.random.PRNGKey(0), ENCODER_TOKENS, TARGETS, TARGETS, enable_dropout=False
    )
  )
  kernel = variables['params']['encoder']['layers']['mlp']['wi_0']['kernel']
  assert kernel.names == ('layers', 'embed', 'mlp')
  assert kernel.value.shape == (2, 32, 64)


def test_dropout():
  model, params = _init(dataclasses.replace(TINY, dropout_rate=0.3))
  off_a = _logits(model, params, enable_dropout=False)
  off_b = _logits(model, params, enable_dropout=False, rngs={'dropout': jax.random.PRNGKey(5)})
  np.testing.assert_array_equal(np.asarray(off_a), np.asarray(off_b))
  on_a = _logits(model, params, enable_dropout=True, rngs={'dropout': jax.random.PRNGKey(1)})
  on_b = _logits(model, params, enable_dropout=True, rngs={'dropout': jax.random.PRNGKey(2)})
  assert not np.allclose(np.asarray(on_a), np.asarray(off_a), atol=1e-3)
  assert not np.allclose(np.asarray(on_a), np.asarray(on_b), atol=1e-3)


def test_bfloat16_activations_return_float32_logits():
  model, params = _init(dataclasses.replace(TINY, dtype='bfloat16'))
  logits = _logits(model, params, enable_dropout=False)
  assert logits.dtype == jnp.float32
  reference = np.asarray(_logits(network.Transformer(TINY), params, enable_dropout=False))
  relative_error = np.linalg.norm(np.asarray(logits) - reference) / np.linalg.norm(reference)
  assert 0.0 < relative_error < 0.02


def test_bfloat16_attention_logits_stay_close_to_float32_ones():
  """`attention_logits_dtype='bfloat16'` (flaxformer's default) moves the logits by bf16
  rounding only; float32 attention logits stay the default."""
  config = dataclasses.replace(TINY, dtype='bfloat16')
  assert config.attention_logits_dtype == 'float32'
  model, params = _init(config)
  reference = np.asarray(_logits(model, params, enable_dropout=False))
  bf16_logits = network.Transformer(dataclasses.replace(config, attention_logits_dtype='bfloat16'))
  logits = np.asarray(_logits(bf16_logits, params, enable_dropout=False))
  relative_error = np.linalg.norm(logits - reference) / np.linalg.norm(reference)
  assert 0.0 < relative_error < 0.02


def test_unknown_attention_logits_dtype_names_the_field():
  with pytest.raises(
    ConfigError, match="T5Config.attention_logits_dtype must be one of .* got 'fp8'"
  ):
    dataclasses.replace(TINY, attention_logits_dtype='fp8')


def test_relpos_bias_per_layer_owns_one_table_per_layer():
  """Per-layer tables all equal to the stack's table give the stack-shared network's logits;
  different tables give other logits (each layer reads its own)."""
  config = dataclasses.replace(TINY, relpos_bias_per_layer=True)
  model, params = _init(TINY)
  shared = _logits(model, params, enable_dropout=False)
  per_layer = {stack: dict(params[stack]) for stack in ('encoder', 'decoder')}
  for stack in per_layer:
    table = per_layer[stack].pop('relpos_bias')
    for i in range(2):
      per_layer[stack][f'layers_{i}'] = {**params[stack][f'layers_{i}'], 'relpos_bias': table}
  per_layer['token_embedder'] = params['token_embedder']
  fresh = nn.meta.unbox(network.init_params(config, jax.random.PRNGKey(0)))
  assert jax.tree.structure(per_layer) == jax.tree.structure(fresh)
  same = _logits(network.Transformer(config), per_layer, enable_dropout=False)
  np.testing.assert_allclose(np.asarray(same), np.asarray(shared), rtol=0, atol=1e-6)
  bias = per_layer['encoder']['layers_1']['relpos_bias']['rel_embedding']
  # A shift that differs by bucket (a constant one would cancel in the softmax).
  shifted = bias + 0.5 * jnp.arange(bias.shape[1])
  per_layer['encoder']['layers_1']['relpos_bias'] = {'rel_embedding': shifted}
  other = _logits(network.Transformer(config), per_layer, enable_dropout=False)
  assert not np.allclose(np.asarray(other), np.asarray(shared), atol=1e-3)


@pytest.mark.parametrize('scan_layers', [False, True], ids=['loop', 'scan'])
def test_adapters_at_init_are_the_identity(scan_layers):
  plain_config = dataclasses.replace(TINY, scan_layers=scan_layers)
  config = dataclasses.replace(plain_config, adapter_dim=8)
  model, params = _init(plain_config)
  fresh = nn.meta.unbox(network.init_params(config, jax.random.PRNGKey(1)))
  adapters = network.adapter_params(fresh)
  layers = 'layers' if scan_layers else 'layers_1'
  stacked = (2,) if scan_layers else ()
  assert adapters['encoder'][layers]['adapter']['wi']['kernel'].shape == stacked + (32, 8)
  assert adapters['decoder'][layers]['adapter']['wo']['kernel'].shape == stacked + (8, 32)
  assert network.adapter_params(params) == {}
  with_adapters = jax.tree.map(lambda x: x, params)  # copy the dict structure
  for stack in ('encoder', 'decoder'):
    for name, layer in adapters[stack].items():
      with_adapters[stack][name]['adapter'] = layer['adapter']
  assert jax.tree.structure(with_adapters) == jax.tree.structure(fresh)
  plain = _logits(model, params, enable_dropout=False)
  # wo starts at zero, so each adapter adds exactly 0: equal, not merely within 1e-6.
  adapted = _logits(network.Transformer(config), with_adapters, enable_dropout=False)
  np.testing.assert_allclose(np.asarray(adapted), np.asarray(plain), rtol=0, atol=1e-6)
  # The adapters are in the computation: trained (non-zero) ones change the outputs.
  trained = jax.tree.map(lambda x: x + 0.1, adapters)
  for stack in ('encoder', 'decoder'):
    for name, layer in trained[stack].items():
      with_adapters[stack][name]['adapter'] = layer['adapter']
  changed = _logits(network.Transformer(config), with_adapters, enable_dropout=False)
  assert not np.allclose(np.asarray(changed), np.asarray(plain), atol=1e-3)


def test_adapter_kernels_use_the_mlp_logical_axes():
  config = dataclasses.replace(TINY, adapter_dim=8, scan_layers=True)
  params = jax.eval_shape(functools.partial(network.init_params, config), jax.random.PRNGKey(0))
  adapter = params['decoder']['layers']['adapter']
  assert adapter['wi']['kernel'].names == ('layers', 'embed', 'mlp')
  assert adapter['wo']['kernel'].names == ('layers', 'mlp', 'embed')
  with pytest.raises(ValueError, match='adapter_dim'):
    dataclasses.replace(TINY, adapter_dim=-1)


def _checkpoints_in_jaxpr(jaxpr) -> int:
  """How many checkpoint (remat) equations `jaxpr` holds, nested ones included."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name in ('checkpoint', 'remat2')
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      count += _checkpoints_in_jaxpr(sub)
  return count


@pytest.mark.parametrize(
  'remat_policy, layer_checkpoints', [('none', True), ('minimal', False), ('full', False)]
)
def test_norms_and_activations_checkpoint_themselves_only_outside_layer_remat(
  remat_policy, layer_checkpoints
):
  """Norm and gated activation recompute their float32 intermediates where no layer remat
  does; inside a rematerialised layer a nested checkpoint would only cost memory."""
  from t5x_lite.nn import blocks  # pylint: disable=g-import-not-at-top

  config = dataclasses.replace(TINY, remat_policy=remat_policy)
  assert blocks.norm(config, 'pre_mlp_layer_norm').recompute is layer_checkpoints
  assert blocks.mlp(config).recompute is layer_checkpoints
  assert blocks.norm(config, 'encoder_norm', in_layer=False).recompute is True
  # The whole network's gradient: one checkpoint per layer when remat is on, and then no
  # nested one; with remat off, checkpoints only around norms and activations.
  model, params = _init(config)
  jaxpr = jax.make_jaxpr(jax.grad(lambda p: jnp.sum(_logits(model, p, enable_dropout=False) ** 2)))(
    params
  ).jaxpr
  layers = TINY.num_encoder_layers + TINY.num_decoder_layers
  # norms: 2 per encoder layer, 3 per decoder layer, 2 final; one activation per layer
  per_network = 2 * TINY.num_encoder_layers + 3 * TINY.num_decoder_layers + 2 + layers
  expected = per_network if remat_policy == 'none' else layers + 2
  assert _checkpoints_in_jaxpr(jaxpr) == expected
