"""Tests for the decoder-only language model and prefix LM (network, model, data)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import seqio
import tensorflow as tf
from flax import linen as nn

import tasks  # noqa: F401  (registers the offline tasks)
from t5x_lite import models
from t5x_lite.nn import decoder_only, decoding, flops
from t5x_lite.data import pipeline
from t5x_lite.training import partitioning
from t5x_lite.run import infer_lib
from t5x_lite.core.errors import ConfigError
from tiny_models import tiny_config, train_losses

VOCAB = 64
LENGTH = 12
ARCHITECTURES = ("decoder_only", "prefix_lm")


def tiny_lm_config(architecture: str, **overrides):
  return tiny_config(architecture=architecture, num_encoder_layers=0, **overrides)


def tiny_model(architecture: str, **overrides) -> models.DecoderOnlyModel:
  vocab = seqio.PassThroughVocabulary(VOCAB, eos_id=1)
  module = decoder_only.DecoderOnlyTransformer(tiny_lm_config(architecture, **overrides))
  return models.DecoderOnlyModel(module, vocab, vocab)


def params_of(model: models.BaseTransformerModel, seed: int = 0):
  return nn.meta.unbox(model.init_params(jax.random.PRNGKey(seed)))


def prefix_lm_batch(prompt_lengths=(4, 4, 2), seed: int = 0) -> dict[str, np.ndarray]:
  """PrefixLMFeatureConverter-style rows: inputs then targets; row 1 ends early."""
  rng = np.random.default_rng(seed)
  targets = rng.integers(2, VOCAB, (len(prompt_lengths), LENGTH)).astype(np.int32)
  targets[1:2, 9:] = 0
  causal = np.zeros_like(targets)
  for row, length in enumerate(prompt_lengths):
    targets[row, length - 1] = 1  # inputs end with EOS, as seqio's tasks append it
    causal[row, : length + 1] = 1
  return {
    "decoder_target_tokens": targets,
    "decoder_input_tokens": np.pad(targets[:, :-1], ((0, 0), (1, 0))),
    "decoder_causal_attention": causal,
    "decoder_loss_weights": ((targets > 0) & (causal == 0)).astype(np.int32),
  }


def with_target_changed(batch, position: int) -> dict[str, np.ndarray]:
  """`batch` with the token at `position` of every row replaced (inputs re-shifted)."""
  targets = batch["decoder_target_tokens"].copy()
  targets[:, position] = targets[:, position] % (VOCAB - 2) + 2 + (targets[:, position] == 63)
  return {
    **batch,
    "decoder_target_tokens": targets,
    "decoder_input_tokens": np.pad(targets[:, :-1], ((0, 0), (1, 0))),
  }


def logits_of(model, params, batch) -> np.ndarray:
  return np.asarray(model.teacher_forced_logits(params, batch, None))


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("scan_layers", [False, True])
def test_logits_never_see_later_targets(architecture, scan_layers):
  model = tiny_model(architecture, scan_layers=scan_layers)
  params, batch = params_of(model), prefix_lm_batch()
  # Target position 6 is input position 7: logits before 7 must not move.
  before, after = (
    logits_of(model, params, batch),
    logits_of(model, params, with_target_changed(batch, 6)),
  )
  np.testing.assert_array_equal(before[:, :7], after[:, :7])
  assert np.abs(before[:, 7:] - after[:, 7:]).max() > 1e-3


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_only_the_prefix_lm_sees_its_whole_prefix(architecture):
  model = tiny_model(architecture)
  params, batch = params_of(model), prefix_lm_batch()
  # Token 2 is input position 3, inside every row's prefix (positions 0..2 at least).
  before, after = (
    logits_of(model, params, batch),
    logits_of(model, params, with_target_changed(batch, 2)),
  )
  change = np.abs(before[:, :3] - after[:, :3]).max()
  if architecture == "prefix_lm":
    assert change > 1e-3
  else:
    assert change == 0.0


def _teacher_forced_continuation(model, params, batch, row: int, generated: np.ndarray):
  """(argmax tokens, log-probs of `generated`) when row's prompt + `generated` is teacher-forced."""
  prompt_length = int(batch["decoder_causal_attention"][row].sum()) - 1
  prompt = batch["decoder_input_tokens"][row, 1 : prompt_length + 1]
  sequence = np.concatenate([prompt, generated])[None, :]  # [1, length]
  causal = np.zeros_like(sequence)
  causal[:, : prompt_length + 1] = 1
  single = {
    # Targets only hide padding from attention: a generated 0 (possible at random
    # init) is a real token to the decoder.
    "decoder_target_tokens": np.where(sequence == 0, 2, sequence),
    "decoder_input_tokens": np.pad(sequence[:, :-1], ((0, 0), (1, 0))),
    "decoder_causal_attention": causal,
  }
  log_probs = jax.nn.log_softmax(logits_of(model, params, single)[0])  # [length, vocab]
  positions = np.arange(prompt_length, prompt_length + len(generated))
  return (
    np.asarray(jnp.argmax(log_probs[positions], axis=-1)),
    float(np.sum(np.asarray(log_probs)[positions, generated])),
  )


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("scan_layers", [False, True])
def test_cached_greedy_decoding_equals_teacher_forcing(architecture, scan_layers):
  model = tiny_model(architecture, scan_layers=scan_layers)
  params, batch = params_of(model), prefix_lm_batch()
  tokens, aux = model.predict_batch_with_aux(params, batch)
  tokens = np.asarray(tokens)
  for row in range(tokens.shape[0]):
    length = int(np.argmax(tokens[row] == 1)) + 1 if (tokens[row] == 1).any() else None
    generated = tokens[row, :length]
    prompt_length = int(batch["decoder_causal_attention"][row].sum()) - 1
    generated = generated[: LENGTH - prompt_length]  # what fits after the prompt
    argmax, score = _teacher_forced_continuation(model, params, batch, row, generated)
    np.testing.assert_array_equal(argmax, generated)
    assert float(aux["scores"][row]) == pytest.approx(score, abs=1e-4)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_beam_search_scores_are_the_continuations_log_probs(architecture):
  model = tiny_model(architecture)
  params, batch = params_of(model), prefix_lm_batch()
  tokens, aux = model.predict_batch_with_aux(
    params, batch, decode_fn="beam", num_decodes=3, return_all_decodes=True
  )
  tokens, scores = np.asarray(tokens), np.asarray(aux["scores"])
  assert np.all(np.diff(scores, axis=1) <= 1e-6)  # best first
  for row in range(tokens.shape[0]):
    prompt_length = int(batch["decoder_causal_attention"][row].sum()) - 1
    best = tokens[row, 0]
    length = int(np.argmax(best == 1)) + 1 if (best == 1).any() else LENGTH - prompt_length
    _, log_prob = _teacher_forced_continuation(model, params, batch, row, best[:length])
    penalty = decoding.length_penalty(prompt_length + length, 0.6)
    assert scores[row, 0] == pytest.approx(log_prob / float(penalty), abs=1e-4)


