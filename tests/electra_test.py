"""ELECTRA-style pre-training (t5x_lite/electra.py): RTD labels, where gradients go, the
loss against a hand computation, sharded training, restores without the generator and bad
settings. The train entry point runs ELECTRA in tests/compare_test.py (its objectives row)
and in the documentation test (docs/training.md's quickstart_electra.gin)."""

import dataclasses
import logging

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from t5x_lite import electra, models
from t5x_lite.checkpoint import checkpoints, partial_restore
from t5x_lite.core import errors, gin_config
from t5x_lite.nn import flops, network
from t5x_lite.training import partitioning
from text_tasks import VOCAB
from tiny_models import tiny_checkpoint_config, tiny_config, train_losses

pytestmark = pytest.mark.usefixtures("clean_gin")
CONFIG = tiny_config(vocab_size=320, num_encoder_layers=1, num_decoder_layers=1)


def _model(mask_rate=0.3, mlm_weight=1.0, rtd_weight=50.0, clm_weight=1.0, config=CONFIG):
  discriminator = models.EncoderDecoderModel(
    network.Transformer(config),
    VOCAB,
    VOCAB,
    z_loss=1e-4,
    label_smoothing=0.1,
    loss_normalizing_factor="NUM_REAL_TARGET_TOKENS",
  )
  return electra.ElectraModel(
    discriminator,
    electra.generator_config(config, 0.25, None),
    mask_rate=mask_rate,
    mask_id=VOCAB.vocab_size - 1,
    mlm_weight=mlm_weight,
    rtd_weight=rtd_weight,
    clm_weight=clm_weight,
  )


def _batch(rows: int = 2, length: int = 9, seed: int = 0) -> dict[str, np.ndarray]:
  """Text as inputs and targets (objectives.electra_text's features), EOS, padding."""
  text = np.random.default_rng(seed).integers(3, 250, (rows, length)).astype(np.int32)
  text[:, -1] = VOCAB.eos_id
  text[0, -3:] = [VOCAB.eos_id, 0, 0]
  return {
    "encoder_input_tokens": text,
    "decoder_input_tokens": np.pad(text[:, :-1], ((0, 0), (1, 0))),
    "decoder_target_tokens": text,
    "decoder_loss_weights": (text > 0).astype(np.float32),
  }


def _params(model, seed=0):
  return nn.meta.unbox(model.init_params(jax.random.PRNGKey(seed)))


class _ForcedGenerator:
  """Stands in for `ElectraModel.heads`: the generator puts all its mass on the original
  token at even positions and on original + 1 at odd ones; the RTD head is the real one."""

  def __init__(self, heads):
    self.heads = heads

  def apply(self, variables, *args, method, **kwargs):
    if method != "mlm_logits":
      return self.heads.apply(variables, *args, method=method, **kwargs)
    tokens = args[0]  # the generator's input: masked positions hold the mask id
    original = self.original
    odd = (jnp.arange(tokens.shape[1]) % 2 == 1)[None, :]
    forced = jnp.where(odd, original + 1, original)
    return 1e4 * jax.nn.one_hot(forced, CONFIG.vocab_size)  # [batch, length, vocab]


def test_rtd_labels_are_exactly_token_differs_from_the_original():
  model = _model(mask_rate=0.9)
  batch = _batch(rows=4, length=16)
  forced = _ForcedGenerator(model.heads)
  forced.original = jnp.asarray(batch["encoder_input_tokens"])
  model.heads = forced
  params = _params(_model())

  @jax.jit
  def run(params, batch):
    return model.corrupt(params, batch, jax.random.PRNGKey(1), None), model.loss_fn(
      params, batch, jax.random.PRNGKey(1)
    )[1]

  (masked, _, corrupted), sums = run(params, batch)
  masked, corrupted = np.asarray(masked), np.asarray(corrupted)
  original = batch["encoder_input_tokens"]
  odd = np.arange(original.shape[1])[None, :] % 2 == 1
  labels = np.asarray(electra.rtd_labels(corrupted, original))
  # Masked positions whose sample equals the original are labelled original.
  assert (masked & ~odd).sum() > 5 and (masked & odd).sum() > 5
  assert (corrupted[masked & ~odd] == original[masked & ~odd]).all()
  assert (labels[masked & ~odd] == 0).all()
  assert (corrupted[masked & odd] == original[masked & odd] + 1).all()
  assert (labels[masked & odd] == 1).all()
  assert (corrupted[~masked] == original[~masked]).all() and (labels[~masked] == 0).all()
  # Padding and EOS are never masked.
  assert not masked[(original == 0) | (original == VOCAB.eos_id)].any()
  assert float(sums["rtd_replaced"]) == (labels * (original > 0)).sum() > 0


