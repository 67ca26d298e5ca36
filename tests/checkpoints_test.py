"""Tests for t5x_lite.checkpoint.checkpoints and t5x_lite.checkpoint.manifest."""

import dataclasses
import json
from pathlib import Path

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from t5x_lite.nn import network
from t5x_lite.checkpoint import checkpoints, train_checkpointer
from t5x_lite.checkpoint.manifest import FILE_MANIFEST
from t5x_lite.core.errors import CheckpointError, ConfigError, CorruptCheckpointError, UserError
from tiny_models import tiny_config


@pytest.fixture(scope="module")
def mesh() -> Mesh:
  return Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))


def _params(scale: float = 1.0) -> dict:
  return {
    "token_embedder": {"embedding": scale * jnp.arange(48.0).reshape(8, 6)},
    "encoder": {"encoder_norm": {"scale": scale * jnp.ones((6,))}},
  }


def _abstract(tree, mesh, specs=None):
  specs = specs or {}

  def leaf(path, x):
    name = "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
    spec = specs.get(name, P())
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

  return jax.tree_util.tree_map_with_path(leaf, tree)


class _CountingIterator:
  """A CheckpointableIterator that records its position in a text file."""

  def __init__(self, position: int = 0):
    self.position = position

  def save_state(self, path: str) -> None:
    with open(path + ".txt", "w") as f:
      f.write(str(self.position))

  def restore_state(self, path: str) -> None:
    with open(path + ".txt") as f:
      self.position = int(f.read())


def _save_steps(directory, steps, keep=2):
  optimizer = optax.adafactor(1e-2)
  ckpt = train_checkpointer.TrainCheckpointer(directory, save_period=2, keep=keep)
  for step in steps:
    params = _params(float(step))
    ckpt.save(step, params, optimizer.init(params), {"rng": [0, step]}, _CountingIterator(step))
  ckpt.close()
  return optimizer


def test_save_keep_and_restore_into_target_shardings(tmp_path, mesh):
  optimizer = _save_steps(tmp_path, [2, 4, 6])
  ckpt = train_checkpointer.TrainCheckpointer(tmp_path, keep=2)
  assert ckpt.all_steps() == [4, 6] and ckpt.latest_step() == 6
  specs = {"token_embedder/embedding": P("data", "model")}
  abstract_params = _abstract(_params(), mesh, specs)
  abstract_opt = _abstract(jax.eval_shape(optimizer.init, _params()), mesh)
  iterator = _CountingIterator()
  restored = ckpt.restore(6, abstract_params, abstract_opt, iterator)
  ckpt.close()
  np.testing.assert_array_equal(
    restored.params["token_embedder"]["embedding"], _params(6.0)["token_embedder"]["embedding"]
  )
  assert restored.params["token_embedder"]["embedding"].sharding == NamedSharding(
    mesh, specs["token_embedder/embedding"]
  )
  assert jax.tree.structure(restored.opt_state) == jax.tree.structure(abstract_opt)
  assert restored.meta == {"rng": [0, 6], "step": 6}
  assert iterator.position == 6
  assert (tmp_path / "6" / FILE_MANIFEST).exists()


def test_existing_step_is_not_overwritten(tmp_path):
  _save_steps(tmp_path, [2], keep=None)
  ckpt = train_checkpointer.TrainCheckpointer(tmp_path)
  params = _params(9.0)
  assert not ckpt.save(2, params, optax.adafactor(1e-2).init(params), {})
  ckpt.close()


def test_different_model_lists_paths_and_shapes(tmp_path, mesh):
  optimizer = _save_steps(tmp_path, [2])
  other = {
    "token_embedder": {"embedding": jnp.zeros((8, 4))},
    "decoder": {"decoder_norm": {"scale": jnp.ones((4,))}},
  }
  ckpt = train_checkpointer.TrainCheckpointer(tmp_path)
  with pytest.raises(checkpoints.CheckpointMismatchError) as e:
    ckpt.restore(2, _abstract(other, mesh), _abstract(jax.eval_shape(optimizer.init, other), mesh))
  ckpt.close()
  message = str(e.value)
  assert "shape mismatch: token_embedder/embedding checkpoint (8, 6) vs model (8, 4)" in message
  assert "missing in checkpoint: decoder/decoder_norm/scale (4,)" in message
  assert "unexpected in checkpoint: encoder/encoder_norm/scale (6,)" in message