def test_max_decode_len_cuts_the_continuation_and_min_decode_len_is_refused():
  model = tiny_model("prefix_lm")
  params, batch = params_of(model), prefix_lm_batch()
  full = np.asarray(model.predict_batch(params, batch))
  cut = np.asarray(model.predict_batch(params, batch, decoder_params={"max_decode_len": 3}))
  assert cut.shape == (3, 3)
  np.testing.assert_array_equal(cut, full[:, :3])
  with pytest.raises(ValueError, match="min_decode_len"):
    model.predict_batch(params, batch, decoder_params={"min_decode_len": 2})


def test_a_language_model_batch_decodes_from_bos():
  model = tiny_model("decoder_only")
  params = params_of(model)
  batch = {k: v for k, v in prefix_lm_batch().items() if k != "decoder_causal_attention"}
  tokens = np.asarray(model.predict_batch(params, batch))
  bos_only = {**batch, "decoder_causal_attention": np.eye(1, LENGTH, dtype=np.int32)[[0, 0, 0]]}
  np.testing.assert_array_equal(tokens, np.asarray(model.predict_batch(params, bos_only)))
  assert tokens.shape == (3, LENGTH)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_packed_rows_equal_the_unpacked_examples(architecture):
  model = tiny_model(architecture)
  params = params_of(model)
  a, b = prefix_lm_batch((3,), seed=1), prefix_lm_batch((2,), seed=2)
  a_len, b_len = 5, 6
  packed = {}
  for key in ("decoder_target_tokens", "decoder_input_tokens", "decoder_causal_attention"):
    packed[key] = np.concatenate([a[key][:, :a_len], b[key][:, :b_len]], axis=1)
  packed["decoder_segment_ids"] = np.array([[1] * a_len + [2] * b_len], np.int32)
  packed["decoder_positions"] = np.array([list(range(a_len)) + list(range(b_len))], np.int32)
  logits = logits_of(model, params, packed)[0]
  for single, start, length in ((a, 0, a_len), (b, a_len, b_len)):
    alone = {k: v[:, :length] for k, v in single.items() if k != "decoder_loss_weights"}
    np.testing.assert_allclose(
      logits[start : start + length], logits_of(model, params, alone)[0], atol=1e-5
    )


