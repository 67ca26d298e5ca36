"""Tests for t5x_lite.training.optimizers."""

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import flax.linen as nn

from t5x_lite import models
from t5x_lite.nn import network
from t5x_lite.training import factored_moments, optimizers
from t5x_lite.core.errors import ConfigError


def test_rsqrt_schedule_values():
  schedule = optimizers.rsqrt_with_warmup(base=1.0, warmup_steps=10000)
  assert float(schedule(0)) == pytest.approx(0.01)
  assert float(schedule(10000)) == pytest.approx(0.01)
  assert float(schedule(40000)) == pytest.approx(0.005)
  scaled = optimizers.rsqrt_with_warmup(base=2.0, warmup_steps=100)
  assert float(scaled(400)) == pytest.approx(0.1)


def test_a_warm_up_longer_than_the_schedule_names_both_bindings():
  with pytest.raises(ConfigError, match=r"warmup_steps \(300\).*decay_steps \(2,"):
    optimizers.warmup_cosine(peak_value=1.0, warmup_steps=300, decay_steps=2)


def test_a_warm_up_as_long_as_the_schedule_is_all_warm_up():
  # TRAIN_STEPS=1 WARMUP_STEPS=1 is allowed ("at most"): optax refuses a zero-step cosine.
  schedule = optimizers.warmup_cosine(peak_value=1.0, warmup_steps=4, decay_steps=4)
  assert [float(schedule(step)) for step in range(5)] == pytest.approx([0, 0.25, 0.5, 0.75, 1])


def test_warmup_cosine_and_constant():
  schedule = optimizers.warmup_cosine(peak_value=1.0, warmup_steps=10, decay_steps=110)
  assert float(schedule(0)) == pytest.approx(0.0)
  assert float(schedule(5)) == pytest.approx(0.5)
  assert float(schedule(10)) == pytest.approx(1.0)
  assert float(schedule(60)) == pytest.approx(0.5, abs=1e-6)
  assert float(schedule(110)) == pytest.approx(0.0, abs=1e-6)
  assert float(optimizers.constant(0.3)(1234)) == pytest.approx(0.3)
  opt = optimizers.adamw(learning_rate=optimizers.constant(0.3))
  assert float(opt.learning_rate(jnp.array(7))) == pytest.approx(0.3)


def _factored_state(state):
  def is_factored(x):
    return isinstance(x, factored_moments.FactoredRmsState)

  leaves = [s for s in jax.tree.leaves(state, is_leaf=is_factored) if is_factored(s)]
  assert len(leaves) == 1
  return leaves[0]


def test_adafactor_factors_large_matrices():
  params = {"big": jnp.ones((256, 128)), "small": jnp.ones((64, 32)), "vec": jnp.ones((256,))}
  opt = optimizers.adafactor(learning_rate=0.01)
  state = _factored_state(opt.init(params))
  # Row and column statistics: one vector per factored dimension (optax's naming).
  assert {state.v_row["big"].shape, state.v_col["big"].shape} == {(256,), (128,)}
  assert state.v["big"].shape == (1,)
  # Below min_dim_size_to_factor and 1-d parameters keep a full second moment.
  assert state.v["small"].shape == (64, 32)
  assert state.v_row["small"].shape == (1,)
  assert state.v["vec"].shape == (256,)


def test_adafactor_second_moment_decay_is_t_pow_minus_0_8():
  params = {"w": jnp.ones((4, 3))}
  opt = optimizers.adafactor(learning_rate=0.01)
  state = opt.init(params)
  g1, g2 = jnp.full((4, 3), 2.0), jnp.full((4, 3), 3.0)
  _, state = opt.update({"w": g1}, state, params)
  _, state = opt.update({"w": g2}, state, params)
  beta2 = 1.0 - 2.0**-0.8  # step 1 uses t=1 (beta 0), step 2 uses t=2
  expected = beta2 * 4.0 + (1 - beta2) * 9.0
  np.testing.assert_allclose(_factored_state(state).v["w"], expected, rtol=1e-5)


def test_adafactor_update_scale_is_parameter_rms_times_lr():
  # One step: v = g^2, update = g / sqrt(v) = sign(g) (RMS 1, not clipped), scaled by
  # lr * max(rms(param), 1e-3).
  params = {"w": jnp.full((8, 8), 0.5)}
  opt = optimizers.adafactor(learning_rate=0.1)
  updates, _ = opt.update({"w": jnp.full((8, 8), 3.0)}, opt.init(params), params)
  np.testing.assert_allclose(updates["w"], -0.1 * 0.5, rtol=1e-5)