def test_a_sample_never_is_padding_or_past_the_vocabulary():
  model = _model(mask_rate=0.9)
  batch = _batch(rows=8, length=32)
  params = _params(model)
  params["token_embedder"]["embedding"] = (
    params["token_embedder"]["embedding"].at[0].mul(50.0).at[VOCAB.vocab_size :].mul(50.0)
  )
  corrupt = jax.jit(lambda p, b, key: model.corrupt(p, b, key, None))
  for seed in range(3):
    masked, _, corrupted = corrupt(params, batch, jax.random.PRNGKey(seed))
    sampled = np.asarray(corrupted)[np.asarray(masked)]
    assert sampled.size and (sampled > 0).all() and (sampled < VOCAB.vocab_size).all()


def _norm(tree) -> float:
  return float(sum(jnp.sum(jnp.abs(x)) for x in jax.tree.leaves(tree)))


def test_the_generator_gets_no_gradient_from_the_discriminator_losses():
  model, batch = _model(), _batch()
  params = _params(model)
  terms = ("electra_mlm", "electra_rtd", "electra_clm")

  @jax.jit
  def term_grads(params):
    def each(p):
      sums = model.loss_fn(p, batch, jax.random.PRNGKey(2))[1]
      return jnp.stack([sums[t] for t in terms])

    return jax.jacrev(each)(params)  # every leaf [3, *shape]: one gradient per term

  grads = term_grads(params)
  mlm_only, rtd_only, clm_only = (jax.tree.map(lambda g, i=i: g[i], grads) for i in range(3))
  for term in (rtd_only, clm_only):
    assert _norm(term["generator"]) == 0.0
    assert _norm(term["encoder"]) > 0 and _norm(term["token_embedder"]) > 0
  assert _norm(rtd_only["rtd_head"]) > 0 and _norm(clm_only["rtd_head"]) == 0.0
  # The generator learns from its own MLM term, which reaches no discriminator layer.
  assert _norm(mlm_only["generator"]) > 0 and _norm(mlm_only["token_embedder"]) > 0
  assert _norm(mlm_only["encoder"]) == 0.0 and _norm(mlm_only["rtd_head"]) == 0.0


