"""Tests for t5x_lite.interop.hf and tools/convert_hf_checkpoint.py.

Tiny randomly initialised transformers T5 models (1.0: tied, relu; 1.1: untied,
gated-gelu) are saved as safetensors, loaded into t5x_lite and compared against
HF PyTorch logits. Inputs are longer than relative_attention_max_distance so the
log-spaced buckets and the clip are exercised in both stacks.
"""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

from t5x_lite.nn import network
from t5x_lite.checkpoint import checkpoints, train_checkpointer
from t5x_lite.interop import hf as hf_interop
from t5x_lite.core.errors import (
  CheckpointNotFoundError,
  CorruptCheckpointError,
  MissingExtraError,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 128
INPUT_LEN = 160  # > relative_attention_max_distance (128)
TARGET_LEN = 140  # > 128 as well, for the causal buckets

# name -> (transformers T5Config kwargs, tied)
HF_MODELS = {
  "t5_1_0": (
    dict(
      d_model=32,
      num_heads=4,
      d_kv=8,
      d_ff=64,
      num_layers=2,
      num_decoder_layers=2,
      feed_forward_proj="relu",
    ),
    True,
  ),
  # heads * d_kv != d_model and enc != dec layers, so swapped axes or counts fail.
  "t5_1_1": (
    dict(
      d_model=32,
      num_heads=4,
      d_kv=6,
      d_ff=48,
      num_layers=2,
      num_decoder_layers=3,
      feed_forward_proj="gated-gelu",
    ),
    False,
  ),
}


def _make_hf_model(name: str, seed: int = 0) -> transformers.T5ForConditionalGeneration:
  """A random tiny HF T5 with non-trivial layer norm scales, in eval mode."""
  kwargs, tied = HF_MODELS[name]
  config = transformers.T5Config(
    vocab_size=VOCAB,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    dropout_rate=0.1,
    tie_word_embeddings=tied,
    **kwargs,
  )
  config.tie_word_embeddings = tied  # transformers 5's constructor ignores it.
  torch.manual_seed(seed)
  model = transformers.T5ForConditionalGeneration(config)
  model.encoder.embed_tokens = model.shared  # untied configs also untie these.
  model.decoder.embed_tokens = model.shared
  with torch.no_grad():
    for param_name, param in model.named_parameters():
      if "layer_norm" in param_name:
        param.uniform_(0.5, 1.5)  # init is all ones, which hides scale mix-ups
  return model.eval()


@pytest.fixture(scope="module", params=sorted(HF_MODELS))
def hf_model_dir(request, tmp_path_factory):
  """(name, HF model, directory it was saved to as safetensors)."""
  model = _make_hf_model(request.param)
  path = str(tmp_path_factory.mktemp(request.param))
  model.save_pretrained(path)
  return request.param, model, path


def _batch(seed: int = 1) -> dict[str, np.ndarray]:
  """Two examples; the second has padded inputs and targets."""
  rng = np.random.default_rng(seed)
  inputs = rng.integers(2, VOCAB, size=(2, INPUT_LEN), dtype=np.int32)
  inputs[1, 100:] = 0
  targets = rng.integers(2, VOCAB, size=(2, TARGET_LEN), dtype=np.int32)
  targets[1, 90:] = 0
  decoder_inputs = np.zeros_like(targets)
  decoder_inputs[:, 1:] = targets[:, :-1]  # [batch, target_len], shifted right, starts at 0
  return dict(
    encoder_input_tokens=inputs, decoder_input_tokens=decoder_inputs, decoder_target_tokens=targets
  )


def _hf_logits(model: transformers.T5ForConditionalGeneration, batch) -> np.ndarray:
  """HF PyTorch logits for `batch`, with padding masks."""
  inputs = torch.from_numpy(batch["encoder_input_tokens"]).long()
  targets = torch.from_numpy(batch["decoder_target_tokens"]).long()
  with torch.no_grad():
    out = model(
      input_ids=inputs,
      attention_mask=(inputs > 0).long(),
      decoder_input_ids=torch.from_numpy(batch["decoder_input_tokens"]).long(),
      decoder_attention_mask=(targets > 0).long(),
    )
  return out.logits.numpy()


def _ours_logits(config: network.T5Config, params, batch) -> np.ndarray:
  """t5x_lite logits for `batch` (no dropout)."""
  logits = network.Transformer(config).apply(
    {"params": params},
    batch["encoder_input_tokens"],
    batch["decoder_input_tokens"],
    batch["decoder_target_tokens"],
    enable_dropout=False,
  )
  return np.asarray(logits)


def _load_tensors(path: str) -> dict[str, np.ndarray]:
  return safetensors.numpy.load_file(os.path.join(path, hf_interop.SAFETENSORS_NAME))


def _assert_tensors_bitwise_equal(a: dict, b: dict) -> None:
  assert sorted(a) == sorted(b)
  for key in a:
    assert a[key].dtype == b[key].dtype, key
    assert a[key].shape == b[key].shape, key
    assert a[key].tobytes() == b[key].tobytes(), key


def _copy_dir(src: str, dst) -> str:
  dst = str(dst)
  shutil.copytree(src, dst)
  return dst


def test_config_mapping(hf_model_dir):
  name, model, path = hf_model_dir
  config, _ = hf_interop.load_hf(path)
  hf = model.config
  assert (config.vocab_size, config.emb_dim, config.num_heads, config.head_dim) == (
    hf.vocab_size,
    hf.d_model,
    hf.num_heads,
    hf.d_kv,
  )
  assert (config.mlp_dim, config.num_encoder_layers, config.num_decoder_layers) == (
    hf.d_ff,
    hf.num_layers,
    hf.num_decoder_layers,
  )
  assert config.mlp_activations == {"t5_1_0": ("relu",), "t5_1_1": ("gelu", "linear")}[name]
  assert config.logits_via_embedding == (name == "t5_1_0")
  assert config.dropout_rate == pytest.approx(0.1)
  assert config.relative_attention_num_buckets == 32
  assert config.relative_attention_max_distance == 128
  assert config.layer_norm_epsilon == pytest.approx(1e-6)
  assert config.param_dtype == "float32" and not config.scan_layers


@pytest.mark.parametrize("scan_layers", [False, True])
def test_tree_matches_network_init(hf_model_dir, scan_layers):
  _, _, path = hf_model_dir
  config, params = hf_interop.load_hf(path, scan_layers=scan_layers)
  tokens = np.ones((1, 4), np.int32)
  abstract = jax.eval_shape(
    lambda: network.Transformer(config).init(
      {"params": jax.random.key(0), "dropout": jax.random.key(1)},
      tokens,
      tokens,
      tokens,
      enable_dropout=False,
    )
  )
  expected = jax.tree.map(lambda x: (x.shape, x.dtype), nn.meta.unbox(abstract["params"]))
  assert jax.tree.map(lambda x: (x.shape, x.dtype), params) == expected


# 'auto' is the CPU's xla_cpu kernels; 'reference' is the plain math, the A/B baseline.
@pytest.mark.parametrize("kernels", ["auto", "reference"])
@pytest.mark.parametrize("scan_layers", [False, True])
def test_logits_match_hf(hf_model_dir, scan_layers, kernels):
  _, model, path = hf_model_dir
  config, params = hf_interop.load_hf(path, scan_layers=scan_layers)
  config = dataclasses.replace(config, kernels=kernels)
  batch = _batch()
  ours, theirs = _ours_logits(config, params, batch), _hf_logits(model, batch)
  assert ours.shape == theirs.shape == (2, TARGET_LEN, VOCAB)
  mask = batch["decoder_target_tokens"] > 0
  np.testing.assert_allclose(ours[mask], theirs[mask], atol=1e-4, rtol=0)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_save_hf_round_trips_bitwise(hf_model_dir, scan_layers, tmp_path):
  _, model, path = hf_model_dir
  config, params = hf_interop.load_hf(path, scan_layers=scan_layers)
  hf_interop.save_hf(config, params, str(tmp_path))
  _assert_tensors_bitwise_equal(_load_tensors(path), _load_tensors(str(tmp_path)))
  config_again, _ = hf_interop.load_hf(str(tmp_path), scan_layers=scan_layers)
  assert config_again == config


def test_save_hf_output_loads_in_transformers(hf_model_dir, tmp_path):
  _, model, path = hf_model_dir
  config, params = hf_interop.load_hf(path)
  hf_interop.save_hf(config, params, str(tmp_path))
  reloaded = transformers.T5ForConditionalGeneration.from_pretrained(str(tmp_path)).eval()
  batch = _batch(seed=2)
  np.testing.assert_array_equal(_hf_logits(reloaded, batch), _hf_logits(model, batch))


def test_save_hf_accepts_boxed_params(hf_model_dir, tmp_path):
  _, _, path = hf_model_dir
  config, params = hf_interop.load_hf(path)
  boxed = jax.tree.map(lambda x: nn.LogicallyPartitioned(x, (None,) * x.ndim), params)
  hf_interop.save_hf(config, boxed, str(tmp_path))
  _assert_tensors_bitwise_equal(_load_tensors(path), _load_tensors(str(tmp_path)))


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
  model = _make_hf_model("t5_1_1")
  model.save_pretrained(str(tmp_path / "single"))
  model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="20KB")
  assert os.path.exists(tmp_path / "sharded" / hf_interop.SAFETENSORS_INDEX_NAME)
  single, sharded = (
    hf_interop.load_hf(str(tmp_path / "single")),
    hf_interop.load_hf(str(tmp_path / "sharded")),
  )
  assert single[0] == sharded[0]
  jax.tree.map(np.testing.assert_array_equal, single[1], sharded[1])