@pytest.mark.parametrize("victim", ["params/manifest.ocdbt", "params/d", "train_meta/metadata"])
def test_truncated_file_is_named_and_older_step_still_restores(tmp_path, mesh, victim):
  optimizer = _save_steps(tmp_path, [2, 4])
  target = tmp_path / "4" / victim
  if target.is_dir():
    target = sorted(p for p in target.iterdir() if p.is_file())[0]
  with open(target, "r+b") as f:
    f.truncate(target.stat().st_size // 2)
  ckpt = train_checkpointer.TrainCheckpointer(tmp_path)
  abstract_opt = _abstract(jax.eval_shape(optimizer.init, _params()), mesh)
  with pytest.raises(CorruptCheckpointError, match=str(target)):
    ckpt.restore(4, _abstract(_params(), mesh), abstract_opt)
  restored = ckpt.restore(2, _abstract(_params(), mesh), abstract_opt)
  ckpt.close()
  assert float(restored.params["encoder"]["encoder_norm"]["scale"][0]) == 2.0


def test_flipped_byte_is_caught_by_checksum(tmp_path, mesh):
  _save_steps(tmp_path, [2])
  target = tmp_path / "2" / "train_meta" / "metadata"
  raw = bytearray(target.read_bytes())
  raw[-2] ^= 1
  target.write_bytes(bytes(raw))
  with pytest.raises(CorruptCheckpointError, match="CRC32 mismatch.*train_meta/metadata"):
    checkpoints.restore_params(tmp_path, _abstract(_params(), mesh))


def test_restore_params_for_finetuning_with_dtype_cast(tmp_path, mesh):
  _save_steps(tmp_path, [2, 4])
  specs = {"token_embedder/embedding": P("model")}
  params = checkpoints.restore_params(tmp_path, _abstract(_params(), mesh, specs), dtype="bfloat16")
  assert params["token_embedder"]["embedding"].dtype == jnp.bfloat16
  assert params["token_embedder"]["embedding"].sharding.spec == P("model")
  np.testing.assert_array_equal(
    np.asarray(params["token_embedder"]["embedding"], np.float32),
    np.asarray(_params(4.0)["token_embedder"]["embedding"]),
  )
  older = checkpoints.restore_params(tmp_path / "2", _abstract(_params(), mesh))
  assert float(older["encoder"]["encoder_norm"]["scale"][0]) == 2.0


def test_restore_params_names_missing_parameter(tmp_path, mesh):
  _save_steps(tmp_path, [2])
  wanted = _params()
  wanted["decoder"] = {"logits_dense": {"kernel": jnp.zeros((6, 8))}}
  with pytest.raises(
    checkpoints.CheckpointMismatchError,
    match=r"missing in checkpoint: decoder/logits_dense/kernel \(6, 8\)",
  ):
    checkpoints.restore_params(tmp_path, _abstract(wanted, mesh))


def test_params_only_checkpoint_round_trip(tmp_path, mesh):
  step_dir = checkpoints.write_params_checkpoint(
    tmp_path / "converted", _params(3.0), config={"emb_dim": 6}
  )
  assert step_dir == (tmp_path / "converted" / "0")
  assert json.loads((step_dir / "config" / "metadata").read_text()) == {"emb_dim": 6}
  params = checkpoints.restore_params(tmp_path / "converted", _abstract(_params(), mesh))
  assert float(params["encoder"]["encoder_norm"]["scale"][0]) == 3.0


def test_missing_checkpoint_is_a_user_error_naming_the_path(tmp_path, mesh, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(
    UserError, match=f"No checkpoint at nowhere \\({tmp_path}/nowhere\\): it does not exist"
  ):
    checkpoints.restore_params("nowhere", _abstract(_params(), mesh))
  (tmp_path / "empty").mkdir()
  with pytest.raises(
    CheckpointError,
    match=f"No checkpoint at empty \\({tmp_path}/empty\\): expected a step directory with params/",
  ):
    checkpoints.find_steps("empty")
  _save_steps(tmp_path / "run", [2])
  with pytest.raises(CheckpointError, match=r"Step 4 not in run \(.*/run\) \(have \[2\]\)"):
    checkpoints.find_steps("run", step=4)


def test_relative_paths_are_taken_from_the_working_directory(tmp_path, mesh, monkeypatch):
  monkeypatch.chdir(tmp_path)
  _save_steps("run", [2, 4])
  params = checkpoints.restore_params("./run", _abstract(_params(), mesh), step=2)
  assert float(params["encoder"]["encoder_norm"]["scale"][0]) == 2.0
  assert checkpoints.find_steps("./run") == [(4, tmp_path / "run" / "4")]
  assert checkpoints.find_steps("./run", step="all") == [
    (s, tmp_path / "run" / str(s)) for s in (2, 4)
  ]
  assert checkpoints.find_steps("run", step="all", exclude=[2, 4]) == []
  assert checkpoints.find_steps("run/2", step="all") == [(2, tmp_path / "run" / "2")]
  step_dir = checkpoints.write_params_checkpoint("converted", _params(3.0))
  assert step_dir == tmp_path / "converted" / "0"
  params = checkpoints.restore_params("converted/0", _abstract(_params(), mesh))
  assert float(params["encoder"]["encoder_norm"]["scale"][0]) == 3.0


def test_model_dir_that_is_a_file_is_named(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "x").write_text("not a directory")
  with pytest.raises(
    CheckpointError, match=f"MODEL_DIR ./x \\({tmp_path}/x\\) is a file, not a directory"
  ):
    train_checkpointer.TrainCheckpointer("./x")
  with pytest.raises(CheckpointError, match=f"x/run .*cannot be created: {tmp_path}/x is a file"):
    train_checkpointer.TrainCheckpointer("x/run")
  with pytest.raises(CheckpointError, match="Checkpoint directory x .* is a file"):
    checkpoints.write_params_checkpoint("x", _params())


def _first_params_file(step_dir) -> str:
  return sorted(
    n for n in json.loads((step_dir / FILE_MANIFEST).read_text()) if n.startswith("params/")
  )[0]


def _truncate_listed_file(step_dir) -> str:
  """Truncates the first params file of the step's files.json; returns its path."""
  name = _first_params_file(step_dir)
  with open(step_dir / name, "r+b") as f:
    f.truncate(1)
  return str(step_dir / name)


def _snapshot(directory) -> dict:
  return {p.relative_to(directory): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def test_restore_params_of_a_root_falls_back_to_the_newest_intact_step(tmp_path, mesh, caplog):
  _save_steps(tmp_path, [2, 4, 6], keep=None)
  bad = [_truncate_listed_file(tmp_path / "6"), _truncate_listed_file(tmp_path / "4")]
  before = _snapshot(tmp_path)
  params = checkpoints.restore_params(tmp_path, _abstract(_params(), mesh))
  assert float(params["encoder"]["encoder_norm"]["scale"][0]) == 2.0
  [warning] = [r.getMessage() for r in caplog.records if "CORRUPT" in r.getMessage()]
  assert (
    "CORRUPT CHECKPOINT STEPS 6, 4 skipped" in warning and f"using step 2 of {tmp_path}" in warning
  )
  assert bad[0] in warning and bad[1] in warning
  with pytest.raises(CorruptCheckpointError, match=bad[0]):  # an explicit step: no fallback
    checkpoints.restore_params(tmp_path / "6", _abstract(_params(), mesh))
  with pytest.raises(CorruptCheckpointError, match=bad[1]):
    checkpoints.restore_params(tmp_path, _abstract(_params(), mesh), step=4)
  _truncate_listed_file(tmp_path / "2")
  with pytest.raises(
    CorruptCheckpointError,
    match=f"No intact checkpoint step in {tmp_path}: step 6: .*step 4: .*step 2: ",
  ):
    checkpoints.find_steps(tmp_path)
  del before[Path("2") / _first_params_file(tmp_path / "2")]
  after = _snapshot(tmp_path)
  assert all(after[k] == v for k, v in before.items())  # nothing else touched


def test_training_restore_falls_back_and_sets_the_corrupt_step_aside_on_save(
  tmp_path, mesh, caplog
):
  optimizer = _save_steps(tmp_path, [2, 4], keep=3)
  bad = _truncate_listed_file(tmp_path / "4")
  corrupt = _snapshot(tmp_path / "4")
  abstract_params = _abstract(_params(), mesh)
  abstract_opt = _abstract(jax.eval_shape(optimizer.init, _params()), mesh)
  ckpt = train_checkpointer.TrainCheckpointer(tmp_path, save_period=2, keep=3)
  iterator = _CountingIterator()
  restored = ckpt.restore_latest(abstract_params, abstract_opt, iterator)
  assert restored.step == 2 and iterator.position == 2 and restored.meta["step"] == 2
  assert ckpt.latest_step() == 2  # the train loop's last good save
  assert "CORRUPT CHECKPOINT STEP 4 skipped (step 4: " in caplog.text and bad in caplog.text
  assert "using step 2" in caplog.text
  assert _snapshot(tmp_path / "4") == corrupt  # restoring leaves it as it is

  params = _params(40.0)  # the redone step 4
  assert ckpt.save(4, params, optimizer.init(params), {"rng": [0, 4]}, _CountingIterator(4))
  ckpt.close()
  assert _snapshot(tmp_path / "4.corrupt") == corrupt
  assert f"Moved corrupt checkpoint step {tmp_path}/4 to {tmp_path}/4.corrupt" in caplog.text
  ckpt = train_checkpointer.TrainCheckpointer(tmp_path, keep=3)
  assert ckpt.all_steps() == [2, 4]
  restored = ckpt.restore_latest(abstract_params, abstract_opt)
  ckpt.close()
  assert restored.step == 4
  assert float(restored.params["encoder"]["encoder_norm"]["scale"][0]) == 40.0


def test_training_restore_without_an_intact_step_names_every_bad_file(tmp_path, mesh):
  optimizer = _save_steps(tmp_path, [2, 4], keep=3)
  bad = [_truncate_listed_file(tmp_path / str(step)) for step in (4, 2)]
  ckpt = train_checkpointer.TrainCheckpointer(tmp_path)
  with pytest.raises(CorruptCheckpointError, match=f"step 4: .*{bad[0]}.*; step 2: .*{bad[1]}"):
    ckpt.restore_latest(
      _abstract(_params(), mesh), _abstract(jax.eval_shape(optimizer.init, _params()), mesh)
    )
  ckpt.close()


def test_model_config_is_the_stored_one_with_gin_overrides(tmp_path):
  stored = tiny_config()
  fields = {
    k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(stored).items()
  }
  step_dir = checkpoints.write_params_checkpoint(tmp_path / "hf", _params(), config=fields)
  gin.clear_config()
  try:
    assert checkpoints.model_config(step_dir) == stored
    gin.bind_parameter("T5Config.dropout_rate", 0.3)
    assert checkpoints.model_config(step_dir) == dataclasses.replace(stored, dropout_rate=0.3)
    bare = checkpoints.write_params_checkpoint(tmp_path / "bare", _params())
    with pytest.raises(ConfigError) as e:
      checkpoints.model_config(bare)
    message = str(e.value)
    assert "\n" not in message and "gin binds no T5Config.{vocab_size, emb_dim" in message
    assert "dropout_rate" not in message and "--gin_file=models/t5_1_1/small.gin" in message
  finally:
    gin.clear_config()


def test_adapter_less_checkpoint_restores_into_a_model_with_adapters(tmp_path, mesh, caplog):
  plain = nn.meta.unbox(network.init_params(tiny_config(), jax.random.PRNGKey(0)))
  checkpoints.write_params_checkpoint(tmp_path / "plain", plain)
  fresh = nn.meta.unbox(network.init_params(tiny_config(adapter_dim=8), jax.random.PRNGKey(1)))
  specs = {"encoder/layers_0/adapter/wi/kernel": P(None, "model")}
  target = _abstract(fresh, mesh, specs)
  fallback = network.adapter_params(
    jax.tree.map(lambda x, t: jax.device_put(x, t.sharding), fresh, target)
  )
  with pytest.raises(checkpoints.CheckpointMismatchError, match="missing in checkpoint: .*adapter"):
    checkpoints.restore_params(tmp_path / "plain", target)  # no fallback: still an error
  params = checkpoints.restore_params(tmp_path / "plain", target, fallback=fallback)
  flat = traverse_util.flatten_dict(params, sep="/")
  adapter_paths = sorted(p for p in flat if "/adapter/" in p)
  assert len(adapter_paths) == 8  # wi and wo of 2 + 2 layers
  for path, value in traverse_util.flatten_dict(plain, sep="/").items():
    np.testing.assert_array_equal(flat.pop(path), value, err_msg=path)
  assert sorted(flat) == adapter_paths
  fresh_flat = traverse_util.flatten_dict(fresh, sep="/")
  for path in adapter_paths:
    np.testing.assert_array_equal(flat[path], fresh_flat[path], err_msg=path)
  assert flat["encoder/layers_0/adapter/wi/kernel"].sharding.spec == P(None, "model")
  [warning] = [r.getMessage() for r in caplog.records if "Not in checkpoint" in r.getMessage()]
  assert "(8): " + ", ".join(adapter_paths) in warning
  # bfloat16 restores cast the fallback too.
  cast = checkpoints.restore_params(tmp_path / "plain", target, fallback=fallback, dtype="bfloat16")
  assert {x.dtype for x in jax.tree.leaves(cast)} == {jnp.dtype(jnp.bfloat16)}


def test_fallback_does_not_excuse_unexpected_or_other_missing_parameters(tmp_path, mesh):
  plain = nn.meta.unbox(network.init_params(tiny_config(), jax.random.PRNGKey(0)))
  checkpoints.write_params_checkpoint(tmp_path / "plain", plain)
  fresh = nn.meta.unbox(
    network.init_params(
      tiny_config(adapter_dim=8, logits_via_embedding=True), jax.random.PRNGKey(1)
    )
  )
  target = _abstract(fresh, mesh)
  with pytest.raises(
    checkpoints.CheckpointMismatchError,
    match=r"unexpected in checkpoint: decoder/logits_dense/kernel \(32, 64\)",
  ) as e:
    checkpoints.restore_params(tmp_path / "plain", target, fallback=network.adapter_params(fresh))
  assert "missing" not in str(e.value)  # the adapters are covered by the fallback
  untied = nn.meta.unbox(network.init_params(tiny_config(adapter_dim=8), jax.random.PRNGKey(1)))
  checkpoints.write_params_checkpoint(
    tmp_path / "tied",
    nn.meta.unbox(
      network.init_params(tiny_config(logits_via_embedding=True), jax.random.PRNGKey(0))
    ),
  )
  with pytest.raises(
    checkpoints.CheckpointMismatchError,
    match=r"missing in checkpoint: decoder/logits_dense/kernel \(32, 64\)",
  ):
    checkpoints.restore_params(
      tmp_path / "tied", _abstract(untied, mesh), fallback=network.adapter_params(untied)
    )
  # Restoring into the model the checkpoint was written from ignores the fallback.
  same = checkpoints.restore_params(
    tmp_path / "plain", _abstract(plain, mesh), fallback=network.adapter_params(fresh)
  )
  jax.tree.map(np.testing.assert_array_equal, same, plain)
