"""Tests for the encoder-decoder whose decoder layers reuse the encoder layers' parameters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import seqio
from flax import linen as nn
from flax import traverse_util

from t5x_lite import models
from t5x_lite.nn import network, shared_encoder_decoder
from t5x_lite.training import partitioning
from t5x_lite.interop import hf
from t5x_lite.core.errors import ConfigError
from tiny_models import tiny_config, train_losses

VOCAB = 64


def shared_model(**overrides) -> models.EncoderDecoderModel:
  vocab = seqio.PassThroughVocabulary(VOCAB, eos_id=1)
  return models.build_model(tiny_config(share_encoder_decoder=True, **overrides), vocab)


def params_of(model, seed: int = 0):
  return nn.meta.unbox(model.init_params(jax.random.PRNGKey(seed)))


def enc_dec_batch(rows: int = 3, seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  inputs = rng.integers(2, VOCAB, (rows, 10)).astype(np.int32)
  inputs[0, 7:] = 0
  targets = rng.integers(2, VOCAB, (rows, 6)).astype(np.int32)
  targets[1, 4:] = 0
  return {
    "encoder_input_tokens": inputs,
    "decoder_target_tokens": targets,
    "decoder_input_tokens": np.pad(targets[:, :-1], ((0, 0), (1, 0))),
    "decoder_loss_weights": (targets > 0).astype(np.int32),
  }


def count(params) -> int:
  return sum(int(np.size(x)) for x in jax.tree_util.tree_leaves(params))


@pytest.mark.parametrize("scan_layers", [False, True])
def test_stored_params_are_the_full_networks_less_the_decoders_shared_layers(scan_layers):
  model = shared_model(scan_layers=scan_layers)
  stored = params_of(model)
  full = params_of(models.build_model(tiny_config(scan_layers=scan_layers), model.input_vocabulary))
  layer = "layers" if scan_layers else "layers_1"
  assert set(stored["decoder"][layer]) == {
    "pre_cross_attention_layer_norm",
    "encoder_decoder_attention",
  }
  decoder_shared = {
    name: full["decoder"][layer][name]
    for name in ("self_attention", "pre_self_attention_layer_norm", "mlp", "pre_mlp_layer_norm")
  }
  layers = 1 if scan_layers else 2
  assert count(stored) == count(full) - layers * count(decoder_shared)
  expanded = shared_encoder_decoder.expand(stored)
  assert jax.tree_util.tree_structure(expanded) == jax.tree_util.tree_structure(full)
  assert expanded["decoder"][layer]["mlp"] is stored["encoder"][layer]["mlp"]
  assert shared_encoder_decoder.contract(expanded) == stored


@pytest.mark.parametrize("scan_layers", [False, True])
def test_logits_equal_the_plain_transformer_with_the_shared_weights_copied(scan_layers):
  model = shared_model(scan_layers=scan_layers)
  params, batch = params_of(model), enc_dec_batch()
  plain = network.Transformer(tiny_config(scan_layers=scan_layers))
  ours = model.teacher_forced_logits(params, batch, None)
  reference = models.EncoderDecoderModel(
    plain, model.input_vocabulary, model.output_vocabulary
  ).teacher_forced_logits(shared_encoder_decoder.expand(params), batch, None)
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(reference))


def test_a_shared_parameters_gradient_is_the_sum_of_its_two_uses():
  model = shared_model()
  params, batch = params_of(model), enc_dec_batch()
  plain = models.EncoderDecoderModel(
    network.Transformer(tiny_config()), model.input_vocabulary, model.output_vocabulary
  )
  grads = jax.grad(lambda p: model.loss_fn(p, batch, None)[0])(params)
  full_grads = jax.grad(lambda p: plain.loss_fn(p, batch, None)[0])(
    shared_encoder_decoder.expand(params)
  )
  for source, target in (("attention", "self_attention"), ("mlp", "mlp")):
    summed = jax.tree_util.tree_map(
      jnp.add, full_grads["encoder"]["layers_0"][source], full_grads["decoder"]["layers_0"][target]
    )
    for ours, reference in zip(
      jax.tree_util.tree_leaves(grads["encoder"]["layers_0"][source]),
      jax.tree_util.tree_leaves(summed),
    ):
      np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-7)
  # Cross-attention is the decoder's own.
  np.testing.assert_allclose(
    grads["decoder"]["layers_0"]["encoder_decoder_attention"]["query"]["kernel"],
    full_grads["decoder"]["layers_0"]["encoder_decoder_attention"]["query"]["kernel"],
    rtol=1e-5,
  )


@pytest.mark.parametrize("decode_fn", ["greedy", "beam"])
def test_cached_decoding_equals_the_plain_transformers(decode_fn):
  model = shared_model()
  params, batch = params_of(model), enc_dec_batch()
  plain = models.EncoderDecoderModel(
    network.Transformer(tiny_config()), model.input_vocabulary, model.output_vocabulary
  )
  kwargs = {"decode_fn": decode_fn, "num_decodes": 2} if decode_fn == "beam" else {}
  tokens, aux = model.predict_batch_with_aux(params, batch, **kwargs)
  reference, reference_aux = plain.predict_batch_with_aux(
    shared_encoder_decoder.expand(params), batch, **kwargs
  )
  np.testing.assert_array_equal(np.asarray(tokens), np.asarray(reference))
  np.testing.assert_allclose(aux["scores"], reference_aux["scores"], rtol=1e-6)


def test_sharded_training_equals_single_device_and_learns():
  model, batch = shared_model(), enc_dec_batch(rows=8, seed=3)
  reference = train_losses(model, batch, partitioning.Partitioner(devices=jax.devices()[:1]))
  sharded = train_losses(model, batch, partitioning.Partitioner(num_partitions=2, fsdp=True))
  np.testing.assert_allclose(sharded, reference, rtol=1e-4)
  assert reference[-1] < reference[0]


def test_hf_export_writes_the_decoder_its_own_copy():
  config = tiny_config(share_encoder_decoder=True)
  params = params_of(shared_model())
  tensors = hf.params_to_hf_tensors(config, params)
  plain = tiny_config()
  restored = hf.params_from_hf_tensors(tensors, plain)
  flat_restored = traverse_util.flatten_dict(restored)
  flat_expected = traverse_util.flatten_dict(shared_encoder_decoder.expand(params))
  assert flat_restored.keys() == flat_expected.keys()
  for path, value in flat_expected.items():
    np.testing.assert_array_equal(np.asarray(flat_restored[path]), np.asarray(value), str(path))


def test_configs_name_what_is_wrong():
  with pytest.raises(ConfigError, match="as many decoder as encoder layers.*2 \\+ 1"):
    tiny_config(share_encoder_decoder=True, num_decoder_layers=1)
  with pytest.raises(ConfigError, match="share_encoder_decoder.*'decoder_only'"):
    tiny_config(share_encoder_decoder=True, architecture="decoder_only", num_encoder_layers=0)
  with pytest.raises(ConfigError, match="architecture='prefix_lm' has no transformers"):
    hf.config_to_hf(tiny_config(architecture="prefix_lm", num_encoder_layers=0))
