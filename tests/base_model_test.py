"""The model contract: a model written only against `base_model.BaseModel` trains, keeps
auxiliary state and evaluates through the trainer unchanged, and the trainer and the
loops reach models through the contract alone."""

import ast
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_lite import base_model
from t5x_lite.nn import losses
from t5x_lite.training import optimizers, partitioning, trainer
from tiny_models import tiny_config

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "t5x_lite"
VOCAB, WIDTH = 16, 8


class _Vocab:
  eos_id = 1
  vocab_size = VOCAB


class BigramModel(base_model.BaseModel):
  """Next-token logits from the current token alone (embedding -> output matrix), with an
  exponential moving average of the params as auxiliary state. Nothing T5 about it:
  only the contract's methods."""

  def __init__(self, ema_decay: float = 0.5):
    self.input_vocabulary = self.output_vocabulary = _Vocab()
    self.ema_decay = ema_decay

  @property
  def network_config(self):
    return tiny_config(vocab_size=VOCAB, emb_dim=WIDTH)

  def init_params(self, rng):
    embed_rng, out_rng = jax.random.split(rng)
    return {
      "embed": nn.LogicallyPartitioned(
        jax.random.normal(embed_rng, (VOCAB, WIDTH)), ("vocab", "embed")
      ),
      "out": nn.LogicallyPartitioned(
        jax.random.normal(out_rng, (WIDTH, VOCAB)) / WIDTH, ("embed", "vocab")
      ),
    }

  def _logits(self, params, batch):
    hidden = params["embed"][batch["decoder_input_tokens"]]  # [batch, length, width]
    return hidden @ params["out"]  # [batch, length, vocab]

  def loss_normalization(self, batch):
    factor, weights = losses.get_loss_normalizing_factor_and_weights(
      "NUM_REAL_TARGET_TOKENS", batch
    )
    return factor, weights

  def loss_fn(self, params, batch, dropout_rng, *, normalization=None, aux_state=None):
    del dropout_rng, aux_state
    factor, weights = normalization or self.loss_normalization(batch)
    logits = self._logits(params, batch)
    targets = batch["decoder_target_tokens"]
    loss, z_loss, _ = losses.compute_weighted_cross_entropy(
      logits, targets, weights, loss_normalizing_factor=factor
    )
    correct = losses.token_correct(logits, targets)
    return loss, losses.metric_sums(correct, batch, weights, loss, z_loss)

  def score_batch(self, params, batch):
    log_probs = jax.nn.log_softmax(self._logits(params, batch))  # [batch, length, vocab]
    targets = batch["decoder_target_tokens"]
    scores = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(scores * (targets > 0), axis=-1)

  def predict_batch_with_aux(self, params, batch, rng=None, **kwargs):
    tokens = jnp.argmax(self._logits(params, batch), axis=-1)  # [batch, length]
    return tokens, {"scores": self.score_batch(params, dict(batch, decoder_target_tokens=tokens))}

  def init_aux_state(self, rng):
    return self.init_params(rng)

  def start_aux_state(self, abstract, params):
    # A copy: the train step donates the params and the auxiliary state, so they must
    # not share buffers.
    return jax.tree.map(lambda p, a: jax.device_put(jnp.copy(p), a.sharding), params, abstract)

  def update_aux_state(self, aux_state, params, step):
    del step
    decay = self.ema_decay
    return jax.tree.map(lambda a, p: decay * a + (1 - decay) * p, aux_state, params)


def _batch(rows: int = 8, length: int = 6) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  inputs = rng.integers(2, VOCAB, (rows, length)).astype(np.int32)
  targets = (inputs + 1) % VOCAB  # learnable: each token's successor
  targets[0, -2:] = 0  # padding: no loss
  return {"decoder_input_tokens": inputs, "decoder_target_tokens": targets}


