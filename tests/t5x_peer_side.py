"""The T5X side of the checkpoint-parity test: save, restore and compare with T5X itself.

This script is NOT imported by the test suite and does not use t5x_lite. It is run with the
interpreter of a separate virtualenv in which Google's T5X and flaxformer are installed, e.g.

  $HOME/t5x_peer/venv/bin/python tests/t5x_peer_side.py save \\
      --arch=flaxformer_1_1 [--scan] --format=orbax|legacy --out=DIR [--params_only]
  $HOME/t5x_peer/venv/bin/python tests/t5x_peer_side.py compare \\
      --arch=flaxformer_1_1 [--scan] --checkpoint=X --reference=Y
  $HOME/t5x_peer/venv/bin/python tests/t5x_peer_side.py dump --arch=flaxformer_1_1 [--scan]

The t5x and flaxformer source trees are found at `$T5X_PEER_SRC/{t5x,flaxformer}`, or else at
`<venv>/../src/{t5x,flaxformer}` relative to the interpreter (the layout of install_t5x.sh).

Architectures (`--arch`), all tiny float32 models with dropout 0 (vocab 256, embed 128, 4 heads
of dim 32, mlp 256, 2 encoder + 2 decoder layers; sizes >= 128 so that T5X's Adafactor factors
the 2-D kernels):

  flaxformer_1_1  flaxformer/t5x/configs/t5/models/t5_1_1_small.gin
  flaxformer_1_0  flaxformer/t5x/configs/t5/models/t5_small.gin
  examples_1_1    t5x/examples/t5/t5_1_1/small.gin (T5X's own examples/t5 network)
  examples_1_0    t5x/examples/t5/t5_1_0/small.gin

`--scan` (flaxformer archs only) scans the encoder and decoder layers (params stacked on axis 1,
the `layers` logical axis) with per-layer relative position biases, as flaxformer's
moe/runs/scan.gin does, and gives Adafactor T5X's logical factor rules so the stacked kernels
are factored per layer.

Subcommands:

  save     Builds the model with gin, initializes the TrainState from PRNGKey(0) under
           PjitPartitioner(num_partitions=1), runs 2 Trainer train steps (Adafactor, constant LR
           0.01) on a fixed random batch, and saves it with T5X's own checkpointer into
           DIR/checkpoint_2: `--format=orbax` uses checkpoints.OrbaxCheckpointManagerInterface
           (T5X's default, use_orbax=True), `--format=legacy` uses checkpoints.Checkpointer
           (msgpack + tensorstore). `--params_only` drops the optimizer param_states from the
           saved state (through T5X's save-time state_transformation_fns). Also writes
           DIR/parity.npz: a fixed padded and packed batch (T5X feature names) and the float32
           logits of the trained model on it. Prints one JSON line.
  compare  Restores the T5X checkpoint directories X (--checkpoint) and Y (--reference), each
           in orbax or legacy format (detected), with T5X's own restore path
           (utils.create_checkpoint_manager_and_restore with a RestoreCheckpointConfig, as
           train.py does), compares their state dicts bitwise, and computes logits with X's
           params on the batch in <parent of Y>/parity.npz. Prints one JSON line:
           {"equal", "leaves", "mismatched", "missing", "extra", "optimizer_state",
            "max_abs_logit_diff", "step", "checkpoint_format", "reference_format", ...}.
           "equal" needs every restored leaf bitwise equal (dtype, shape, values) and the same
           leaf paths both as restored and as stored on disk ("missing"/"extra" are relative
           to Y). If X holds no optimizer param_states, T5X's strict restore refuses it
           ("strict_restore_error"); it is then restored params-only (assignment map
           `state/param_states.*` -> None with fallback_to_scratch), "optimizer_state" is false
           and only target/ and state/step are compared. If T5X cannot restore X or Y at all,
           the line has "equal": false and "restore_error".
  dump     Prints every state_dict leaf path (slash-joined) with its shape and dtype, then the
           logical axis names of every param ("logical_axes target/...").
"""

import argparse
import itertools
import json
import os
import sys
from typing import Any, Callable

import numpy as np

# Before jax, tensorflow and t5x are imported (lazily, by the subcommands).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

