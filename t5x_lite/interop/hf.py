"""Conversion between Hugging Face transformers T5 checkpoints and t5x_lite params.

`load_hf` reads a `T5ForConditionalGeneration` directory (config.json plus
model.safetensors or a sharded model.safetensors.index.json) into a `T5Config` and
a plain (unboxed) parameter tree with the names fixed by the network. `save_hf`
writes the inverse, a directory that `T5ForConditionalGeneration.from_pretrained`
loads. Both directions are exact: tensors are only transposed and reshaped, never
rescaled (HF's query kernel, like T5X's, has the 1/sqrt(head_dim) factor folded in).

Only safetensors are read; PyTorch pickles (`pytorch_model.bin`) are refused, since
unpickling can run arbitrary code. Unusable inputs raise `CheckpointError`s naming
the file or tensor: missing files `CheckpointNotFoundError`, unreadable ones
`CorruptCheckpointError`, configs or tensors that cannot be converted exactly
`HFCheckpointError`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

import flax
import jax
import numpy as np

from t5x_lite.core import errors
from t5x_lite.nn import shared_encoder_decoder
from t5x_lite.core.errors import (
  CheckpointError,
  CheckpointNotFoundError,
  ConfigError,
  CorruptCheckpointError,
)
from t5x_lite.nn.network import T5Config

CONFIG_NAME = "config.json"
SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
_PICKLE_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json")

# HF `feed_forward_proj` <-> t5x_lite `mlp_activations`. HF's "gated-gelu" is the
# tanh approximation ("gelu_new"), which is what T5X's 'gelu' computes.
_FF_PROJ_TO_ACTIVATIONS = {"relu": ("relu",), "gated-gelu": ("gelu", "linear")}
_ACTIVATIONS_TO_FF_PROJ = {v: k for k, v in _FF_PROJ_TO_ACTIVATIONS.items()}

# HF tensors that duplicate `shared.weight` in some checkpoints (tied copies).
_EMBEDDING_ALIASES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
# Present in old checkpoints; HF itself ignores it (cross-attention has no bias).
_IGNORED = ("decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",)

Params = dict[str, Any]


class HFCheckpointError(CheckpointError, ValueError):
  """An HF config or tensors (or params) that cannot be converted exactly."""


@dataclasses.dataclass(frozen=True)
class _Spec:
  """One HF tensor and the t5x_lite parameter it becomes.

  Attributes:
    hf_name: tensor name in the safetensors file.
    path: t5x_lite parameter path (unscanned layout).
    kind: 'copy' (same layout), 'transpose' ([out, in] <-> [in, out]),
      'qkv' ([heads*kv, embed] <-> [embed, heads, kv]) or
      'out' ([embed, heads*kv] <-> [heads, kv, embed]).
    shape: t5x_lite shape implied by the config.
  """

  hf_name: str
  path: tuple[str, ...]
  kind: str
  shape: tuple[int, ...]

  @property
  def hf_shape(self) -> tuple[int, ...]:
    """Shape of the HF tensor implied by the config."""
    if self.kind == "copy":
      return self.shape
    if self.kind == "transpose":
      return self.shape[::-1]
    if self.kind == "qkv":
      embed, heads, kv = self.shape
      return (heads * kv, embed)
    heads, kv, embed = self.shape
    return (embed, heads * kv)


def _to_t5x(spec: _Spec, tensor: np.ndarray) -> np.ndarray:
  """Converts one HF tensor to the t5x_lite layout of `spec`."""
  if spec.kind == "copy":
    return tensor
  # HF Linear weights are [out, in]; every non-copy kind starts with a transpose.
  return np.ascontiguousarray(tensor.T).reshape(spec.shape)  # e.g. [embed, heads, kv]


def _to_hf(spec: _Spec, array: np.ndarray) -> np.ndarray:
  """Converts one t5x_lite parameter to the HF layout of `spec`."""
  if spec.kind == "copy":
    return np.ascontiguousarray(array)
  if spec.kind == "qkv":
    array = array.reshape(array.shape[0], -1)  # [embed, heads * kv]
  elif spec.kind == "out":
    array = array.reshape(-1, array.shape[-1])  # [heads * kv, embed]
  return np.ascontiguousarray(array.T)  # [out, in]


def _attention_specs(hf_prefix: str, path: tuple[str, ...], config: T5Config) -> list[_Spec]:
  """Specs of one HF attention block (q, k, v, o) mapped to query/key/value/out."""
  qkv_shape = (config.emb_dim, config.num_heads, config.head_dim)
  out_shape = (config.num_heads, config.head_dim, config.emb_dim)
  return [
    _Spec(f"{hf_prefix}.q.weight", path + ("query", "kernel"), "qkv", qkv_shape),
    _Spec(f"{hf_prefix}.k.weight", path + ("key", "kernel"), "qkv", qkv_shape),
    _Spec(f"{hf_prefix}.v.weight", path + ("value", "kernel"), "qkv", qkv_shape),
    _Spec(f"{hf_prefix}.o.weight", path + ("out", "kernel"), "out", out_shape),
  ]


def _mlp_specs(hf_prefix: str, path: tuple[str, ...], config: T5Config) -> list[_Spec]:
  """Specs of one HF DenseReluDense block mapped to mlp/wi(_j)/wo."""
  wi_shape = (config.emb_dim, config.mlp_dim)
  if len(config.mlp_activations) == 1:
    names = ["wi"]
  else:
    names = [f"wi_{j}" for j in range(len(config.mlp_activations))]
  specs = [
    _Spec(f"{hf_prefix}.{name}.weight", path + (name, "kernel"), "transpose", wi_shape)
    for name in names
  ]
  wo_shape = (config.mlp_dim, config.emb_dim)
  specs.append(_Spec(f"{hf_prefix}.wo.weight", path + ("wo", "kernel"), "transpose", wo_shape))
  return specs


def _scale_spec(hf_name: str, path: tuple[str, ...], config: T5Config) -> _Spec:
  """Spec of one RMS norm scale."""
  return _Spec(hf_name, path + ("scale",), "copy", (config.emb_dim,))


def _relpos_spec(stack: str, config: T5Config) -> _Spec:
  """Spec of a stack's relative position bias table (stored in HF block 0)."""
  hf_name = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
  shape = (config.num_heads, config.relative_attention_num_buckets)
  return _Spec(hf_name, (stack, "relpos_bias", "rel_embedding"), "transpose", shape)