def _train(model, partitioner, steps, num_microbatches=1):
  optimizer = optimizers.adafactor(learning_rate=0.1)
  state, shardings = trainer.init_train_state(model, optimizer, jax.random.PRNGKey(0), partitioner)
  abstract, _ = trainer.abstract_train_state(model, optimizer, partitioner)
  state = state.replace(aux_state=model.start_aux_state(abstract.aux_state, state.params))
  step = trainer.make_train_step(model, optimizer, partitioner, shardings, num_microbatches)
  history = []
  for _ in range(steps):
    previous = jax.device_get(state.aux_state)
    state, metrics = step(state, _batch(), jax.random.PRNGKey(1))
    history.append((previous, jax.device_get(metrics)))
  return state, shardings, history


def test_a_model_written_against_the_contract_trains_through_the_trainer():
  model, partitioner = BigramModel(), partitioning.Partitioner(num_partitions=2)
  state, shardings, history = _train(model, partitioner, steps=8)
  losses_seen = [float(m["loss"]) for _, m in history]
  assert all(b < a for a, b in zip(losses_seen, losses_seen[1:])), losses_seen
  assert losses_seen[-1] < 0.6 * losses_seen[0], losses_seen
  assert float(history[-1][1]["accuracy"]) > float(history[0][1]["accuracy"])
  # Params and the auxiliary state shard by the axes the model gave them: 'vocab' over 'model'.
  assert shardings.params["embed"].spec == jax.sharding.PartitionSpec("model", None)
  assert state.params["embed"].sharding.spec == shardings.params["embed"].spec
  assert state.aux_state["out"].sharding.spec == shardings.aux_state["out"].spec
  # update_aux_state ran inside the step: the average moved toward the new params.
  previous, _ = history[-1]
  params, aux = jax.device_get(state.params), jax.device_get(state.aux_state)
  expected = jax.tree.map(lambda a, p: 0.5 * a + 0.5 * p, previous, params)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6), aux, expected)
  # Evaluation goes through the same contract (eval_fn, finalize_metrics).
  evaluate = trainer.make_eval_step(model, partitioner, shardings.params)
  metrics = jax.device_get(evaluate(state.params, _batch()))
  assert np.isfinite(metrics["loss"]) and metrics["loss"] < losses_seen[0]


def test_microbatches_use_the_contracts_full_batch_normalization():
  partitioner = partitioning.Partitioner(num_partitions=2)
  _, _, whole = _train(BigramModel(), partitioner, steps=2)
  _, _, halves = _train(BigramModel(), partitioner, steps=2, num_microbatches=2)
  for (_, a), (_, b) in zip(whole, halves):
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)
    np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=1e-5)


def test_abstract_methods_are_required():
  class Partial(base_model.BaseModel):
    def init_params(self, rng):
      return {}

  with pytest.raises(TypeError, match="loss_fn"):
    Partial()


def _isinstance_model_checks(path: pathlib.Path) -> list[str]:
  tree = ast.parse(path.read_text(encoding="utf-8"))
  return [
    f"{path.name}:{node.lineno}: {ast.unparse(node)}"
    for node in ast.walk(tree)
    if isinstance(node, ast.Call)
    and ast.unparse(node.func) == "isinstance"
    and "Model" in ast.unparse(node.args[1])
  ]


def test_the_trainer_and_the_loops_never_switch_on_the_model_kind():
  sources = sorted((PACKAGE / "training").glob("*.py")) + sorted((PACKAGE / "run").glob("*.py"))
  assert len(sources) > 10
  switches = [hit for path in sources for hit in _isinstance_model_checks(path)]
  assert not switches, switches
  for path in sources:
    imported = {
      alias.name
      for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
      if isinstance(node, ast.ImportFrom) and node.module == "t5x_lite"
      for alias in node.names
    }
    # A distillation model is chosen by gin (runs/distill.gin) and reached as a BaseModel.
    assert "distillation" not in imported, path
    if path.parent.name == "training":
      assert "models" not in imported, path  # the trainer sees only base_model