ARCHS = ("flaxformer_1_1", "flaxformer_1_0", "examples_1_1", "examples_1_0")
GIN_FILES = {
  "flaxformer_1_1": "flaxformer/t5x/configs/t5/models/t5_1_1_small.gin",
  "flaxformer_1_0": "flaxformer/t5x/configs/t5/models/t5_small.gin",
  "examples_1_1": "t5x/examples/t5/t5_1_1/small.gin",
  "examples_1_0": "t5x/examples/t5/t5_1_0/small.gin",
}
VOCAB = 256
EMBED = 128
HEADS = 4
HEAD_DIM = 32
MLP = 256
LAYERS = 2
LEARNING_RATE = 0.01
TRAIN_STEPS = 2
# The fixed training batch: batch size, encoder length, decoder length.
TRAIN_SHAPE = (4, 16, 8)
# The parity batch: batch size, encoder length, decoder length.
PARITY_SHAPE = (3, 12, 10)
FEATURES = (
  "encoder_input_tokens",
  "decoder_input_tokens",
  "decoder_target_tokens",
  "encoder_segment_ids",
  "decoder_segment_ids",
  "encoder_positions",
  "decoder_positions",
)
# Flaxformer scanned layout, adapted from flaxformer/t5x/configs/moe/runs/scan.gin to
# t5_architecture. EncoderDecoder.scan_layers is only passed on to predict_fn; the Encoder and
# Decoder fields are what actually scan. scan.gin's `adafactor.standard_factor_rules` (an
# HParamMap factor_map) no longer exists in T5X, whose replacement is the logical factor rules
# (the `layers` axis becomes a BATCH dimension of the factored second moments).
SCAN_BINDINGS = (
  # Bindings are parsed like a gin file of their own: register what they reference.
  "from __gin__ import dynamic_registration",
  "from flaxformer.architectures.t5 import t5_architecture",
  "from flaxformer.components import relative_position_biases",
  "from t5x import adafactor",
  "t5_architecture.EncoderDecoder.scan_layers = True",
  "t5_architecture.Encoder.scan_layers = True",
  "t5_architecture.Decoder.scan_layers = True",
  "t5_architecture.EncoderLayer.scanned = True",
  "t5_architecture.DecoderLayer.scanned = True",
  "t5_architecture.Encoder.shared_relative_position_bias_factory = None",
  "t5_architecture.Decoder.shared_relative_position_bias_factory = None",
  "t5_architecture.EncoderLayer.relative_position_bias_factory = "
  "@relative_position_biases.RelativePositionBiases",
  "t5_architecture.DecoderLayer.relative_position_bias_factory = "
  "@relative_position_biases.RelativePositionBiases",
  "adafactor.Adafactor.logical_factor_rules = @adafactor.standard_logical_factor_rules()",
)


def source_root() -> str:
  """Where the t5x and flaxformer source trees live (as in shared/peers/t5x_train_step.py)."""
  venv = os.path.dirname(os.path.dirname(os.path.abspath(sys.executable)))
  return os.environ.get("T5X_PEER_SRC") or os.path.join(os.path.dirname(venv), "src")


def gin_bindings(arch: str, scan: bool) -> list[str]:
  """The gin bindings that shrink `arch` to the tiny float32 model."""
  if arch.startswith("flaxformer"):
    bindings = [
      "ACTIVATION_DTYPE = 'float32'",
      "DROPOUT_RATE = 0.0",
      f"NUM_EMBEDDINGS = {VOCAB}",
      f"EMBED_DIM = {EMBED}",
      f"NUM_HEADS = {HEADS}",
      f"HEAD_DIM = {HEAD_DIM}",
      f"MLP_DIM = {MLP}",
      f"NUM_ENCODER_LAYERS = {LAYERS}",
      f"NUM_DECODER_LAYERS = {LAYERS}",
    ]
    if scan:
      bindings += SCAN_BINDINGS
    return bindings
  if scan:
    raise SystemExit("--scan is only supported for the flaxformer architectures")
  return [
    "DROPOUT_RATE = 0.0",
    "network.T5Config.dtype = 'float32'",
    f"network.T5Config.vocab_size = {VOCAB}",
    f"network.T5Config.emb_dim = {EMBED}",
    f"network.T5Config.num_heads = {HEADS}",
    f"network.T5Config.head_dim = {HEAD_DIM}",
    f"network.T5Config.mlp_dim = {MLP}",
    f"network.T5Config.num_encoder_layers = {LAYERS}",
    f"network.T5Config.num_decoder_layers = {LAYERS}",
    "network.T5Config.dropout_rate = 0.0",
  ]