def _encoder_specs(config: T5Config) -> Iterator[_Spec]:
  """Specs of the encoder stack."""
  yield _relpos_spec("encoder", config)
  for i in range(config.num_encoder_layers):
    hf, path = f"encoder.block.{i}", ("encoder", f"layers_{i}")
    yield _scale_spec(
      f"{hf}.layer.0.layer_norm.weight", path + ("pre_attention_layer_norm",), config
    )
    yield from _attention_specs(f"{hf}.layer.0.SelfAttention", path + ("attention",), config)
    yield _scale_spec(f"{hf}.layer.1.layer_norm.weight", path + ("pre_mlp_layer_norm",), config)
    yield from _mlp_specs(f"{hf}.layer.1.DenseReluDense", path + ("mlp",), config)
  yield _scale_spec("encoder.final_layer_norm.weight", ("encoder", "encoder_norm"), config)


def _decoder_specs(config: T5Config) -> Iterator[_Spec]:
  """Specs of the decoder stack, including the untied output projection."""
  yield _relpos_spec("decoder", config)
  for i in range(config.num_decoder_layers):
    hf, path = f"decoder.block.{i}", ("decoder", f"layers_{i}")
    yield _scale_spec(
      f"{hf}.layer.0.layer_norm.weight", path + ("pre_self_attention_layer_norm",), config
    )
    yield from _attention_specs(f"{hf}.layer.0.SelfAttention", path + ("self_attention",), config)
    yield _scale_spec(
      f"{hf}.layer.1.layer_norm.weight", path + ("pre_cross_attention_layer_norm",), config
    )
    yield from _attention_specs(
      f"{hf}.layer.1.EncDecAttention", path + ("encoder_decoder_attention",), config
    )
    yield _scale_spec(f"{hf}.layer.2.layer_norm.weight", path + ("pre_mlp_layer_norm",), config)
    yield from _mlp_specs(f"{hf}.layer.2.DenseReluDense", path + ("mlp",), config)
  yield _scale_spec("decoder.final_layer_norm.weight", ("decoder", "decoder_norm"), config)
  if not config.logits_via_embedding:
    shape = (config.emb_dim, config.vocab_size)
    yield _Spec("lm_head.weight", ("decoder", "logits_dense", "kernel"), "transpose", shape)