def test_bfloat16_checkpoint_keeps_dtype_and_round_trips(tmp_path):
  model = _make_hf_model("t5_1_0").to(torch.bfloat16)
  model.save_pretrained(str(tmp_path / "hf"))
  config, params = hf_interop.load_hf(str(tmp_path / "hf"))
  assert config.param_dtype == "bfloat16"
  assert {x.dtype.name for x in jax.tree.leaves(params)} == {"bfloat16"}
  hf_interop.save_hf(config, params, str(tmp_path / "out"))
  _assert_tensors_bitwise_equal(
    _load_tensors(str(tmp_path / "hf")), _load_tensors(str(tmp_path / "out"))
  )
  config32, params32 = hf_interop.load_hf(str(tmp_path / "hf"), param_dtype="float32")
  assert config32.param_dtype == "float32"
  assert {x.dtype.name for x in jax.tree.leaves(params32)} == {"float32"}


@pytest.mark.parametrize("ff_proj", ["gated-silu", "swish-me-not"])
def test_unsupported_feed_forward_proj_is_refused(hf_model_dir, tmp_path, ff_proj):
  _, _, path = hf_model_dir
  bad = _copy_dir(path, tmp_path / "bad")
  with open(os.path.join(bad, "config.json")) as f:
    hf_config = json.load(f)
  hf_config["feed_forward_proj"] = ff_proj
  with open(os.path.join(bad, "config.json"), "w") as f:
    json.dump(hf_config, f)
  with pytest.raises(ValueError, match=f"feed_forward_proj.*{ff_proj}"):
    hf_interop.load_hf(bad)