def test_adafactor_without_axes_equals_optax_adafactor():
  # Rank <= 2 parameters use the same rule as optax's Adafactor (T5X's heuristic).
  rng = np.random.RandomState(1)
  params = {
    "big": jnp.asarray(rng.randn(256, 130), jnp.float32),
    "small": jnp.asarray(rng.randn(40, 30), jnp.float32),
    "vec": jnp.asarray(rng.randn(64), jnp.float32),
  }
  ours, reference = optimizers.adafactor(learning_rate=0.05), optax.adafactor(0.05)
  ours_state, reference_state = ours.init(params), reference.init(params)
  for step in range(3):
    grads = jax.tree.map(lambda p, s=step: jnp.sin(p * (s + 1)), params)
    ours_update, ours_state = ours.update(grads, ours_state, params)
    reference_update, reference_state = reference.update(grads, reference_state, params)
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7),
      ours_update,
      reference_update,
    )
    params = optax.apply_updates(params, ours_update)


def _t5x_factored_update(param, grads, rows, cols, batch=(), lr=0.1):
  """T5X's Adafactor by its definition, in float64 numpy, over several steps."""
  param = np.asarray(param, np.float64)
  averaging = tuple(d for d in range(param.ndim) if d not in batch)
  v_row = v_col = None
  for step, grad in enumerate(grads):
    grad = np.asarray(grad, np.float64)
    decay = 1.0 - (step + 1.0) ** -0.8
    g2 = grad**2 + 1e-30
    row_mean = g2.mean(axis=cols)  # statistics over the column dims, per row
    col_mean = g2.mean(axis=rows)
    v_row = row_mean if v_row is None else decay * v_row + (1 - decay) * row_mean
    v_col = col_mean if v_col is None else decay * v_col + (1 - decay) * col_mean
    # v ~ v_row (x) v_col / mean(v_row over rows); y = g / sqrt(v)
    rows_in_v_row = tuple(d - sum(c < d for c in cols) for d in rows)
    estimate = np.expand_dims(v_row, cols) * np.expand_dims(v_col, rows)
    estimate = estimate / np.expand_dims(v_row.mean(axis=rows_in_v_row, keepdims=True), cols)
    y = grad / np.sqrt(estimate)
    y = y / np.maximum(1.0, np.sqrt((y**2).mean(axis=averaging, keepdims=True)))
    scale = np.maximum(np.sqrt((param**2).mean(axis=averaging, keepdims=True)), 1e-3)
    update = -lr * scale * y
    param = param + update
  return update, v_row, v_col


@pytest.mark.parametrize(
  "axes,shape,rows,cols,batch",
  [
    (("embed", "heads", "kv"), (6, 2, 3), (0,), (1, 2), ()),  # attention q/k/v kernel
    (("heads", "kv", "embed"), (2, 3, 6), (2,), (0, 1), ()),  # attention output kernel
    (("layers", "embed", "mlp"), (2, 5, 4), (1,), (2,), (0,)),  # scanned MLP kernel
  ],
)
def test_adafactor_factors_by_logical_axes_as_t5x(axes, shape, rows, cols, batch):
  rng = np.random.RandomState(0)
  param = jnp.asarray(rng.randn(*shape), jnp.float32)
  grads = [jnp.asarray(rng.randn(*shape), jnp.float32) for _ in range(3)]
  opt = optimizers.adafactor(learning_rate=0.1).with_param_axes(
    {"w": jax.sharding.PartitionSpec(*axes)}
  )
  params, state = {"w": param}, opt.init({"w": param})
  for grad in grads:
    update, state = opt.update({"w": grad}, state, params)
    params = optax.apply_updates(params, update)
  expected, v_row, v_col = _t5x_factored_update(param, grads, rows, cols, batch)
  factored = _factored_state(state)
  assert factored.v["w"].shape == (1,)  # no full second moment
  np.testing.assert_allclose(factored.v_row["w"], v_row, rtol=1e-5)
  np.testing.assert_allclose(factored.v_col["w"], v_col, rtol=1e-5)
  np.testing.assert_allclose(update["w"], expected, rtol=1e-4, atol=1e-7)


def test_adafactor_state_of_t5_1_1_small_matches_t5x_formula():
  config = network.T5Config(
    vocab_size=32128,
    emb_dim=512,
    num_heads=6,
    head_dim=64,
    mlp_dim=1024,
    num_encoder_layers=8,
    num_decoder_layers=8,
    mlp_activations=("gelu", "linear"),
    dropout_rate=0.0,
    logits_via_embedding=False,
  )
  model = models.EncoderDecoderModel(network.Transformer(config), None, None)
  key = jax.ShapeDtypeStruct((2,), jnp.uint32)
  params = nn.meta.unbox(jax.eval_shape(model.init_params, key))
  opt = optimizers.adafactor(learning_rate=0.01).with_param_axes(model.param_axes())
  state = _factored_state(jax.eval_shape(opt.init, params))
  size = sum(
    int(np.prod(x.shape)) for t in (state.v_row, state.v_col, state.v) for x in jax.tree.leaves(t)
  )
  d, h, k, f, v = 512, 6, 64, 1024, 32128
  # Factored: a row and a column statistic and a (1,) placeholder for the full one;
  # unfactored: the full statistic and two (1,) placeholders.
  attention = 4 * (d + h * k + 1)  # q, k, v, o: rows [d], columns [h, k]
  mlp = 3 * (d + f + 1)  # wi_0, wi_1, wo: 2-D, both dims >= 128
  norm = d + 2
  encoder = 8 * (attention + mlp + 2 * norm) + norm
  decoder = 8 * (2 * attention + mlp + 3 * norm) + norm
  embedding_and_logits = 2 * (v + d + 1)
  relpos = 2 * (32 * h + 2)  # [heads, buckets]: too small to factor
  assert size == encoder + decoder + embedding_and_logits + relpos
  assert size < 300_000  # optax's own rule keeps 19.0M elements here (attention unfactored)