def _param_specs(config: T5Config) -> list[_Spec]:
  """All HF tensor <-> t5x_lite parameter correspondences implied by `config`."""
  embedding = _Spec(
    "shared.weight",
    ("token_embedder", "embedding"),
    "copy",
    (config.vocab_size, config.emb_dim),
  )
  return [embedding, *_encoder_specs(config), *_decoder_specs(config)]


def config_from_hf(
  hf_config: Mapping[str, Any], *, scan_layers: bool = False, param_dtype: str = "float32"
) -> T5Config:
  """Maps a transformers T5 config dict (config.json) to a `T5Config`.

  Args:
    hf_config: the parsed config.json of a T5ForConditionalGeneration.
    scan_layers: value for `T5Config.scan_layers` (not an HF concept).
    param_dtype: value for `T5Config.param_dtype`.

  Returns:
    The equivalent `T5Config`.

  Raises:
    HFCheckpointError: if the config describes something t5x_lite cannot run exactly.
  """
  model_type = hf_config.get("model_type", "t5")
  if model_type not in ("t5", "mt5"):  # mT5 is T5 1.1 with a bigger vocabulary.
    raise HFCheckpointError(f"model_type={model_type!r} is not supported: expected 't5' or 'mt5'.")
  if not hf_config.get("is_encoder_decoder", True):
    raise HFCheckpointError(
      "is_encoder_decoder=False: only encoder-decoder T5 models are supported."
    )
  ff_proj = hf_config.get("feed_forward_proj", "relu")
  if ff_proj not in _FF_PROJ_TO_ACTIVATIONS:
    raise HFCheckpointError(
      f"Unsupported feed_forward_proj={ff_proj!r}: t5x_lite supports "
      f"{sorted(_FF_PROJ_TO_ACTIVATIONS)} ('relu' = T5 1.0, 'gated-gelu' = T5 1.1)."
    )
  # transformers 5 stores the output scaling as `scale_decoder_outputs` and forces
  # `tie_word_embeddings=True`; older configs only have `tie_word_embeddings`.
  tied = hf_config.get("scale_decoder_outputs", hf_config.get("tie_word_embeddings", True))
  num_layers = hf_config.get("num_layers", 6)
  num_decoder_layers = hf_config.get("num_decoder_layers")
  return T5Config(
    vocab_size=hf_config.get("vocab_size", 32128),
    emb_dim=hf_config.get("d_model", 512),
    num_heads=hf_config.get("num_heads", 8),
    head_dim=hf_config.get("d_kv", 64),
    mlp_dim=hf_config.get("d_ff", 2048),
    num_encoder_layers=num_layers,
    num_decoder_layers=num_layers if num_decoder_layers is None else num_decoder_layers,
    mlp_activations=_FF_PROJ_TO_ACTIVATIONS[ff_proj],
    dropout_rate=hf_config.get("dropout_rate", 0.1),
    logits_via_embedding=bool(tied),
    relative_attention_num_buckets=hf_config.get("relative_attention_num_buckets", 32),
    relative_attention_max_distance=hf_config.get("relative_attention_max_distance", 128),
    layer_norm_epsilon=hf_config.get("layer_norm_epsilon", 1e-6),
    param_dtype=param_dtype,
    scan_layers=scan_layers,
  )