def _rewrite_tensors(path: str, edit) -> None:
  tensors = _load_tensors(path)
  edit(tensors)
  safetensors.numpy.save_file(
    tensors, os.path.join(path, hf_interop.SAFETENSORS_NAME), metadata={"format": "pt"}
  )


def test_wrong_shaped_tensor_names_its_path(hf_model_dir, tmp_path):
  _, _, path = hf_model_dir
  bad = _copy_dir(path, tmp_path / "bad")
  name = "encoder.block.1.layer.1.DenseReluDense.wo.weight"
  good_shape = _load_tensors(path)[name].shape  # [d_model, d_ff]
  _rewrite_tensors(bad, lambda t: t.update({name: t[name][:, :-1].copy()}))
  with pytest.raises(ValueError) as err:
    hf_interop.load_hf(bad)
  message = str(err.value)
  assert name in message and "encoder/layers_1/mlp/wo/kernel" in message
  bad_shape = (good_shape[0], good_shape[1] - 1)
  assert f"checkpoint shape {bad_shape}, config implies {good_shape}" in message


def test_missing_and_unexpected_tensors_are_listed(hf_model_dir, tmp_path):
  _, _, path = hf_model_dir
  bad = _copy_dir(path, tmp_path / "bad")
  missing = "decoder.block.1.layer.1.EncDecAttention.k.weight"

  def edit(tensors):
    tensors["encoder.block.7.layer.0.layer_norm.weight"] = tensors.pop(missing)[:, 0].copy()

  _rewrite_tensors(bad, edit)
  with pytest.raises(
    ValueError,
    match=r"missing \['decoder\.block\.1\.layer\.1\.EncDecAttention"
    r"\.k\.weight'\], unexpected \['encoder\.block\.7",
  ):
    hf_interop.load_hf(bad)


