"""Checkpoints on disk: which steps a path holds, the model config they store, restores.

The one owner of "which step, which stored config": `find_steps` turns a
checkpoint root or step directory into verified step directories (newest, all,
or one step), `model_config` reads the T5Config a step stores (gin bindings
override it field by field), `restore_params` restores the params item into
abstract params with shardings (`partitioning.Partitioner.abstract_params`),
optionally taking parameters the checkpoint lacks (adapters added for
fine-tuning) from a fallback tree.
Training checkpoints are written and resumed by `train_checkpointer`;
`write_params_checkpoint` writes the converters' layout (params and config, and from
T5X optionally the optimizer state).

Layout (a checkpoint ROOT is an orbax `CheckpointManager` directory; relative
paths are taken relative to the working directory):

  <root>/<step>/params/         StandardSave of the plain (unboxed) params dict
  <root>/<step>/opt_state/      StandardSave of the optax state (training, T5X converter)
  <root>/<step>/train_meta/     JsonSave: step, rng, data position, model config, vocabulary
  <root>/<step>/data_iterator/  one file set per host: the input pipeline position
  <root>/<step>/config/         JsonSave of the T5Config fields (converters only)
  <root>/<step>/files.json      size and CRC32 of every file of the step

`files.json` is written once a step is fully committed. Before a restore every
listed file is checked, so a truncated or corrupt file fails with an error that
names it instead of an opaque tensorstore message, and nothing is restored from
a damaged step. Older steps are never touched by a failed restore. Given a
root, restores fall back to the newest intact step (warning about the corrupt
newer ones); given one step directory, a corrupt step is an error.

Restores go straight into the target shardings: callers pass an abstract tree
of `jax.ShapeDtypeStruct`s carrying `sharding`, and the on-disk tree is first
compared against it so a different model fails with the list of paths whose
shapes differ instead of a silent re-initialisation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Collection, Mapping
from typing import Any

import gin
import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from flax import traverse_util

from t5x_lite.nn import network
from t5x_lite.checkpoint.manifest import (
  intact_steps,
  newest_intact,
  verify_files,
  write_file_manifest,
)
from t5x_lite.core.errors import (
  CheckpointError,
  CheckpointNotFoundError,
  ConfigError,
  CorruptCheckpointError,
)
from t5x_lite.core.paths import absolute_path, not_a_directory, shown

PARAMS = "params"
OPT_STATE = "opt_state"
TRAIN_META = "train_meta"
DATA_ITERATOR = "data_iterator"
# A model's auxiliary state, in the steps of a model that keeps it across resumes
# (`BaseModel.checkpoint_aux_state`: an EMA teacher).
AUX_STATE = "aux_state"
CONFIG = "config"
# Key of the T5Config fields inside the `train_meta` item.
MODEL_CONFIG_KEY = "model_config"
# Key of the training vocabulary's `vocabulary_fingerprint` inside `train_meta`.
VOCABULARY_KEY = "vocabulary"
# Top-level params subtrees that only a pre-training objective trains beside the T5
# network (ELECTRA's generator and replaced-token-detection head, `t5x_lite.electra`).
# A restore into a model without them drops them, listed in one warning.
PRETRAINING_ONLY_PARAMS = ("generator", "rtd_head")


class CheckpointMismatchError(CheckpointError):
  """The checkpoint's tree does not match the model being restored into."""


# ----------------------------------------------------------------------------
# Tree comparison.


def _key_str(key: Any) -> str:
  """Renders one pytree key (dict key, attribute, or index) as a path part."""
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def flat_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
  """Maps 'a/b/c' paths to leaf shapes for arrays, abstract arrays or metadata.

  Args:
    tree: a pytree whose leaves have a `.shape` (jax/numpy arrays,
      `jax.ShapeDtypeStruct`, orbax `ArrayMetadata`).

  Returns:
    Dict from slash-joined path to shape tuple; `None` leaves are skipped.
  """
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {
    "/".join(_key_str(k) for k in path): tuple(leaf.shape)
    for path, leaf in leaves
    if leaf is not None
  }