def config_to_hf(config: T5Config) -> dict[str, Any]:
  """Maps a `T5Config` to a transformers T5 config dict (config.json).

  Both `tie_word_embeddings` (read by transformers 4) and `scale_decoder_outputs`
  (read by transformers 5, whose T5Config always ties and ignores the former in
  its constructor) are written.

  Raises:
    ConfigError: if `config.mlp_activations` has no transformers equivalent, the
      network has a relative position bias per layer (HF's T5 has one per stack), or
      it is a decoder-only model.
  """
  if config.architecture != "encoder_decoder":
    raise ConfigError(
      f"T5Config.architecture={config.architecture!r} has no transformers T5 equivalent "
      "(T5ForConditionalGeneration is the encoder-decoder)."
    )
  if config.relpos_bias_per_layer:
    raise ConfigError(
      "relpos_bias_per_layer=True (a relative position bias per layer) has no transformers "
      "T5 equivalent: HF's T5 has one per stack."
    )
  activations = tuple(config.mlp_activations)
  if activations not in _ACTIVATIONS_TO_FF_PROJ:
    raise ConfigError(
      f"mlp_activations={activations!r} has no transformers feed_forward_proj; "
      f"supported: {sorted(_ACTIVATIONS_TO_FF_PROJ)}."
    )
  return {
    "architectures": ["T5ForConditionalGeneration"],
    "model_type": "t5",
    "is_encoder_decoder": True,
    "vocab_size": config.vocab_size,
    "d_model": config.emb_dim,
    "num_heads": config.num_heads,
    "d_kv": config.head_dim,
    "d_ff": config.mlp_dim,
    "num_layers": config.num_encoder_layers,
    "num_decoder_layers": config.num_decoder_layers,
    "feed_forward_proj": _ACTIVATIONS_TO_FF_PROJ[activations],
    "dropout_rate": config.dropout_rate,
    "tie_word_embeddings": config.logits_via_embedding,
    "scale_decoder_outputs": config.logits_via_embedding,
    "relative_attention_num_buckets": config.relative_attention_num_buckets,
    "relative_attention_max_distance": config.relative_attention_max_distance,
    "layer_norm_epsilon": config.layer_norm_epsilon,
    "dtype": config.param_dtype,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "decoder_start_token_id": 0,
  }


def _read_json(path: str) -> Any:
  """A JSON file of an HF checkpoint directory.

  Raises:
    CheckpointNotFoundError: if it does not exist.
    CorruptCheckpointError: if it is not valid JSON.
  """
  if not os.path.isfile(path):
    raise CheckpointNotFoundError(
      f"{path} not found: expected an HF T5 checkpoint directory "
      f"with {CONFIG_NAME} and {SAFETENSORS_NAME}."
    )
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CorruptCheckpointError(f"{path}: not a JSON file ({e}).") from e


def _safetensors() -> Any:
  """The safetensors package (the `hf` extra), or a one-line `MissingExtraError`."""
  errors.require_extra("hf", ("safetensors",), "Reading or writing Hugging Face checkpoints")
  import safetensors.numpy  # pylint: disable=import-outside-toplevel

  return safetensors


def _read_safetensors_file(path: str) -> dict[str, np.ndarray]:
  """Every tensor of one safetensors file.

  Raises:
    CheckpointNotFoundError: if it does not exist.
    CorruptCheckpointError: naming the file when it is not a (complete) safetensors file.
  """
  if not os.path.isfile(path):
    raise CheckpointNotFoundError(f"{path} not found.")
  safetensors = _safetensors()
  try:
    with safetensors.safe_open(path, framework="numpy") as f:
      return {key: f.get_tensor(key) for key in f.keys()}
  except safetensors.SafetensorError as e:
    reason = str(e).removeprefix("Error while deserializing header: ")
    raise CorruptCheckpointError(f"{path}: not a safetensors file ({reason})") from e


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """Reads every tensor of an HF checkpoint directory as numpy arrays.

  Args:
    path: directory with model.safetensors, or model.safetensors.index.json
      and the shards it names.

  Returns:
    Tensor name -> array (bfloat16 tensors come back as ml_dtypes.bfloat16).

  Raises:
    CheckpointNotFoundError: if there are no safetensors weights, with a
      conversion hint when only PyTorch pickles are present, or a shard is missing.
    CorruptCheckpointError: naming a file that is not valid safetensors or JSON.
  """
  index_file = os.path.join(path, SAFETENSORS_INDEX_NAME)
  if os.path.exists(index_file):
    weight_map = _read_json(index_file).get("weight_map")
    if not isinstance(weight_map, dict):
      raise CorruptCheckpointError(f"{index_file}: no 'weight_map' object.")
    files = sorted(set(weight_map.values()))
  elif os.path.exists(os.path.join(path, SAFETENSORS_NAME)):
    files = [SAFETENSORS_NAME]
  else:
    pickles = [n for n in _PICKLE_NAMES if os.path.exists(os.path.join(path, n))]
    if pickles:
      raise CheckpointNotFoundError(
        f"{path} has only PyTorch pickle weights ({', '.join(pickles)}), which t5x_lite "
        "never unpickles. Convert them to safetensors first, e.g. "
        "`T5ForConditionalGeneration.from_pretrained(path).save_pretrained(new_path)` "
        "(transformers writes model.safetensors by default)."
      )
    raise CheckpointNotFoundError(f"No {SAFETENSORS_NAME} or {SAFETENSORS_INDEX_NAME} in {path}.")
  tensors = {}
  for name in files:
    tensors.update(_read_safetensors_file(os.path.join(path, name)))
  return tensors


