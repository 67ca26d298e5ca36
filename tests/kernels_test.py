"""The kernel seam: `T5Config.kernels` selects a set, and every set computes the same network.

'reference' is the plain math; 'xla_cpu' and 'xla_gpu' (its attention through
`jax.nn.dot_product_attention`, implementation='xla' on the CPU) must agree with it to
float tolerance on the loss, every gradient and the greedy and beam decodes of a tiny model.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_lite import models
from t5x_lite.core.errors import ConfigError
from t5x_lite.kernels import reference, registry, xla_cpu, xla_gpu
from t5x_lite.kernels.base import CacheLayouts
from t5x_lite.nn import decoder_only, network
from tiny_models import tiny_config


@dataclasses.dataclass(frozen=True)
class _Vocab:
  vocab_size: int = 64
  eos_id: int = 1


def test_auto_resolves_to_xla_cpu_on_cpu_and_reference_elsewhere(monkeypatch):
  assert jax.default_backend() == "cpu"
  assert registry.select("auto") is xla_cpu.KERNELS
  assert registry.select("reference") is reference.KERNELS
  assert registry.select("xla_cpu") is xla_cpu.KERNELS
  assert registry.select("xla_gpu") is xla_gpu.KERNELS
  for backend in ("gpu", "tpu"):  # 'gpu': until a GPU run shows xla_gpu faster
    monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
    assert registry.select("auto") is reference.KERNELS


def test_auto_resolves_for_the_backend_a_program_is_compiled_for():
  """The TPU precompiler traces on the CPU: 'auto' must give the TPU's kernels there."""
  with registry.compiling_for("tpu"):
    assert registry.select("auto") is reference.KERNELS
    assert registry.select("xla_cpu") is xla_cpu.KERNELS  # a named set stays named
  assert registry.select("auto") is xla_cpu.KERNELS


def test_an_unknown_kernels_name_is_one_config_error():
  with pytest.raises(ConfigError, match=r"T5Config.kernels must be one of \('auto', 'reference'"):
    tiny_config(kernels="cudnn")


def test_cache_layouts_must_be_batch_first_permutations():
  with pytest.raises(ValueError, match="self_key"):
    CacheLayouts(self_key="kbhd")
  with pytest.raises(ValueError, match="cross_value"):
    CacheLayouts(cross_value="bkh")


def _batch(rng: np.random.Generator) -> dict[str, np.ndarray]:
  inputs = rng.integers(2, 64, (3, 12)).astype(np.int32)
  inputs[0, 9:] = 0
  targets = rng.integers(2, 64, (3, 7)).astype(np.int32)
  targets[1, 5:] = 0
  return {
    "encoder_input_tokens": inputs,
    "decoder_input_tokens": np.pad(targets[:, :-1], ((0, 0), (1, 0))),
    "decoder_target_tokens": targets,
    "decoder_loss_weights": (targets > 0).astype(np.float32),
  }


def _model(config: network.T5Config) -> models.EncoderDecoderModel:
  return models.EncoderDecoderModel(network.Transformer(config), _Vocab(), _Vocab())