def check_tree_matches(
  saved: Mapping[str, tuple[int, ...]],
  target: Mapping[str, tuple[int, ...]],
  *,
  what: str,
  location: str,
) -> None:
  """Raises `CheckpointMismatchError` unless both trees have equal paths/shapes.

  Args:
    saved: path -> shape of the tree on disk.
    target: path -> shape of the tree the caller restores into.
    what: item name for the message, e.g. 'params'.
    location: checkpoint directory for the message.

  Raises:
    CheckpointMismatchError: listing missing, unexpected and reshaped paths.
  """
  missing = sorted(set(target) - set(saved))
  unexpected = sorted(set(saved) - set(target))
  reshaped = sorted(p for p in set(saved) & set(target) if tuple(saved[p]) != tuple(target[p]))
  if not (missing or unexpected or reshaped):
    return
  lines = [f"The {what} in checkpoint {location} do not match the model:"]
  lines += [f"  missing in checkpoint: {p} {target[p]}" for p in missing]
  lines += [f"  unexpected in checkpoint: {p} {saved[p]}" for p in unexpected]
  lines += [f"  shape mismatch: {p} checkpoint {saved[p]} vs model {target[p]}" for p in reshaped]
  raise CheckpointMismatchError("\n".join(lines))


# ----------------------------------------------------------------------------
# Params-only checkpoints (fine-tuning, HF conversion).


def is_step_dir(path: epath.PathLike) -> bool:
  """Whether `path` is one step directory (it holds `params/`), not a checkpoint root."""
  return (absolute_path(path) / PARAMS).is_dir()


def _root_steps(root: epath.PathLike) -> list[int]:
  """The numbered step directories holding `params/` of a checkpoint root, ascending.

  Raises:
    CheckpointNotFoundError: naming `root` (as given and absolute) when it does
      not exist or holds no step.
  """
  path = absolute_path(root)
  steps = (
    sorted(int(p.name) for p in path.iterdir() if p.name.isdigit() and (p / PARAMS).is_dir())
    if path.is_dir()
    else []
  )
  if not steps:
    why = (
      "expected a step directory with params/ or a MODEL_DIR with numbered step directories"
      if path.exists()
      else "it does not exist"
    )
    raise CheckpointNotFoundError(f"No checkpoint at {shown(root)}: {why}")
  return steps


def check_exists(path: epath.PathLike) -> None:
  """Raises `CheckpointNotFoundError` unless `path` is a step directory or a root with
  steps (`find_steps`' first check, without reading or verifying any file)."""
  if not is_step_dir(path):
    _root_steps(path)


def read_json_item(step_dir: epath.Path, item: str) -> dict[str, Any] | None:
  """A JsonSave item of a step directory (`TRAIN_META`, `CONFIG`), or None when absent."""
  if not (step_dir / item).is_dir():
    return None
  with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as checkpointer:
    return dict(checkpointer.restore(step_dir / item, args=ocp.args.JsonRestore()))


def _step_of(step_dir: epath.Path) -> int:
  """A step directory's step: its name when a number, else its `train_meta` step, else 0."""
  if step_dir.name.isdigit():
    return int(step_dir.name)
  return int((read_json_item(step_dir, TRAIN_META) or {}).get("step", 0))


def find_steps(
  path: epath.PathLike,
  *,
  step: int | str = "newest",
  exclude: Collection[int] = (),
  verify_checksums: bool = True,
) -> list[tuple[int, epath.Path]]:
  """The intact (step, absolute step directory) pairs that `path` names, ascending.

  Eval, infer, fine-tuning and the converters all find their checkpoint here.

  Args:
    path: a checkpoint root (MODEL_DIR, numbered step directories) or one step
      directory (holding `params/`), which is its one step whatever `step` says;
      relative paths are relative to the working directory.
    step: from a root, 'newest' (the newest intact step: newer corrupt ones are
      skipped with a warning naming the bad file), 'all' (every intact step,
      corrupt ones skipped likewise) or one step number.
    exclude: steps to leave out before anything is verified (e.g. steps already
      evaluated); the result is empty when every step is excluded.
    verify_checksums: compare CRC32s from files.json (sizes are always compared).

  Raises:
    CheckpointNotFoundError: `path` holds no checkpoint, or not the step asked for.
    CorruptCheckpointError: the step directory given, the step asked for, or every
      candidate step of the root, is corrupt (naming each bad file).
  """
  root = absolute_path(path)

  def verified(number: int, step_dir: epath.Path) -> list[tuple[int, epath.Path]]:
    verify_files(step_dir, checksums=verify_checksums)
    return [(number, step_dir)]

  if is_step_dir(root):
    number = _step_of(root)
    return [] if number in exclude else verified(number, root)
  steps = _root_steps(path)
  candidates = [s for s in steps if s not in exclude]
  if isinstance(step, int):
    if step not in steps:
      raise CheckpointNotFoundError(f"Step {step} not in {shown(path)} (have {steps})")
    return [] if step in exclude else verified(step, root / str(step))
  if not candidates:
    return []
  if step == "all":
    pairs = [(s, root / str(s)) for s in candidates]
    return intact_steps(root, pairs, checksums=verify_checksums)
  if step != "newest":
    raise ValueError(f"step must be 'newest', 'all' or a step number, got {step!r}")
  newest, _ = newest_intact(
    root, candidates, lambda s: verify_files(root / str(s), checksums=verify_checksums)
  )
  return [(newest, root / str(newest))]


