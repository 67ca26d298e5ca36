"""Tests for t5x_lite.nn.decoding against brute-force references on a tiny cached model.

The toy model is a position-dependent trigram table: the logits for the next token
depend on the fed token, the token before it (read from the cache, so a wrong beam
gather changes the results) and the 0-d `cache_index` (checks it is passed through).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from t5x_lite.nn import decoding

EOS = 1
VOCAB = 5


@dataclasses.dataclass(frozen=True)
class TrigramModel:
  """logits(next | prev, token, index) = table[prev, token] + pos[index]."""

  table: np.ndarray  # [vocab, vocab, vocab]
  pos: np.ndarray  # [max_len, vocab]

  def tokens_to_logits(self, ids: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
    token = ids[:, 0]  # [rows]
    vocab = self.table.shape[0]
    # One-hot contractions rather than gathers: these also shard under Explicit axes.
    prev_1h = jax.nn.one_hot(cache["prev"], vocab)  # [rows, vocab]
    token_1h = jax.nn.one_hot(token, vocab)  # [rows, vocab]
    logits = jnp.einsum("rp,rt,ptv->rv", prev_1h, token_1h, self.table)  # [rows, vocab]
    logits += jax.nn.one_hot(cache["cache_index"], self.pos.shape[0]) @ self.pos  # [vocab]
    return logits, {"prev": token, "cache_index": cache["cache_index"] + 1}

  def init_cache(self, rows: int) -> dict:
    return {"prev": jnp.zeros((rows,), jnp.int32), "cache_index": jnp.zeros((), jnp.int32)}

  def step_log_probs(self, prefix: tuple[int, ...]) -> np.ndarray:
    """[vocab] float64 log-probs of the token after `prefix` (BOS excluded)."""
    context = (0, 0) + tuple(prefix)
    logits = self.table[context[-2], context[-1]] + self.pos[len(prefix)]
    return logits - np.logaddexp.reduce(logits)

  def sequence_log_prob(self, tokens: tuple[int, ...]) -> float:
    return float(sum(self.step_log_probs(tokens[:i])[t] for i, t in enumerate(tokens)))


def make_model(seed: int, vocab: int = VOCAB, max_len: int = 8, eos_bias: float = 0.0):
  """Random trigram model; pad (0) is never likely, EOS shifted by eos_bias."""
  rng = np.random.default_rng(seed)
  table = 2.0 * rng.normal(size=(vocab, vocab, vocab))
  table[..., 0] -= 30.0
  table[..., EOS] += eos_bias
  pos = rng.normal(size=(max_len, vocab))
  return TrigramModel(table.astype(np.float32), pos.astype(np.float32))


def sample(model, batch, length, rng=0, num_decodes=1, **kwargs):
  """Runs jitted temperature_sample with an all-zero prompt."""
  fn = functools.partial(
    decoding.temperature_sample,
    tokens_to_logits=model.tokens_to_logits,
    eos_id=EOS,
    num_decodes=num_decodes,
    **kwargs,
  )
  prompt = jnp.zeros((batch, length), jnp.int32)
  key = jax.random.key(rng)
  seqs, scores = jax.jit(fn)(prompt, model.init_cache(batch * num_decodes), decode_rng=key)
  return np.asarray(seqs), np.asarray(scores)


def beam(model, batch, length, num_decodes, prompt=None, **kwargs):
  """Runs jitted beam_search."""
  fn = functools.partial(
    decoding.beam_search,
    tokens_to_logits=model.tokens_to_logits,
    eos_id=EOS,
    num_decodes=num_decodes,
    **kwargs,
  )
  prompt = jnp.zeros((batch, length), jnp.int32) if prompt is None else prompt
  seqs, scores = jax.jit(fn)(prompt, model.init_cache(batch * num_decodes))
  return np.asarray(seqs), np.asarray(scores)


def numpy_greedy(model, length, min_len=0, prefix=()):
  tokens = list(prefix)
  while len(tokens) < length and EOS not in tokens:
    log_probs = model.step_log_probs(tuple(tokens))
    if len(tokens) < min_len:
      log_probs[EOS] = -np.inf
    tokens.append(int(np.argmax(log_probs)))
  return tokens + [0] * (length - len(tokens))


def trimmed(seq) -> tuple[int, ...]:
  """Tokens up to and including the first EOS."""
  seq = [int(t) for t in seq]
  return tuple(seq[: seq.index(EOS) + 1]) if EOS in seq else tuple(seq)


def penalised(model, seq, alpha):
  tokens = trimmed(seq)
  return model.sequence_log_prob(tokens) / ((5.0 + len(tokens)) / 6.0) ** alpha


def brute_force(model, length, alpha, min_len=0):
  """All complete sequences (EOS-terminated, or length `length`), best first."""
  results = []
  for n in range(1, length + 1):
    for tokens in itertools.product(range(VOCAB), repeat=n):
      if EOS in tokens[: max(n - 1, min_len)] or (tokens[-1] != EOS and n < length):
        continue
      score = model.sequence_log_prob(tokens) / ((5.0 + n) / 6.0) ** alpha
      results.append((score, tokens + (0,) * (length - n)))
  results.sort(key=lambda r: -r[0])
  return results


# ----------------------------------------------------------------------- helpers


def test_expand_and_gather_helpers():
  x = jnp.arange(6).reshape(3, 2)  # [batch, 2]
  expanded = decoding.flat_batch_beam_expand(x, 2)
  np.testing.assert_array_equal(expanded[:, 0], [0, 0, 2, 2, 4, 4])
  tree = decoding.expand_to_beams({"a": x, "cache_index": jnp.array(7)}, 3)
  assert tree["a"].shape == (9, 2) and tree["cache_index"].shape == ()
  beams = decoding.unflatten_beam_dim(expanded, 3, 2)  # [3, 2, 2]
  np.testing.assert_array_equal(decoding.flatten_beam_dim(beams), expanded)
  picked = decoding.gather_beams(jnp.arange(6).reshape(2, 3), jnp.array([[2, 2], [0, 1]]))
  np.testing.assert_array_equal(picked, [[2, 2], [3, 4]])
  cache = {"k": jnp.arange(4), "cache_index": jnp.array(5)}
  gathered = decoding.gather_cache_beams(cache, jnp.array([[1, 1], [1, 0]]), 2)
  np.testing.assert_array_equal(gathered["k"], [1, 1, 3, 2])
  assert int(gathered["cache_index"]) == 5


def test_cache_with_wrong_rows_is_rejected():
  model = make_model(0)
  with pytest.raises(ValueError, match="expand_to_beams"):
    decoding.beam_search(
      jnp.zeros((2, 4), jnp.int32), model.init_cache(3), model.tokens_to_logits, EOS
    )


# ------------------------------------------------------------- greedy / sampling


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_matches_numpy(seed):
  model = make_model(seed, eos_bias=1.0)
  seqs, scores = sample(model, 2, 6, temperature=0.0)
  expected = numpy_greedy(model, 6)
  for row in range(2):
    np.testing.assert_array_equal(seqs[row, 0], expected)
    expected_score = model.sequence_log_prob(trimmed(expected))
    np.testing.assert_allclose(scores[row, 0], expected_score, rtol=1e-5)
  fn = functools.partial(
    decoding.greedy_decode, tokens_to_logits=model.tokens_to_logits, eos_id=EOS
  )
  greedy_seqs, _ = jax.jit(fn)(jnp.zeros((2, 6), jnp.int32), model.init_cache(2))
  np.testing.assert_array_equal(greedy_seqs, seqs)


def test_topk_one_and_tiny_topp_are_greedy():
  model = make_model(3)
  greedy, _ = sample(model, 3, 6, temperature=0.0, num_decodes=2)
  topk1, _ = sample(model, 3, 6, temperature=1.5, topk=1, num_decodes=2)
  topp, _ = sample(model, 3, 6, temperature=1.5, topp=1e-6, num_decodes=2)
  np.testing.assert_array_equal(topk1, greedy)
  np.testing.assert_array_equal(topp, greedy)


def test_seeds():
  model = make_model(4)
  fn = jax.jit(
    functools.partial(
      decoding.temperature_sample,
      tokens_to_logits=model.tokens_to_logits,
      eos_id=EOS,
      num_decodes=8,
    )
  )
  prompt, cache = jnp.zeros((2, 8), jnp.int32), model.init_cache(16)
  first, first_scores = fn(prompt, cache, decode_rng=jax.random.key(7))
  again, again_scores = fn(prompt, cache, decode_rng=jax.random.key(7))
  other, _ = fn(prompt, cache, decode_rng=jax.random.key(8))
  np.testing.assert_array_equal(first, again)
  np.testing.assert_array_equal(first_scores, again_scores)
  assert not np.array_equal(first, other)


def first_token_frequencies(model, num_draws, **kwargs):
  seqs, _ = sample(model, 1, 1, rng=11, num_decodes=num_draws, **kwargs)
  return np.bincount(seqs[0, :, 0], minlength=VOCAB) / num_draws


def softmax(x):
  e = np.exp(x - x.max())
  return e / e.sum()


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_sampling_frequencies_match_softmax(temperature):
  model = make_model(5)
  logits = model.table[0, 0] + model.pos[0]
  freqs = first_token_frequencies(model, 8000, temperature=temperature)
  np.testing.assert_allclose(freqs, softmax(logits / temperature), atol=0.03)


def test_topk_and_topp_frequencies():
  model = make_model(6)
  probs = softmax(model.table[0, 0] + model.pos[0])
  order = np.argsort(-probs)
  top2 = np.zeros(VOCAB)
  top2[order[:2]] = probs[order[:2]] / probs[order[:2]].sum()
  np.testing.assert_allclose(first_token_frequencies(model, 8000, topk=2), top2, atol=0.03)
  # Nucleus of mass 0.9: the shortest prefix (by probability) reaching 0.9.
  keep = order[: int(np.searchsorted(np.cumsum(probs[order]), 0.9)) + 1]
  assert 1 < len(keep) < VOCAB  # the fixture exercises a real cut
  nucleus = np.zeros(VOCAB)
  nucleus[keep] = probs[keep] / probs[keep].sum()
  np.testing.assert_allclose(first_token_frequencies(model, 8000, topp=0.9), nucleus, atol=0.03)


def test_eos_padding_and_scores():
  model = make_model(7, eos_bias=2.0)
  seqs, scores = sample(model, 4, 8, num_decodes=8, rescale_log_probs=False)
  early = 0
  for seq, score in zip(seqs.reshape(-1, 8), scores.reshape(-1)):
    tokens = trimmed(seq)
    np.testing.assert_array_equal(seq[len(tokens) :], 0)
    assert 0 not in tokens
    early += tokens[-1] == EOS and len(tokens) < 8
    np.testing.assert_allclose(score, model.sequence_log_prob(tokens), rtol=1e-4)
  assert early > 0
  assert np.all(np.diff(scores, axis=1) <= 0)  # best first


def test_rescaled_scores_use_the_sampled_distribution():
  model = make_model(8, eos_bias=1.0)
  seqs, scores = sample(model, 2, 5, num_decodes=4, temperature=2.0)
  for seq, score in zip(seqs.reshape(-1, 5), scores.reshape(-1)):
    tokens = trimmed(seq)
    expected = 0.0
    for i, t in enumerate(tokens):
      context = (0, 0) + tokens[:i]
      scaled = (model.table[context[-2], context[-1]] + model.pos[i]) / 2.0
      expected += scaled[t] - np.logaddexp.reduce(scaled)
    np.testing.assert_allclose(score, expected, rtol=1e-4)


def test_min_decode_len():
  model = make_model(9, eos_bias=3.0)
  seqs, _ = sample(model, 4, 8, num_decodes=8, min_decode_len=3)
  eos_positions = [trimmed(s).index(EOS) for s in seqs.reshape(-1, 8) if EOS in s]
  assert min(eos_positions) == 3  # never before 3, and the fixture does stop there
  seqs, _ = sample(model, 4, 8, num_decodes=8, min_decode_len=8)
  assert not np.any(seqs == EOS) and np.all(seqs != 0)


def test_max_decode_len_and_prompt():
  model = make_model(10)
  prompt = jnp.zeros((2, 6), jnp.int32).at[:, 1:3].set(jnp.array([[3, 4], [2, 2]]))
  fn = functools.partial(
    decoding.greedy_decode,
    tokens_to_logits=model.tokens_to_logits,
    eos_id=EOS,
    max_decode_len=4,
  )
  seqs, scores = jax.jit(fn)(prompt, model.init_cache(2))
  for row, prefix in enumerate([(3, 4), (2, 2)]):
    expected = numpy_greedy(model, 4, prefix=prefix)
    np.testing.assert_array_equal(seqs[row, 0], expected + [0, 0])
    tokens = trimmed(expected)
    forced = model.sequence_log_prob(tokens[:2])
    expected_score = model.sequence_log_prob(tokens) - forced
    np.testing.assert_allclose(scores[row, 0], expected_score, rtol=1e-5)


def counting_model(model):
  """Wraps tokens_to_logits so every executed step increments a host counter."""
  calls = []

  def tokens_to_logits(ids, cache):
    jax.debug.callback(lambda: calls.append(1))
    return model.tokens_to_logits(ids, cache)

  return tokens_to_logits, calls


def test_sampling_stops_when_all_finished():
  model = make_model(11, eos_bias=60.0)
  tokens_to_logits, calls = counting_model(model)
  for min_len, steps in [(0, 1), (3, 4)]:
    calls.clear()
    fn = functools.partial(
      decoding.temperature_sample,
      tokens_to_logits=tokens_to_logits,
      eos_id=EOS,
      num_decodes=2,
      min_decode_len=min_len,
    )
    prompt = jnp.zeros((2, 8), jnp.int32)
    seqs, _ = jax.jit(fn)(prompt, model.init_cache(4), decode_rng=jax.random.key(0))
    jax.effects_barrier()
    assert len(calls) == steps
    assert np.all(np.asarray(seqs)[:, :, min_len] == EOS)


@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit])
def test_sharded_batch_matches_unsharded(axis_type):
  model = make_model(12, eos_bias=1.0)
  mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
  shard = NamedSharding(mesh, PartitionSpec("data"))
  prompt = jnp.zeros((8, 6), jnp.int32)
  cache = model.init_cache(16)
  sharded_cache = dict(cache, prev=jax.device_put(cache["prev"], shard))
  for fn in [
    functools.partial(decoding.beam_search, num_decodes=2),
    functools.partial(decoding.temperature_sample, decode_rng=jax.random.key(3), num_decodes=2),
  ]:
    fn = jax.jit(functools.partial(fn, tokens_to_logits=model.tokens_to_logits, eos_id=EOS))
    expected = fn(prompt, cache)
    with jax.set_mesh(mesh):
      got = fn(jax.device_put(prompt, shard), sharded_cache)
    assert got[0].sharding.spec[0] == "data"
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-6)


# ------------------------------------------------------------------ beam search


@pytest.mark.parametrize(
  "seed, alpha, min_len", [(0, 0.6, 0), (1, 0.0, 0), (2, 1.0, 2), (3, 0.6, 0)]
)
def test_beam_search_is_exact_with_enough_beams(seed, alpha, min_len):
  model = make_model(seed, eos_bias=1.0)
  length = 4
  # (vocab - 1) ** (length - 1) beams keep every non-EOS prefix alive.
  beams = (VOCAB - 1) ** (length - 1)
  seqs, scores = beam(model, 2, length, beams, alpha=alpha, min_decode_len=min_len)
  reference = brute_force(model, length, alpha, min_len)[:beams]
  for row in range(2):
    np.testing.assert_allclose(scores[row], [r[0] for r in reference], rtol=1e-4)
    for got, (_, expected) in zip(seqs[row, :10], reference[:10]):
      np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("seed", range(4))
def test_beam_scores_sorted_and_beat_greedy(seed):
  model = make_model(seed, eos_bias=0.5)
  seqs, scores = beam(model, 3, 8, 4)
  greedy = numpy_greedy(model, 8)
  for row in range(3):
    assert np.all(np.diff(scores[row]) <= 0)
    assert len({tuple(s) for s in seqs[row]}) == 4
    for seq, score in zip(seqs[row], scores[row]):
      np.testing.assert_allclose(score, penalised(model, seq, 0.6), rtol=1e-4)
    assert scores[row, 0] >= penalised(model, greedy, 0.6) - 1e-5


@pytest.mark.parametrize("seed", range(3))
def test_one_beam_is_greedy_without_eos(seed):
  model = make_model(seed)
  seqs, _ = beam(model, 2, 6, 1, min_decode_len=6)
  expected = numpy_greedy(model, 6, min_len=6)
  np.testing.assert_array_equal(seqs[:, 0], [expected, expected])


def test_beam_min_max_len_and_prompt():
  model = make_model(13, eos_bias=3.0)
  seqs, _ = beam(model, 2, 6, 3, min_decode_len=6)
  assert not np.any(seqs == EOS) and np.all(seqs != 0)
  prompt = jnp.zeros((2, 6), jnp.int32).at[:, 1].set(jnp.array([3, 4]))
  seqs, scores = beam(model, 2, 6, 3, prompt=prompt, max_decode_len=3)
  np.testing.assert_array_equal(seqs[:, :, 0], [[3] * 3, [4] * 3])
  np.testing.assert_array_equal(seqs[:, :, 3:], 0)
  for seq, score in zip(seqs.reshape(-1, 6), scores.reshape(-1)):
    tokens = trimmed(seq[:3])
    forced = model.sequence_log_prob(tokens[:1])
    expected = (model.sequence_log_prob(tokens) - forced) / ((5.0 + len(tokens)) / 6.0) ** 0.6
    np.testing.assert_allclose(score, expected, rtol=1e-4)


def test_beam_search_stops_early():
  model = make_model(14, eos_bias=50.0)
  tokens_to_logits, calls = counting_model(model)
  fn = functools.partial(
    decoding.beam_search, tokens_to_logits=tokens_to_logits, eos_id=EOS, num_decodes=2
  )
  seqs, _ = jax.jit(fn)(jnp.zeros((2, 8), jnp.int32), model.init_cache(4))
  jax.effects_barrier()
  # Step 0 finishes one beam, step 1 the second; no live beam can then win.
  assert len(calls) == 2
  np.testing.assert_array_equal(np.asarray(seqs)[:, 0, 0], [EOS, EOS])


# ------------------------------------------------------------- real network


NETWORK_DECODES = 3


@functools.cache
def network_decoder(scan_layers: bool, share_encoded: bool = False):
  """A tiny real Transformer with its cache, per the network's decode contract.

  With `share_encoded` the decoder gets the encoder output once per batch row (its
  decodes share it, as `models.EncoderDecoderModel` decodes), else repeated per decode.

  Returns:
    (teacher_forced(decoder_input_tokens [rows, L]) -> logits [rows, L, vocab],
    cache, tokens_to_logits, batch size, length); rows = batch * NETWORK_DECODES.
  """
  from flax import linen as nn

  from t5x_lite.nn import network

  config = network.T5Config(
        vocab_size=24, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=32,
        num_encoder_layers=2, num_decoder_layers=2, mlp_activations=("gelu", "linear"),
        dropout_rate=0.0, logits_via_embedding=False, scan_layers=scan_layers,
    )  # fmt: skip
  model = network.Transformer(config)
  batch, length = 2, 6
  enc_tokens = jax.random.randint(jax.random.key(1), (batch, 5), 2, 24).at[1, 3:].set(0)
  targets = jnp.ones((batch, length), jnp.int32)
  # Random normal params of the right shapes: compiling the real initialisers takes
  # far longer on CPU than this whole test, and decoding does not care how they were drawn.
  init = functools.partial(model.init, enable_dropout=False)
  shapes = nn.meta.unbox(jax.eval_shape(init, jax.random.key(0), enc_tokens, targets, targets))
  leaves, treedef = jax.tree.flatten(shapes["params"])
  rng = np.random.default_rng(0)
  params = treedef.unflatten([0.5 * rng.normal(size=x.shape).astype(x.dtype) for x in leaves])
  rows_tokens = decoding.flat_batch_beam_expand(enc_tokens, NETWORK_DECODES)  # [rows, 5]
  decoder_enc_tokens = enc_tokens if share_encoded else rows_tokens
  encoded = jax.jit(functools.partial(model.apply, enable_dropout=False, method=model.encode))(
    {"params": params}, decoder_enc_tokens
  )  # [batch or rows, input_len, emb]

  def decode_step(variables, ids):
    logits, new_vars = model.apply(
            variables, encoded, decoder_enc_tokens, ids, decode=True, enable_dropout=False,
            mutable=["cache"], method=model.decode,
        )  # fmt: skip
    return logits[:, 0], new_vars["cache"]  # [rows, vocab]

  _, cache = decode_step({"params": params}, jnp.ones((rows_tokens.shape[0], length), jnp.int32))
  cross_rows = {
    leaf.shape[0]
    for path, leaf in jax.tree_util.tree_leaves_with_path(cache)
    if "encoder_decoder_attention" in jax.tree_util.keystr(path)
  }
  assert cross_rows == {decoder_enc_tokens.shape[0]}

  def tokens_to_logits(ids, step_cache):
    return decode_step({"params": params, "cache": step_cache}, ids)

  @jax.jit
  def teacher_forced(decoder_input_tokens):
    ones = jnp.ones_like(decoder_input_tokens)  # no target-padding mask
    return model.apply(
      {"params": params}, rows_tokens, decoder_input_tokens, ones, enable_dropout=False
    )  # [rows, length, vocab]

  return teacher_forced, cache, tokens_to_logits, batch, length


def teacher_forced_log_probs(teacher_forced, seqs):
  """Per-token log-probs [batch, n, L] and logits of seqs [batch, n, L], teacher-forced."""
  batch, n, length = seqs.shape
  flat = seqs.reshape(batch * n, length)  # [batch * n, L]
  shifted = jnp.pad(flat, ((0, 0), (1, 0)))[:, :-1]  # [batch * n, L], BOS first
  logits = teacher_forced(shifted).reshape(batch, n, length, -1)  # [batch, n, L, vocab]
  log_probs = jax.nn.log_softmax(logits, axis=-1)  # [batch, n, L, vocab]
  token_log_probs = jnp.take_along_axis(log_probs, seqs[..., None], axis=-1)[..., 0]
  return np.asarray(token_log_probs), np.asarray(logits)


def real_length(seq) -> int:
  return len(trimmed(seq))


@pytest.mark.parametrize("share_encoded", [False, True])
def test_real_network_cached_greedy_matches_teacher_forcing(share_encoded):
  teacher_forced, cache, tokens_to_logits, batch, length = network_decoder(False, share_encoded)
  fn = functools.partial(
    decoding.greedy_decode,
    tokens_to_logits=tokens_to_logits,
    eos_id=EOS,
    num_decodes=NETWORK_DECODES,
  )
  seqs, scores = jax.jit(fn)(jnp.zeros((batch, length), jnp.int32), cache)
  token_log_probs, logits = teacher_forced_log_probs(teacher_forced, seqs)
  seqs = np.asarray(seqs)
  for row in range(batch):
    n = real_length(seqs[row, 0])
    # Each generated token is the argmax of the teacher-forced logits at its position.
    np.testing.assert_array_equal(np.argmax(logits[row, 0, :n], axis=-1), seqs[row, 0, :n])
    np.testing.assert_allclose(scores[row, 0], token_log_probs[row, 0, :n].sum(), rtol=1e-4)
    np.testing.assert_array_equal(seqs[row], seqs[row, :1].repeat(NETWORK_DECODES, axis=0))


@pytest.mark.parametrize("scan_layers,share_encoded", [(False, False), (False, True), (True, True)])
def test_real_network_beam_search_scores_match_teacher_forcing(scan_layers, share_encoded):
  teacher_forced, cache, tokens_to_logits, batch, length = network_decoder(
    scan_layers, share_encoded
  )
  fn = functools.partial(
    decoding.beam_search,
    tokens_to_logits=tokens_to_logits,
    eos_id=EOS,
    num_decodes=NETWORK_DECODES,
  )
  seqs, scores = jax.jit(fn)(jnp.zeros((batch, length), jnp.int32), cache)
  token_log_probs, _ = teacher_forced_log_probs(teacher_forced, seqs)
  seqs, scores = np.asarray(seqs), np.asarray(scores)
  for row in range(batch):
    assert np.all(np.diff(scores[row]) <= 0)
    for j in range(NETWORK_DECODES):
      n = real_length(seqs[row, j])
      expected = token_log_probs[row, j, :n].sum() / ((5.0 + n) / 6.0) ** 0.6
      np.testing.assert_allclose(scores[row, j], expected, rtol=1e-4)
