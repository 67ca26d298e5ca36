"""Tests for t5x_lite.checkpoint.partial_restore and t5x_lite.checkpoint.scan_layout.

T5X-style fine-tuning starts.
"""

import functools
import json
import logging

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf
from flax import traverse_util
from jax.sharding import PartitionSpec as P

from t5x_lite import models
from t5x_lite.nn import network
from t5x_lite.data import pipeline
from t5x_lite.checkpoint import checkpoints, partial_restore, train_checkpointer
from t5x_lite.training import optimizers, partitioning, trainer
from t5x_lite.run import train_lib
from t5x_lite.core import errors
from t5x_lite.core.errors import CheckpointError, ConfigError
from t5x_lite.checkpoint.partial_restore import RestoreConfig
from text_tasks import VOCAB, register_text_task
from tiny_models import tiny_checkpoint_config, tiny_config

TASK = "partial_restore_test_text"
MismatchError = checkpoints.CheckpointMismatchError


def _source(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
  del shuffle_files, seed
  texts = [f"{split} line {i}: " + "xyz" * (i % 4) for i in range(32)]
  return tf.data.Dataset.from_tensor_slices({"inputs": texts, "targets": texts})


register_text_task(TASK, _source, ["train"])
pytestmark = pytest.mark.usefixtures("clean_gin")


@pytest.fixture(scope="module")
def partitioner() -> partitioning.Partitioner:
  """data=4 x model=2: restored leaves must land in real model-parallel shardings."""
  return partitioning.Partitioner(num_partitions=2)


@functools.lru_cache(maxsize=None)
def _init(config: network.T5Config, seed: int = 0) -> dict:
  """Plain params of `config` on the host (unscanned configs: eager init is fast)."""
  return jax.device_get(nn.meta.unbox(network.init_params(config, jax.random.PRNGKey(seed))))


def _target(config: network.T5Config, partitioner) -> dict:
  return partitioner.abstract_params(lambda key: network.init_params(config, key))[0]


def _fresh(config: network.T5Config, partitioner) -> dict:
  """Stand-in fresh params, sharded like the target: values no checkpoint here holds."""

  def leaf(t: jax.ShapeDtypeStruct) -> jax.Array:
    values = np.arange(np.prod(t.shape), dtype=np.float32).reshape(t.shape) / 1000 + 7
    return jax.device_put(values.astype(t.dtype), t.sharding)

  return jax.tree.map(leaf, _target(config, partitioner))


def _stacked_by_hand(flat: dict) -> dict:
  """An unscanned flat params dict in the scanned layout: layer i at index i of axis 0."""
  layers: dict[str, list] = {}
  out = {}
  for path, value in sorted(flat.items(), key=lambda kv: kv[0]):
    stack, sep, rest = path.partition("/layers_")
    if not sep:
      out[path] = value
      continue
    index, _, leaf = rest.partition("/")
    layers.setdefault(f"{stack}/layers/{leaf}", []).append((int(index), value))
  out.update(
    {p: np.stack([v for _, v in sorted(vs, key=lambda iv: iv[0])]) for p, vs in layers.items()}
  )
  return out


def _restore(path, config, partitioner, restore_config=None, **kwargs) -> dict:
  """Restores `path` into a model of `config`; returns path -> array."""
  restored = partial_restore.restore_params(
    path,
    _target(config, partitioner),
    _fresh(config, partitioner),
    restore_config or RestoreConfig(),
    **kwargs,
  )
  return traverse_util.flatten_dict(restored, sep="/")


def _flat(tree) -> dict:
  return traverse_util.flatten_dict(jax.device_get(tree), sep="/")


def _warnings(caplog, text: str) -> list[str]:
  return [r.getMessage() for r in caplog.records if text in r.getMessage()]


# ---------------------------------------------------------------- parameters


def test_default_config_restores_every_parameter_into_the_target_shardings(tmp_path, partitioner):
  config = tiny_config()
  saved = _init(config, 0)
  checkpoints.write_params_checkpoint(tmp_path, saved)
  restored = _restore(tmp_path, config, partitioner)
  target = traverse_util.flatten_dict(_target(config, partitioner), sep="/")
  assert restored.keys() == _flat(saved).keys()
  for path, value in _flat(saved).items():
    np.testing.assert_array_equal(restored[path], value, err_msg=path)
    assert restored[path].sharding.is_equivalent_to(target[path].sharding, value.ndim), path
  assert restored["token_embedder/embedding"].sharding.spec == P("model", None)  # vocab split


def test_assignment_map_renames_skips_and_ignores_what_nothing_reads(tmp_path, partitioner, caplog):
  config = tiny_config()
  saved = _flat(_init(config, 0))
  checkpoints.write_params_checkpoint(tmp_path, traverse_util.unflatten_dict(saved, sep="/"))
  fresh = _flat(_fresh(config, partitioner))
  assignment_map = [
    (r"encoder/layers_1/(.*)", r"encoder/layers_0/\1"),  # first match wins: before the next
    (r"encoder/layers_1/.*", None),
    (r"decoder/logits_dense/kernel", None),
  ]
  with caplog.at_level(logging.INFO, logger="absl"):
    restored = _restore(tmp_path, config, partitioner, RestoreConfig(assignment_map))
  for path, value in restored.items():
    if path.startswith("encoder/layers_1/"):
      expected = saved[path.replace("layers_1", "layers_0")]
    elif path == "decoder/logits_dense/kernel":
      expected = fresh[path]
    else:
      expected = saved[path]
    np.testing.assert_array_equal(value, expected, err_msg=path)
  [ignored] = _warnings(caplog, "no model parameter reads")
  unread = sorted(p for p in saved if p.startswith("encoder/layers_1/")) + [
    "decoder/logits_dense/kernel"
  ]
  assert f"({len(unread)}): " + ", ".join(sorted(unread)) in ignored
  [skipped] = _warnings(caplog, "Not restored")
  assert "RestoreConfig.assignment_map -> None" in skipped and "decoder/logits_dense" in skipped


def test_an_assignment_map_drops_a_pretraining_head_that_is_otherwise_an_error(
  tmp_path, partitioner, caplog
):
  untied = _flat(_init(tiny_config(), 0))
  checkpoints.write_params_checkpoint(tmp_path, traverse_util.unflatten_dict(untied, sep="/"))
  tied = tiny_config(logits_via_embedding=True)
  with pytest.raises(MismatchError, match=r"unexpected in checkpoint: decoder/logits_dense"):
    _restore(tmp_path, tied, partitioner)
  # docs/training.md's example: keep the encoder, start the decoder from scratch.
  restored = _restore(tmp_path, tied, partitioner, RestoreConfig([("decoder/.*", None)]))
  fresh = _flat(_fresh(tied, partitioner))
  for path, value in restored.items():
    expected = fresh[path] if path.startswith("decoder/") else untied[path]
    np.testing.assert_array_equal(value, expected, err_msg=path)
  [ignored] = _warnings(caplog, "no model parameter reads")
  assert "decoder/logits_dense/kernel" in ignored and "encoder/" not in ignored


def test_missing_parameters_are_an_error_unless_fallback_to_scratch(tmp_path, partitioner, caplog):
  tied = _flat(_init(tiny_config(logits_via_embedding=True), 0))
  checkpoints.write_params_checkpoint(tmp_path, traverse_util.unflatten_dict(tied, sep="/"))
  untied = tiny_config()
  with pytest.raises(MismatchError) as e:
    _restore(tmp_path, untied, partitioner)
  message = str(e.value)
  assert "missing in checkpoint: decoder/logits_dense/kernel (32, 64)" in message
  assert "RestoreConfig.fallback_to_scratch=True" in message and "unexpected" not in message
  restored = _restore(tmp_path, untied, partitioner, RestoreConfig(fallback_to_scratch=True))
  fresh = _flat(_fresh(untied, partitioner))
  np.testing.assert_array_equal(
    restored.pop("decoder/logits_dense/kernel"), fresh["decoder/logits_dense/kernel"]
  )
  assert restored.keys() == tied.keys()
  for path, value in restored.items():
    np.testing.assert_array_equal(value, tied[path], err_msg=path)
  [warning] = _warnings(caplog, "taken from the freshly initialised model")
  assert warning.endswith("(1): decoder/logits_dense/kernel")


def test_adapters_a_checkpoint_lacks_start_fresh_without_fallback_to_scratch(tmp_path, partitioner):
  plain = _flat(_init(tiny_config(), 0))
  checkpoints.write_params_checkpoint(tmp_path, traverse_util.unflatten_dict(plain, sep="/"))
  with_adapters = tiny_config(adapter_dim=8)
  restored = _restore(tmp_path, with_adapters, partitioner)
  adapters = sorted(p for p in restored if "/adapter/" in p)
  assert len(adapters) == 8
  fresh = _flat(_fresh(with_adapters, partitioner))
  for path in adapters:
    np.testing.assert_array_equal(restored.pop(path), fresh[path], err_msg=path)
  for path, value in restored.items():
    np.testing.assert_array_equal(value, plain[path], err_msg=path)


def test_mapped_paths_the_checkpoint_lacks_or_shapes_that_differ_are_errors(tmp_path, partitioner):
  config = tiny_config()
  checkpoints.write_params_checkpoint(tmp_path, _init(config, 0))
  head = ("decoder/logits_dense/kernel", "head/kernel")
  with pytest.raises(MismatchError) as e:
    _restore(tmp_path, config, partitioner, RestoreConfig([head]))
  assert (
    "missing in checkpoint: head/kernel (32, 64) (for decoder/logits_dense/kernel, "
    f"RestoreConfig.assignment_map pair {head!r})"
  ) in str(e.value)
  with pytest.raises(MismatchError) as e:
    _restore(tmp_path, tiny_config(mlp_dim=48), partitioner)
  assert (
    "shape mismatch: encoder/layers_0/mlp/wi_0/kernel checkpoint (32, 64) vs model (32, 48)"
  ) in str(e.value)
  mapped = [("decoder/layers_0/mlp/wi_0/kernel", "token_embedder/embedding")]
  with pytest.raises(MismatchError) as e:
    _restore(tmp_path, config, partitioner, RestoreConfig(mapped))
  assert (
    "shape mismatch: decoder/layers_0/mlp/wi_0/kernel checkpoint (64, 32) vs model (32, 64) "
    "(read from token_embedder/embedding)"
  ) in str(e.value)


@pytest.mark.parametrize(
  "build, expected",
  [
    (lambda: RestoreConfig([("encoder/(", None)]), "pattern 'encoder/(' is not a regular"),
    (lambda: RestoreConfig(["encoder/.*"]), "entries are (regex, replacement or None) pairs"),
    (lambda: RestoreConfig([("encoder/.*", 3)]), "must be strings"),
    (
      lambda: RestoreConfig([("decoder/.*", None)], restore_optimizer_state=True),
      "RestoreConfig.restore_optimizer_state=True cannot be combined with "
      "RestoreConfig.assignment_map",
    ),
  ],
  ids=["bad-regex", "not-a-pair", "not-a-string", "with-optimizer-state"],
)
def test_bad_restore_configs_are_one_line_errors_naming_the_binding(build, expected, capsys):
  with pytest.raises(ConfigError) as e:
    build()
  with pytest.raises(SystemExit):
    errors.fail(str(e.value))  # as the entry points print it: without gin's note
  [line] = capsys.readouterr().err.splitlines()
  assert line.startswith("ERROR: RestoreConfig.") and expected in line


def test_patterns_that_match_nothing_or_bad_backreferences_are_one_line_errors(tmp_path):
  paths = list(_flat(_init(tiny_config(), 0)))
  with pytest.raises(ConfigError) as e:
    partial_restore.map_paths(paths, RestoreConfig([("encoder/layer_0/.*", None)]).assignment_map)
  message = str(e.value)
  assert "\n" not in message
  assert "RestoreConfig.assignment_map pattern 'encoder/layer_0/.*' matches no model" in message
  assert "'decoder/layers_0/" in message  # shows what a path looks like
  with pytest.raises(ConfigError, match=r"pair \('encoder/(.*)', '\\\\2'\) cannot map encoder/"):
    partial_restore.map_paths(paths, RestoreConfig([("encoder/(.*)", r"\2")]).assignment_map)


def test_gin_binds_the_restore_config():
  gin.parse_config(
    "RestoreConfig.assignment_map = [(r'decoder/(.*)', r'encoder/\\1'), ('.*_norm/.*', None)]\n"
    "RestoreConfig.fallback_to_scratch = True\n"
  )
  assert RestoreConfig() == RestoreConfig(
    ((r"decoder/(.*)", r"encoder/\1"), (".*_norm/.*", None)), fallback_to_scratch=True
  )


def test_dtype_cast_applies_to_restored_and_fresh_parameters(tmp_path, partitioner):
  config = tiny_config()
  saved = _flat(_init(config, 0))
  checkpoints.write_params_checkpoint(tmp_path, traverse_util.unflatten_dict(saved, sep="/"))
  skip = RestoreConfig([("decoder/logits_dense/kernel", None)])
  restored = _restore(tmp_path, config, partitioner, skip, dtype="bfloat16")
  assert {x.dtype for x in restored.values()} == {jnp.dtype(jnp.bfloat16)}
  fresh = _flat(_fresh(config, partitioner))
  for path, value in restored.items():
    source = fresh if path == "decoder/logits_dense/kernel" else saved
    np.testing.assert_array_equal(value, source[path].astype(jnp.bfloat16), err_msg=path)


# ---------------------------------------------------------------- layouts


def _logits(config: network.T5Config, params) -> np.ndarray:
  tokens = (jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % 60) + 2  # [batch, length]
  return np.asarray(network.Transformer(config).apply({"params": params}, tokens, tokens, tokens))


def test_scanned_and_unscanned_layouts_convert_exactly_both_ways(tmp_path, partitioner, caplog):
  loop, scan = (
    tiny_config(num_decoder_layers=3),
    tiny_config(num_decoder_layers=3, scan_layers=True),
  )
  saved = _flat(_init(loop, 0))
  checkpoints.write_params_checkpoint(
    tmp_path / "loop", traverse_util.unflatten_dict(saved, sep="/")
  )
  with caplog.at_level(logging.INFO, logger="absl"):
    stacked = _restore(tmp_path / "loop", scan, partitioner)
  assert _warnings(caplog, "has unscanned layers: restoring them scanned")
  target = traverse_util.flatten_dict(_target(scan, partitioner), sep="/")
  assert stacked.keys() == target.keys()
  for path, value in stacked.items():
    assert value.sharding.is_equivalent_to(target[path].sharding, value.ndim), path
    stack, _, rest = path.partition("/layers/")
    if not rest:
      np.testing.assert_array_equal(value, saved[path], err_msg=path)
      continue
    num_layers = 2 if stack == "encoder" else 3
    assert value.shape[0] == num_layers, path
    for i in range(num_layers):  # nn.scan stacks layer i at index i of axis 0
      np.testing.assert_array_equal(value[i], saved[f"{stack}/layers_{i}/{rest}"], err_msg=path)
  stacked_tree = traverse_util.unflatten_dict(jax.device_get(stacked), sep="/")
  np.testing.assert_allclose(
    _logits(scan, stacked_tree), _logits(loop, _init(loop, 0)), rtol=1e-5, atol=1e-5
  )
  checkpoints.write_params_checkpoint(tmp_path / "scan", stacked_tree)
  with caplog.at_level(logging.INFO, logger="absl"):
    back = _restore(tmp_path / "scan", loop, partitioner)
  assert _warnings(caplog, "has scanned layers: restoring them unscanned")
  assert back.keys() == saved.keys()
  for path, value in back.items():  # the round trip is bitwise
    np.testing.assert_array_equal(value, saved[path], err_msg=path)
  # A scanned checkpoint of the other depth: the stacked shapes name the problem.
  with pytest.raises(MismatchError) as e:
    _restore(tmp_path / "loop", tiny_config(scan_layers=True), partitioner)
  assert (
    "shape mismatch: decoder/layers/mlp/wo/kernel checkpoint (3, 64, 32) vs model (2, 64, 32)"
  ) in str(e.value)
  assert "(the checkpoint's layers are shown scanned, like the model's)" in str(e.value)


def test_layouts_convert_with_an_assignment_map_in_the_models_layout(tmp_path, partitioner):
  saved = _stacked_by_hand(_flat(_init(tiny_config(), 0)))
  checkpoints.write_params_checkpoint(tmp_path, traverse_util.unflatten_dict(saved, sep="/"))
  # Both unscanned decoder layers read the checkpoint's (scanned) decoder layer 0.
  mapping = [(r"decoder/layers_\d+/(.*)", r"decoder/layers_0/\1")]
  restored = _restore(tmp_path, tiny_config(), partitioner, RestoreConfig(mapping))
  for i in range(2):
    np.testing.assert_array_equal(
      restored[f"decoder/layers_{i}/mlp/wo/kernel"], saved["decoder/layers/mlp/wo/kernel"][0]
    )


# ---------------------------------------------------------------- optimizer state


def _model(**overrides) -> models.EncoderDecoderModel:
  module = network.Transformer(tiny_checkpoint_config(**overrides))
  return models.EncoderDecoderModel(
    module, VOCAB, VOCAB, loss_normalizing_factor="NUM_REAL_TARGET_TOKENS"
  )


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, partitioner):
  """A training checkpoint at step 5 whose optimizer state is not the initial one."""
  model, optimizer = _model(), optimizers.adafactor(learning_rate=0.0)
  params = _init(tiny_checkpoint_config(), 3)
  opt_state = jax.tree.map(
    lambda x: x + (0.25 if jnp.issubdtype(x.dtype, jnp.floating) else 3),
    optimizer.with_param_axes(model.param_axes()).init(params),
  )
  directory = tmp_path_factory.mktemp("pretrained")
  ckpt = train_checkpointer.TrainCheckpointer(directory, async_save=False)
  ckpt.save(5, params, opt_state, {"rng": [0, 0], "data_batches_consumed": 5})
  ckpt.close()
  return directory, params, jax.device_get(opt_state)


