"""Autoregressive decoding with a key/value cache: sampling, greedy and beam search.

Everything here is pure and jit-compilable: a decode is one `lax.while_loop` whose
body calls `tokens_to_logits` on one token per sequence, so the model's cache makes a
step cost O(length). All arrays keep batch as their leading axis, so a batch sharded
over the mesh's 'data' axis stays sharded through the loop.

Conventions shared by `temperature_sample` and `beam_search`:
  * `tokens_to_logits(ids [batch, 1] int32, cache) -> (logits [batch, vocab], cache)`.
  * `decoder_prompt` is [batch, length]; position 0 is the BOS token (0) fed first.
    A non-zero `decoder_prompt[:, i + 1]` forces output token i (a prompt prefix);
    forced tokens add nothing to the scores, and a forced EOS (a decoder-only model's
    prompt may hold one) does not end the sequence. An all-zero prompt decodes freely.
    `initial_step` s > 0 starts the loop at output position s, taking positions < s
    from the prompt (they must all be forced, and the cache must hold their keys and
    values: a prefilled prompt, see `models.DecoderOnlyModel`).
  * The cache comes ALREADY expanded to `batch * num_decodes` rows (each batch row
    repeated consecutively, see `expand_to_beams`). Every cache leaf has that batch
    axis leading, except 0-d leaves (`cache_index`), which are passed through, and
    leaves with `batch` rows, one shared by all of a row's decodes (an
    encoder-decoder's cross-attention keys and values, which the steps only read).
  * Outputs are [batch, num_decodes, length] without the BOS, best-scoring first;
    after EOS a sequence is padded with 0. Output token i can only be EOS when
    i >= min_decode_len, and at most `max_decode_len` (default: length) tokens are
    produced; positions past it are 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from t5x_lite.core.types import PyTree
from t5x_lite.kernels import reference
from t5x_lite.kernels.base import ArgmaxFn

TokensToLogits = Callable[[jax.Array, PyTree], tuple[jax.Array, PyTree]]

# Large finite stand-in for -inf: keeps beam arithmetic free of inf - inf = nan.
NEG_INF = -1.0e7


# ------------------------------------------------------------------ beam helpers


def flat_batch_beam_expand(x: jax.Array, beam_size: int) -> jax.Array:
  """Repeats each batch row `beam_size` times consecutively.

  Args:
    x: [batch, ...] array.
    beam_size: copies of each row.

  Returns:
    [batch * beam_size, ...]: rows ordered (b0, b0, ..., b1, b1, ...).
  """
  # [batch, beams, ...]
  expanded = jnp.broadcast_to(x[:, None], (x.shape[0], beam_size) + x.shape[1:])
  return flatten_beam_dim(expanded)  # [batch * beams, ...]


def expand_to_beams(tree: PyTree, beam_size: int) -> PyTree:
  """`flat_batch_beam_expand` on every leaf of a tree; 0-d leaves are kept.

  Use it for encoder outputs, encoder tokens and an initialised decoder cache.

  Args:
    tree: leaves [batch, ...] (or 0-d, e.g. a cache's `cache_index`).
    beam_size: copies of each row.

  Returns:
    The tree with leaves [batch * beam_size, ...].
  """
  return jax.tree.map(
    lambda x: x if jnp.ndim(x) == 0 else flat_batch_beam_expand(x, beam_size), tree
  )


def unflatten_beam_dim(x: jax.Array, batch_size: int, beam_size: int) -> jax.Array:
  """[batch * beams, ...] -> [batch, beams, ...]."""
  return x.reshape((batch_size, beam_size) + x.shape[1:])  # [batch, beams, ...]


def flatten_beam_dim(x: jax.Array) -> jax.Array:
  """[batch, beams, ...] -> [batch * beams, ...]."""
  return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])  # [batch * beams, ...]


def gather_beams(tree: PyTree, beam_indices: jax.Array) -> PyTree:
  """Selects beams per batch row.

  Args:
    tree: leaves [batch, old_beams, ...].
    beam_indices: [batch, new_beams] int, indices into old_beams.

  Returns:
    The tree with leaves [batch, new_beams, ...]: out[b, j] = x[b, beam_indices[b, j]].
  """
  return jax.tree.map(lambda x: jax.vmap(lambda row, idx: row[idx])(x, beam_indices), tree)


def gather_cache_beams(cache: PyTree, beam_indices: jax.Array, beam_size: int) -> PyTree:
  """Reorders a flat [batch * beams, ...] cache along its beams; 0-d leaves are kept.

  Args:
    cache: leaves [batch * beam_size, ...] or 0-d.
    beam_indices: [batch, beam_size] int, source beam of each new beam.
    beam_size: beams per batch row.

  Returns:
    The cache with the same shapes, rows taken from the selected source beams.
  """
  batch_size = beam_indices.shape[0]

  def gather(x: jax.Array) -> jax.Array:
    if x.ndim == 0:
      return x
    beams = unflatten_beam_dim(x, batch_size, beam_size)  # [batch, beams, ...]
    return flatten_beam_dim(gather_beams(beams, beam_indices))  # [batch * beams, ...]

  return jax.tree.map(gather, cache)


def gather_rewritten_cache_beams(
  new_cache: PyTree, old_cache: PyTree, beam_indices: jax.Array, beam_size: int
) -> PyTree:
  """`gather_cache_beams` on the leaves a step rewrote; the others are kept as they are.

  A leaf that `tokens_to_logits` returned unchanged (the very same array, e.g. the
  cross-attention keys/values cached from the encoder output) holds the same values
  for every beam of a batch row (repeated by `expand_to_beams`, or one shared row),
  so reordering its beams would copy it onto itself. Skipping it saves copying the
  largest part of an encoder-decoder cache at every step. A leaf with one row per
  batch row (shared by the row's beams) is kept as returned: reordering a row's beams
  does not change it.

  Args:
    new_cache: the cache returned by the step, leaves [batch * beam_size, ...], [batch,
      ...] (shared) or 0-d.
    old_cache: the cache the step was given (same structure).
    beam_indices: [batch, beam_size] int, source beam of each new beam.
    beam_size: beams per batch row.

  Returns:
    new_cache with its rewritten leaves' rows taken from the selected source beams.
  """
  batch_size = beam_indices.shape[0]

  def gather(new: jax.Array, old: jax.Array) -> jax.Array:
    if new is old or (new.ndim and new.shape[0] == batch_size and beam_size > 1):
      return new
    return gather_cache_beams(new, beam_indices, beam_size)

  return jax.tree.map(gather, new_cache, old_cache)


def length_penalty(length: jax.Array | int, alpha: float) -> jax.Array:
  """T5X/GNMT length penalty ((5 + length) / 6) ** alpha; scores are log-prob / this."""
  return jnp.power((5.0 + jnp.asarray(length, jnp.float32)) / 6.0, alpha)


# ---------------------------------------------------------------- shared checks


def _resolve_lengths(length: int, min_decode_len: int, max_decode_len: int | None) -> int:
  """Validates the length arguments and returns the effective max_decode_len."""
  max_decode_len = length if max_decode_len is None else max_decode_len
  if not 0 < max_decode_len <= length:
    raise ValueError(f"max_decode_len={max_decode_len} must be in [1, {length}].")
  if not 0 <= min_decode_len <= max_decode_len:
    raise ValueError(f"min_decode_len={min_decode_len} must be in [0, {max_decode_len}].")
  return max_decode_len


def _check_cache(cache: PyTree, batch_size: int, num_decodes: int) -> None:
  """Raises if a non-scalar cache leaf has neither batch * num_decodes nor batch rows."""
  rows = batch_size * num_decodes
  for path, leaf in jax.tree_util.tree_leaves_with_path(cache):
    if jnp.ndim(leaf) and leaf.shape[0] not in (rows, batch_size):
      raise ValueError(
        f"cache leaf {jax.tree_util.keystr(path)} has shape {leaf.shape}; expected a "
        f"leading batch * num_decodes = {rows} axis (use expand_to_beams), or "
        f"batch = {batch_size} for a leaf shared by each row's decodes."
      )


def _prompt_buffer(decoder_prompt: jax.Array) -> jax.Array:
  """[batch, length] -> [batch, length + 1] int32 with a trailing 0 column.

  Column i + 1 holds the token forced at output position i (0 = free); the extra
  column makes that lookup valid for the last output position too.
  """
  return jnp.pad(decoder_prompt.astype(jnp.int32), ((0, 0), (0, 1)))


def _eos_blocked(vocab_size: int, step: jax.Array, eos_id: int, min_decode_len: int) -> jax.Array:
  """[vocab] bool: True at EOS while step < min_decode_len (EOS not allowed yet)."""
  return (jnp.arange(vocab_size) == eos_id) & (step < min_decode_len)


# --------------------------------------------------------------------- sampling


def _topk_mask(logits: jax.Array, topk: int) -> jax.Array:
  """Keeps the topk largest logits of [rows, vocab] (ties at the k-th all kept)."""
  if topk >= logits.shape[-1]:
    return logits
  kth = lax.top_k(logits, topk)[0][:, -1:]  # [rows, 1]
  return jnp.where(logits < kth, NEG_INF, logits)


def _topp_mask(logits: jax.Array, topp: float) -> jax.Array:
  """Nucleus filter on [rows, vocab]: keeps the most likely tokens up to mass topp (>= 1)."""
  sorted_logits = -jnp.sort(-logits, axis=-1)  # [rows, vocab], descending
  probs = jax.nn.softmax(sorted_logits, axis=-1)  # [rows, vocab]
  mass_before = jnp.cumsum(probs, axis=-1) - probs  # [rows, vocab]; 0 at index 0
  num_kept = jnp.sum(mass_before < topp, axis=-1, keepdims=True)  # [rows, 1], >= 1
  threshold = jnp.take_along_axis(sorted_logits, num_kept - 1, axis=-1)  # [rows, 1]
  return jnp.where(logits < threshold, NEG_INF, logits)


def _choose_tokens(
  logits: jax.Array,
  rng: jax.Array | None,
  blocked: jax.Array,
  *,
  temperature: float,
  topk: int,
  topp: float,
  rescale_log_probs: bool,
  argmax: ArgmaxFn,
) -> tuple[jax.Array, jax.Array]:
  """Picks one token per row of logits [rows, vocab], never a `blocked` [vocab] one.

  Returns:
    (tokens [rows] int32, log-probs [rows] of those tokens). Greedy (temperature 0)
    scores under the model's log_softmax(logits); sampling under the distribution
    sampled from (temperature, blocking, top-k, top-p applied) if rescale_log_probs,
    else under the model's.
  """
  model_log_probs = jax.nn.log_softmax(logits)  # [rows, vocab]
  if temperature == 0.0:
    tokens = argmax(jnp.where(blocked, NEG_INF, logits))  # [rows]
    log_probs = model_log_probs
  else:
    scaled = jnp.where(blocked, NEG_INF, logits / temperature)  # [rows, vocab]
    if topk:
      scaled = _topk_mask(scaled, topk)
    if 0.0 < topp < 1.0:
      scaled = _topp_mask(scaled, topp)
    if rng is None:
      raise ValueError('sampling (temperature > 0) needs a PRNG key')
    tokens = jax.random.categorical(rng, scaled, axis=-1)  # [rows]
    log_probs = jax.nn.log_softmax(scaled) if rescale_log_probs else model_log_probs
  tokens = tokens.astype(jnp.int32)
  chosen = jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]  # [rows]
  return tokens, chosen


class _SampleState(NamedTuple):
  """Loop carry of `temperature_sample` (rows = batch * num_decodes)."""

  step: jax.Array  # [] int32: output tokens produced so far
  sequences: jax.Array  # [rows, length + 1] int32, column 0 is the BOS
  finished: jax.Array  # [rows] bool: EOS already produced
  scores: jax.Array  # [rows] float32: summed log-probs
  cache: PyTree  # leaves [rows, ...] or 0-d


def temperature_sample(
  decoder_prompt: jax.Array,
  cache: PyTree,
  tokens_to_logits: TokensToLogits,
  eos_id: int,
  decode_rng: jax.Array | None,
  *,
  num_decodes: int = 1,
  temperature: float = 1.0,
  topk: int = 0,
  topp: float = 0.0,
  min_decode_len: int = 0,
  max_decode_len: int | None = None,
  rescale_log_probs: bool = True,
  initial_step: int | jax.Array = 0,
  argmax: ArgmaxFn = reference.argmax,
) -> tuple[jax.Array, jax.Array]:
  """Samples `num_decodes` continuations per batch row (greedy at temperature 0).

  Stops early once every sequence has produced EOS. See the module docstring for the
  prompt, cache and output conventions.

  Args:
    decoder_prompt: [batch, length] int; column 0 is BOS (0), the rest 0 or forced tokens.
    cache: decoder cache, leaves [batch * num_decodes, ...] or 0-d.
    tokens_to_logits: one decoding step, see the module docstring.
    eos_id: end-of-sequence token id.
    decode_rng: PRNG key; unused (may be None) when temperature == 0.
    num_decodes: samples per batch row.
    temperature: Python float >= 0; 0 means greedy (argmax).
    topk: if > 0, sample only among the topk most likely tokens.
    topp: if in (0, 1), sample only from the nucleus of mass topp (>= 1 token kept).
    min_decode_len: EOS is masked out for output positions < min_decode_len.
    max_decode_len: at most this many tokens are produced (default: length).
    rescale_log_probs: score sampled tokens under the modified distribution actually
      sampled from (True, as T5X) or under the model's unmodified softmax (False).
      Greedy always scores under the unmodified softmax.
    initial_step: 0-d int, the first output position decoded (see the module docstring).
    argmax: greedy's argmax over the vocabulary: the network's kernels' (`Kernels.argmax`).

  Returns:
    (sequences [batch, num_decodes, length] int32, scores [batch, num_decodes]
    float32: summed log-probs of the produced tokens, EOS included), best first.
  """
  if temperature < 0 or topk < 0 or not 0.0 <= topp <= 1.0:
    raise ValueError(f"Bad sampling parameters {temperature=}, {topk=}, {topp=}.")
  if temperature > 0 and decode_rng is None:
    raise ValueError("decode_rng is required when temperature > 0.")
  batch_size, length = decoder_prompt.shape
  max_decode_len = _resolve_lengths(length, min_decode_len, max_decode_len)
  _check_cache(cache, batch_size, num_decodes)
  # [rows, length + 1]
  prompt = flat_batch_beam_expand(_prompt_buffer(decoder_prompt), num_decodes)

  def body(state: _SampleState) -> _SampleState:
    ids = lax.dynamic_slice_in_dim(state.sequences, state.step, 1, axis=1)  # [rows, 1]
    logits, cache = tokens_to_logits(ids, state.cache)  # [rows, vocab]
    blocked = _eos_blocked(logits.shape[-1], state.step, eos_id, min_decode_len)  # [vocab]
    rng = None if decode_rng is None else jax.random.fold_in(decode_rng, state.step)
    tokens, log_probs = _choose_tokens(
      logits.astype(jnp.float32),
      rng,
      blocked,
      temperature=temperature,
      topk=topk,
      topp=topp,
      rescale_log_probs=rescale_log_probs,
      argmax=argmax,
    )  # [rows], [rows]
    forced = lax.dynamic_index_in_dim(prompt, state.step + 1, axis=1, keepdims=False)  # [rows]
    tokens = jnp.where(forced != 0, forced, tokens)
    log_probs = jnp.where(forced != 0, 0.0, log_probs)
    tokens = jnp.where(state.finished, 0, tokens)
    log_probs = jnp.where(state.finished, 0.0, log_probs)
    sequences = lax.dynamic_update_slice_in_dim(
      state.sequences, tokens[:, None], state.step + 1, axis=1
    )  # [rows, length + 1]
    return _SampleState(
      step=state.step + 1,
      sequences=sequences,
      finished=state.finished | ((tokens == eos_id) & (forced == 0)),
      scores=state.scores + log_probs,
      cache=cache,
    )

  def cond(state: _SampleState) -> jax.Array:
    return (state.step < max_decode_len) & ~jnp.all(state.finished)

  step = jnp.asarray(initial_step, jnp.int32)
  init = _SampleState(
    step=step,
    # Built from `prompt` so that they inherit its (batch) sharding.
    sequences=jnp.where(jnp.arange(length + 1) <= step, prompt, 0),  # [rows, length + 1]
    finished=jnp.zeros_like(prompt[:, 0], jnp.bool_),  # [rows]
    scores=jnp.zeros_like(prompt[:, 0], jnp.float32),  # [rows]
    cache=cache,
  )
  final = lax.while_loop(cond, body, init)
  # [batch, decodes, length]
  sequences = final.sequences[:, 1:].reshape(batch_size, num_decodes, length)
  scores = final.scores.reshape(batch_size, num_decodes)  # [batch, decodes]
  order = jnp.argsort(-scores, axis=1, stable=True)  # [batch, decodes]
  return gather_beams(sequences, order), jnp.take_along_axis(scores, order, axis=1)


def greedy_decode(
  decoder_prompt: jax.Array,
  cache: PyTree,
  tokens_to_logits: TokensToLogits,
  eos_id: int,
  *,
  num_decodes: int = 1,
  min_decode_len: int = 0,
  max_decode_len: int | None = None,
  argmax: ArgmaxFn = reference.argmax,
) -> tuple[jax.Array, jax.Array]:
  """Greedy decoding: `temperature_sample` at temperature 0 (same args and outputs)."""
  return temperature_sample(
    decoder_prompt,
    cache,
    tokens_to_logits,
    eos_id,
    None,
    num_decodes=num_decodes,
    temperature=0.0,
    min_decode_len=min_decode_len,
    max_decode_len=max_decode_len,
    argmax=argmax,
  )


# ------------------------------------------------------------------ beam search


class _BeamState(NamedTuple):
  """Loop carry of `beam_search`. Live beams are kept sorted, best first."""

  step: jax.Array  # [] int32: output tokens produced so far
  live_seqs: jax.Array  # [batch, beams, length + 1] int32, column 0 is the BOS
  live_logprobs: jax.Array  # [batch, beams] float32
  finished_seqs: jax.Array  # [batch, beams, length + 1] int32
  finished_scores: jax.Array  # [batch, beams] float32, length-penalised
  finished_flags: jax.Array  # [batch, beams] bool: slot holds a real sequence
  cache: PyTree  # leaves [batch * beams, ...] or 0-d


def _beam_init(
  prompt: jax.Array, cache: PyTree, beam_size: int, initial_step: int | jax.Array = 0
) -> _BeamState:
  """Initial state: one live beam per row (the others at NEG_INF), nothing finished.

  Everything is built from `prompt` [batch, length + 1] so that it inherits its
  (batch) sharding.
  """
  width = prompt.shape[1]
  step = jnp.asarray(initial_step, jnp.int32)
  bos = jnp.where(jnp.arange(width) <= step, prompt, 0)  # [batch, length + 1]
  # [batch, beams, length + 1]
  seqs = jnp.broadcast_to(bos[:, None, :], (bos.shape[0], beam_size, width))
  zeros = jnp.zeros_like(seqs[:, :, 0], jnp.float32)  # [batch, beams]
  return _BeamState(
    step=step,
    live_seqs=seqs,
    live_logprobs=jnp.where(jnp.arange(beam_size) == 0, zeros, NEG_INF),  # [batch, beams]
    finished_seqs=seqs,
    finished_scores=zeros + NEG_INF,  # [batch, beams]
    finished_flags=zeros > 0,  # [batch, beams], all False
    cache=cache,
  )


def _beam_step_log_probs(
  state: _BeamState,
  prompt: jax.Array,
  tokens_to_logits: TokensToLogits,
  eos_id: int,
  min_decode_len: int,
) -> tuple[jax.Array, PyTree]:
  """Runs the model on every live beam's last token.

  Returns:
    (log-probs [batch, beams, vocab] with EOS masked before min_decode_len and prompt
    tokens forced (log-prob 0, others NEG_INF), the model's new flat cache).
  """
  batch_size, beam_size = state.live_logprobs.shape
  ids = lax.dynamic_slice_in_dim(state.live_seqs, state.step, 1, axis=2)  # [batch, beams, 1]
  logits, cache = tokens_to_logits(flatten_beam_dim(ids), state.cache)  # [batch * beams, vocab]
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))  # [batch * beams, vocab]
  log_probs = unflatten_beam_dim(log_probs, batch_size, beam_size)  # [batch, beams, vocab]
  blocked = _eos_blocked(log_probs.shape[-1], state.step, eos_id, min_decode_len)  # [vocab]
  log_probs = jnp.where(blocked, NEG_INF, log_probs)
  forced = lax.dynamic_index_in_dim(prompt, state.step + 1, axis=1)  # [batch, 1]
  forced_log_probs = jnp.where(
    jnp.arange(log_probs.shape[-1]) == forced[:, :, None], 0.0, NEG_INF
  )  # [batch, 1, vocab]
  log_probs = jnp.where(forced[:, :, None] != 0, forced_log_probs, log_probs)
  return log_probs, cache


def _update_finished(
  state: _BeamState,
  seqs: jax.Array,
  logprobs: jax.Array,
  newly_finished: jax.Array,
  alpha: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Merges newly finished candidates into the finished set, keeping the best.

  Args:
    state: current state (its finished set and step).
    seqs: [batch, 2 * beams, length + 1] candidate sequences.
    logprobs: [batch, 2 * beams] candidate log-probs.
    newly_finished: [batch, 2 * beams] bool, candidates that end here.
    alpha: length penalty exponent.

  Returns:
    (finished_seqs, finished_scores, finished_flags), [batch, beams, ...], best first.
  """
  beam_size = state.finished_scores.shape[1]
  scores = logprobs / length_penalty(state.step + 1, alpha)  # [batch, 2 * beams]
  scores = jnp.where(newly_finished, scores, NEG_INF)
  # [batch, 3 * beams, length + 1]
  all_seqs = jnp.concatenate([state.finished_seqs, seqs], axis=1)
  all_scores = jnp.concatenate([state.finished_scores, scores], axis=1)  # [batch, 3*beams]
  all_flags = jnp.concatenate([state.finished_flags, newly_finished], axis=1)  # [batch, 3*beams]
  top_scores, top = lax.top_k(all_scores, beam_size)  # [batch, beams]
  return gather_beams(all_seqs, top), top_scores, gather_beams(all_flags, top)


def _beam_step(
  state: _BeamState,
  prompt: jax.Array,
  tokens_to_logits: TokensToLogits,
  eos_id: int,
  alpha: float,
  min_decode_len: int,
  max_decode_len: int,
) -> _BeamState:
  """Extends every live beam by one token and updates the live and finished sets."""
  batch_size, beam_size = state.live_logprobs.shape
  log_probs, cache = _beam_step_log_probs(state, prompt, tokens_to_logits, eos_id, min_decode_len)
  vocab_size = log_probs.shape[-1]
  candidates = state.live_logprobs[:, :, None] + log_probs  # [batch, beams, vocab]
  candidates = candidates.reshape(batch_size, beam_size * vocab_size)  # [batch, beams * vocab]
  # 2 * beams candidates hold at most `beams` EOS ones (one per source beam), so at
  # least `beams` of them can stay live.
  top_logprobs, top = lax.top_k(candidates, 2 * beam_size)  # [batch, 2 * beams]
  top_beams = top // vocab_size  # [batch, 2 * beams]
  top_tokens = top % vocab_size  # [batch, 2 * beams]
  top_seqs = gather_beams(state.live_seqs, top_beams)  # [batch, 2 * beams, length + 1]
  top_seqs = lax.dynamic_update_slice_in_dim(
    top_seqs, top_tokens[:, :, None], state.step + 1, axis=2
  )  # [batch, 2 * beams, length + 1]
  forced = lax.dynamic_index_in_dim(prompt, state.step + 1, axis=1)  # [batch, 1]
  # [batch, 2 * beams]: a forced EOS is part of the prompt, not an end
  is_eos = (top_tokens == eos_id) & (forced == 0)
  # A candidate built on a dead beam or a masked token is not a real sequence.
  real = top_logprobs > NEG_INF / 2  # [batch, 2 * beams]
  # At the last step every candidate ends (truncated at max_decode_len).
  ends = real & (is_eos | (state.step + 1 == max_decode_len))  # [batch, 2 * beams]
  finished = _update_finished(state, top_seqs, top_logprobs, ends, alpha)

  # [batch, beams]: the best non-EOS candidates stay live.
  live_logprobs, live = lax.top_k(jnp.where(is_eos, NEG_INF, top_logprobs), beam_size)
  source_beams = jnp.take_along_axis(top_beams, live, axis=1)  # [batch, beams]
  return _BeamState(
    step=state.step + 1,
    live_seqs=gather_beams(top_seqs, live),  # [batch, beams, length + 1]
    live_logprobs=live_logprobs,
    finished_seqs=finished[0],
    finished_scores=finished[1],
    finished_flags=finished[2],
    cache=gather_rewritten_cache_beams(cache, state.cache, source_beams, beam_size),
  )


def _beam_search_done(state: _BeamState, alpha: float, max_decode_len: int) -> jax.Array:
  """True when no live beam can still beat any row's worst finished sequence.

  A live beam's log-prob only falls as it grows, so its best possible final score is
  logprob / max(penalty) over the lengths it may still reach (log-probs are <= 0).
  """
  best_penalty = jnp.maximum(
    length_penalty(state.step + 1, alpha), length_penalty(max_decode_len, alpha)
  )
  best_live = jnp.max(state.live_logprobs, axis=1) / best_penalty  # [batch]
  worst_finished = jnp.min(state.finished_scores, axis=1)  # [batch]
  full = jnp.all(state.finished_flags, axis=1)  # [batch]
  return jnp.all(full & (worst_finished >= best_live))


def beam_search(
  decoder_prompt: jax.Array,
  cache: PyTree,
  tokens_to_logits: TokensToLogits,
  eos_id: int,
  *,
  num_decodes: int = 4,
  alpha: float = 0.6,
  min_decode_len: int = 0,
  max_decode_len: int | None = None,
  initial_step: int | jax.Array = 0,
) -> tuple[jax.Array, jax.Array]:
  """Beam search with T5X's length penalty and a separate set of finished beams.

  Each step extends the `num_decodes` live beams, takes the top 2 * num_decodes
  candidates by log-prob, moves those ending in EOS (and, at max_decode_len, all of
  them) into the finished set scored log-prob / ((5 + length) / 6) ** alpha (length
  counts EOS), and keeps the best non-EOS candidates live. The loop stops early once
  no live beam can beat any row's worst finished one. See the module docstring for
  the prompt, cache and output conventions.

  Args:
    decoder_prompt: [batch, length] int; column 0 is BOS (0), the rest 0 or forced tokens.
    cache: decoder cache, leaves [batch * num_decodes, ...] or 0-d.
    tokens_to_logits: one decoding step, see the module docstring.
    eos_id: end-of-sequence token id.
    num_decodes: beam size, also the number of sequences returned per row.
    alpha: length-penalty exponent (0 = plain log-prob).
    min_decode_len: EOS is masked out for output positions < min_decode_len.
    max_decode_len: at most this many tokens are produced (default: length).
    initial_step: 0-d int, the first output position decoded (see the module docstring).

  Returns:
    (sequences [batch, num_decodes, length] int32, scores [batch, num_decodes]
    float32), best first. Scores are the model's log-probs (EOS masking does not
    renormalise; forced prompt tokens add 0) divided by the length penalty. A slot
    with no real sequence (only possible when vocab * steps is tiny) scores <= NEG_INF / 2.
  """
  batch_size, length = decoder_prompt.shape
  max_decode_len = _resolve_lengths(length, min_decode_len, max_decode_len)
  _check_cache(cache, batch_size, num_decodes)
  prompt = _prompt_buffer(decoder_prompt)  # [batch, length + 1]

  def body(state: _BeamState) -> _BeamState:
    return _beam_step(
      state, prompt, tokens_to_logits, eos_id, alpha, min_decode_len, max_decode_len
    )

  def cond(state: _BeamState) -> jax.Array:
    return (state.step < max_decode_len) & ~_beam_search_done(state, alpha, max_decode_len)

  final = lax.while_loop(cond, body, _beam_init(prompt, cache, num_decodes, initial_step))
  return final.finished_seqs[:, :, 1:], final.finished_scores
