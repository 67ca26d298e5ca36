"""Tests of t5x_lite.kernels.xla_cpu: each kernel equals the reference math, in the form
XLA:CPU runs fastest (checked on the lowered or compiled HLO)."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_lite.kernels import reference, xla_cpu
from t5x_lite.kernels.base import to_layout
from t5x_lite.nn import layers


def _lowered_dots(fn, *args) -> list[str]:
  """The StableHLO dot_general lines of `fn(*args)` lowered for the CPU."""
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cpu",)).as_text()
  return [line for line in text.splitlines() if "stablehlo.dot_general" in line]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("recompute", [True, False])
def test_rms_norm_gradients_equal_autodiff_of_the_formula(dtype, recompute):
  x = (jax.random.normal(jax.random.PRNGKey(0), (3, 5, 16)) * 2.0).astype(dtype)
  scale = jnp.linspace(0.5, 2.0, 16, dtype=jnp.float32)
  cotangent = jax.random.normal(jax.random.PRNGKey(1), (3, 5, 16))

  def loss(kernels, scale, x):
    module = layers.RMSNorm(kernels=kernels, dtype=dtype, recompute=recompute)
    y = module.apply({"params": {"scale": scale}}, x)
    return jnp.vdot(y.astype(jnp.float32), cotangent)

  def formula(scale, x):  # differentiated by autodiff
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6) * scale
    return jnp.vdot(y.astype(dtype).astype(jnp.float32), cotangent)

  expected = jax.grad(formula, (0, 1))(scale, x)
  for kernels in (xla_cpu.KERNELS, reference.KERNELS):
    grads = jax.grad(lambda s, x, k=kernels: loss(k, s, x), (0, 1))(scale, x)
    # The scale gradient sums 15 tokens in another order (a matmul in xla_cpu).
    for got, want in zip(grads, expected):
      np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-6, atol=1e-6
      )
  # xla_cpu sums the scale gradient as a [1, tokens] @ [tokens, embed] matmul; the
  # reference keeps autodiff's reduction.
  matmul = "tensor<1x15xf32>"

  def scale_grad(kernels):
    return _lowered_dots(jax.grad(lambda s, x: loss(kernels, s, x)), scale, x)

  assert any(matmul in line for line in scale_grad(xla_cpu.KERNELS))
  assert not any(matmul in line for line in scale_grad(reference.KERNELS))


def test_projection_merges_batch_and_length_into_tokens():
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 4))  # [batch, length, embed]

  def project(kernels):
    return layers.Projection(features=(5,), kernel_axes=("embed", "mlp"), kernels=kernels)

  params = project(xla_cpu.KERNELS).init(jax.random.PRNGKey(1), x)
  kernel = params["params"]["kernel"].unbox()

  def loss(kernels, params, x):
    return jnp.sum(jnp.sin(project(kernels).apply(params, x)))

  def formula(kernel, x):
    return jnp.sum(jnp.sin(jnp.einsum("...e,em->...m", x, kernel)))

  np.testing.assert_allclose(
    project(xla_cpu.KERNELS).apply(params, x), jnp.einsum("...e,em->...m", x, kernel), rtol=1e-6
  )
  grads = jax.grad(lambda p, x: loss(xla_cpu.KERNELS, p, x), argnums=(0, 1))(params, x)
  ref = jax.grad(formula, argnums=(0, 1))(kernel, x)
  np.testing.assert_allclose(grads[0]["params"]["kernel"].unbox(), ref[0], rtol=1e-6)
  np.testing.assert_allclose(grads[1], ref[1], rtol=1e-6)

  # xla_cpu runs every matmul, the kernel gradient's included, over 6 tokens; the
  # reference keeps the [batch, length] contraction (elsewhere a merge can be a relayout).
  ours = _lowered_dots(jax.grad(lambda p, x: loss(xla_cpu.KERNELS, p, x)), params, x)
  assert ours and all("tensor<6x" in line and "2x3x" not in line for line in ours), ours
  plain = _lowered_dots(jax.grad(lambda p, x: loss(reference.KERNELS, p, x)), params, x)
  assert plain and all("tensor<2x3x" in line for line in plain), plain


@pytest.mark.parametrize(
  "x_shape, kernel_shape, contract, out_dtype",
  [
    ((2, 24, 32), (32, 48), (0,), None),  # MLP
    ((2, 24, 32), (32, 4, 8), (0,), None),  # query/key/value
    ((2, 24, 4, 8), (4, 8, 32), (0, 1), None),  # attention output
    ((2, 24, 32), (32, 40), (0,), jnp.float32),  # untied logits
    ((16, 1, 32), (32, 48), (0,), None),  # one decode step of 16 rows
  ],
)
def test_bfloat16_projection_runs_every_cpu_matmul_in_bfloat16(
  x_shape, kernel_shape, contract, out_dtype
):
  """A bfloat16 projection and both products of its gradient are plain row-major
  bfloat16 x bfloat16 -> float32 matmuls (XLA:CPU converted transposed-operand ones to
  float32 first, at half the speed), with autodiff's values to bfloat16 rounding."""
  x = jax.random.normal(jax.random.PRNGKey(0), x_shape, jnp.bfloat16)
  kernel = jax.random.normal(jax.random.PRNGKey(1), kernel_shape) * 0.2  # float32 param

  def loss(dense, x, kernel):
    out = dense(x, kernel.astype(jnp.bfloat16), contract, out_dtype)
    assert out.dtype == (out_dtype or jnp.bfloat16)
    return jnp.sum(jnp.sin(out.astype(jnp.float32)))

  def autodiff(x, k, contract, out_dtype):
    out = reference.dense(x, k, contract, out_dtype or jnp.float32)
    return out.astype(out_dtype or jnp.bfloat16)

  ours = jax.jit(jax.value_and_grad(lambda *a: loss(xla_cpu.dense, *a), (0, 1)))
  formula = jax.value_and_grad(lambda *a: loss(autodiff, *a), (0, 1))
  (value, (dx, dk)), (ref_value, (ref_dx, ref_dk)) = ours(x, kernel), formula(x, kernel)
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