def build_model(arch: str, scan: bool) -> Any:
  """Builds MODEL (a t5x.models.EncoderDecoderModel) from the arch's gin file."""
  import gin

  repo = "flaxformer" if arch.startswith("flaxformer") else "t5x"
  # gin cannot resolve the package-relative includes of these gin files (flaxformer's configs
  # are a namespace package), so parse them with the source tree as the working directory.
  cwd = os.getcwd()
  os.chdir(os.path.join(source_root(), repo))
  try:
    gin.parse_config_files_and_bindings(
      [GIN_FILES[arch]], gin_bindings(arch, scan), finalize_config=False
    )
  finally:
    os.chdir(cwd)
  return gin.query_parameter("%MODEL").scoped_configurable_fn()


class Setup:
  """A model with its partitioner and TrainStateInitializer."""

  def __init__(self, arch: str, scan: bool):
    import jax.numpy as jnp
    from t5x import partitioning, utils

    self.arch = arch
    self.scan = scan
    self.model = build_model(arch, scan)
    self.partitioner = partitioning.PjitPartitioner(
      num_partitions=1, logical_axis_rules=partitioning.standard_logical_axis_rules()
    )
    batch, enc_len, dec_len = TRAIN_SHAPE
    input_shapes = {
      "encoder_input_tokens": (batch, enc_len),
      "decoder_input_tokens": (batch, dec_len),
      "decoder_target_tokens": (batch, dec_len),
      "decoder_loss_weights": (batch, dec_len),
    }
    self.initializer = utils.TrainStateInitializer(
      optimizer_def=self.model.optimizer_def,
      init_fn=self.model.get_initial_variables,
      input_shapes=input_shapes,
      input_types={k: jnp.int32 for k in input_shapes},
      partitioner=self.partitioner,
    )

  def logits(self, params: Any, batch: dict[str, np.ndarray]) -> np.ndarray:
    """float32 logits of the model with `params` on `batch` (T5X feature names), no dropout."""
    import jax

    def forward(params: Any, batch: dict[str, Any]) -> Any:
      # initializer.__init__ may have cloned the module (spmd annotations for scanned layers).
      return self.model.module.apply(
        {"params": params},
        batch["encoder_input_tokens"],
        batch["decoder_input_tokens"],
        batch["decoder_target_tokens"],
        encoder_segment_ids=batch["encoder_segment_ids"],
        decoder_segment_ids=batch["decoder_segment_ids"],
        encoder_positions=batch["encoder_positions"],
        decoder_positions=batch["decoder_positions"],
        enable_dropout=False,
      )

    inputs = {k: np.asarray(batch[k], np.int32) for k in FEATURES}
    return np.asarray(jax.jit(forward)(params, inputs), np.float32)


def flat_state(state_dict: Any) -> dict[str, Any]:
  """Flattens a (nested) state dict to {'a/b/c': leaf}."""
  from flax import traverse_util

  return {"/".join(k): v for k, v in traverse_util.flatten_dict(state_dict).items()}


def train_batch() -> dict[str, np.ndarray]:
  """A fixed random (unpacked, unpadded) training batch."""
  rng = np.random.default_rng(0)
  batch, enc_len, dec_len = TRAIN_SHAPE
  targets = rng.integers(2, VOCAB, size=(batch, dec_len), dtype=np.int32)
  return {
    "encoder_input_tokens": rng.integers(2, VOCAB, size=(batch, enc_len), dtype=np.int32),
    "decoder_input_tokens": np.concatenate(
      [np.zeros((batch, 1), np.int32), targets[:, :-1]], axis=1
    ),
    "decoder_target_tokens": targets,
    "decoder_loss_weights": np.ones((batch, dec_len), np.int32),
  }