def _check_hf_tensors(tensors: Mapping[str, np.ndarray], specs: list[_Spec], tied: bool) -> None:
  """Raises HFCheckpointError on missing, unexpected, wrong-shaped or inconsistent tensors."""
  expected = {s.hf_name for s in specs}
  aliases = _EMBEDDING_ALIASES + (("lm_head.weight",) if tied else ())
  missing = sorted(expected - tensors.keys())
  unexpected = sorted(tensors.keys() - expected - set(aliases) - set(_IGNORED))
  if missing or unexpected:
    raise HFCheckpointError(
      f"HF tensors do not match the config: missing {missing}, unexpected {unexpected}."
    )
  wrong = [
    f"{s.hf_name} (t5x_lite {'/'.join(s.path)}): checkpoint shape "
    f"{tuple(tensors[s.hf_name].shape)}, config implies {s.hf_shape}"
    for s in specs
    if tuple(tensors[s.hf_name].shape) != s.hf_shape
  ]
  if wrong:
    raise HFCheckpointError("Parameter shapes differ from the config:\n  " + "\n  ".join(wrong))
  shared = tensors["shared.weight"]
  for alias in aliases:
    if alias in tensors and not np.array_equal(tensors[alias], shared):
      raise HFCheckpointError(
        f"{alias} differs from shared.weight; t5x_lite has one token embedding "
        "(and, with tied logits, uses it as the output projection)."
      )


def _layer_counts(config: T5Config) -> tuple[tuple[str, int], ...]:
  """(stack name, number of layers) of the encoder and the decoder."""
  return (("encoder", config.num_encoder_layers), ("decoder", config.num_decoder_layers))


def _stack_layers(params: Params, config: T5Config) -> Params:
  """Stacks layers_{i} trees of each stack into `layers` with a leading layer axis."""
  params = {k: dict(v) if isinstance(v, dict) else v for k, v in params.items()}
  for stack, num in _layer_counts(config):
    layers = [params[stack].pop(f"layers_{i}") for i in range(num)]
    params[stack]["layers"] = jax.tree.map(lambda *xs: np.stack(xs), *layers)  # [layers, ...]
  return params


