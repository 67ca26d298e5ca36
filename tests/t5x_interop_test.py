"""T5X checkpoint import/export: layouts, Adafactor state, the converter, and parity with T5X.

The parity tests run T5X itself (`tests/t5x_peer_side.py` in the T5X peer's venv, made by
`bash ../shared/peers/install_t5x.sh $HOME/t5x_peer`); they are skipped, saying so, when
that venv is missing. Set T5X_PEER_PYTHON to use another interpreter.
"""

import dataclasses
import functools
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import tensorstore as ts
from flax import linen as nn
from flax import serialization, traverse_util

from t5x_lite import models
from t5x_lite.nn import network
from t5x_lite.checkpoint import checkpoints, partial_restore
from t5x_lite.training import optimizers, partitioning
from t5x_lite.training import trainer
from t5x_lite.interop import t5x as t5x_interop
from t5x_peer import PEER_PYTHON, needs_t5x_peer
from tiny_models import tiny_config

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Width 128 so that T5X's Adafactor (min_dim_size_to_factor=128) factors the kernels.
WIDE = dict(vocab_size=256, emb_dim=128, num_heads=4, head_dim=32, mlp_dim=256)


def _params(config: network.T5Config, seed: int = 0):
  return nn.meta.unbox(network.init_params(config, jax.random.PRNGKey(seed)))


def _flat(tree) -> dict:
  return traverse_util.flatten_dict(jax.device_get(tree), sep="/")


def _assert_bitwise(a, b) -> None:
  a, b = _flat(a), _flat(b)
  assert a.keys() == b.keys()
  for k in a:
    x, y = np.asarray(a[k]), np.asarray(b[k])
    assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), k


def _adafactor(config: network.T5Config) -> optimizers.Optimizer:
  boxed = jax.eval_shape(
    functools.partial(network.init_params, config), jax.ShapeDtypeStruct((2,), np.uint32)
  )
  return optimizers.adafactor(learning_rate=0.01).with_param_axes(nn.get_partition_spec(boxed))


def _trained_state(config: network.T5Config, steps: int = 2):
  """Params and Adafactor state after `steps` updates with random gradients."""
  params = _params(config)
  opt = _adafactor(config)
  state = opt.init(params)
  for i in range(steps):
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(i + 1), len(leaves))
    grads = treedef.unflatten([jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])
    updates, state = opt.update(grads, state, params)
    params = jax.tree.map(lambda p, u: p + u, params, updates)
  return params, state


@pytest.mark.parametrize(
  "per_layer,scanned",
  [(False, False), (True, False), (True, True)],  # flaxformer's scanned T5: a bias per layer
  ids=["unscanned", "unscanned_relpos_per_layer", "scanned"],
)
def test_params_round_trip_bitwise_in_t5x_layouts(per_layer, scanned):
  config = tiny_config(**WIDE, relpos_bias_per_layer=per_layer)
  params = _params(config)
  t5x = t5x_interop.params_to_t5x(params, config, scanned)
  layer = "encoder/encoder/" if scanned else "encoder/layers_1/"
  query, out = t5x[f"{layer}attention/query/kernel"], t5x[f"{layer}attention/out/kernel"]
  if scanned:  # flaxformer scans parameters on axis 1
    assert query.shape == (128, 2, 128) and out.shape == (128, 2, 128)
    assert t5x["decoder/decoder/relpos_bias/rel_embedding"].shape == (4, 2, 32)
    np.testing.assert_array_equal(
      query[:, 1].reshape(128, 4, 32), params["encoder"]["layers_1"]["attention"]["query"]["kernel"]
    )
  else:  # 2-D kernels [embed, heads*kv] and [heads*kv, embed]
    assert query.shape == (128, 128) and out.shape == (128, 128)
  assert t5x_interop.is_scanned(t5x) == scanned
  assert network.T5Config(**t5x_interop.config_fields(t5x), dropout_rate=0.0) == config
  _assert_bitwise(t5x_interop.params_from_t5x(t5x, config), params)


def test_config_fields_of_t5_1_0():
  config = tiny_config(**WIDE, mlp_activations=("relu",), logits_via_embedding=True)
  fields = t5x_interop.config_fields(t5x_interop.params_to_t5x(_params(config), config))
  assert network.T5Config(**fields, dropout_rate=0.0) == config


@pytest.mark.parametrize("scanned", [False, True], ids=["unscanned", "scanned"])
def test_adafactor_state_round_trips_and_has_t5x_shapes(scanned):
  config = tiny_config(**WIDE, relpos_bias_per_layer=scanned)
  _, state = _trained_state(config)
  t5x = t5x_interop.opt_state_to_t5x(state, config, 128, scanned)
  fresh = t5x_interop.fresh_t5x_param_states(config, 128, scanned)
  assert {k: v.shape for k, v in t5x.items()} == {k: v.shape for k, v in fresh.items()}
  layer = "encoder/encoder/" if scanned else "encoder/layers_0/"
  assert t5x[f"{layer}attention/query/kernel/v_col"].shape == ((2, 128) if scanned else (128,))
  assert t5x[f"{layer}pre_mlp_layer_norm/scale/v"].shape == ((128, 2) if scanned else (128,))
  restored = t5x_interop.opt_state_from_t5x(
    t5x, 7, config, _adafactor(config).init(_params(config))
  )
  ours, back = (t5x_interop._the_factored_state(s) for s in (state, restored))
  for slot in ("v_row", "v_col", "v"):
    _assert_bitwise(getattr(back, slot), getattr(ours, slot))
  counts = [
    int(leaf)
    for path, leaf in jax.tree_util.tree_leaves_with_path(restored)
    if getattr(path[-1], "name", None) == "count"
  ]
  assert counts and set(counts) == {7}


