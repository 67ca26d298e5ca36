"""Running a model on numpy batches: decoding options and jitted predict / score.

Shared by `python -m t5x_lite.eval`, `python -m t5x_lite.infer` and the seqio
evaluation inside the training loop:

* `DecodeConfig`: greedy / beam / sampling options (gin: `DecodeConfig.*`).
* `ModelRunner`: predict / score numpy batches with one jitted function each
  (`partitioning.Partitioner.jit`), params sharded by their logical axes, batches
  over the mesh's 'data' axis, outputs replicated (so every host can read them).

Which checkpoint step and which model config are `t5x_lite.checkpoint.checkpoints`' concern;
the mesh (gin: `Partitioner.num_partitions`, `.fsdp`) is the partitioner's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import gin
import jax
import numpy as np

from t5x_lite import base_model
from t5x_lite.training import partitioning
from t5x_lite.core.errors import ConfigError
from t5x_lite.core.types import PyTree

DECODE_FNS = ("greedy", "beam", "sample")
# Model feature names of one unpacked batch (encoder-decoder or decoder-only).
FEATURES = (
  "encoder_input_tokens",
  "decoder_input_tokens",
  "decoder_target_tokens",
  "decoder_loss_weights",
  "decoder_causal_attention",
)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """How predictions are decoded (T5X's `decoder_params` and `num_decodes`).

  Attributes:
    decode_fn: 'greedy', 'beam' or 'sample'.
    num_decodes: beams ('beam') or samples ('sample'); the best one is returned.
    alpha: beam search length-penalty exponent.
    temperature: sampling temperature ('sample').
    topk: sample among the k most likely tokens (0: all).
    topp: nucleus sampling mass (0: off).
    max_decode_len: at most this many tokens (default: the targets length).
    min_decode_len: EOS is blocked before this many tokens.
    seed: sampling seed (batch i uses fold_in(PRNGKey(seed), i)).
  """

  decode_fn: str = "greedy"
  num_decodes: int = 1
  alpha: float = 0.6
  temperature: float = 1.0
  topk: int = 0
  topp: float = 0.0
  max_decode_len: int | None = None
  min_decode_len: int = 0
  seed: int = 0

  def __post_init__(self):
    if self.decode_fn not in DECODE_FNS:
      raise ConfigError(
        f"DecodeConfig.decode_fn must be one of {DECODE_FNS}, got {self.decode_fn!r}."
      )
    if self.num_decodes < 1:
      raise ConfigError(f"DecodeConfig.num_decodes must be >= 1, got {self.num_decodes}.")

  def predict_kwargs(self) -> dict[str, Any]:
    """Keyword arguments of `BaseModel.predict_batch_with_aux`."""
    params: dict[str, Any] = {"min_decode_len": self.min_decode_len}
    if self.max_decode_len:
      params["max_decode_len"] = self.max_decode_len
    if self.decode_fn == "beam":
      params["alpha"] = self.alpha
    elif self.decode_fn == "sample":
      params.update(temperature=self.temperature, topk=self.topk, topp=self.topp)
    num_decodes = 1 if self.decode_fn == "greedy" else self.num_decodes
    return {"decode_fn": self.decode_fn, "num_decodes": num_decodes, "decoder_params": params}


# ------------------------------------------------------------------ running


def bucket(length: int, cap: int, smallest: int = 16) -> int:
  """A shape bucket: the next power of two >= `length` (at least `smallest`), at most `cap`.

  Batches cut or padded to buckets compile a handful of shapes, each once, instead of
  one per length (or every batch padded to the longest length there could be).
  """
  return min(cap, max(smallest, 1 << max(length - 1, 0).bit_length()))


def row_bucket(rows: int, data_size: int, cap: int) -> int:
  """Rows to pad `rows` to: `data_size` times a power of two, at most `cap`."""
  per_device = -(-rows // data_size)
  return min(cap, data_size * (1 << max(per_device - 1, 0).bit_length()))


def pad_rows(batch: Mapping[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
  """Zero-pads every [n, length] feature to [rows, length] (zero rows carry no weight)."""
  padded = {}
  for name, value in batch.items():
    value = np.asarray(value)
    out = np.zeros((rows,) + value.shape[1:], value.dtype)  # [rows, length]
    out[: value.shape[0]] = value
    padded[name] = out
  return padded


class ModelRunner:
  """Jitted, sharded predict and score over numpy batches of up to `batch_size` rows."""

  def __init__(
    self,
    model: base_model.BaseModel,
    partitioner: partitioning.Partitioner,
    param_shardings: PyTree,
    decode: DecodeConfig,
    batch_size: int,
  ):
    """Builds the jitted functions (compiled on first use per feature lengths).

    Args:
      model: the model.
      partitioner: mesh and logical-axis rules; batches are split over 'data'.
      param_shardings: NamedSharding per parameter
        (`Partitioner.abstract_params`, or the training state's).
      decode: decoding options.
      batch_size: global rows per call; a multiple of the mesh's data size.
    """
    if batch_size % partitioner.data_size:
      raise ConfigError(
        f"Batch size {batch_size} is not a multiple of the mesh's data "
        f"axis ({partitioner.data_size} devices)."
      )
    self.model, self.partitioner = model, partitioner
    self.decode, self.batch_size = decode, batch_size
    kwargs = decode.predict_kwargs()

    def predict(params: PyTree, batch: dict[str, jax.Array], rng: jax.Array):
      return model.predict_batch_with_aux(params, batch, rng, **kwargs)

    batch_sharding, replicated = partitioner.batch_sharding, partitioner.replicated
    self._predict = partitioner.jit(
      predict,
      in_shardings=(param_shardings, batch_sharding, replicated),
      out_shardings=replicated,
    )
    self._score = partitioner.jit(
      model.score_batch,
      in_shardings=(param_shardings, batch_sharding),
      out_shardings=replicated,
    )
    self._calls = 0

  def _global(
    self, batch: Mapping[str, np.ndarray], padded_rows: int | None
  ) -> tuple[dict[str, jax.Array], int]:
    """Pads to `padded_rows` (default `batch_size`) and places the batch on the mesh;
    returns the real rows."""
    rows = len(next(iter(batch.values())))
    padded_rows = padded_rows or self.batch_size
    if rows > padded_rows or padded_rows % self.partitioner.data_size:
      raise ValueError(
        f"Got {rows} rows to pad to {padded_rows}, which must be at least that and a "
        f"multiple of the mesh's data axis ({self.partitioner.data_size})."
      )
    padded = pad_rows({k: v for k, v in batch.items() if k in FEATURES}, padded_rows)
    sharding = self.partitioner.batch_sharding
    placed: dict[str, jax.Array] = {
      k: jax.make_array_from_callback(v.shape, sharding, lambda i, v=v: v[i])
      for k, v in padded.items()
    }
    return placed, rows

  def predict(
    self, params: PyTree, batch: Mapping[str, np.ndarray], padded_rows: int | None = None
  ) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [rows, length] int32, 0 after EOS; scores [rows] float32).

    `padded_rows`: the row count the batch is padded to (default `batch_size`;
    `row_bucket` gives few shapes for varying counts).
    """
    placed, rows = self._global(batch, padded_rows)
    rng = jax.random.fold_in(jax.random.PRNGKey(self.decode.seed), self._calls)
    self._calls += 1
    tokens, aux = self._predict(params, placed, rng)
    return np.asarray(tokens)[:rows], np.asarray(aux["scores"])[:rows]

  def score(
    self, params: PyTree, batch: Mapping[str, np.ndarray], padded_rows: int | None = None
  ) -> np.ndarray:
    """[rows] float32 sums of target log-likelihoods (`padded_rows` as in `predict`)."""
    placed, rows = self._global(batch, padded_rows)
    return np.asarray(self._score(params, placed))[:rows]