def stored_config_fields(step_dir: epath.Path) -> dict[str, Any] | None:
  """The T5Config fields a step stores, or None.

  Training checkpoints keep them in `train_meta` (`MODEL_CONFIG_KEY`), HF
  conversions in the `config` item; a step has one or the other, and `train_meta`
  is read first.
  """
  meta = read_json_item(step_dir, TRAIN_META) or {}
  return meta.get(MODEL_CONFIG_KEY) or read_json_item(step_dir, CONFIG)


def vocabulary_fingerprint(vocabulary: Any) -> dict[str, Any] | None:
  """What identifies a SentencePiece vocabulary, for `train_meta`; None for other kinds.

  {'sentencepiece_model_file': the path it was loaded from, 'sha256': a hash of
  the model's bytes (its pieces), 'extra_ids': sentinel count}. A
  `vocab.DeferredVocabulary` is fingerprinted as what it resolves to now.
  """
  vocabulary = getattr(vocabulary, "resolved", vocabulary)
  model = getattr(vocabulary, "sp_model", None)
  if not isinstance(model, bytes):
    return None
  return {
    "sentencepiece_model_file": str(vocabulary.sentencepiece_model_file),
    "sha256": hashlib.sha256(model).hexdigest(),
    "extra_ids": int(vocabulary.extra_ids),
  }


def check_vocabulary(step_dir: epath.Path, vocabulary: Any) -> None:
  """Refuses to use a checkpoint with another vocabulary than the one it was trained with.

  A model of the same vocab_size restores and runs with any vocabulary of that
  size, and then decodes nonsense: the gin file that binds the training
  vocabulary was left out. Checkpoints that store no fingerprint (older ones,
  converted ones) and vocabularies that are not SentencePiece are not checked.

  Raises:
    ConfigError: naming both vocabularies and the gin binding to set.
  """
  stored = (read_json_item(step_dir, TRAIN_META) or {}).get(VOCABULARY_KEY)
  current = vocabulary_fingerprint(vocabulary)
  if not stored or current is None:
    return
  if (stored["sha256"], stored["extra_ids"]) == (current["sha256"], current["extra_ids"]):
    return
  trained_with = stored["sentencepiece_model_file"]
  raise ConfigError(
    f"{shown(step_dir)} was trained with the vocabulary {trained_with} "
    f"({stored['extra_ids']} extra ids), but this run's vocabulary is "
    f"{current['sentencepiece_model_file']} ({current['extra_ids']} extra ids); bind "
    f"--gin.get_vocabulary.sentencepiece_model_file=\"'{trained_with}'\" or pass the gin "
    "file that set it in training."
  )


def model_config(step_dir: epath.Path) -> network.T5Config:
  """The step's stored T5Config, overridden field by field by `T5Config.*` gin bindings.

  So `--gin_file=models/...` or `--gin.T5Config.dropout_rate=0` still apply, and a
  checkpoint that stores no config is used with the model's gin file.

  Raises:
    ConfigError: when neither the checkpoint nor gin defines every field.
  """
  stored = stored_config_fields(step_dir) or {}
  bound = gin.get_bindings(network.T5Config)
  fields: dict[str, Any] = {
    k: tuple(v) if isinstance(v, list) else v for k, v in stored.items() if k not in bound
  }
  required = [
    f.name
    for f in dataclasses.fields(network.T5Config)
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
  ]
  if missing := [name for name in required if name not in fields and name not in bound]:
    raise ConfigError(
      f"{step_dir} stores no model config and gin binds no T5Config.{{{', '.join(missing)}}}; "
      "pass the model's gin file, e.g. --gin_file=models/t5_1_1/small.gin."
    )
  config = network.T5Config(**fields)  # gin supplies the bound fields
  logging.info(
    "Model config (checkpoint %s, gin overrides %s): %s", step_dir, sorted(bound), config
  )
  return config