def _attention(kernels, q, k, v, bias, **layout):
  layout = {"key_axes": "bkhd", "value_axes": "bkhd", **layout}
  return kernels.attention(
    q,
    k,
    v,
    [bias],
    dtype=q.dtype,
    logits_dtype=jnp.float32,
    dropout_rate=0.0,
    dropout_rng=None,
    **layout,
  )


def test_bfloat16_attention_runs_every_cpu_matmul_in_bfloat16():
  """bfloat16 attention's two matmuls and the four of their gradient are plain
  row-major bf16 x bf16 -> f32 batched matmuls, with autodiff's values to bfloat16
  rounding (the float32 softmax cotangent is rounded to bfloat16, as T5X's is)."""
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q, k, v = (jax.random.normal(key, (2, 16, 3, 8), jnp.bfloat16) for key in keys[:3])
  bias = jax.random.normal(keys[3], (1, 3, 16, 16))  # [1, heads, q, k]

  def ours(q, k, v):
    out = _attention(xla_cpu.KERNELS, q, k, v, bias)
    return jnp.sum(jnp.sin(out.astype(jnp.float32)))

  def formula(q, k, v):
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    weights = jax.nn.softmax(logits + bias, axis=-1).astype(jnp.bfloat16)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v, preferred_element_type=jnp.float32)
    return jnp.sum(jnp.sin(out.astype(jnp.bfloat16).astype(jnp.float32)))

  fn = jax.jit(jax.value_and_grad(ours, (0, 1, 2)))
  (value, grads), (ref_value, ref_grads) = (
    fn(q, k, v),
    jax.value_and_grad(formula, (0, 1, 2))(q, k, v),
  )
  np.testing.assert_allclose(value, ref_value, rtol=2e-2)
  for got, want in zip(grads, ref_grads):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max())
  _assert_plain_bfloat16_dots(fn.lower(q, k, v).compile().as_text(), 6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("key_axes", ["bkhd", "bhkd", "bhdk", "bkdh"])
def test_attention_over_any_key_layout_equals_the_reference(dtype, key_axes):
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q = jax.random.normal(keys[0], (2, 3, 4, 8), dtype)  # [batch, q, heads, kv]
  k, v = (jax.random.normal(key, (2, 5, 4, 8), dtype) for key in keys[1:3])  # 'bkhd'
  bias = jax.random.normal(keys[3], (1, 4, 3, 5))  # [1, heads, q, k]
  value_axes = "bkhd" if key_axes == "bkhd" else "bhkd"
  laid_out = {"key_axes": key_axes, "value_axes": value_axes}
  want = _attention(reference.KERNELS, q, k, v, bias)
  got = _attention(
    xla_cpu.KERNELS, q, to_layout(k, key_axes), to_layout(v, value_axes), bias, **laid_out
  )
  assert got.shape == want.shape == (2, 3, 4, 8)
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_argmax_is_jnp_argmax_with_ties_nan_and_inf(dtype):
  rng = np.random.default_rng(0)
  # Few distinct values, so most rows have ties for the maximum.
  x = rng.integers(-3, 4, size=(4, 7, 300)).astype(np.float32)
  x[0, 0] = -np.inf
  x[0, 1, 5] = np.inf
  x[0, 2, [9, 40]] = np.nan
  x[0, 3, 299] = np.nan
  x = jnp.asarray(x, dtype)
  got = jax.jit(xla_cpu.argmax)(x)
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(got, jnp.argmax(x, axis=-1))
  np.testing.assert_array_equal(got, reference.argmax(x))
  np.testing.assert_array_equal(got[0, :4], [0, 5, 9, 299])


def test_tied_logits_merge_tokens_and_equal_the_reference():
  module = layers.Embed(num_embeddings=10, features=4, kernels=xla_cpu.KERNELS)
  variables = module.init(jax.random.PRNGKey(0), jnp.array([[1, 2]]))
  table = np.asarray(nn.meta.unbox(variables)["params"]["embedding"])
  query = jax.random.normal(jax.random.PRNGKey(1), (2, 3, 4))
  logits = module.apply(variables, query, method=layers.Embed.attend)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(query) @ table.T, rtol=1e-5)
  dots = _lowered_dots(lambda q: module.apply(variables, q, method=layers.Embed.attend), query)
  assert dots and all("tensor<6x4xf32>" in line for line in dots), dots
