"""Conversion between T5X checkpoints and t5x_lite params and Adafactor state.

T5X writes a training step as `<model_dir>/checkpoint_<step>/`, holding its TrainState's
state dict `{'target': params, 'state': {'step': int32, 'param_states': ...}}`: as an
orbax PyTree in `state/` (T5X's default, `train.use_orbax=True`), or in the legacy
layout as a msgpack file `checkpoint` (`{'version': 3, 'optimizer': <state dict>}`)
whose partitioned arrays are zarr arrays (tensorstore) beside it.

T5X's own `examples/t5` network and flaxformer's T5 1.0/1.1 (unscanned) name their
parameters as t5x_lite does (`encoder/layers_0/attention/query/kernel`, ...), but keep
attention kernels 2-D: query/key/value [embed, heads*head_dim] and out
[heads*head_dim, embed], where t5x_lite has [embed, heads, head_dim] and
[heads, head_dim, embed]. Conversion only reshapes, so it is exact both ways (both
fold 1/sqrt(head_dim) into the query kernel's initialisation, not into the network).

Adafactor: T5X keeps per parameter `{v_row, v_col, v, m}` ((1,) placeholders where
unused), as t5x_lite's `factored_moments.FactoredRmsState` keeps `v_row`, `v_col`,
`v`. A factored statistic is the EMA of squared gradients averaged over some dims;
a T5X statistic becomes the t5x_lite one that keeps the same dims (the names `row`
and `col` may swap: T5X factors a 2-D kernel by dim size, t5x_lite a 3-D one by
logical axes), reshaped. Where the two optimizers factor a parameter differently the
state cannot be carried exactly, and conversion stops naming that parameter.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from etils import epath
from flax import serialization, traverse_util

from t5x_lite.nn import network
from t5x_lite.training import factored_moments
from t5x_lite.core.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from t5x_lite.core.paths import absolute_path, shown

Flat = dict[str, np.ndarray]

STATE_DIR = "state"  # orbax item of a T5X step
MSGPACK_FILE = "checkpoint"  # legacy msgpack of a T5X step
STEP_PREFIX = "checkpoint"
_LEGACY_VERSION = 3
_STEP_DIR = re.compile(r"checkpoint_(\d+)")
# T5X's Adafactor default (`min_dim_size_to_factor`), used where shapes alone are ambiguous.
T5X_MIN_DIM_SIZE_TO_FACTOR = 128
_SLOTS = ("v_row", "v_col", "v", "m")
_QKV = re.compile(r".*attention/(query|key|value)/kernel")
_OUT = re.compile(r".*attention/out/kernel")
_JOINED = "joined"  # T5X's heads*head_dim axis, t5x_lite's ('heads', 'kv')


class T5XCheckpointError(CheckpointError, ValueError):
  """A T5X checkpoint (or t5x_lite state) that cannot be converted exactly."""


# ---------------------------------------------------------------- finding and reading


def _step_of(step_dir: epath.Path) -> int:
  match = _STEP_DIR.fullmatch(step_dir.name)
  return int(match.group(1)) if match else -1


def is_t5x_step_dir(path: epath.Path) -> bool:
  """Whether `path` is one T5X step (orbax `state/` or legacy `checkpoint` file)."""
  return (path / STATE_DIR).is_dir() or (path / MSGPACK_FILE).is_file()


def find_step_dir(path: epath.PathLike, step: int | None = None) -> epath.Path:
  """The T5X step directory that `path` names.

  Args:
    path: a `checkpoint_<step>` directory, or a directory holding them (a T5X
      model_dir); relative to the working directory.
    step: from a model_dir, this step (default: the newest).

  Raises:
    CheckpointNotFoundError: no T5X checkpoint there, or not the step asked for.
  """
  given = absolute_path(path)
  if not given.exists():
    raise CheckpointNotFoundError(f"T5X checkpoint {shown(path)} does not exist")
  if given.is_dir() and is_t5x_step_dir(given):
    return given
  steps = (
    sorted((_step_of(p), p) for p in given.iterdir() if _step_of(p) >= 0 and is_t5x_step_dir(p))
    if given.is_dir()
    else []
  )
  if not steps:
    raise CheckpointNotFoundError(
      f"{shown(path)} is not a T5X checkpoint: expected checkpoint_<step>/ holding state/ "
      f"(orbax) or a msgpack file '{MSGPACK_FILE}' (legacy), or a directory of them"
    )
  if step is None:
    return steps[-1][1]
  for number, step_dir in steps:
    if number == step:
      return step_dir
  raise CheckpointNotFoundError(
    f"{shown(path)} has no T5X step {step}; it has {[n for n, _ in steps]}"
  )


def _read_orbax(state_dir: epath.Path) -> dict[str, Any]:
  import orbax.checkpoint as ocp  # noqa: PLC0415  (heavy; only this reader needs it)

  try:
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
      metadata = checkpointer.metadata(state_dir).item_metadata
      if metadata is None:
        raise T5XCheckpointError(f"{state_dir}: its metadata is missing or unreadable")
      tree = metadata.tree
      args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
      return checkpointer.restore(state_dir, args=ocp.args.PyTreeRestore(restore_args=args))
  except T5XCheckpointError:
    raise
  except Exception as e:  # orbax raises many types for unreadable checkpoints
    raise CorruptCheckpointError(f"Cannot read the T5X orbax checkpoint {state_dir}: {e}") from e


def _tensorstore_spec(leaf: Any) -> bool:
  return isinstance(leaf, dict) and "driver" in leaf and "kvstore" in leaf


def _read_tensorstore(spec: dict[str, Any], step_dir: epath.Path) -> np.ndarray:
  import tensorstore as ts  # noqa: PLC0415

  spec = dict(spec)
  kvstore = dict(spec["kvstore"])
  if kvstore.get("driver") == "file" and not kvstore["path"].startswith("/"):
    kvstore["path"] = str(step_dir / kvstore["path"])  # T5X stores paths relative to the step
  spec["kvstore"] = kvstore
  try:
    return np.asarray(ts.open(spec, open=True).result().read().result())
  except Exception as e:  # tensorstore errors: name the array, not the whole spec
    reason = str(e).split(" [tensorstore_spec=")[0]
    raise CorruptCheckpointError(f"Cannot read T5X array {kvstore['path']}: {reason}") from e


def _read_legacy(step_dir: epath.Path) -> dict[str, Any]:
  path = step_dir / MSGPACK_FILE
  try:
    contents = serialization.msgpack_restore(path.read_bytes())
  except Exception as e:  # msgpack raises several types on damaged input
    raise CorruptCheckpointError(f"Cannot read {path}: {e}") from e
  if not isinstance(contents, dict) or "optimizer" not in contents:
    raise T5XCheckpointError(f"{path} is not a T5X checkpoint (no 'optimizer' entry)")
  return jax.tree.map(
    lambda leaf: _read_tensorstore(leaf, step_dir) if _tensorstore_spec(leaf) else leaf,
    contents["optimizer"],
    is_leaf=_tensorstore_spec,
  )


def read_state(step_dir: epath.Path) -> tuple[Flat, Flat, int]:
  """(params, Adafactor param_states, step) of one T5X step, as '/'-joined flat dicts.

  `param_states` keys are `<param path>/<slot>` (slot in v_row, v_col, v, m); empty
  when the checkpoint has no optimizer state.

  Raises:
    CorruptCheckpointError: an unreadable file, named.
    T5XCheckpointError: contents that are not a T5X TrainState.
  """
  orbax_dir = step_dir / STATE_DIR
  state = _read_orbax(orbax_dir) if orbax_dir.is_dir() else _read_legacy(step_dir)
  if not isinstance(state, dict) or "target" not in state:
    raise T5XCheckpointError(f"{step_dir} holds no T5X parameters ('target')")
  flat = traverse_util.flatten_dict(state, sep="/")
  params = {k[len("target/") :]: np.asarray(v) for k, v in flat.items() if k.startswith("target/")}
  prefix = "state/param_states/"
  states = {k[len(prefix) :]: np.asarray(v) for k, v in flat.items() if k.startswith(prefix)}
  step = flat.get("state/step")
  return params, states, int(np.asarray(step)) if step is not None else _step_of(step_dir)


# ---------------------------------------------------------------- layouts and params


def is_scanned(params: Mapping[str, Any]) -> bool:
  """Whether T5X params are flaxformer's scanned layout (`encoder/encoder/...`)."""
  return any(name.startswith(("encoder/encoder/", "decoder/decoder/")) for name in params)