@pytest.mark.parametrize("name", ["adafactor", "adamw"])
def test_optimizers_reduce_a_quadratic(name):
  target = jnp.asarray(np.random.RandomState(0).randn(160, 130), jnp.float32)
  params = {"w": jnp.zeros((160, 130)) + 0.1}
  make = {"adafactor": optimizers.adafactor, "adamw": optimizers.adamw}[name]
  opt = make(learning_rate=0.1, clip_grad_norm=10.0)

  def loss(p):
    return jnp.mean((p["w"] - target) ** 2)

  @jax.jit
  def step(p, s):
    grads = jax.grad(loss)(p)
    updates, s = opt.update(grads, s, p)
    return optax.apply_updates(p, updates), s

  state = opt.init(params)
  initial = float(loss(params))
  for _ in range(60):
    params, state = step(params, state)
  assert float(loss(params)) < 0.2 * initial


def test_gin_configures_optimizer():
  with gin.unlock_config():
    gin.parse_config(
      """
            from t5x_lite.training import optimizers
            optimizers.adafactor.learning_rate = @optimizers.rsqrt_with_warmup()
            optimizers.rsqrt_with_warmup.warmup_steps = 100
            """
    )
  try:
    opt = optimizers.adafactor()
    assert float(opt.learning_rate(jnp.array(400))) == pytest.approx(0.05)
  finally:
    gin.clear_config()


def _changed_per_step(params, optimizer, steps):
  """Paths whose values changed at each step, under constant gradients of ones."""
  state, changed = optimizer.init(params), []
  for _ in range(steps):
    grads = jax.tree.map(jnp.ones_like, params)
    updates, state = optimizer.update(grads, state, params)
    new = optax.apply_updates(params, updates)
    flat_old = jax.tree_util.tree_flatten_with_path(params)[0]
    flat_new = jax.tree.leaves(new)
    changed.append(
      {
        optimizers.param_path(path): np.asarray(np.any(a != b, axis=tuple(range(1, a.ndim))))
        if "layers/" in optimizers.param_path(path)
        else bool(np.any(a != b))
        for (path, a), b in zip(flat_old, flat_new)
      }
    )
    params = new
  return changed


def test_gradual_unfreezing_unfreezes_blocks_from_the_top_in_both_stacks():
  params = {
    "encoder": {f"layers_{i}": {"w": jnp.full((4, 4), 0.5)} for i in range(3)},
    "decoder": {f"layers_{i}": {"w": jnp.full((4, 4), 0.5)} for i in range(2)},
    "token_embedder": {"embedding": jnp.full((8, 4), 0.5)},
  }
  opt = optimizers.adamw(learning_rate=0.1).with_gradual_unfreezing(2)
  changed = _changed_per_step(params, opt, 6)

  def trained(step):
    return sorted(path for path, moved in changed[step].items() if moved)

  embedding, enc, dec = "token_embedder/embedding", "encoder/layers_{}/w", "decoder/layers_{}/w"
  assert trained(0) == sorted([embedding, enc.format(2), dec.format(1)])  # steps 0-1: top blocks
  assert trained(1) == trained(0)
  assert trained(2) == sorted(
    [embedding, enc.format(1), enc.format(2), dec.format(0), dec.format(1)]
  )
  assert trained(4) == sorted(changed[4])  # step 4: every block of both stacks


def test_gradual_unfreezing_of_scanned_layers_goes_by_layer_index():
  params = {"encoder": {"layers": {"w": jnp.full((3, 4, 4), 0.5)}}, "norm": jnp.full((4,), 1.0)}
  opt = optimizers.adafactor(learning_rate=0.1).with_gradual_unfreezing(1)
  changed = _changed_per_step(params, opt, 3)
  assert [list(c["encoder/layers/w"]) for c in changed] == [
    [False, False, True],
    [False, True, True],
    [True, True, True],
  ]
  assert all(c["norm"] for c in changed)
  with pytest.raises(ConfigError, match="positive step count, got 0"):
    opt.with_gradual_unfreezing(0)