def test_loss_counts_targets_only_and_metrics_count_the_inputs():
  model = tiny_model("prefix_lm")
  params, batch = params_of(model), prefix_lm_batch()
  loss, metrics = model.eval_fn(params, batch)
  log_probs = jax.nn.log_softmax(logits_of(model, params, batch))  # [batch, length, vocab]
  targets, weights = batch["decoder_target_tokens"], batch["decoder_loss_weights"]
  token_log_probs = np.take_along_axis(np.asarray(log_probs), targets[..., None], -1)[..., 0]
  assert float(metrics["cross_ent_loss"]) == pytest.approx(
    -float(np.sum(token_log_probs * weights)), rel=1e-5
  )
  assert float(metrics["num_input_tokens"]) == 4 + 4 + 2
  assert float(loss) > 0


def test_sharded_decoder_only_training_equals_single_device():
  model, batch = tiny_model("prefix_lm"), prefix_lm_batch((4, 4, 2, 3, 1, 5, 4, 2), seed=3)
  reference = train_losses(model, batch, partitioning.Partitioner(devices=jax.devices()[:1]))
  sharded = train_losses(model, batch, partitioning.Partitioner(num_partitions=2, fsdp=True))
  np.testing.assert_allclose(sharded, reference, rtol=1e-4)
  assert reference[-1] < reference[0]


def test_infer_batches_equal_seqios_prefix_lm_features():
  examples = [
    infer_lib.Example("a", "b", np.array([5, 6, 7, 1]), np.array([8, 9, 1])),
    infer_lib.Example("c", None, np.array([4, 1]), None),
  ]
  lengths = {"inputs": 6, "targets": 4}
  ours = infer_lib.make_batch(examples, lengths, "prefix_lm")
  dataset = tf.data.Dataset.from_tensor_slices(
    {
      "inputs": tf.ragged.constant([[5, 6, 7, 1], [4, 1]]),
      "targets": tf.ragged.constant([[8, 9, 1], []]),
    }
  ).map(lambda x: {k: v.to_tensor() if hasattr(v, "to_tensor") else v for k, v in x.items()})
  converted = list(seqio.DecoderFeatureConverter(pack=False)(dataset, lengths).as_numpy_iterator())
  for key in converted[0]:
    np.testing.assert_array_equal(ours[key], np.stack([row[key] for row in converted]), err_msg=key)


def test_an_lm_task_for_an_encoder_decoder_is_one_config_error():
  config = pipeline.DatasetConfig("cpython_lm", {"targets": 16}, 4)
  with pytest.raises(ConfigError, match=r"Task 'cpython_lm' has targets only .* decoder-only"):
    pipeline.feature_converter(config)
  lm_config = pipeline.for_model(config, tiny_lm_config("decoder_only"))
  assert isinstance(pipeline.feature_converter(lm_config), seqio.DecoderFeatureConverter)


def test_feature_converter_and_flops_follow_the_architecture():
  config = pipeline.DatasetConfig("cpython_span_corruption", {"inputs": 16, "targets": 8}, 4)
  assert isinstance(pipeline.feature_converter(config), seqio.EncDecFeatureConverter)
  lm_config = pipeline.for_model(config, tiny_lm_config("prefix_lm"))
  assert isinstance(pipeline.feature_converter(lm_config), seqio.DecoderFeatureConverter)
  assert pipeline.model_feature_lengths(lm_config) == {
    "decoder_target_tokens": 24,
    "decoder_input_tokens": 24,
    "decoder_loss_weights": 24,
    "decoder_causal_attention": 24,
    "decoder_segment_ids": 24,
    "decoder_positions": 24,
  }
  lm = tiny_lm_config("decoder_only", num_decoder_layers=2)
  encdec = tiny_config(num_encoder_layers=2, num_decoder_layers=2)
  # Same layers over I + T tokens: the decoder-only pays no cross-attention and no encoder.
  assert flops.network_lengths(lm, 16, 8) == (0, 24)
  lm_flops = flops.forward_flops(lm, 0, 24)
  e, h, m, v = 32, 32, 64, VOCAB
  layer = 4 * 48 * e * h + 4 * 24 * 24 * h + 2 * 24 * e * m * 3
  assert lm_flops == pytest.approx(2 * layer + 2 * 24 * e * v)
  assert lm_flops < flops.forward_flops(encdec, 16, 8)


def test_configs_name_what_is_wrong():
  with pytest.raises(ConfigError, match="T5Config.architecture must be one of"):
    tiny_config(architecture="encoder_only")
  with pytest.raises(ConfigError, match="num_encoder_layers must be 0"):
    tiny_config(architecture="decoder_only")
  with pytest.raises(ConfigError, match="DatasetConfig.architecture"):
    pipeline.DatasetConfig("cpython_span_corruption", {"targets": 8}, 4, architecture="lm")
