"""Tests for t5x_lite.models on a tiny T5."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import seqio
from flax.core import meta

from t5x_lite import models
from t5x_lite.core import errors
from t5x_lite.nn import network
from t5x_lite.training import partitioning
from tiny_models import tiny_config, train_losses

VOCAB = 64
EOS = 1


def tiny_model(**kwargs) -> models.EncoderDecoderModel:
  vocab = seqio.PassThroughVocabulary(VOCAB, eos_id=EOS)
  return models.EncoderDecoderModel(network.Transformer(tiny_config()), vocab, vocab, **kwargs)


def unpacked_batch(seed: int = 0, batch: int = 3, length: int = 7) -> dict[str, jnp.ndarray]:
  rng = np.random.RandomState(seed)
  inputs = rng.randint(2, VOCAB, size=(batch, length)).astype(np.int32)
  targets = rng.randint(2, VOCAB, size=(batch, length)).astype(np.int32)
  for row in range(batch):
    end = length - 1 - row  # rows of different lengths, each ending in EOS
    targets[row, end] = EOS
    targets[row, end + 1 :] = 0
    inputs[row, length - row :] = 0
  decoder_inputs = np.pad(targets[:, :-1], ((0, 0), (1, 0)))
  return {
    "encoder_input_tokens": jnp.asarray(inputs),
    "decoder_input_tokens": jnp.asarray(decoder_inputs),
    "decoder_target_tokens": jnp.asarray(targets),
    "decoder_loss_weights": jnp.asarray(targets > 0, jnp.float32),
  }


def packed_batch() -> dict[str, jnp.ndarray]:
  targets = np.array([[5, 6, 1, 7, 8, 9, 1, 0], [10, 11, 12, 13, 1, 0, 0, 0]], np.int32)
  segments = np.array([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 0, 0, 0]], np.int32)
  positions = np.array([[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 0, 0, 0]], np.int32)
  decoder_inputs = np.where(positions == 0, 0, np.pad(targets[:, :-1], ((0, 0), (1, 0))))
  decoder_inputs = decoder_inputs * (segments > 0)
  inputs = np.array([[3, 4, 1, 5, 1, 0], [6, 7, 8, 1, 0, 0]], np.int32)
  in_segments = np.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0]], np.int32)
  in_positions = np.array([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]], np.int32)
  return {
    "encoder_input_tokens": jnp.asarray(inputs),
    "encoder_segment_ids": jnp.asarray(in_segments),
    "encoder_positions": jnp.asarray(in_positions),
    "decoder_input_tokens": jnp.asarray(decoder_inputs),
    "decoder_target_tokens": jnp.asarray(targets),
    "decoder_segment_ids": jnp.asarray(segments),
    "decoder_positions": jnp.asarray(positions),
    "decoder_loss_weights": jnp.asarray(targets > 0, jnp.float32),
  }


@pytest.fixture(scope="module")
def model_and_params():
  model = tiny_model()
  params = jax.jit(model.init_params)(jax.random.PRNGKey(0))
  return model, meta.unbox(params)


@functools.partial(jax.jit, static_argnums=0)
def _jit_logits(model, params, batch):
  return model.teacher_forced_logits(params, batch, None)


def _teacher_forced_logits(model, params, batch) -> np.ndarray:
  return np.asarray(_jit_logits(model, params, batch), np.float64)


def _np_log_softmax(logits: np.ndarray) -> np.ndarray:
  m = logits.max(-1, keepdims=True)
  return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))


def test_initial_params_are_boxed_with_logical_axes():
  model = tiny_model()
  params = jax.eval_shape(model.init_params, jax.random.PRNGKey(0))
  embedding = params["token_embedder"]["embedding"]
  assert embedding.names == ("vocab", "embed")
  assert embedding.value.shape == (VOCAB, 32)
  assert params["decoder"]["logits_dense"]["kernel"].names == ("embed", "vocab")


def test_score_batch_is_minus_summed_cross_entropy(model_and_params):
  model, params = model_and_params
  batch = unpacked_batch()
  scores = np.asarray(jax.jit(model.score_batch)(params, batch))
  logits = _teacher_forced_logits(model, params, batch)
  targets = np.asarray(batch["decoder_target_tokens"])
  token_ce = -np.take_along_axis(_np_log_softmax(logits), targets[..., None], -1)[..., 0]
  expected = -(token_ce * (targets > 0)).sum(-1)
  np.testing.assert_allclose(scores, expected, rtol=1e-5)
  # The same total through loss_fn (no z-loss, per-token sum).
  loss, _ = jax.jit(tiny_model(z_loss=0.0).loss_fn)(params, batch, None)
  np.testing.assert_allclose(float(loss), -scores.sum(), rtol=1e-5)


def test_loss_and_metrics_on_unpacked_batch(model_and_params):
  model, params = model_and_params
  batch = unpacked_batch(1)
  loss, sums = jax.jit(model.loss_fn)(params, batch, None)
  metrics = model.finalize_metrics(sums)
  logits = _teacher_forced_logits(model, params, batch)
  targets = np.asarray(batch["decoder_target_tokens"])
  mask = targets > 0
  token_ce = -np.take_along_axis(_np_log_softmax(logits), targets[..., None], -1)[..., 0]
  log_z = np.log(np.exp(logits).sum(-1))
  z = 1e-4 * (log_z**2 * mask).sum()
  np.testing.assert_allclose(float(metrics["z_loss"]), z, rtol=1e-4)
  np.testing.assert_allclose(float(metrics["cross_ent_loss"]), (token_ce * mask).sum(), rtol=1e-5)
  np.testing.assert_allclose(float(loss), (token_ce * mask).sum() + z, rtol=1e-5)
  accuracy = ((logits.argmax(-1) == targets) & mask).sum() / mask.sum()
  assert float(metrics["accuracy"]) == pytest.approx(accuracy)
  assert float(metrics["nonpadding_fraction"]) == pytest.approx(mask.sum() / targets.size)
  assert float(metrics["num_tokens"]) == mask.sum()
  assert float(metrics["num_sequences"]) == 3.0
  eval_loss, eval_metrics = jax.jit(model.eval_fn)(params, batch)
  assert float(eval_loss) == pytest.approx(float(loss))
  assert set(eval_metrics) == set(metrics)


def test_packed_metrics_count_segments(model_and_params):
  model, params = model_and_params
  batch = packed_batch()
  _, sums = jax.jit(model.loss_fn)(params, batch, None)
  metrics = model.finalize_metrics(sums)
  assert float(metrics["num_sequences"]) == 3.0
  assert float(metrics["num_tokens"]) == 12.0
  assert float(metrics["nonpadding_fraction"]) == pytest.approx(12 / 16)
  assert float(metrics["num_input_tokens"]) == 9.0


def test_average_per_sequence_on_packed_batch(model_and_params):
  _, params = model_and_params
  model = tiny_model(z_loss=0.0, loss_normalizing_factor="AVERAGE_PER_SEQUENCE")
  batch = packed_batch()
  loss, _ = jax.jit(model.loss_fn)(params, batch, None)
  logits = _teacher_forced_logits(model, params, batch)
  targets = np.asarray(batch["decoder_target_tokens"])
  token_ce = -np.take_along_axis(_np_log_softmax(logits), targets[..., None], -1)[..., 0]
  means = [token_ce[0, :3].mean(), token_ce[0, 3:7].mean(), token_ce[1, :5].mean()]
  np.testing.assert_allclose(float(loss), np.mean(means), rtol=1e-5)


@pytest.mark.parametrize(
  "overrides",
  [
    {"dropout_rate": 0.1},
    {"logits_via_embedding": True},
    {"share_encoder_decoder": True},
    {"architecture": "prefix_lm", "num_encoder_layers": 0},
  ],
  ids=["untied_dropout", "tied", "shared", "prefix_lm"],
)
def test_chunked_loss_equals_the_whole_logits_loss(overrides):
  """`loss_chunk_length` gives the same loss, metric sums and gradients (packed batch,
  label smoothing, z-loss, per-sequence normalization, a ragged last chunk)."""
  config = tiny_config(**overrides)
  vocab = seqio.PassThroughVocabulary(VOCAB, eos_id=EOS)
  model_cls = models.EncoderDecoderModel
  batch = packed_batch()
  if config.architecture != "encoder_decoder":
    model_cls = models.DecoderOnlyModel
    batch = {k: v for k, v in batch.items() if not k.startswith("encoder_")}
    batch["decoder_causal_attention"] = (batch["decoder_positions"] < 2).astype(jnp.int32)
  options = dict(label_smoothing=0.1, z_loss=1e-3, loss_normalizing_factor="AVERAGE_PER_SEQUENCE")
  whole = model_cls(models.network_module(config), vocab, vocab, **options)
  chunked = model_cls(models.network_module(config), vocab, vocab, loss_chunk_length=3, **options)
  params = meta.unbox(jax.jit(whole.init_params)(jax.random.PRNGKey(1)))
  dropout_rng = jax.random.PRNGKey(2) if config.dropout_rate else None

  def loss_and_grads(model):
    grad_fn = jax.value_and_grad(model.loss_fn, has_aux=True)
    return jax.jit(grad_fn)(params, batch, dropout_rng)

  (loss, sums), grads = loss_and_grads(whole)
  (loss_c, sums_c), grads_c = loss_and_grads(chunked)
  np.testing.assert_allclose(loss_c, loss, rtol=1e-6)
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-6), sums_c, sums)
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-7), grads_c, grads)


def test_sharded_chunked_training_equals_single_device_whole_logits():
  """Chunks under a data x model mesh with fsdp (the vocabulary split over 'model')
  train as the whole logits on one device."""
  batch = unpacked_batch(4, batch=4)
  single = partitioning.Partitioner(devices=jax.devices()[:1])
  reference = train_losses(tiny_model(), batch, single)
  sharded = partitioning.Partitioner(num_partitions=2, fsdp=True)
  chunked = train_losses(tiny_model(loss_chunk_length=2), batch, sharded)
  np.testing.assert_allclose(chunked, reference, rtol=1e-5)
  assert reference[-1] < reference[0]


@pytest.mark.parametrize("value", [0, -2, 2.5, True, "8"])
def test_bad_loss_chunk_length_is_a_config_error(value):
  with pytest.raises(errors.ConfigError, match="EncoderDecoderModel.loss_chunk_length"):
    tiny_model(loss_chunk_length=value)


def _predict(model, params, batch, rng=None, **kwargs):
  """Jitted `predict_batch_with_aux` (keyword arguments are static)."""
  rng = jax.random.PRNGKey(0) if rng is None else rng
  predict = jax.jit(lambda p, b, r: model.predict_batch_with_aux(p, b, r, **kwargs))
  return predict(params, batch, rng)


def _reference_greedy(model, params, batch, length: int) -> np.ndarray:
  """Step-by-step argmax of the full teacher-forced pass fed its own outputs."""
  batch_size = batch["encoder_input_tokens"].shape[0]
  decoder_inputs = np.zeros((batch_size, length), np.int32)
  outputs = np.zeros((batch_size, length), np.int32)
  for i in range(length):
    step_batch = {
      "encoder_input_tokens": batch["encoder_input_tokens"],
      "decoder_input_tokens": jnp.asarray(decoder_inputs),
      "decoder_target_tokens": jnp.ones((batch_size, length), jnp.int32),
    }
    logits = _teacher_forced_logits(model, params, step_batch)
    outputs[:, i] = logits[:, i].argmax(-1)
    if i + 1 < length:
      decoder_inputs[:, i + 1] = outputs[:, i]
  return np.asarray(models._zero_after_eos(jnp.asarray(outputs), EOS))


def test_greedy_predictions_match_teacher_forced_argmax(model_and_params):
  model, params = model_and_params
  batch = unpacked_batch(2, batch=3, length=6)
  tokens, aux = _predict(model, params, batch)
  expected = _reference_greedy(model, params, batch, 6)
  np.testing.assert_array_equal(np.asarray(tokens), expected)
  assert aux["scores"].shape == (3,)


def test_greedy_with_eos_biased_params_pads_after_eos(model_and_params):
  model, params = model_and_params
  # Make EOS likely only mid-way: bias the output projection towards EOS a little.
  kernel = params["decoder"]["logits_dense"]["kernel"]
  biased = jax.tree.map(lambda x: x, params)
  biased["decoder"]["logits_dense"]["kernel"] = kernel.at[:, EOS].add(0.6 * jnp.abs(kernel).max())
  batch = unpacked_batch(3, batch=3, length=6)
  tokens = np.asarray(_predict(model, biased, batch)[0])
  expected = _reference_greedy(model, biased, batch, 6)
  np.testing.assert_array_equal(tokens, expected)
  for row in tokens:
    if EOS in row:
      assert not row[list(row).index(EOS) + 1 :].any()


@pytest.mark.parametrize("decode_fn", ["beam", "sample"])
def test_multi_decode_shapes_and_scores(model_and_params, decode_fn):
  model, params = model_and_params
  batch = unpacked_batch(4, batch=2, length=5)
  decoder_params = {"max_decode_len": 4}
  if decode_fn == "sample":
    decoder_params.update(temperature=1.0, topk=5)
  tokens, aux = _predict(
    model,
    params,
    batch,
    jax.random.PRNGKey(1),
    decoder_params=decoder_params,
    num_decodes=3,
    decode_fn=decode_fn,
    return_all_decodes=True,
  )
  assert tokens.shape == (2, 3, 4)
  scores = np.asarray(aux["scores"])
  assert scores.shape == (2, 3)
  assert np.all(np.diff(scores, axis=1) <= 1e-6)  # best first
  best, _ = _predict(
    model,
    params,
    batch,
    jax.random.PRNGKey(1),
    decoder_params=decoder_params,
    num_decodes=3,
    decode_fn=decode_fn,
  )
  np.testing.assert_array_equal(np.asarray(best), np.asarray(tokens[:, 0]))


@pytest.mark.parametrize("num_decodes", [1, 3])
def test_decodes_share_their_input_cross_attention_cache(model_and_params, num_decodes):
  """The encoder output is projected and cached once per input, not once per decode."""
  model, params = model_and_params
  batch = unpacked_batch(6, batch=2, length=5)
  _, cache, _, _ = model._decoding_inputs(params, batch, num_decodes, None, 0)
  rows = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(cache):
    attention = path[-2].key  # 'self_attention' or 'encoder_decoder_attention'
    if leaf.ndim:
      rows.setdefault(attention, set()).add(leaf.shape[0])
  assert rows == {"self_attention": {2 * num_decodes}, "encoder_decoder_attention": {2}}


def test_beam_search_best_beats_greedy_score(model_and_params):
  model, params = model_and_params
  batch = unpacked_batch(5, batch=2, length=5)
  greedy, _ = _predict(model, params, batch)
  beam, _ = _predict(
    model, params, batch, decoder_params={"alpha": 0.0}, num_decodes=4, decode_fn="beam"
  )

  def sequence_log_prob(tokens):
    targets = np.asarray(tokens)
    scored = {
      "encoder_input_tokens": batch["encoder_input_tokens"],
      "decoder_input_tokens": jnp.asarray(np.pad(targets[:, :-1], ((0, 0), (1, 0)))),
      "decoder_target_tokens": jnp.asarray(targets),
    }
    return np.asarray(jax.jit(model.score_batch)(params, scored))

  assert np.all(sequence_log_prob(beam) >= sequence_log_prob(greedy) - 1e-4)


def test_bad_decode_arguments_raise(model_and_params):
  model, params = model_and_params
  with pytest.raises(ValueError):
    model.predict_batch(params, unpacked_batch(), decode_fn="nucleus")
  with pytest.raises(ValueError):
    model.predict_batch(params, unpacked_batch(), decoder_params={"beam_width": 3})
