"""Tests for t5x_lite.optimizers."""

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from t5x_lite import optimizers


def test_rsqrt_schedule_values():
  schedule = optimizers.rsqrt_with_warmup(base=1.0, warmup_steps=10000)
  assert float(schedule(0)) == pytest.approx(0.01)
  assert float(schedule(10000)) == pytest.approx(0.01)
  assert float(schedule(40000)) == pytest.approx(0.005)
  scaled = optimizers.rsqrt_with_warmup(base=2.0, warmup_steps=100)
  assert float(scaled(400)) == pytest.approx(0.1)


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
    return isinstance(x, optax.FactoredState)

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
            from t5x_lite import optimizers
            optimizers.adafactor.learning_rate = @optimizers.rsqrt_with_warmup()
            optimizers.rsqrt_with_warmup.warmup_steps = 100
            """
    )
  try:
    opt = optimizers.adafactor()
    assert float(opt.learning_rate(jnp.array(400))) == pytest.approx(0.05)
  finally:
    gin.clear_config()