def _unstack_layers(params: Params, config: T5Config) -> Params:
  """Inverse of `_stack_layers`: splits `layers` into layers_{i} trees."""
  params = {k: dict(v) if isinstance(v, dict) else v for k, v in params.items()}
  for stack, num in _layer_counts(config):
    stacked = params[stack].pop("layers")
    for i in range(num):
      params[stack][f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
  return params


def params_from_hf_tensors(tensors: Mapping[str, np.ndarray], config: T5Config) -> Params:
  """Converts HF T5 tensors to a plain t5x_lite parameter tree.

  Args:
    tensors: HF tensor name -> array, as returned by `read_safetensors`.
    config: the model config; `scan_layers` selects the stacked layout and
      `param_dtype` the dtype of the returned arrays.

  Returns:
    Nested dict of numpy arrays in the network's parameter layout.

  Raises:
    HFCheckpointError: listing missing/unexpected tensors, or every tensor whose shape
      differs from the config (with its HF name, parameter path and both shapes).
  """
  specs = _param_specs(config)
  _check_hf_tensors(tensors, specs, config.logits_via_embedding)
  dtype = jax.numpy.dtype(config.param_dtype)
  flat = {s.path: _to_t5x(s, tensors[s.hf_name]).astype(dtype, copy=False) for s in specs}
  params = flax.traverse_util.unflatten_dict(flat)
  return _stack_layers(params, config) if config.scan_layers else params


def _plain_numpy(params: Any) -> Params:
  """Unboxes (LogicallyPartitioned), unfreezes and fetches params as numpy arrays."""
  params = flax.core.unfreeze(flax.core.meta.unbox(params))
  return jax.tree.map(np.asarray, jax.device_get(params))


def params_to_hf_tensors(config: T5Config, params: Any) -> dict[str, np.ndarray]:
  """Converts a t5x_lite parameter tree (boxed or plain) to HF T5 tensors.

  A shared encoder-decoder (`share_encoder_decoder`) is written in full: HF's decoder
  gets its own copy of the shared weights.

  Raises:
    HFCheckpointError: listing missing/unexpected parameters, or every parameter whose
      shape differs from the config (with its path and both shapes).
  """
  params = _plain_numpy(params)
  if config.share_encoder_decoder:
    params = shared_encoder_decoder.expand(params)
  if config.scan_layers:
    params = _unstack_layers(params, config)
  flat: dict[tuple[str, ...], Any] = flax.traverse_util.flatten_dict(params)
  specs = _param_specs(config)
  missing = sorted("/".join(s.path) for s in specs if s.path not in flat)
  unexpected = sorted("/".join(p) for p in flat.keys() - {s.path for s in specs})
  if missing or unexpected:
    raise HFCheckpointError(
      f"Params do not match the config: missing {missing}, unexpected {unexpected}."
    )
  wrong = [
    f"{'/'.join(s.path)}: shape {flat[s.path].shape}, config implies {s.shape}"
    for s in specs
    if flat[s.path].shape != s.shape
  ]
  if wrong:
    raise HFCheckpointError("Parameter shapes differ from the config:\n  " + "\n  ".join(wrong))
  return {s.hf_name: _to_hf(s, flat[s.path]) for s in specs}


def _common_dtype(tensors: Mapping[str, np.ndarray], path: str) -> str:
  """Name of the single dtype shared by all tensors of a checkpoint."""
  names = sorted({np.dtype(t.dtype).name for t in tensors.values()})
  if len(names) != 1:
    raise HFCheckpointError(f"{path} mixes dtypes {names}; pass param_dtype to choose one.")
  return names[0]


def load_hf(
  path: str, *, scan_layers: bool = False, param_dtype: str | None = None
) -> tuple[T5Config, Params]:
  """Loads an HF `T5ForConditionalGeneration` directory.

  Args:
    path: directory with config.json and model.safetensors (or a sharded
      model.safetensors.index.json).
    scan_layers: return the stacked (`scan_layers=True`) parameter layout.
    param_dtype: dtype of the returned params; None keeps the checkpoint's dtype.

  Returns:
    (config, params): the `T5Config` and the plain parameter tree.

  Raises:
    CheckpointNotFoundError: no config.json or no safetensors weights (e.g. only
      pytorch_model.bin).
    CorruptCheckpointError: naming a file that is not valid JSON or safetensors.
    HFCheckpointError: unsupported config, or tensors that do not match it.
  """
  hf_config = _read_json(os.path.join(path, CONFIG_NAME))
  tensors = read_safetensors(path)
  param_dtype = param_dtype or _common_dtype(tensors, path)
  config = config_from_hf(hf_config, scan_layers=scan_layers, param_dtype=param_dtype)
  return config, params_from_hf_tensors(tensors, config)


def save_hf(config: T5Config, params: Any, path: str) -> None:
  """Writes params as an HF `T5ForConditionalGeneration` directory.

  The result (config.json + model.safetensors, tensors in `config.param_dtype`'s
  storage dtype) loads with `T5ForConditionalGeneration.from_pretrained(path)`.

  Args:
    config: the model config.
    params: boxed (LogicallyPartitioned) or plain parameter tree, in the layout
      `config.scan_layers` selects.
    path: output directory (created if needed).
  """
  tensors = params_to_hf_tensors(config, params)
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, CONFIG_NAME), "w") as f:
    json.dump(config_to_hf(config), f, indent=2, sort_keys=True)
  _safetensors().numpy.save_file(
    tensors, os.path.join(path, SAFETENSORS_NAME), metadata={"format": "pt"}
  )