def parity_batch() -> dict[str, np.ndarray]:
  """The fixed padded and packed parity batch, laid out as seqio's packing does.

  Row 0 holds one segment followed by padding, row 1 two packed segments followed by padding,
  row 2 one segment filling the whole row. Each segment ends with EOS (1); positions restart at
  0 in each segment; decoder inputs are the targets shifted right within each segment (0 at each
  segment start); padding has token 0, segment id 0 and position 0.
  """
  rng = np.random.default_rng(1234)
  batch, enc_len, dec_len = PARITY_SHAPE
  # Segment lengths per row: (encoder lengths, decoder lengths).
  layout = [((7,), (6,)), ((5, 4), (4, 3)), ((enc_len,), (dec_len,))]
  out = {
    k: np.zeros((batch, enc_len if k.startswith("encoder") else dec_len), np.int32)
    for k in FEATURES
  }
  for row, (enc_segs, dec_segs) in enumerate(layout):
    for side, segs in (("encoder", enc_segs), ("decoder", dec_segs)):
      start = 0
      for seg_id, length in enumerate(segs, start=1):
        tokens = rng.integers(2, VOCAB, size=length, dtype=np.int32)
        tokens[-1] = 1
        span = slice(start, start + length)
        out[f"{side}_segment_ids"][row, span] = seg_id
        out[f"{side}_positions"][row, span] = np.arange(length, dtype=np.int32)
        if side == "encoder":
          out["encoder_input_tokens"][row, span] = tokens
        else:
          out["decoder_target_tokens"][row, span] = tokens
          out["decoder_input_tokens"][row, span] = np.concatenate([[0], tokens[:-1]])
        start += length
  return out


def drop_param_states(state_dict: Any, infos: Any) -> tuple[Any, Any]:
  """Save-time state transformation: keep the params and step, drop the optimizer states."""

  def prune(tree: Any) -> Any:
    tree = dict(tree)
    tree["state"] = {k: v for k, v in tree["state"].items() if k != "param_states"}
    return tree

  return prune(state_dict), prune(infos)


def cmd_save(args: argparse.Namespace) -> dict[str, Any]:
  import jax
  from t5x import checkpoints, utils
  from t5x import trainer as trainer_lib

  setup = Setup(args.arch, args.scan)
  train_state = setup.initializer.from_scratch(jax.random.PRNGKey(0))
  trainer = trainer_lib.Trainer(
    model=setup.model,
    train_state=train_state,
    partitioner=setup.partitioner,
    eval_names=[],
    summary_dir=None,
    train_state_axes=setup.initializer.train_state_axes,
    rng=jax.random.PRNGKey(1),
    learning_rate_fn=utils.create_learning_rate_scheduler(
      factors="constant", base_learning_rate=LEARNING_RATE
    ),
    num_microbatches=None,
  )
  batch = train_batch()
  summary = trainer.train(itertools.repeat(batch), num_steps=TRAIN_STEPS).result()
  # T5X's train summary of the 2 steps (sanity only: the loss is not normalized per token).
  loss = float(np.asarray(getattr(summary["loss"], "value", summary["loss"])))
  train_state = trainer.train_state
  jax.block_until_ready(train_state)
  trainer.close()
  step = int(np.asarray(train_state.step))

  out = os.path.abspath(args.out)
  os.makedirs(out, exist_ok=True)
  transforms = [drop_param_states] if args.params_only else []
  if args.format == "orbax":
    manager = checkpoints.OrbaxCheckpointManagerInterface(
      directory=out,
      train_state=setup.initializer.global_train_state_shape,
      partitioner=setup.partitioner,
      save_dtype="float32",  # SaveCheckpointConfig's default, as train.py passes it.
    )
    manager.save(train_state, transforms)
    manager.wait_until_finished()
    manager.close()
  else:
    checkpointer = checkpoints.Checkpointer(
      train_state=setup.initializer.global_train_state_shape,
      partitioner=setup.partitioner,
      checkpoints_dir=out,
    )
    checkpointer.save(train_state, transforms)
  ckpt_dir = os.path.join(out, f"checkpoint_{step}")
  if not os.path.isdir(ckpt_dir):
    raise SystemExit(f"T5X did not write {ckpt_dir}: {sorted(os.listdir(out))}")

  parity = parity_batch()
  logits = setup.logits(train_state.params, parity)
  np.savez(os.path.join(out, "parity.npz"), **parity, logits=logits)
  num_params = int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(train_state.params)))
  return {
    "checkpoint": ckpt_dir,
    "step": step,
    "format": args.format,
    "arch": args.arch,
    "scan": args.scan,
    "num_params": num_params,
    "params_only": args.params_only,
    "train_loss": loss,
  }