def _start(path, optimizer, partitioner, frozen_by=()):
  abstract, _ = trainer.abstract_train_state(_model(), optimizer, partitioner)
  return partial_restore.restore_start(
    path,
    abstract.params,
    _fresh(tiny_checkpoint_config(), partitioner),
    RestoreConfig(restore_optimizer_state=True),
    abstract_opt_state=abstract.opt_state,
    frozen_by=frozen_by,
  )


def test_optimizer_state_and_step_are_restored_equal_to_the_saved_ones(pretrained, partitioner):
  directory, params, opt_state = pretrained
  start = _start(directory, optimizers.adafactor(learning_rate=0.0), partitioner)
  assert start.step == 5
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(start.params), params)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(start.opt_state), opt_state)
  assert len(jax.tree.leaves(opt_state)) > 10


def test_optimizer_state_mismatches_are_one_line_errors(pretrained, partitioner, tmp_path):
  directory, params, _ = pretrained
  with pytest.raises(MismatchError) as e:
    _start(directory, optimizers.adamw(learning_rate=0.0), partitioner)
  message = str(e.value)
  assert "\n" not in message and "RestoreConfig.restore_optimizer_state=True" in message
  assert "missing in checkpoint: 0/mu/decoder/decoder_norm/scale (32,), " in message
  assert "; unexpected: 0/v/decoder/decoder_norm/scale (32,), " in message
  assert message.endswith("(+80 more)")  # at most 8 paths of each kind
  frozen = optimizers.adafactor(learning_rate=0.0).with_trainable(["decoder/.*"])
  with pytest.raises(ConfigError) as e:
    _start(directory, frozen, partitioner, frozen_by=["train.trainable_parameters"])
  message = str(e.value)
  assert "\n" not in message
  assert (
    "RestoreConfig.restore_optimizer_state=True cannot be combined with train.trainable_parameters"
  ) in message
  checkpoints.write_params_checkpoint(tmp_path, params)
  with pytest.raises(CheckpointError, match="holds no optimizer state"):
    _start(tmp_path, optimizers.adafactor(learning_rate=0.0), partitioner)


def test_train_continues_from_the_restored_step_with_gin_bindings(pretrained, tmp_path):
  directory, params, _ = pretrained
  gin.parse_config(
    "train.restore_config = @RestoreConfig()\nRestoreConfig.restore_optimizer_state = True\n"
  )
  state = train_lib.train(
    model_dir=str(tmp_path),
    total_steps=6,
    train_dataset_cfg=pipeline.DatasetConfig(
      TASK, {"inputs": 16, "targets": 16}, batch_size=8, pack=False
    ),
    optimizer=optimizers.adafactor(learning_rate=0.0),
    model=_model(),
    initial_checkpoint_path=str(directory),
    log_period=1,
  )
  assert int(state.step) == 6
  with open(tmp_path / "metrics.jsonl") as f:
    steps = [r["step"] for r in map(json.loads, f) if r["split"] == "train"]
  assert steps == [6]  # one step: from the restored step 5
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), params)  # lr 0
