"""Running a restored model on batches: decoding options, checkpoints, jitted predict/score.

Shared by `python -m t5x_lite.eval`, `python -m t5x_lite.infer` and the
evaluation inside the training loop:

* `DecodeConfig`: greedy / beam / sampling options (gin: `DecodeConfig.*`).
* `mesh_and_rules`: the device mesh (gin: `mesh_and_rules.num_partitions`, `.fsdp`).
* `checkpoint_steps`: a checkpoint step directory or a checkpoint root
  (MODEL_DIR) -> its (step, absolute directory) pairs; `step_number` of one.
* `network_config`: the T5Config stored with a checkpoint (training writes it to
  `train_meta`, the HF converter to `config`), with every `T5Config.*` gin
  binding taking precedence, so `--gin_file=models/...` still overrides it.
* `abstract_params`: the restore target of `checkpoints.restore_params`, so params
  are restored straight into their mesh shardings.
* `ModelRunner`: predict / score numpy batches with one jitted function each,
  params sharded by their logical axes, batches over the mesh's 'data' axis,
  outputs replicated (so every host can read them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import gin
import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.sharding import NamedSharding, PartitionSpec

from t5x_lite import checkpoints, models, network, partitioning
from t5x_lite.checkpoint_manifest import absolute_path
from t5x_lite.errors import ConfigError

PyTree = Any
DECODE_FNS = ("greedy", "beam", "sample")
# Model feature names of one unpacked encoder-decoder batch.
FEATURES = (
  "encoder_input_tokens",
  "decoder_input_tokens",
  "decoder_target_tokens",
  "decoder_loss_weights",
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
    """Keyword arguments of `EncoderDecoderModel.predict_batch_with_aux`."""
    params: dict[str, Any] = {"min_decode_len": self.min_decode_len}
    if self.max_decode_len:
      params["max_decode_len"] = self.max_decode_len
    if self.decode_fn == "beam":
      params["alpha"] = self.alpha
    elif self.decode_fn == "sample":
      params.update(temperature=self.temperature, topk=self.topk, topp=self.topp)
    num_decodes = 1 if self.decode_fn == "greedy" else self.num_decodes
    return {"decode_fn": self.decode_fn, "num_decodes": num_decodes, "decoder_params": params}


@gin.configurable
def mesh_and_rules(
  num_partitions: int = 1, fsdp: bool = False
) -> tuple[jax.sharding.Mesh, partitioning.LogicalRules]:
  """The mesh and logical-axis rules of eval / infer (gin: `mesh_and_rules.*`).

  Args:
    num_partitions: model-parallel size; the data axis takes the other devices.
    fsdp: also shard parameters' embed axis over 'data'.
  """
  return (
    partitioning.create_mesh(num_partitions=num_partitions),
    partitioning.standard_logical_axis_rules(fsdp=fsdp),
  )


# ------------------------------------------------------------------ checkpoints


def checkpoint_steps(path: epath.PathLike) -> list[tuple[int, epath.Path]]:
  """(step, step directory) pairs of a checkpoint root or one step directory, ascending.

  A step directory is one holding `params/` (`step_number` gives its step).
  Relative paths are relative to the working directory; the directories
  returned are absolute.

  Raises:
    CheckpointNotFoundError: naming `path` when it does not exist or holds no checkpoint.
  """
  root = absolute_path(path)
  if checkpoints.is_step_dir(root):
    return [(step_number(root), root)]
  return [(step, root / str(step)) for step in checkpoints.root_steps(path)]


def step_number(step_dir: epath.Path) -> int:
  """The step of a step directory: its name when that is a number, else the step
  recorded in its `train_meta`, else 0."""
  if step_dir.name.isdigit():
    return int(step_dir.name)
  meta = _json_item(step_dir, checkpoints.TRAIN_META) or {}
  return int(meta.get("step", 0))


def _json_item(step_dir: epath.Path, item: str) -> dict[str, Any] | None:
  """A JsonSave item of a step directory, or None when absent."""
  if not (step_dir / item).is_dir():
    return None
  with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as checkpointer:
    return dict(checkpointer.restore(step_dir / item))


def network_config(step_dir: epath.Path) -> network.T5Config:
  """The checkpoint's T5Config, overridden field by field by `T5Config.*` gin bindings.

  Raises:
    ConfigError: when neither the checkpoint nor gin defines every field.
  """
  meta = _json_item(step_dir, checkpoints.TRAIN_META) or {}
  stored = meta.get("model_config") or _json_item(step_dir, checkpoints.CONFIG) or {}
  bound = gin.get_bindings(network.T5Config)
  fields = {k: tuple(v) if isinstance(v, list) else v for k, v in stored.items() if k not in bound}
  try:
    config = network.T5Config(**fields)  # gin supplies the bound fields
  except TypeError as e:
    raise ConfigError(
      f"{step_dir} stores no complete model config ({e}); pass the model's gin file, "
      "e.g. --gin_file=models/t5_1_1/small.gin."
    ) from e
  logging.info(
    "Model config (checkpoint %s, gin overrides %s): %s", step_dir, sorted(bound), config
  )
  return config


def abstract_params(
  model: models.EncoderDecoderModel, mesh: jax.sharding.Mesh, rules: partitioning.LogicalRules
) -> tuple[PyTree, PyTree]:
  """(plain abstract params carrying their shardings, the shardings), nothing allocated."""
  shapes = {"encoder_input_tokens": (1, 1), "decoder_input_tokens": (1, 1)}

  def init(key: jax.Array) -> PyTree:
    return model.get_initial_variables(key, shapes)["params"]

  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    boxed = jax.eval_shape(init, jax.random.PRNGKey(0))
  shardings = partitioning.logical_shardings(boxed, mesh, rules)
  abstract = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), nn.meta.unbox(boxed), shardings
  )
  return abstract, shardings


# ------------------------------------------------------------------ running


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
    model: models.EncoderDecoderModel,
    mesh: jax.sharding.Mesh,
    rules: partitioning.LogicalRules,
    param_shardings: PyTree,
    decode: DecodeConfig,
    batch_size: int,
  ):
    """Builds the jitted functions (compiled on first use per feature lengths).

    Args:
      model: the model.
      mesh: device mesh; batches are split over its 'data' axis.
      rules: logical-axis rules.
      param_shardings: NamedSharding per parameter (`abstract_params`, or the
        training state's).
      decode: decoding options.
      batch_size: global rows per call; a multiple of the mesh's data size.
    """
    data_size = mesh.shape["data"]
    if batch_size % data_size:
      raise ConfigError(
        f"Batch size {batch_size} is not a multiple of the mesh's data axis ({data_size} devices)."
      )
    self.model, self.mesh, self.rules = model, mesh, rules
    self.decode, self.batch_size = decode, batch_size
    self._batch_sharding = partitioning.batch_sharding(mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    kwargs = decode.predict_kwargs()

    def predict(params: PyTree, batch: dict[str, jax.Array], rng: jax.Array):
      return model.predict_batch_with_aux(params, batch, rng, **kwargs)

    self._predict = jax.jit(
      predict,
      in_shardings=(param_shardings, self._batch_sharding, replicated),
      out_shardings=replicated,
    )
    self._score = jax.jit(
      model.score_batch,
      in_shardings=(param_shardings, self._batch_sharding),
      out_shardings=replicated,
    )
    self._calls = 0

  def _global(self, batch: Mapping[str, np.ndarray]) -> tuple[dict[str, jax.Array], int]:
    """Pads to `batch_size` rows and places the batch on the mesh; returns real rows."""
    rows = len(next(iter(batch.values())))
    if rows > self.batch_size:
      raise ValueError(f"Got {rows} rows, more than batch_size {self.batch_size}.")
    padded = pad_rows({k: v for k, v in batch.items() if k in FEATURES}, self.batch_size)
    placed = {
      k: jax.make_array_from_callback(v.shape, self._batch_sharding, lambda i, v=v: v[i])
      for k, v in padded.items()
    }
    return placed, rows

  def predict(
    self, params: PyTree, batch: Mapping[str, np.ndarray]
  ) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [rows, length] int32, 0 after EOS; scores [rows] float32)."""
    placed, rows = self._global(batch)
    rng = jax.random.fold_in(jax.random.PRNGKey(self.decode.seed), self._calls)
    self._calls += 1
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      tokens, aux = self._predict(params, placed, rng)
    return np.asarray(tokens)[:rows], np.asarray(aux["scores"])[:rows]

  def score(self, params: PyTree, batch: Mapping[str, np.ndarray]) -> np.ndarray:
    """[rows] float32 sums of target log-likelihoods."""
    placed, rows = self._global(batch)
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      scores = self._score(params, placed)
    return np.asarray(scores)[:rows]