def drop_pretraining_only(
  saved: Mapping[str, tuple[int, ...]], target_paths: Collection[str], location: Any
) -> dict[str, tuple[int, ...]]:
  """`saved` (path -> shape) without the `PRETRAINING_ONLY_PARAMS` subtrees the target
  lacks; what is dropped is listed in one warning naming `location`."""
  wanted = {path.split("/", 1)[0] for path in target_paths}
  dropped: dict[str, int] = {}
  kept = {}
  for path, shape in saved.items():
    top = path.split("/", 1)[0]
    if top in PRETRAINING_ONLY_PARAMS and top not in wanted:
      dropped[top] = dropped.get(top, 0) + 1
    else:
      kept[path] = shape
  if dropped:
    logging.warning(
      "Pre-training-only params of checkpoint %s dropped (the model has none): %s",
      location,
      ", ".join(f"{top}/ ({count} arrays)" for top, count in dropped.items()),
    )
  return kept


def _cast_abstract(target: Any, dtype: str | None) -> Any:
  """Overrides the dtype of every abstract leaf when `dtype` is given."""
  if dtype is None:
    return target
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, np.dtype(dtype), sharding=x.sharding),
    target,
  )


def saved_shapes(item_dir: epath.Path) -> dict[str, tuple[int, ...]]:
  """Path -> shape of a StandardSave item, read from its metadata only."""
  if not item_dir.is_dir():
    raise CorruptCheckpointError(f"Checkpoint item missing: {item_dir}")
  try:
    with ocp.StandardCheckpointer() as checkpointer:
      return flat_shapes(checkpointer.metadata(item_dir).item_metadata.tree)
  except Exception as e:  # orbax raises several types for unreadable metadata
    raise CorruptCheckpointError(f"Cannot read metadata of {item_dir}: {e}") from e


def restore_item(item_dir: epath.Path, target: Any, what: str) -> Any:
  """Validates an item's tree against `target` and restores it into it.

  A `PARAMS` item may hold `PRETRAINING_ONLY_PARAMS` subtrees the target lacks: they
  are dropped with one warning and the rest is read (an orbax partial restore).
  """
  saved = saved_shapes(item_dir)
  target_shapes = flat_shapes(target)
  kept = drop_pretraining_only(saved, target_shapes, item_dir) if what == PARAMS else saved
  check_tree_matches(kept, target_shapes, what=what, location=os.fspath(item_dir))
  try:
    if len(kept) == len(saved):
      with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(item_dir, target)
    args = ocp.args.PyTreeRestore(
      item=target,
      restore_args=ocp.checkpoint_utils.construct_restore_args(target),
      partial_restore=True,
    )
    with ocp.PyTreeCheckpointer() as checkpointer:
      return checkpointer.restore(item_dir, args=args)
  except Exception as e:  # tensorstore errors name the file in their message
    raise CheckpointError(f"Cannot restore {item_dir}: {e}") from e


def _fallback_leaves(
  fallback: Any, missing: Collection[str], target: Mapping[str, Any], location: str
) -> dict[str, Any]:
  """Path -> fallback value for each `missing` path the fallback tree has.

  Values get the dtype of their `target` leaf.

  Raises:
    CheckpointMismatchError: a fallback value's shape differs from the target's.
  """
  flat: dict[str, Any] = traverse_util.flatten_dict(fallback, sep="/")
  leaves = {path: flat[path] for path in sorted(missing) if path in flat}
  if reshaped := [p for p, x in leaves.items() if tuple(x.shape) != tuple(target[p].shape)]:
    raise CheckpointMismatchError(
      f"Fallback params for checkpoint {location} do not match the model: "
      + ", ".join(f"{p} {leaves[p].shape} vs model {target[p].shape}" for p in reshaped)
    )
  return {
    p: x if x.dtype == target[p].dtype else x.astype(target[p].dtype) for p, x in leaves.items()
  }


