"""Fine-tuning starts with T5X's RestoreCheckpointConfig semantics.

`train.initial_checkpoint_path` starts a fresh run from a checkpoint; `RestoreConfig`
(gin: `train.restore_config = @RestoreConfig()`, or just `RestoreConfig.*` bindings)
says how:

* `assignment_map`: (regex, replacement) pairs. The first regex that `re.fullmatch`es a
  model parameter path (`encoder/layers_0/attention/query/kernel`) reads that parameter
  from the checkpoint path `match.expand(replacement)` (`\\1` backreferences, as
  `re.sub` and T5X), or keeps its fresh initialisation when the replacement is None;
  paths no regex matches read themselves. With a map, checkpoint parameters that no
  model parameter reads are ignored (listed in one warning): that drops e.g. a
  pre-training head. A regex that matches no model path is an error.
* `fallback_to_scratch`: model parameters the checkpoint lacks keep their fresh
  initialisation (listed in one warning). Off, they are an error, except adapters
  (`network.adapter_params`), which always start from their identity initialisation.
* Pre-training-only subtrees (`checkpoints.PRETRAINING_ONLY_PARAMS`: an ELECTRA
  checkpoint's `generator/` and `rtd_head/`) that the model lacks are dropped, listed in
  one warning, so a plain `EncoderDecoderModel` fine-tunes from such a checkpoint.
* `restore_optimizer_state`: also restores the `opt_state` item and the step
  (continued pre-training into a new MODEL_DIR); the RNG and the data start fresh.

Layouts: a checkpoint of scanned layers (`encoder/layers/...`, stacked on axis 0)
restores into an unscanned model (`encoder/layers_0/...`) and the other way round,
detected from the checkpoint's metadata (`t5x_lite.checkpoint.scan_layout`). The checkpoint is
viewed in the model's layout (assignment-map replacements name paths of that view) and
converted exactly. The optimizer state is restored only into the same layout.

Stored leaves are read with an orbax partial restore (only the leaves some parameter
reads), straight into shardings derived from the target's; slices, stacks and dtype
casts run jitted with the target's shardings as outputs.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import gin
import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from flax import traverse_util

from t5x_lite.nn import network
from t5x_lite.checkpoint import checkpoints, scan_layout
from t5x_lite.checkpoint.checkpoints import CheckpointMismatchError
from t5x_lite.core.errors import CheckpointError, ConfigError

Pair = tuple[str, str | None]
Shape = scan_layout.Shape

_MAP = "RestoreConfig.assignment_map"
# Longest list of paths one line of an optimizer-state mismatch shows per kind.
_SHOWN = 8


def _pair(entry: Any) -> Pair:
  """One validated (regex, replacement or None) entry of an assignment map."""
  if isinstance(entry, str) or not isinstance(entry, Sequence) or len(entry) != 2:
    raise ConfigError(f"{_MAP} entries are (regex, replacement or None) pairs, got {entry!r}")
  pattern, replacement = entry
  if not isinstance(pattern, str) or not (replacement is None or isinstance(replacement, str)):
    raise ConfigError(f"{_MAP} entry {tuple(entry)!r}: the regex and replacement must be strings")
  try:
    re.compile(pattern)
  except re.error as e:
    raise ConfigError(f"{_MAP} pattern {pattern!r} is not a regular expression: {e}") from e
  return pattern, replacement


@gin.configurable
@dataclasses.dataclass(frozen=True)
class RestoreConfig:
  """How `train.initial_checkpoint_path` is restored (T5X's RestoreCheckpointConfig).

  Attributes:
    assignment_map: (regex, replacement) pairs over model parameter paths; see the
      module docstring. Empty: every parameter reads its own path.
    fallback_to_scratch: parameters the checkpoint lacks keep their fresh init.
    restore_optimizer_state: also restore the optimizer state and the step.
  """

  assignment_map: Sequence[Pair] = ()
  fallback_to_scratch: bool = False
  restore_optimizer_state: bool = False

  def __post_init__(self):
    pairs = tuple(_pair(entry) for entry in self.assignment_map)
    object.__setattr__(self, "assignment_map", pairs)
    if self.restore_optimizer_state and pairs:
      raise ConfigError(
        f"RestoreConfig.restore_optimizer_state=True cannot be combined with {_MAP}: "
        "the optimizer state is restored only into the model it was saved with"
      )


# ----------------------------------------------------------------------------
# Paths: the assignment map and the checkpoint's view in the model's layout.


def map_paths(
  paths: Iterable[str], assignment_map: Sequence[Pair]
) -> dict[str, tuple[str | None, Pair | None]]:
  """Model path -> (checkpoint path or None for fresh init, the pair that mapped it).

  Args:
    paths: model parameter paths ('encoder/layers_0/mlp/wi_0/kernel').
    assignment_map: validated (regex, replacement) pairs; the first regex that
      fully matches a path decides; unmatched paths map to themselves (pair None).

  Raises:
    ConfigError: naming the patterns that match no path, or a replacement whose
      backreferences do not fit its pattern.
  """
  paths = sorted(paths)
  compiled = [
    (re.compile(pattern), (pattern, replacement)) for pattern, replacement in assignment_map
  ]
  result: dict[str, tuple[str | None, Pair | None]] = {}
  for path in paths:
    result[path] = (path, None)
    for regex, pair in compiled:
      if match := regex.fullmatch(path):
        try:
          result[path] = (None if pair[1] is None else match.expand(pair[1]), pair)
        except (re.error, IndexError) as e:
          raise ConfigError(f"{_MAP} pair {pair!r} cannot map {path}: {e}") from e
        break
  unused = [pattern for regex, (pattern, _) in compiled if not any(map(regex.fullmatch, paths))]
  if unused:
    example = next((p for p in paths if "/layers" in p), paths[0] if paths else "")
    raise ConfigError(
      f"{_MAP} pattern{'s' * (len(unused) > 1)} {', '.join(map(repr, unused))} "
      f"match{'es' * (len(unused) == 1)} no model parameter path (re.fullmatch against "
      f"paths such as {example!r})"
    )
  return result


# ----------------------------------------------------------------------------
# Planning: what each model parameter is made of, and the errors.


@dataclasses.dataclass
class _Plan:
  """Where each model parameter comes from."""

  reads: dict[str, scan_layout.Read]  # model path -> what it is read from
  renamed: dict[str, str]  # model path -> a different checkpoint path it reads
  skipped: list[str]  # mapped to None: fresh init
  fallback: list[str]  # not in the checkpoint: fresh init
  ignored: list[str]  # checkpoint paths no model parameter reads


def _mismatch_message(
  location: str,
  missing: Sequence[tuple[str, str, Pair | None]],
  unexpected: Sequence[str],
  reshaped: Sequence[tuple[str, str, Shape]],
  target: Mapping[str, Any],
  view: Mapping[str, scan_layout.Read],
  converted: str | None,
) -> str:
  """`checkpoints.check_tree_matches`' lines, naming the assignment-map pair of a path."""

  def mapped(path: str, source: str, pair: Pair | None) -> str:
    return f" (for {path}, {_MAP} pair {pair!r})" if pair is not None and source != path else ""

  lines = [f"The params in checkpoint {location} do not match the model:"]
  lines += [
    f"  missing in checkpoint: {source} {tuple(target[path].shape)}{mapped(path, source, pair)}"
    for path, source, pair in missing
  ]
  lines += [f"  unexpected in checkpoint: {p} {view[p].shape}" for p in unexpected]
  lines += [
    f"  shape mismatch: {path} checkpoint {shape} vs model {tuple(target[path].shape)}"
    + (f" (read from {source})" if source != path else "")
    for path, source, shape in reshaped
  ]
  if converted:
    lines.append(f"  (the checkpoint's layers are shown {converted}, like the model's)")
  if missing or unexpected:
    lines.append(
      f"  {_MAP} maps or skips (None) parameters; RestoreConfig.fallback_to_scratch=True "
      "initialises missing ones freshly."
    )
  return "\n".join(lines)


def _plan(
  target: Mapping[str, Any],
  view: Mapping[str, scan_layout.Read],
  config: RestoreConfig,
  adapters: Iterable[str],
  location: str,
  converted: str | None,
) -> _Plan:
  """Resolves every model parameter to a read of `view` or to its fresh init.

  Raises:
    ConfigError: an assignment-map pattern matches no model path.
    CheckpointMismatchError: missing (not excused), reshaped, or (without an
      assignment map) unexpected parameters.
  """
  mapping = map_paths(target, config.assignment_map)
  adapters = set(adapters)
  plan = _Plan(reads={}, renamed={}, skipped=[], fallback=[], ignored=[])
  missing, reshaped = [], []
  for path, (source, pair) in mapping.items():
    if source is None:
      plan.skipped.append(path)
    elif source not in view:
      if config.fallback_to_scratch or (path in adapters and source == path):
        plan.fallback.append(path)
      else:
        missing.append((path, source, pair))
    elif view[source].shape != tuple(target[path].shape):
      reshaped.append((path, source, view[source].shape))
    else:
      plan.reads[path] = view[source]
      if source != path:
        plan.renamed[path] = source
  unexpected = sorted(set(view) - {source for source, _ in mapping.values()})
  if config.assignment_map:
    plan.ignored, unexpected = unexpected, []
  if missing or unexpected or reshaped:
    raise CheckpointMismatchError(
      _mismatch_message(location, missing, unexpected, reshaped, target, view, converted)
    )
  return plan


# ----------------------------------------------------------------------------
# Reading: orbax partial restore, then slices / stacks / casts into the target.


def _read_leaves(
  item_dir: epath.Path,
  reads: Mapping[str, scan_layout.Read],
  target: Mapping[str, jax.ShapeDtypeStruct],
  saved: Mapping[str, Shape],
) -> dict[str, jax.Array]:
  """Model path -> parameter, for every read; only the stored leaves needed are read."""
  abstract: dict[str, jax.ShapeDtypeStruct] = {}
  for path, read in reads.items():
    sharding = scan_layout.read_sharding(target[path].sharding, read)
    for source in read.sources:
      if source not in abstract:
        abstract[source] = jax.ShapeDtypeStruct(
          saved[source], target[path].dtype, sharding=sharding
        )
  if not abstract:
    return {}
  tree = traverse_util.unflatten_dict(abstract, sep="/")
  args = ocp.args.PyTreeRestore(
    item=tree,
    restore_args=ocp.checkpoint_utils.construct_restore_args(tree),
    partial_restore=True,
  )
  try:
    with ocp.PyTreeCheckpointer() as checkpointer:
      restored: dict[str, Any] = traverse_util.flatten_dict(
        checkpointer.restore(item_dir, args=args), sep="/"
      )
  except Exception as e:  # tensorstore errors name the file in their message
    raise CheckpointError(f"Cannot restore {item_dir}: {e}") from e
  return {
    path: scan_layout.assemble(read, [restored[s] for s in read.sources], target[path])
    for path, read in reads.items()
  }


def _log_plan(plan: _Plan, step_dir: epath.Path) -> None:
  """One line per kind of parameter not read from its own path."""
  renamed = [f"{t} <- {s}" for t, s in plan.renamed.items()]
  kinds = (
    (logging.info, "Read from other checkpoint paths", renamed),
    (logging.info, f"Not restored ({_MAP} -> None), freshly initialised", plan.skipped),
    (
      logging.warning,
      f"Not in checkpoint {step_dir}, taken from the freshly initialised model",
      plan.fallback,
    ),
    (logging.warning, "Checkpoint params no model parameter reads, ignored", plan.ignored),
  )
  for log, what, paths in kinds:
    if paths:
      log("%s (%d): %s", what, len(paths), ", ".join(paths))


def _restore_params(
  step_dir: epath.Path,
  target: Any,
  fresh: Any,
  config: RestoreConfig,
  dtype: str | None,
) -> Any:
  """`restore_params` of one verified step directory."""
  item_dir = step_dir / checkpoints.PARAMS
  flat_target: dict[str, Any] = traverse_util.flatten_dict(target, sep="/")
  if dtype is not None:
    flat_target = {
      p: jax.ShapeDtypeStruct(x.shape, np.dtype(dtype), sharding=x.sharding)
      for p, x in flat_target.items()
    }
  saved = checkpoints.drop_pretraining_only(
    checkpoints.saved_shapes(item_dir), flat_target, step_dir
  )
  model_layout, stored_layout = scan_layout.layout(flat_target), scan_layout.layout(saved)
  view = scan_layout.checkpoint_view(saved, model_layout)
  converted = model_layout if view.keys() != saved.keys() else None
  if converted:
    logging.info(
      "Checkpoint %s has %s layers: restoring them %s", step_dir, stored_layout, converted
    )
  adapters = traverse_util.flatten_dict(network.adapter_params(target), sep="/")
  plan = _plan(flat_target, view, config, adapters, str(item_dir), converted)
  _log_plan(plan, step_dir)
  leaves = _read_leaves(item_dir, plan.reads, flat_target, saved)
  flat_fresh: dict[str, Any] = traverse_util.flatten_dict(fresh, sep="/")
  for path in plan.skipped + plan.fallback:
    leaves[path] = scan_layout.like(flat_fresh[path], flat_target[path])
  return traverse_util.unflatten_dict(leaves, sep="/")


def restore_params(
  path: epath.PathLike,
  target: Any,
  fresh: Any,
  config: RestoreConfig | None = None,
  *,
  dtype: str | None = None,
  step: int | None = None,
  verify_checksums: bool = True,
) -> Any:
  """Restores a checkpoint's `params` into a model as `config` says.

  Args:
    path: checkpoint root or step directory (`checkpoints.find_steps`).
    target: abstract params tree (`jax.ShapeDtypeStruct` with shardings), plain.
    fresh: freshly initialised params sharded like `target`: parameters mapped
      to None, adapters and (with `fallback_to_scratch`) missing ones come from it.
    config: default `RestoreConfig()` (with its gin bindings).
    dtype: cast every parameter to this dtype; default: each target leaf's.
    step: step of a root; None: the newest intact one.
    verify_checksums: compare CRC32s from files.json before restoring.

  Returns:
    The params tree, sharded like `target`.

  Raises:
    ConfigError: an assignment-map pattern matches no model parameter path.
    CheckpointMismatchError: missing, unexpected or reshaped parameters (as
      `config` leaves them), naming each path.
    CheckpointNotFoundError, CorruptCheckpointError: as `checkpoints.find_steps`.
  """
  [(_, step_dir)] = checkpoints.find_steps(
    path, step="newest" if step is None else step, verify_checksums=verify_checksums
  )
  return _restore_params(step_dir, target, fresh, config or RestoreConfig(), dtype)


# ----------------------------------------------------------------------------
# Optimizer state and step.


def _listed(kind: str, items: Sequence[str]) -> str:
  """'kind: a, b, ... (+N more)' with at most `_SHOWN` items."""
  more = f" (+{len(items) - _SHOWN} more)" if len(items) > _SHOWN else ""
  return f"{kind}: {', '.join(items[:_SHOWN])}{more}"


def _opt_state_mismatch(saved: Mapping[str, Shape], target: Mapping[str, Shape]) -> str:
  """One line listing missing, unexpected and reshaped optimizer-state paths ('' if none)."""
  missing = [f"{p} {target[p]}" for p in sorted(set(target) - set(saved))]
  unexpected = [f"{p} {saved[p]}" for p in sorted(set(saved) - set(target))]
  reshaped = [
    f"{p} checkpoint {saved[p]} vs optimizer {target[p]}"
    for p in sorted(set(saved) & set(target))
    if tuple(saved[p]) != tuple(target[p])
  ]
  parts = [("missing in checkpoint", missing), ("unexpected", unexpected), ("shape", reshaped)]
  return "; ".join(_listed(kind, items) for kind, items in parts if items)


def _restore_opt_state(step_dir: epath.Path, target: Any, frozen_by: Sequence[str]) -> Any:
  """The `opt_state` item of `step_dir`, restored into the abstract optax state `target`."""
  item_dir = step_dir / checkpoints.OPT_STATE
  if not item_dir.is_dir():
    raise CheckpointError(
      f"RestoreConfig.restore_optimizer_state=True, but checkpoint {step_dir} holds no "
      "optimizer state (opt_state/): it has parameters only"
    )
  mismatch = _opt_state_mismatch(
    checkpoints.saved_shapes(item_dir), checkpoints.flat_shapes(target)
  )
  if mismatch and frozen_by:
    raise ConfigError(
      "RestoreConfig.restore_optimizer_state=True cannot be combined with "
      f"{' and '.join(frozen_by)}: the optimizer state of {step_dir} differs from the "
      f"frozen setup's ({mismatch})"
    )
  if mismatch:
    raise CheckpointMismatchError(
      f"The optimizer state in checkpoint {item_dir} does not match the optimizer "
      f"(RestoreConfig.restore_optimizer_state=True): {mismatch}"
    )
  return checkpoints.restore_item(item_dir, target, checkpoints.OPT_STATE)


@dataclasses.dataclass(frozen=True)
class Start:
  """What a fine-tuning start restores: params, and optimizer state and step if asked."""

  params: Any
  opt_state: Any | None = None
  step: int | None = None


def restore_start(
  path: epath.PathLike,
  abstract_params: Any,
  fresh_params: Any,
  config: RestoreConfig,
  *,
  dtype: str | None = None,
  abstract_opt_state: Any | None = None,
  frozen_by: Sequence[str] = (),
  vocabulary: Any | None = None,
) -> Start:
  """Restores the start of a fine-tuning run from the newest intact step of `path`.

  Args:
    path: checkpoint root or step directory.
    abstract_params: abstract params with shardings (`restore_params`' target).
    fresh_params: freshly initialised params sharded like them.
    config: the restore configuration.
    dtype: cast the restored params to this dtype.
    abstract_opt_state: abstract optax state with shardings; needed with
      `config.restore_optimizer_state`.
    frozen_by: gin bindings that freeze parameters in this run (their optimizer
      state differs from a full one), for the error message.
    vocabulary: this run's vocabulary, checked against the one the checkpoint was
      trained with (`checkpoints.check_vocabulary`); None: not checked.

  Returns:
    The params; with `restore_optimizer_state` also the optimizer state and step.

  Raises:
    ConfigError, CheckpointMismatchError: as `restore_params`; an optimizer-state
      mismatch (naming `frozen_by` when a frozen setup causes it).
  """
  [(number, step_dir)] = checkpoints.find_steps(path)
  if vocabulary is not None:
    checkpoints.check_vocabulary(step_dir, vocabulary)
  params = _restore_params(step_dir, abstract_params, fresh_params, config, dtype)
  if not config.restore_optimizer_state:
    return Start(params)
  if abstract_opt_state is None:
    raise ValueError("restore_optimizer_state needs abstract_opt_state")
  opt_state = _restore_opt_state(step_dir, abstract_opt_state, frozen_by)
  logging.info("Restored the optimizer state and step %d of %s", number, step_dir)
  return Start(params, opt_state, number)