def test_duplicate_embedding_copies_and_legacy_tensors_are_accepted(tmp_path):
  """Older checkpoints also store tied copies and an unused cross-attention bias."""
  path = str(tmp_path / "hf")
  _make_hf_model("t5_1_0").save_pretrained(path)
  expected = hf_interop.load_hf(path)

  def edit(tensors):
    for name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"):
      tensors[name] = tensors["shared.weight"].copy()
    tensors["decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"] = np.ones(
      (32, 4), np.float32
    )

  _rewrite_tensors(path, edit)
  config, params = hf_interop.load_hf(path)
  assert config == expected[0]
  jax.tree.map(np.testing.assert_array_equal, params, expected[1])


def test_tied_config_with_different_lm_head_is_refused(tmp_path):
  path = str(tmp_path / "hf")
  _make_hf_model("t5_1_0").save_pretrained(path)
  _rewrite_tensors(path, lambda t: t.update({"lm_head.weight": t["shared.weight"] + 1}))
  with pytest.raises(ValueError, match="lm_head.weight differs from shared.weight"):
    hf_interop.load_hf(path)


def test_pytorch_bin_only_is_refused_without_unpickling(tmp_path):
  with open(tmp_path / "config.json", "w") as f:
    json.dump({"model_type": "t5"}, f)
  # Not a valid pickle: any attempt to unpickle would fail differently.
  (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle")
  with pytest.raises(FileNotFoundError, match="pytorch_model.bin.*safetensors"):
    hf_interop.load_hf(str(tmp_path))


def test_save_hf_wrong_shape_names_param_path(hf_model_dir, tmp_path):
  _, _, path = hf_model_dir
  config, params = hf_interop.load_hf(path)
  params["decoder"]["relpos_bias"]["rel_embedding"] = np.zeros((4, 31), np.float32)
  with pytest.raises(
    ValueError,
    match=r"decoder/relpos_bias/rel_embedding: shape \(4, 31\), "
    r"config implies \(4, 32\)",
  ):
    hf_interop.save_hf(config, params, str(tmp_path))


def _run_converter(
  *flags: str, check: bool = True, cwd: str = REPO_ROOT
) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, os.path.join(REPO_ROOT, "tools", "convert_hf_checkpoint.py"), *flags],
    check=check,
    cwd=cwd,
    capture_output=True,
    text=True,
  )


@pytest.mark.slow
def test_converter_round_trip_through_orbax_with_relative_paths(hf_model_dir, tmp_path):
  name, _, path = hf_model_dir
  scan_layers = name == "t5_1_1"  # one stacked, one unstacked layout
  shutil.copytree(path, tmp_path / "hf")
  _run_converter(
    "--hf_dir=hf", "--output_dir=./ckpt", f"--scan_layers={scan_layers}", cwd=str(tmp_path)
  )
  assert {"config", "params"} <= set(os.listdir(tmp_path / "ckpt" / "0"))
  _run_converter(
    "--direction=to_hf", "--checkpoint_dir=ckpt", "--output_dir=hf_out", cwd=str(tmp_path)
  )
  out = str(tmp_path / "hf_out")
  _assert_tensors_bitwise_equal(_load_tensors(path), _load_tensors(out))
  assert hf_interop.load_hf(out)[0] == hf_interop.load_hf(path)[0]


def _error_line(result: subprocess.CompletedProcess) -> str:
  """The converter's one ERROR line (exit status 1, no traceback)."""
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
  [line] = [x for x in result.stderr.splitlines() if x.startswith("ERROR:")]
  return line