def checkpoint_format(path: str) -> str:
  """'orbax' for a checkpoint_N dir with a state/ subdir, 'legacy' for one with a msgpack."""
  if os.path.isdir(os.path.join(path, "state")):
    return "orbax"
  if os.path.isfile(os.path.join(path, "checkpoint")):
    return "legacy"
  raise SystemExit(f"{path} is neither an orbax (state/) nor a legacy (checkpoint) T5X checkpoint")


def checkpoint_keys(path: str, fmt: str) -> set[str]:
  """Slash-joined paths of every leaf stored in the checkpoint at `path`, model-independent.

  T5X's restore only reads what the model's TrainState asks for (orbax drops extra keys), so
  the stored key sets are compared too. Legacy checkpoints are listed with T5X's own
  load_t5x_checkpoint (lazily, nothing is read), orbax ones from orbax's tree metadata.
  """
  from flax import traverse_util

  if fmt == "legacy":
    from t5x import checkpoints

    tree = checkpoints.load_t5x_checkpoint(path, lazy_parameters=True)
  else:
    import orbax.checkpoint as ocp

    tree = ocp.PyTreeCheckpointer().metadata(os.path.join(path, "state"))
    tree = getattr(tree, "item_metadata", tree)
    tree = getattr(tree, "tree", tree)
  return set(traverse_util.flatten_dict(dict(tree), sep="/"))


def restore(setup: Setup, path: str, params_only: bool) -> Any:
  """Restores the T5X checkpoint dir `path` through T5X's train.py restore path.

  With `params_only`, the optimizer param_states are dropped from the checkpoint with an
  assignment map and filled in from scratch (T5X's documented way to load params only).
  """
  import jax
  from t5x import utils

  kwargs: dict[str, Any] = {}
  if params_only:
    kwargs = {"assignment_map": ((r"state/param_states.*", None),), "fallback_to_scratch": True}
  cfg = utils.RestoreCheckpointConfig(path=path, mode="specific", dtype=None, **kwargs)
  train_state, manager = utils.create_checkpoint_manager_and_restore(
    train_state_initializer=setup.initializer,
    partitioner=setup.partitioner,
    restore_checkpoint_cfg=cfg,
    restore_path=path,
    fallback_init_rng=jax.random.PRNGKey(0),
    model_dir=os.path.dirname(path),
    use_orbax=checkpoint_format(path) == "orbax",
  )
  manager.close()
  if train_state is None:
    raise SystemExit(f"T5X restored nothing from {path}")
  return train_state