def test_factoring_mismatch_is_named():
  """At width 32 T5X's Adafactor factors nothing; t5x_lite's factors 3-D attention kernels."""
  config = tiny_config()
  _, state = _trained_state(config, steps=1)
  with pytest.raises(
    t5x_interop.T5XCheckpointError,
    match=r"factored '\w+/layers_0/\w*attention/.*use --optimizer_state=false",
  ):
    t5x_interop.opt_state_to_t5x(state, config, 128)


def _run_converter(*flags: str, cwd: str, check: bool = True) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, os.path.join(REPO_ROOT, "tools", "convert_t5x_checkpoint.py"), *flags],
    check=check,
    cwd=cwd,
    capture_output=True,
    text=True,
  )


def _error_line(result: subprocess.CompletedProcess) -> str:
  """The converter's one ERROR line (exit status 1, no traceback)."""
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
  [line] = [x for x in result.stderr.splitlines() if x.startswith("ERROR:")]
  return line


def _restore(root: str):
  [(step, step_dir)] = checkpoints.find_steps(root)
  config = checkpoints.model_config(step_dir)
  abstract, _ = partitioning.Partitioner().abstract_params(
    functools.partial(network.init_params, config)
  )
  return step, config, checkpoints.restore_params(step_dir, abstract)


@pytest.mark.slow
def test_converter_round_trips_both_t5x_formats_with_relative_paths(tmp_path):
  """t5x_lite -> T5X (orbax) -> t5x_lite -> T5X (legacy msgpack) -> t5x_lite, Adafactor
  state included, from relative paths; every array bitwise equal."""
  config = tiny_config(**WIDE)
  params, state = _trained_state(config)
  checkpoints.write_params_checkpoint(
    tmp_path / "ours", params, step=2, config=dataclasses.asdict(config), opt_state=state
  )
  cwd = str(tmp_path)
  _run_converter("--direction=to_t5x", "--checkpoint_dir=ours", "--output_dir=t5x", cwd=cwd)
  assert (tmp_path / "t5x" / "checkpoint_2" / "state").is_dir()
  _run_converter("--t5x_checkpoint=t5x", "--output_dir=back", cwd=cwd)
  _run_converter(
    "--direction=to_t5x",
    "--checkpoint_dir=back",
    "--output_dir=legacy",
    "--t5x_format=legacy",
    cwd=cwd,
  )
  assert (tmp_path / "legacy" / "checkpoint_2" / "checkpoint").is_file()
  result = _run_converter("--t5x_checkpoint=legacy/checkpoint_2", "--output_dir=again", cwd=cwd)
  assert "params and Adafactor state" in result.stdout
  step, restored_config, restored = _restore(str(tmp_path / "again"))
  assert step == 2 and restored_config == config
  _assert_bitwise(restored, params)
  # Training continues from it: RestoreConfig(restore_optimizer_state=True), as the
  # trainer builds the state for train.optimizer = @adafactor().
  model = models.EncoderDecoderModel(network.Transformer(config), None, None)
  partitioner = partitioning.Partitioner()
  abstract, _ = trainer.abstract_train_state(
    model, optimizers.adafactor(learning_rate=0.01), partitioner
  )
  start = partial_restore.restore_start(
    tmp_path / "again",
    abstract.params,
    _params(config, seed=1),
    partial_restore.RestoreConfig(restore_optimizer_state=True),
    abstract_opt_state=abstract.opt_state,
  )
  assert start.step == 2
  _assert_bitwise(start.params, params)
  for slot in ("v_row", "v_col", "v"):
    _assert_bitwise(
      getattr(t5x_interop._the_factored_state(start.opt_state), slot),
      getattr(t5x_interop._the_factored_state(state), slot),
    )