@pytest.mark.slow
def test_garbage_safetensors_and_missing_files_are_named(tmp_path):
  hf_dir = tmp_path / "hf"
  hf_dir.mkdir()
  weights = hf_dir / hf_interop.SAFETENSORS_NAME
  weights.write_bytes(np.random.default_rng(0).bytes(100))
  with pytest.raises(CheckpointNotFoundError, match=f"{hf_dir}/config.json not found"):
    hf_interop.load_hf(str(hf_dir))
  (hf_dir / "config.json").write_text('{"model_type": "t5"')
  with pytest.raises(CorruptCheckpointError, match=f"{hf_dir}/config.json: not a JSON file"):
    hf_interop.load_hf(str(hf_dir))
  (hf_dir / "config.json").write_text('{"model_type": "t5"}')
  message = f"{weights}: not a safetensors file (header too large)"
  with pytest.raises(CorruptCheckpointError, match=re.escape(message)):
    hf_interop.load_hf(str(hf_dir))
  result = _run_converter("--hf_dir=hf", "--output_dir=out", check=False, cwd=str(tmp_path))
  assert _error_line(result) == f"ERROR: {message}"
  assert not (tmp_path / "out").exists()
  result = _run_converter(
    "--direction=to_hf", "--checkpoint_dir=nope", "--output_dir=out", check=False, cwd=str(tmp_path)
  )
  assert _error_line(result) == f"ERROR: No checkpoint at nope ({tmp_path}/nope): it does not exist"


@pytest.mark.slow
def test_converter_to_hf_takes_config_from_gin(tmp_path):
  path = str(tmp_path / "hf")
  _make_hf_model("t5_1_1").save_pretrained(path)
  config, params = hf_interop.load_hf(path)
  root, out = str(tmp_path / "ckpt"), str(tmp_path / "hf_out")
  checkpoints.write_params_checkpoint(root, params, step=3)  # no `config` item
  failed = _run_converter(
    "--direction=to_hf", f"--checkpoint_dir={root}", f"--output_dir={out}", check=False
  )
  assert failed.returncode != 0 and "--gin_file" in failed.stderr
  gin_file = tmp_path / "model.gin"
  gin_file.write_text(
    "".join(
      f"T5Config.{field.name} = {getattr(config, field.name)!r}\n"
      for field in dataclasses.fields(config)
      if field.name != "dropout_rate"
    )
  )
  _run_converter(
    "--direction=to_hf",
    f"--checkpoint_dir={root}",
    f"--output_dir={out}",
    f"--gin_file={gin_file}",
    "--gin_bindings=T5Config.dropout_rate = 0.1",
  )
  _assert_tensors_bitwise_equal(_load_tensors(path), _load_tensors(out))


@pytest.mark.slow
def test_converter_to_hf_reads_training_checkpoint_config(tmp_path):
  path = str(tmp_path / "hf")
  _make_hf_model("t5_1_0").save_pretrained(path)
  config, params = hf_interop.load_hf(path)
  root, out = str(tmp_path / "train"), str(tmp_path / "hf_out")
  ckpt = train_checkpointer.TrainCheckpointer(root, async_save=False)
  meta = {"rng": [0, 1], "model_config": dataclasses.asdict(config)}
  ckpt.save(7, params, {"count": np.zeros((), np.int32)}, meta)
  ckpt.close()
  _run_converter("--direction=to_hf", f"--checkpoint_dir={root}", f"--output_dir={out}")
  _assert_tensors_bitwise_equal(_load_tensors(path), _load_tensors(out))


def test_without_the_hf_extra_reading_says_how_to_install_it(hf_model_dir, monkeypatch):
  _, _, path = hf_model_dir
  monkeypatch.setitem(sys.modules, "safetensors", None)  # how Python marks a module absent
  with pytest.raises(MissingExtraError) as raised:
    hf_interop.load_hf(path)
  assert str(raised.value) == (
    "Reading or writing Hugging Face checkpoints needs the `hf` extra (safetensors is not "
    "installed): pip install -e '.[hf]'"
  )