def _log_softmax(x: np.ndarray) -> np.ndarray:
  x = x.astype(np.float64)
  shifted = x - x.max(-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_the_loss_equals_a_hand_computation():
  model, batch = _model(mask_rate=0.4, rtd_weight=7.0, clm_weight=0.5), _batch(rows=3)
  params = _params(model)
  loss, sums = model.loss_fn(params, batch, None)  # evaluation's fixed masking key
  masked, mlm_logits, corrupted = model.corrupt(params, batch, jax.random.PRNGKey(0), None)
  masked, corrupted = np.asarray(masked), np.asarray(corrupted)
  original = batch["encoder_input_tokens"]
  assert masked.sum() > 0 and (corrupted != original).sum() > 0
  factor = float((batch["decoder_target_tokens"] > 0).sum())  # NUM_REAL_TARGET_TOKENS
  log_probs = _log_softmax(np.asarray(mlm_logits))
  picked = np.take_along_axis(log_probs, original[..., None], -1)[..., 0]
  mlm = -(picked * masked).sum() / (factor * 0.4)
  disc_params = model.inner_params(params)
  encoded = model.discriminator.module.apply(
    {"params": disc_params}, corrupted, enable_dropout=False, method="encode"
  )
  logit = np.asarray(encoded, np.float64) @ np.asarray(params["rtd_head"]["kernel"])[:, 0]
  label = (corrupted != original).astype(np.float64)
  bce = np.log1p(np.exp(-np.abs(logit))) + np.maximum(logit, 0) - label * logit
  rtd = (bce * (original > 0)).sum() / factor
  corrupted_batch = {**batch, "encoder_input_tokens": corrupted}
  clm, _ = model.discriminator.loss_fn(disc_params, corrupted_batch, None)
  np.testing.assert_allclose(sums["electra_mlm"], mlm, rtol=1e-5)
  np.testing.assert_allclose(sums["electra_rtd"], rtd, rtol=1e-5)
  np.testing.assert_allclose(sums["electra_clm"], clm, rtol=1e-5)
  np.testing.assert_allclose(loss, mlm + 7.0 * rtd + 0.5 * float(clm), rtol=1e-5)
  metrics = model.finalize_metrics(sums)
  np.testing.assert_allclose(
    metrics["rtd_accuracy"], np.mean((logit > 0) == label, where=original > 0), rtol=1e-6
  )
  assert float(metrics["replaced_fraction"]) == (label * masked).sum() / masked.sum()


def test_a_sharded_step_equals_one_device():
  model, batch = _model(), _batch(rows=8, length=12)
  reference = train_losses(model, batch, partitioning.Partitioner(devices=jax.devices()[:1]))
  sharded = train_losses(model, batch, partitioning.Partitioner(num_partitions=2, fsdp=True))
  assert len(jax.devices()) == 8
  np.testing.assert_allclose(sharded, reference, rtol=2e-5)
  assert reference[-1] < reference[0]


def test_params_shard_by_their_logical_axes_and_flops_count_the_generator():
  model = _model()
  axes = traverse_util.flatten_dict(model.param_axes(), sep="/")
  assert axes["generator/embed/projection/kernel"] == jax.sharding.PartitionSpec("embed", "mlp")
  assert axes["generator/encoder/layers_0/mlp/wi_0/kernel"] == jax.sharding.PartitionSpec(
    "embed", "mlp"
  )
  assert axes["rtd_head/kernel"] == jax.sharding.PartitionSpec("embed", "kv")
  plain = model.discriminator.train_flops_per_step(4, 16, 16)
  gen = model.generator
  generator = flops.forward_flops(gen, 16, 0) + 2 * 16 * CONFIG.emb_dim * (
    2 * gen.emb_dim + CONFIG.vocab_size + 1
  )
  assert model.train_flops_per_step(4, 16, 16) == pytest.approx(plain + 3 * 4 * generator)


def test_a_checkpoint_restores_into_the_plain_model_without_generator_and_rtd_head(
  tmp_path, caplog
):
  model = _model(config=tiny_checkpoint_config())
  saved = jax.device_get(_params(model))
  config = dataclasses.asdict(model.network_config)
  checkpoints.write_params_checkpoint(tmp_path / "electra", saved, config=config)
  plain = models.build_model(checkpoints.model_config(tmp_path / "electra" / "0"), VOCAB)
  partitioner = partitioning.Partitioner(num_partitions=2)
  abstract = partitioner.abstract_params(plain.init_params)[0]
  fresh = jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype, device=t.sharding), abstract)
  expected = traverse_util.flatten_dict(model.inner_params(saved), sep="/")
  with caplog.at_level(logging.WARNING, logger="absl"):
    start = partial_restore.restore_start(
      tmp_path / "electra", abstract, fresh, partial_restore.RestoreConfig()
    )  # fine-tuning
    evaluated = checkpoints.restore_params(tmp_path / "electra", abstract)  # eval, infer
  for restored in (start.params, evaluated):
    flat = traverse_util.flatten_dict(jax.device_get(restored), sep="/")
    assert flat.keys() == expected.keys()
    for path, value in expected.items():
      np.testing.assert_array_equal(flat[path], value, err_msg=path)
  dropped = [r.getMessage() for r in caplog.records if "Pre-training-only" in r.getMessage()]
  assert len(dropped) == 2, dropped  # one line per restore
  assert "generator/ (" in dropped[0] and "rtd_head/ (1 arrays)" in dropped[0]
  # The restored params fine-tune: the plain model's loss runs on them.
  loss, _ = plain.loss_fn(start.params, _batch(), None)
  assert np.isfinite(float(loss))


@pytest.mark.parametrize(
  "kwargs,binding",
  [
    (dict(rtd_weight=-1.0), "build_electra_model.rtd_weight must be >= 0"),
    (dict(mlm_weight=-0.5), "build_electra_model.mlm_weight must be >= 0"),
    (dict(generator_width_fraction=1.5), "build_electra_model.generator_width_fraction"),
    (dict(generator_num_layers=2), "build_electra_model.generator_num_layers"),
    (dict(mask_rate=1.0), "build_electra_model.mask_rate"),
  ],
)
def test_bad_settings_are_one_line_errors_naming_the_binding(kwargs, binding):
  with pytest.raises(errors.ConfigError, match=binding) as e:
    electra.build_electra_model(config=tiny_checkpoint_config(), vocabulary=VOCAB, **kwargs)
  lines = [line for line in str(e.value).splitlines() if "In call to configurable" not in line]
  assert len(lines) == 1, str(e.value)  # gin's note is dropped by `errors.fail`


def test_a_decoder_only_config_is_refused():
  config = tiny_checkpoint_config(architecture="decoder_only", num_encoder_layers=0)
  with pytest.raises(errors.ConfigError, match="architecture is 'decoder_only'"):
    electra.build_electra_model(config=config, vocabulary=VOCAB)


def test_electra_gin_binds_the_model_and_its_macros():
  gin_config.parse_gin(["quickstart_electra.gin"], ["ELECTRA_RTD_WEIGHT = 30.0"])

  def bound(name: str):
    return gin_config.resolved_macro(gin.query_parameter(f"electra.build_electra_model.{name}"))

  assert (bound("rtd_weight"), bound("generator_width_fraction"), bound("mask_rate")) == (
    30.0,
    0.25,
    0.15,
  )
  assert gin.query_parameter("train.model").selector == "electra.build_electra_model"
  model = electra.build_electra_model()
  assert model.generator.emb_dim == model.network_config.emb_dim // 4
  assert model.mask_id == model.input_vocabulary.vocab_size - 1