def _run(config: network.T5Config, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Loss, metric sums and gradients of one batch; greedy and beam decodes of its inputs."""
  model = _model(config)
  params = nn.meta.unbox(model.init_params(jax.random.PRNGKey(0)))
  grad_fn = jax.jit(jax.value_and_grad(lambda p: model.loss_fn(p, batch, None), has_aux=True))
  (loss, sums), grads = grad_fn(params)
  prompt = {
    "encoder_input_tokens": batch["encoder_input_tokens"],
    "decoder_input_tokens": np.zeros((3, 6), np.int32),
  }
  greedy, greedy_aux = jax.jit(lambda p: model.predict_batch_with_aux(p, prompt))(params)
  beam, beam_aux = jax.jit(
    lambda p: model.predict_batch_with_aux(p, prompt, num_decodes=3, decode_fn="beam")
  )(params)
  out = {"loss": loss, "greedy": greedy, "beam": beam}
  out |= {"greedy_scores": greedy_aux["scores"], "beam_scores": beam_aux["scores"]}
  out |= {f"sums/{k}": v for k, v in sums.items()}
  for path, leaf in jax.tree_util.tree_leaves_with_path(grads):
    out[f"grad{jax.tree_util.keystr(path)}"] = leaf
  return {k: np.asarray(v, np.float32) for k, v in out.items()}


def _packed_batch(rng: np.random.Generator) -> dict[str, np.ndarray]:
  """Two examples packed in each row of `_batch`: segment ids (0 on padding) and positions."""
  batch = _batch(rng)
  batch["encoder_input_tokens"][0, 9:] = rng.integers(2, 64, 3)
  for side, tokens, split in (
    ("encoder", batch["encoder_input_tokens"], 8),
    ("decoder", batch["decoder_target_tokens"], 4),
  ):
    length = tokens.shape[1]
    ids = np.where(np.arange(length) < split, 1, 2) * (tokens > 0)  # [batch, length]
    batch[f"{side}_segment_ids"] = ids.astype(np.int32)
    positions = np.where(np.arange(length) < split, np.arange(length), np.arange(length) - split)
    batch[f"{side}_positions"] = np.broadcast_to(positions, tokens.shape).astype(np.int32)
  return batch


@pytest.mark.parametrize("kernels", ["xla_cpu", "xla_gpu"])
@pytest.mark.parametrize(
  "overrides, rtol",
  [
    ({}, 1e-5),  # T5 1.1: gated GELU, untied logits
    ({"mlp_activations": ("relu",), "logits_via_embedding": True, "adapter_dim": 8}, 1e-5),
    ({"dtype": "bfloat16", "scan_layers": True, "remat_policy": "minimal"}, 3e-2),
  ],
)
def test_kernels_agree_with_reference_on_loss_gradients_and_decodes(kernels, overrides, rtol):
  batch = _batch(np.random.default_rng(0))
  ours = _run(tiny_config(kernels=kernels, **overrides), batch)
  ref = _run(tiny_config(kernels="reference", **overrides), batch)
  assert ours.keys() == ref.keys()
  for name in ("greedy", "beam"):
    np.testing.assert_array_equal(ours[name], ref[name], err_msg=name)
  assert (ours["greedy"] > 0).any()  # decodes that produced tokens, not only padding
  for name, want in ref.items():
    scale = max(float(np.abs(want).max()), 1e-6)
    np.testing.assert_allclose(ours[name], want, rtol=rtol, atol=rtol * scale, err_msg=name)


@pytest.mark.parametrize("dtype, rtol", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_xla_gpu_agrees_with_reference_on_a_packed_batch(dtype, rtol):
  """Segment masks (packing) as biases of every attention, in training's loss and gradients."""
  batch = _packed_batch(np.random.default_rng(2))
  results = {}
  for kernels in ("xla_gpu", "reference"):
    model = _model(tiny_config(kernels=kernels, dtype=dtype))
    params = nn.meta.unbox(model.init_params(jax.random.PRNGKey(0)))
    loss_fn = jax.jit(jax.value_and_grad(lambda p, m=model: m.loss_fn(p, batch, None)[0]))
    results[kernels] = loss_fn(params)
  (loss, grads), (ref_loss, ref_grads) = results["xla_gpu"], results["reference"]
  np.testing.assert_allclose(loss, ref_loss, rtol=rtol)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(
      got, want, rtol=rtol, atol=rtol * max(float(np.abs(want).max()), 1e-6)
    )


@pytest.mark.parametrize("kernels", ["xla_cpu", "xla_gpu"])
def test_kernels_agree_with_reference_in_a_prefilled_decoder_only_decode(kernels):
  config = tiny_config(num_encoder_layers=0, architecture="prefix_lm")
  rng = np.random.default_rng(1)
  tokens = rng.integers(2, 64, (3, 10)).astype(np.int32)
  prefix = np.zeros((3, 10), np.int32)
  prefix[:, :4] = 1
  prefix[2, :6] = 1
  batch = {"decoder_input_tokens": tokens, "decoder_causal_attention": prefix}
  decodes = {}
  for name in (kernels, "reference"):
    cfg = dataclasses.replace(config, kernels=name)
    model = models.DecoderOnlyModel(decoder_only.DecoderOnlyTransformer(cfg), _Vocab(), _Vocab())
    params = nn.meta.unbox(model.init_params(jax.random.PRNGKey(0)))
    decodes[name] = jax.jit(
      lambda p, m=model: m.predict_batch_with_aux(p, batch, decoder_params={"max_decode_len": 5})
    )(params)
  np.testing.assert_array_equal(decodes[kernels][0], decodes["reference"][0])
  np.testing.assert_allclose(
    decodes[kernels][1]["scores"], decodes["reference"][1]["scores"], rtol=1e-5
  )


@pytest.mark.parametrize("kernels", ["reference", "xla_cpu", "xla_gpu"])
def test_the_decode_caches_take_the_kernels_layout(kernels):
  config = tiny_config(kernels=kernels)
  layouts = registry.select(kernels).cache
  model = network.Transformer(config)
  encoder_tokens = jnp.ones((2, 5), jnp.int32)
  params = model.init(jax.random.PRNGKey(0), encoder_tokens, encoder_tokens[:, :3], None)
  encoded = model.apply(params, encoder_tokens, method=network.Transformer.encode)
  _, variables = model.apply(
    params,
    encoded,
    encoder_tokens,
    jnp.ones((2, 1), jnp.int32),
    decode=True,
    max_decode_length=11,
    mutable=["cache"],
    method=network.Transformer.decode,
  )
  layer = variables["cache"]["decoder"]["layers_0"]
  sizes = {"b": 2, "h": 4, "d": 8}
  for attention, length, key_axes, value_axes in (
    ("self_attention", 11, layouts.self_key, layouts.self_value),
    ("encoder_decoder_attention", 5, layouts.cross_key, layouts.cross_value),
  ):
    for name, axes in (("cached_key", key_axes), ("cached_value", value_axes)):
      want = tuple({**sizes, "k": length}[a] for a in axes)
      assert layer[attention][name].shape == want, (attention, name, axes)
  if kernels == "xla_cpu":  # heads-major caches, the cross-attention key kv-major
    assert layer["self_attention"]["cached_key"].shape == (2, 4, 11, 8)
    assert layer["encoder_decoder_attention"]["cached_key"].shape == (2, 4, 8, 5)
  else:  # as the projections give them: [batch, length, heads, kv]
    assert layer["self_attention"]["cached_key"].shape == (2, 11, 4, 8)


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_the_network_hands_padding_lengths_only_where_the_mask_is_padding(monkeypatch, packed):
  """Encoder self-attention and cross-attention over unpacked rows get their lengths
  (`base.PaddingLengths`, for kernels that take them in place of the mask); the causal
  self-attention and packed rows (segment masks) never do."""
  seen = []

  def spy(query, key, value, biases, **kwargs):
    padding = kwargs["padding"]
    seen.append((query.shape[1], key.shape[1], None if padding is None else padding))
    return reference.attention(query, key, value, biases, **kwargs)

  monkeypatch.setitem(
    registry.KERNELS, "xla_gpu", dataclasses.replace(xla_gpu.KERNELS, attention=spy)
  )
  rng = np.random.default_rng(0)
  batch = _packed_batch(rng) if packed else _batch(rng)
  model = _model(tiny_config(kernels="xla_gpu"))
  params = nn.meta.unbox(model.init_params(jax.random.PRNGKey(0)))
  seen.clear()
  model.loss_fn(params, batch, None)
  encoder_len, target_len = (
    batch["encoder_input_tokens"].shape[1],
    batch["decoder_target_tokens"].shape[1],
  )
  by_shape = {}
  for q, k, padding in seen:
    by_shape.setdefault((q, k), []).append(padding)
  assert set(by_shape) == {
    (encoder_len, encoder_len),
    (target_len, target_len),
    (target_len, encoder_len),
  }
  assert all(p is None for p in by_shape[(target_len, target_len)])  # causal
  for shape in ((encoder_len, encoder_len), (target_len, encoder_len)):
    for padding in by_shape[shape]:
      if packed:
        assert padding is None
        continue
      want_q = (
        batch["decoder_target_tokens"] if shape[0] == target_len else batch["encoder_input_tokens"]
      ) > 0
      np.testing.assert_array_equal(padding.query, want_q.sum(1))
      np.testing.assert_array_equal(padding.key, (batch["encoder_input_tokens"] > 0).sum(1))