@pytest.mark.slow
def test_bad_inputs_are_one_line_each(tmp_path):
  cwd = str(tmp_path)
  (tmp_path / "empty").mkdir()
  line = _error_line(
    _run_converter("--t5x_checkpoint=empty", "--output_dir=out", cwd=cwd, check=False)
  )
  assert "empty" in line and "is not a T5X checkpoint" in line
  config = tiny_config(**WIDE)
  t5x = t5x_interop.params_to_t5x(_params(config), config)
  states = t5x_interop.fresh_t5x_param_states(config, 128)
  t5x_interop.write_checkpoint(tmp_path / "t5x", t5x, states, 3)
  line = _error_line(
    _run_converter(
      "--t5x_checkpoint=t5x", "--output_dir=out", "--gin.T5Config.num_heads=8", cwd=cwd, check=False
    )
  )
  assert "is shaped (128, 128), the configured T5 needs (128, 256)" in line
  assert "T5Config bindings" in line
  del t5x["decoder/layers_1/mlp/wo/kernel"]
  t5x_interop.write_checkpoint(tmp_path / "partial", t5x, states, 3, legacy=True)
  line = _error_line(
    _run_converter("--t5x_checkpoint=partial", "--output_dir=out", cwd=cwd, check=False)
  )
  assert "lacks parameter 'decoder/layers_1/mlp/wo/kernel'" in line
  assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- parity with T5X itself

ARCHS = [
  ("flaxformer_1_1", False),
  ("flaxformer_1_0", False),
  ("examples_1_1", False),
  ("examples_1_0", False),
  ("flaxformer_1_1", True),
]


def _peer(*args: str) -> dict:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device, as T5X's
  result = subprocess.run(
    [PEER_PYTHON, os.path.join(REPO_ROOT, "tests", "t5x_peer_side.py"), *args],
    capture_output=True,
    text=True,
    check=False,
    env=env,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@needs_t5x_peer
@pytest.mark.parametrize("t5x_format", ["orbax", "legacy"])
@pytest.mark.parametrize("arch,scan", ARCHS, ids=[f"{a}{'_scan' if s else ''}" for a, s in ARCHS])
def test_parity_with_t5x(arch, scan, t5x_format, tmp_path):
  """T5X saves a trained tiny model; imported here, its logits on a padded, packed batch
  equal T5X's (loss-bearing positions, 1e-5); exported back, T5X restores every array of
  its TrainState (params, Adafactor state, step) bitwise."""
  scan_flag = ["--scan"] if scan else []
  out = tmp_path / "t5x"
  saved = _peer("save", f"--arch={arch}", *scan_flag, f"--format={t5x_format}", f"--out={out}")
  cwd = str(tmp_path)
  _run_converter(f"--t5x_checkpoint={saved['checkpoint']}", "--output_dir=ours", cwd=cwd)
  _, config, params = _restore(str(tmp_path / "ours"))
  batch = dict(np.load(out / "parity.npz"))
  logits = network.Transformer(config).apply(
    {"params": params},
    *(batch[k] for k in ("encoder_input_tokens", "decoder_input_tokens", "decoder_target_tokens")),
    **{k: batch[k] for k in ("encoder_segment_ids", "decoder_segment_ids")},
    **{k: batch[k] for k in ("encoder_positions", "decoder_positions")},
    enable_dropout=False,
  )
  valid = batch["decoder_target_tokens"] > 0
  diff = np.abs(np.asarray(logits) - batch["logits"])[valid].max()
  print(
    json.dumps(
      {"arch": arch, "scan": scan, "format": t5x_format, "max_abs_logit_diff": float(diff)}
    )
  )
  assert diff <= 1e-5
  _run_converter(
    "--direction=to_t5x",
    "--checkpoint_dir=ours",
    "--output_dir=back",
    f"--t5x_format={t5x_format}",
    cwd=cwd,
  )
  compared = _peer(
    "compare",
    f"--arch={arch}",
    *scan_flag,
    f"--checkpoint={tmp_path / 'back' / 'checkpoint_2'}",
    f"--reference={saved['checkpoint']}",
  )
  assert compared["equal"] and compared["optimizer_state"], compared


def test_legacy_tensorstore_arrays_are_read_and_a_missing_one_is_named(tmp_path):
  """T5X's legacy layout keeps partitioned arrays as zarr arrays beside the msgpack file,
  referenced by relative tensorstore specs."""
  config = tiny_config(**WIDE)
  params = t5x_interop.params_to_t5x(_params(config), config)
  states = t5x_interop.fresh_t5x_param_states(config, 128)
  step_dir = t5x_interop.write_checkpoint(tmp_path, params, states, 4, legacy=True)
  contents = serialization.msgpack_restore((step_dir / "checkpoint").read_bytes())
  name = "target.decoder.logits_dense.kernel"
  kernel = params["decoder/logits_dense/kernel"]
  spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": name}}
  absolute = {**spec, "kvstore": {"driver": "file", "path": str(step_dir / name)}}
  store = ts.open(absolute, create=True, dtype=ts.float32, shape=kernel.shape).result()
  store.write(kernel).result()
  contents["optimizer"]["target"]["decoder"]["logits_dense"]["kernel"] = spec
  (step_dir / "checkpoint").write_bytes(serialization.msgpack_serialize(contents))
  read, _, step = t5x_interop.read_state(t5x_interop.find_step_dir(tmp_path))
  assert step == 4
  np.testing.assert_array_equal(read["decoder/logits_dense/kernel"], kernel)
  for path in (step_dir / name).iterdir():
    path.unlink()
  with pytest.raises(checkpoints.CorruptCheckpointError, match=f"Cannot read T5X array .*{name}"):
    t5x_interop.read_state(step_dir)