def cmd_compare(args: argparse.Namespace) -> dict[str, Any]:
  setup = Setup(args.arch, args.scan)
  ckpt, ref = os.path.abspath(args.checkpoint), os.path.abspath(args.reference)
  ckpt_fmt, ref_fmt = checkpoint_format(ckpt), checkpoint_format(ref)
  ckpt_keys, ref_keys = checkpoint_keys(ckpt, ckpt_fmt), checkpoint_keys(ref, ref_fmt)
  optimizer_state = any(k.startswith("state/param_states/") for k in ckpt_keys)
  result: dict[str, Any] = {"checkpoint_format": ckpt_fmt, "reference_format": ref_fmt}
  try:
    try:
      state = restore(setup, ckpt, params_only=False)
    except Exception as e:
      if optimizer_state:
        raise
      # T5X refuses a checkpoint without param_states unless told to restore params only.
      result["strict_restore_error"] = f"{type(e).__name__}: {str(e)[:300]}"
      state = restore(setup, ckpt, params_only=True)
    reference = restore(setup, ref, params_only=False)
  except Exception as e:
    result.update(
      {
        "equal": False,
        "optimizer_state": optimizer_state,
        "mismatched": [],
        "missing": sorted(ref_keys - ckpt_keys)[:50],
        "extra": sorted(ckpt_keys - ref_keys)[:50],
        "restore_error": f"{type(e).__name__}: {str(e)[:1000]}",
      }
    )
    return result

  got = {k: np.asarray(v) for k, v in flat_state(state.state_dict()).items()}
  want = {k: np.asarray(v) for k, v in flat_state(reference.state_dict()).items()}
  if not optimizer_state:
    # T5X filled the param_states in from scratch; they are not the checkpoint's.
    def keep(k: str) -> bool:
      return not k.startswith("state/param_states/")

    got = {k: v for k, v in got.items() if keep(k)}
    want = {k: v for k, v in want.items() if keep(k)}
    ckpt_keys = {k for k in ckpt_keys if keep(k)}
    ref_keys = {k for k in ref_keys if keep(k)}
  mismatched = [
    k
    for k in sorted(set(got) & set(want))
    if got[k].dtype != want[k].dtype
    or got[k].shape != want[k].shape
    or not np.array_equal(got[k], want[k])
  ]
  # Leaves missing from / extra in X, both in what T5X restored and in what is stored on disk.
  missing = sorted((set(want) - set(got)) | (ref_keys - ckpt_keys))
  extra = sorted((set(got) - set(want)) | (ckpt_keys - ref_keys))

  parity = dict(np.load(os.path.join(os.path.dirname(ref), "parity.npz")))
  logits = setup.logits(state.params, parity)
  diff = float(np.max(np.abs(logits.astype(np.float64) - parity["logits"].astype(np.float64))))
  result.update(
    {
      "equal": not mismatched and not missing and not extra,
      "leaves": len(got),
      "mismatched": mismatched[:20],
      "missing": missing,
      "extra": extra,
      "optimizer_state": optimizer_state,
      "max_abs_logit_diff": diff,
      "step": int(np.asarray(got["state/step"])),
    }
  )
  if mismatched:
    k = mismatched[0]
    result["first_mismatch"] = {
      "path": k,
      "checkpoint": [str(got[k].dtype), list(got[k].shape)],
      "reference": [str(want[k].dtype), list(want[k].shape)],
      "max_abs_diff": float(np.max(np.abs(got[k].astype(np.float64) - want[k])))
      if got[k].shape == want[k].shape
      else None,
    }
  return result


def cmd_dump(args: argparse.Namespace) -> None:
  import jax
  from flax.linen import partitioning as flax_partitioning
  from jax.sharding import PartitionSpec

  def is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)

  setup = Setup(args.arch, args.scan)
  shape = setup.initializer.global_train_state_shape
  for path, leaf in flat_state(shape.state_dict()).items():
    print(f"{path} {tuple(leaf.shape)} {leaf.dtype}")
  if shape.params_axes is not None:
    names = flax_partitioning.get_axis_names(shape.params_axes)
    for path, spec in flat_state(jax.tree_util.tree_map(tuple, names, is_leaf=is_spec)).items():
      print(f"logical_axes target/{path} {spec}")


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="cmd", required=True)

  def command(name: str, fn: Callable[[argparse.Namespace], Any]) -> argparse.ArgumentParser:
    p = sub.add_parser(name)
    p.add_argument("--arch", required=True, choices=ARCHS)
    p.add_argument("--scan", action="store_true", help="scanned layers (flaxformer only)")
    p.set_defaults(fn=fn)
    return p

  save = command("save", cmd_save)
  save.add_argument("--format", required=True, choices=("orbax", "legacy"))
  save.add_argument("--out", required=True, help="directory that will hold checkpoint_2/")
  save.add_argument("--params_only", action="store_true", help="save without param_states")
  compare = command("compare", cmd_compare)
  compare.add_argument("--checkpoint", required=True, help="checkpoint_N dir to check")
  compare.add_argument("--reference", required=True, help="checkpoint_N dir written by save")
  command("dump", cmd_dump)
  args = parser.parse_args(argv)

  result = args.fn(args)
  if result is not None:
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
  main()