def config_fields(params: Mapping[str, np.ndarray]) -> dict[str, Any]:
  """The T5Config fields that T5X params' names and shapes determine.

  Not determined (gin supplies them or their defaults stand): dropout_rate,
  relative_attention_max_distance, layer_norm_epsilon, dtype, and which gated
  activation a T5 1.1-style MLP uses (GELU assumed, as in T5 1.1, mT5 and ByT5).

  Raises:
    T5XCheckpointError: naming what is missing or is not a T5 encoder-decoder.
  """
  scanned = is_scanned(params)
  layer = "encoder/encoder/" if scanned else "encoder/layers_0/"
  need = ["token_embedder/embedding", f"{layer}attention/query/kernel", f"{layer}mlp/wo/kernel"]
  if missing := [name for name in need if name not in params]:
    raise T5XCheckpointError(
      f"Not a T5 encoder-decoder checkpoint: no parameter {missing[0]!r} "
      f"(it has {sorted(params)[:3]}...)"
    )
  per_layer = f"{layer}relpos_bias/rel_embedding"
  relpos = params.get(per_layer, params.get("encoder/relpos_bias/rel_embedding"))
  if relpos is None:
    raise T5XCheckpointError("Not a T5 checkpoint: no relative position bias (relpos_bias)")
  vocab_size, emb_dim = params["token_embedder/embedding"].shape
  num_heads, num_buckets = relpos.shape[0], relpos.shape[-1]
  joined = params[f"{layer}attention/query/kernel"].shape[-1]

  def depth(stack: str) -> int:
    if scanned:
      return int(params[f"{stack}/{stack}/mlp/wo/kernel"].shape[1])
    return len({m.group(1) for k in params if (m := re.match(rf"{stack}/layers_(\d+)/", k))})

  return dict(
    vocab_size=int(vocab_size),
    emb_dim=int(emb_dim),
    num_heads=int(num_heads),
    head_dim=int(joined // num_heads),
    mlp_dim=int(params[f"{layer}mlp/wo/kernel"].shape[0]),
    num_encoder_layers=depth("encoder"),
    num_decoder_layers=depth("decoder"),
    mlp_activations=("gelu", "linear") if f"{layer}mlp/wi_0/kernel" in params else ("relu",),
    logits_via_embedding="decoder/logits_dense/kernel" not in params,
    relative_attention_num_buckets=int(num_buckets),
    relpos_bias_per_layer=per_layer in params,
    param_dtype=str(params["token_embedder/embedding"].dtype),
  )


def _expand(labels: tuple[str, ...]) -> tuple[str, ...]:
  return tuple(sub for a in labels for sub in (("heads", "kv") if a == _JOINED else (a,)))


@dataclasses.dataclass(frozen=True)
class _Param:
  """One t5x_lite parameter (unscanned path) and where T5X keeps it.

  Attributes:
    path: t5x_lite path, e.g. 'encoder/layers_0/attention/query/kernel'.
    ours: its logical axes, e.g. ('embed', 'heads', 'kv').
    shape: its shape.
    t5x_path: T5X path ('encoder/encoder/attention/query/kernel' when scanned).
    t5x: T5X axes, e.g. ('embed', 'layers', 'joined').
    layer: index on T5X's 'layers' axis (scanned), else None.
    num_layers: size of that axis.
  """

  path: str
  ours: tuple[str, ...]
  shape: tuple[int, ...]
  t5x_path: str
  t5x: tuple[str, ...]
  layer: int | None
  num_layers: int

  @property
  def size(self) -> dict[str, int]:
    return {**dict(zip(self.ours, self.shape)), "layers": self.num_layers}

  def shape_of(self, labels: tuple[str, ...]) -> tuple[int, ...]:
    """Shape of T5X-axes `labels` (joined = heads * kv)."""
    return tuple(int(np.prod([self.size[s] for s in _expand((a,))])) for a in labels)

  @property
  def t5x_shape(self) -> tuple[int, ...]:
    return self.shape_of(self.t5x)

  def to_ours(self, x: np.ndarray, labels: tuple[str, ...], ours: tuple[str, ...]) -> np.ndarray:
    """A T5X array with axes `labels` -> this layer's slice in t5x_lite axes `ours`."""
    if "layers" in labels:
      assert self.layer is not None  # a scanned parameter has its index on 'layers'
      x = np.take(x, self.layer, axis=labels.index("layers"))
      labels = tuple(a for a in labels if a != "layers")
    expanded = _expand(labels)
    x = x.reshape([self.size[a] for a in expanded])
    return np.transpose(x, [expanded.index(a) for a in ours])

  def to_t5x(self, x: np.ndarray, ours: tuple[str, ...], labels: tuple[str, ...]) -> np.ndarray:
    """Inverse of `to_ours` for this layer (without the 'layers' axis)."""
    labels = tuple(a for a in labels if a != "layers")
    expanded = _expand(labels)
    x = np.transpose(x, [ours.index(a) for a in expanded])
    return x.reshape(self.shape_of(labels))


def _params_of(config: network.T5Config, scanned: bool) -> list[_Param]:
  """Every parameter of the unscanned network for `config`, and its place in T5X."""
  unscanned = dataclasses.replace(config, scan_layers=False)
  boxed = jax.eval_shape(
    functools.partial(network.init_params, unscanned), jax.ShapeDtypeStruct((2,), np.uint32)
  )
  depth = {"encoder": config.num_encoder_layers, "decoder": config.num_decoder_layers}
  out = []
  leaves: dict[str, Any] = traverse_util.flatten_dict(boxed, sep="/")  # nn.Partitioned
  for path, leaf in leaves.items():
    ours = tuple(leaf.names)
    t5x = ours
    if _QKV.fullmatch(path):
      t5x = ("embed", _JOINED)
    elif _OUT.fullmatch(path):
      t5x = (_JOINED, "embed")
    t5x_path, layer = path, None
    match = re.fullmatch(r"(encoder|decoder)/layers_(\d+)/(.*)", path)
    if scanned and match:  # flaxformer scans parameters on axis 1
      stack, layer, rest = match.group(1), int(match.group(2)), match.group(3)
      t5x_path, t5x = f"{stack}/{stack}/{rest}", (t5x[0], "layers", *t5x[1:])
    num_layers = depth[match.group(1)] if match else 1
    out.append(_Param(path, ours, tuple(leaf.value.shape), t5x_path, t5x, layer, num_layers))
  return out


def params_from_t5x(params: Mapping[str, np.ndarray], config: network.T5Config) -> dict[str, Any]:
  """T5X params (flat, either layout) -> t5x_lite's unscanned parameter tree.

  Raises:
    T5XCheckpointError: a parameter missing, left over, or shaped unlike `config`.
  """
  expected = _params_of(config, is_scanned(params))
  if extra := sorted(set(params) - {p.t5x_path for p in expected}):
    raise T5XCheckpointError(
      f"T5X parameter {extra[0]!r} has no place in the configured T5 ({len(extra)} such); "
      "check the T5Config bindings"
    )
  out = {}
  for p in expected:
    if p.t5x_path not in params:
      raise T5XCheckpointError(f"T5X checkpoint lacks parameter {p.t5x_path!r}")
    x = params[p.t5x_path]
    if tuple(x.shape) != p.t5x_shape:
      raise T5XCheckpointError(
        f"T5X parameter {p.t5x_path!r} is shaped {tuple(x.shape)}, the configured T5 needs "
        f"{p.t5x_shape}; check the T5Config bindings"
      )
    out[p.path] = p.to_ours(x, p.t5x, p.ours)
  return traverse_util.unflatten_dict(out, sep="/")


def _group(params_of: list[_Param]) -> dict[str, list[_Param]]:
  """T5X path -> its t5x_lite parameters (one, or one per layer when scanned)."""
  groups: dict[str, list[_Param]] = {}
  for p in params_of:
    groups.setdefault(p.t5x_path, []).append(p)
  return groups


def _assemble(arrays: list[np.ndarray], labels: tuple[str, ...]) -> np.ndarray:
  """Per-layer T5X arrays (without 'layers') -> one T5X array with axes `labels`."""
  if "layers" not in labels:
    return arrays[0]
  return np.stack(arrays, axis=labels.index("layers"))


def params_to_t5x(params: Any, config: network.T5Config, scanned: bool = False) -> Flat:
  """t5x_lite's unscanned parameter tree -> T5X params (flat; `scanned`: flaxformer's)."""
  flat = traverse_util.flatten_dict(jax.device_get(params), sep="/")
  return {
    t5x_path: _assemble(
      [p.to_t5x(np.asarray(flat[p.path]), p.ours, p.t5x) for p in parts], parts[0].t5x
    )
    for t5x_path, parts in _group(_params_of(config, scanned)).items()
  }


# ---------------------------------------------------------------- Adafactor state

# T5X's standard logical factor rules, with the joined heads*kv axis a column axis.
_T5X_RULES = {**factored_moments.FACTOR_RULES, _JOINED: factored_moments.COLUMN}


def _t5x_factoring(p: _Param, min_dim: int) -> factored_moments.Factoring:
  """How T5X's Adafactor factors `p`'s T5X array: its rank-1/2 heuristic (the default), or
  its standard logical rules for higher ranks (scanned layouts need them)."""
  return factored_moments.factoring(p.t5x_shape, p.t5x, min_dim, _T5X_RULES)


def _kept(labels: tuple[str, ...], f: factored_moments.Factoring) -> dict[str, tuple[str, ...]]:
  """Axes that a factored v_row (all but the columns) and v_col (all but the rows) keep."""
  return {
    "v_row": tuple(a for d, a in enumerate(labels) if d not in f.cols),
    "v_col": tuple(a for d, a in enumerate(labels) if d not in f.rows),
  }


def _slot_for(kept: tuple[str, ...], ours: dict[str, tuple[str, ...]]) -> str | None:
  """The t5x_lite slot that keeps the same axes as a T5X statistic keeping `kept`."""
  wanted = set(_expand(tuple(a for a in kept if a != "layers")))
  return next((slot for slot, axes in ours.items() if set(axes) == wanted), None)


def _our_factoring(p: _Param) -> factored_moments.Factoring:
  """Which dims t5x_lite's Adafactor takes as rows/columns, were `p` factored."""
  return factored_moments.factoring(p.shape, p.ours, min_dim_size_to_factor=0)


def _is_factored_state(x: Any) -> bool:
  return isinstance(x, factored_moments.FactoredRmsState)


def _the_factored_state(opt_state: Any) -> factored_moments.FactoredRmsState:
  found = [
    x for x in jax.tree.leaves(opt_state, is_leaf=_is_factored_state) if _is_factored_state(x)
  ]
  if len(found) != 1:
    raise T5XCheckpointError(
      "Only the state of one t5x_lite Adafactor (optimizers.adafactor) carries T5X's "
      "Adafactor state; convert with --optimizer_state=false"
    )
  return found[0]


def _cannot_carry(what: str) -> T5XCheckpointError:
  return T5XCheckpointError(
    f"{what}: the state cannot be carried exactly; use --optimizer_state=false"
  )


def opt_state_from_t5x(
  param_states: Mapping[str, np.ndarray], step: int, config: network.T5Config, init_state: Any
) -> Any:
  """T5X Adafactor param_states -> `init_state` (a fresh t5x_lite Adafactor state) filled in.

  Args:
    param_states: flat `<T5X param path>/<slot>` arrays from `read_state`.
    step: the T5X step; every optax `count` becomes it.
    config: the model config.
    init_state: a fresh state of the t5x_lite optimizer for the same (unscanned) model.

  Raises:
    T5XCheckpointError: a slot missing, momentum (T5X `m`) present, or a parameter the
      two Adafactors factor differently, named.
  """
  state = jax.device_get(_the_factored_state(init_state))
  slots: dict[str, dict[str, Any]] = {
    name: traverse_util.flatten_dict(getattr(state, name), sep="/") for name in _SLOTS[:3]
  }
  for t5x_path, parts in _group(_params_of(config, is_scanned(param_states))).items():
    got = {s: param_states[f"{t5x_path}/{s}"] for s in _SLOTS if f"{t5x_path}/{s}" in param_states}
    if any(s not in got for s in _SLOTS[:3]):
      raise T5XCheckpointError(f"T5X optimizer state lacks v_row/v_col/v of {t5x_path!r}")
    if "m" in got and got["m"].shape != (1,):
      raise _cannot_carry(
        f"T5X's Adafactor has momentum ('m' of {t5x_path!r}); t5x_lite's carries second moments"
      )
    t5x_factored = got["v_row"].shape != (1,)
    f = _t5x_factoring(parts[0], 0)
    if t5x_factored:
      kept = _kept(parts[0].t5x, f)
      for slot in ("v_row", "v_col"):
        if tuple(got[slot].shape) != parts[0].shape_of(kept[slot]):
          raise _cannot_carry(f"T5X's {slot} of {t5x_path!r} is shaped {got[slot].shape}")
    for p in parts:
      if (slots["v_row"][p.path].shape != (1,)) != t5x_factored:
        raise _cannot_carry(
          f"T5X's Adafactor {'factored' if t5x_factored else 'did not factor'} {t5x_path!r}, "
          f"t5x_lite's {'does not' if t5x_factored else 'does'}"
        )
      if not t5x_factored:
        slots["v"][p.path] = p.to_ours(got["v"], p.t5x, p.ours)
        continue
      ours = _kept(p.ours, _our_factoring(p))
      for slot, labels in kept.items():
        target = _slot_for(labels, ours)
        if target is None:
          raise _cannot_carry(f"T5X's Adafactor factors {t5x_path!r} over other axes")
        slots[target][p.path] = p.to_ours(got[slot], labels, ours[target])
  filled = state._replace(
    count=np.asarray(step, np.int32),
    **{name: traverse_util.unflatten_dict(v, sep="/") for name, v in slots.items()},
  )
  replaced = jax.tree.map(
    lambda x: filled if _is_factored_state(x) else x, init_state, is_leaf=_is_factored_state
  )
  return _with_counts(replaced, step)


def _with_counts(opt_state: Any, step: int) -> Any:
  """Every optax step counter (`count` fields) set to `step`."""

  def one(path: Any, leaf: Any) -> Any:
    last = path[-1] if path else None
    # (jaxlib's GetAttrKey has no stub, so isinstance does not narrow `last` for type checkers.)
    if isinstance(last, jax.tree_util.GetAttrKey) and last.name == "count":  # pyright: ignore[reportOptionalMemberAccess]
      return np.asarray(step, np.asarray(leaf).dtype)
    return leaf

  return jax.tree_util.tree_map_with_path(one, opt_state)


def opt_state_to_t5x(
  opt_state: Any, config: network.T5Config, min_dim: int, scanned: bool = False
) -> Flat:
  """t5x_lite Adafactor state -> T5X param_states (flat `<path>/<slot>`, `m` placeholders).

  Args:
    opt_state: the t5x_lite optimizer state (one FactoredRmsState inside).
    config: the model config.
    min_dim: T5X's `min_dim_size_to_factor`, to check that T5X would factor alike.
    scanned: flaxformer's scanned layout.

  Raises:
    T5XCheckpointError: a parameter T5X's Adafactor would factor differently, named.
  """
  state = jax.device_get(_the_factored_state(opt_state))
  slots: dict[str, dict[str, Any]] = {
    name: traverse_util.flatten_dict(getattr(state, name), sep="/") for name in _SLOTS[:3]
  }
  out = _fresh(config, min_dim, scanned)
  for t5x_path, parts in _group(_params_of(config, scanned)).items():
    f = _t5x_factoring(parts[0], min_dim)
    labels = parts[0].t5x
    kept = _kept(labels, f) if f.factored else {"v": labels}
    per_slot: dict[str, list[np.ndarray]] = {slot: [] for slot in kept}
    for p in parts:
      if (slots["v_row"][p.path].shape != (1,)) != f.factored:
        raise _cannot_carry(
          f"t5x_lite's Adafactor {'did not factor' if f.factored else 'factored'} {p.path!r}, "
          f"T5X's (min_dim_size_to_factor={min_dim}) would {'' if f.factored else 'not '}"
          f"factor {p.t5x_shape}"
        )
      ours = _kept(p.ours, _our_factoring(p)) if f.factored else {"v": p.ours}
      for slot, t5x_labels in kept.items():
        source = _slot_for(t5x_labels, ours)
        if source is None:
          raise _cannot_carry(f"T5X's Adafactor would factor {t5x_path!r} over other axes")
        x = np.asarray(slots[source][p.path], np.float32)
        per_slot[slot].append(p.to_t5x(x, ours[source], t5x_labels))
    for slot, arrays in per_slot.items():
      out[f"{t5x_path}/{slot}"] = _assemble(arrays, kept[slot])
  return out


def _fresh(config: network.T5Config, min_dim: int, scanned: bool) -> Flat:
  """The param_states T5X's Adafactor initialises: zeros, (1,) placeholders where unused."""
  out = {}
  for t5x_path, parts in _group(_params_of(config, scanned)).items():
    p = parts[0]
    f = _t5x_factoring(p, min_dim)
    shapes: dict[str, tuple[int, ...]] = {"v_row": (1,), "v_col": (1,), "v": (1,), "m": (1,)}
    if f.factored:
      shapes.update({slot: p.shape_of(labels) for slot, labels in _kept(p.t5x, f).items()})
    else:
      shapes["v"] = p.t5x_shape
    out.update(
      {f"{t5x_path}/{slot}": np.zeros(shape, np.float32) for slot, shape in shapes.items()}
    )
  return out


def fresh_t5x_param_states(config: network.T5Config, min_dim: int, scanned: bool = False) -> Flat:
  """The param_states T5X's Adafactor initialises (zeros), for params-only exports."""
  return _fresh(config, min_dim, scanned)


# ---------------------------------------------------------------- writing


def write_checkpoint(
  model_dir: epath.PathLike, params: Flat, param_states: Flat, step: int, legacy: bool = False
) -> epath.Path:
  """Writes `<model_dir>/checkpoint_<step>/` as T5X's checkpointer would read it.

  Args:
    model_dir: T5X model/checkpoint directory (created).
    params: flat T5X params.
    param_states: flat `<path>/<slot>` Adafactor state.
    step: the step.
    legacy: the msgpack layout (arrays inline) instead of T5X's default orbax one.

  Raises:
    CheckpointError: the step exists already.
  """
  root = absolute_path(model_dir)
  step_dir = root / f"{STEP_PREFIX}_{step}"
  if step_dir.exists():
    raise CheckpointError(f"{shown(model_dir)} already has {step_dir.name}; write to a new one")
  state = {
    "target": traverse_util.unflatten_dict(params, sep="/"),
    "state": {
      "step": np.asarray(step, np.int32),
      "param_states": traverse_util.unflatten_dict(param_states, sep="/"),
    },
  }
  if legacy:
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{step_dir.name}.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    payload = {"version": _LEGACY_VERSION, "optimizer": state}
    (tmp / MSGPACK_FILE).write_bytes(serialization.msgpack_serialize(payload))
    tmp.rename(step_dir)
    return step_dir
  import orbax.checkpoint as ocp  # noqa: PLC0415

  options = ocp.CheckpointManagerOptions(step_prefix=STEP_PREFIX, enable_async_checkpointing=False)
  handlers = {STATE_DIR: ocp.PyTreeCheckpointHandler(use_ocdbt=True)}
  with ocp.CheckpointManager(root, item_handlers=handlers, options=options) as manager:
    manager.save(step, args=ocp.args.Composite(**{STATE_DIR: ocp.args.PyTreeSave(state)}))
  return step_dir