def restore_params(
  path: epath.PathLike,
  target: Any,
  *,
  step: int | None = None,
  dtype: str | None = None,
  verify_checksums: bool = True,
  fallback: Any | None = None,
) -> Any:
  """Restores only the `params` item of a checkpoint (fine-tuning start).

  Args:
    path: checkpoint root or step directory (training run or HF conversion);
      relative paths are relative to the working directory.
    target: abstract params tree (`jax.ShapeDtypeStruct` with shardings),
      plain (unboxed) and without a 'params' wrapper.
    step: step to restore from a root; None means the newest intact one
      (`find_steps`).
    dtype: optional dtype every parameter is cast to on restore; by default
      each parameter gets the dtype of its `target` leaf.
    verify_checksums: compare CRC32s from files.json before restoring.
    fallback: params the checkpoint may lack: a tree nested like `target` (all of
      it or a part, e.g. `network.adapter_params` of freshly initialised params)
      of arrays sharded like `target`. Each parameter missing from the checkpoint
      is taken from it (cast to its target dtype), and their paths are listed in
      one warning; a missing parameter it does not hold is still an error.

  Returns:
    The params tree, sharded like `target`.

  Raises:
    CheckpointNotFoundError: naming a path that holds no checkpoint.
    CheckpointMismatchError: listing missing (and not in `fallback`), unexpected
      and reshaped parameters.
    CorruptCheckpointError: naming a damaged file.
  """
  [(_, step_dir)] = find_steps(
    path, step="newest" if step is None else step, verify_checksums=verify_checksums
  )
  logging.info("Restoring params from %s", step_dir)
  item_dir = step_dir / PARAMS
  target = _cast_abstract(target, dtype)
  if fallback is None:
    return restore_item(item_dir, target, PARAMS)
  flat_target = traverse_util.flatten_dict(target, sep="/")
  missing = set(flat_target) - set(saved_shapes(item_dir))
  filled = _fallback_leaves(fallback, missing, flat_target, os.fspath(item_dir))
  if not filled:
    return restore_item(item_dir, target, PARAMS)
  logging.warning(
    "Not in checkpoint %s, taken from the freshly initialised model (%d): %s",
    step_dir,
    len(filled),
    ", ".join(filled),
  )
  rest = {p: x for p, x in flat_target.items() if p not in filled}
  restored = restore_item(item_dir, traverse_util.unflatten_dict(rest, sep="/"), PARAMS)
  return traverse_util.unflatten_dict(
    {**traverse_util.flatten_dict(restored, sep="/"), **filled}, sep="/"
  )


def write_params_checkpoint(
  root: epath.PathLike,
  params: Any,
  *,
  step: int = 0,
  config: Mapping[str, Any] | None = None,
  opt_state: Any = None,
) -> epath.Path:
  """Writes a converted checkpoint root (the HF and T5X converters' layout).

  Args:
    root: checkpoint root to create.
    params: plain params tree (arrays).
    step: step number of the written checkpoint.
    config: optional JSON-serialisable model config, item `config`.
    opt_state: optional optax state, item `opt_state` (what
      `RestoreConfig.restore_optimizer_state` restores).

  Returns:
    The step directory written.

  Raises:
    CheckpointError: if `root` or a parent of it is a file, or `root` already
      has the step.
  """
  if problem := not_a_directory("Checkpoint directory", root):
    raise CheckpointError(problem)
  if (absolute_path(root) / str(step)).exists():
    raise CheckpointError(
      f"Checkpoint directory {shown(root)} already has step {step}; write to a new directory"
    )
  items: dict[str, ocp.args.CheckpointArgs] = {PARAMS: ocp.args.StandardSave(params)}
  if config is not None:
    items[CONFIG] = ocp.args.JsonSave(dict(config))
  if opt_state is not None:
    items[OPT_STATE] = ocp.args.StandardSave(opt_state)
  with ocp.CheckpointManager(
    absolute_path(root),
    options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False),
  ) as manager:
    manager.save(step, args=ocp.args.Composite(**items), force=True)
  step_dir = absolute_path(root) / str(step)
  if jax.process_index() == 0:
    write_file_manifest(step_dir)
  return step_dir
