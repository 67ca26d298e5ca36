"""Gin model configs, public parameter counts, FLOP counts and tools/model_info.py."""

import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys

import gin
import jax
import pytest
from flax.core import meta

from t5x_lite import models
from t5x_lite.nn import flops, network

REPO = pathlib.Path(__file__).resolve().parents[1]
GIN_ROOT = REPO / 'gin'
MODEL_GIN_FILES = sorted(str(p.relative_to(GIN_ROOT)) for p in (GIN_ROOT / 'models').rglob('*.gin'))


@pytest.fixture(autouse=True)
def clean_gin():
  gin.clear_config()
  gin.add_config_file_search_path(str(GIN_ROOT))
  yield
  gin.clear_config()


def _config(gin_file: str, bindings: tuple[str, ...] = ()) -> network.T5Config:
  gin.parse_config_files_and_bindings([gin_file], list(bindings), finalize_config=False)
  return network.T5Config()


def _num_params(config: network.T5Config) -> int:
  abstract = jax.eval_shape(lambda: models.init_params(config, jax.random.PRNGKey(0)))
  return sum(math.prod(x.shape) for x in jax.tree.leaves(meta.unbox(abstract)))


def test_all_eighteen_model_files_exist():
  families = {}
  for gin_file in MODEL_GIN_FILES:
    families.setdefault(gin_file.split('/')[1], []).append(gin_file)
  assert {name: len(files) for name, files in families.items()} == {
    't5_1_0': 6,
    't5_1_1': 6,
    'decoder_only': 3,
    'prefix_lm': 3,
  }, MODEL_GIN_FILES


@pytest.mark.parametrize('gin_file', MODEL_GIN_FILES)
def test_every_model_gin_file_parses(gin_file):
  config = _config(gin_file)
  assert config.head_dim in (8, 64, 128)
  architecture = {'decoder_only': 'decoder_only', 'prefix_lm': 'prefix_lm'}.get(
    gin_file.split('/')[1], 'encoder_decoder'
  )
  assert config.architecture == architecture
  if 't5_1_0' not in gin_file:
    assert config.mlp_activations == ('gelu', 'linear') and not config.logits_via_embedding
    assert config.dropout_rate == 0.0
  else:
    assert config.mlp_activations == ('relu',) and config.logits_via_embedding
    assert config.dropout_rate == 0.1


@pytest.mark.parametrize(
  'gin_file,expected',
  [
    ('models/t5_1_0/small.gin', 60_506_624),
    ('models/t5_1_0/base.gin', 222_903_552),
    ('models/t5_1_1/small.gin', 76_961_152),
    ('models/t5_1_1/base.gin', 247_577_856),
  ],
)
def test_public_parameter_counts(gin_file, expected):
  assert _num_params(_config(gin_file)) == expected


def test_decoder_only_sizes_are_one_t5_1_1_stack_without_cross_attention():
  """The T5 paper's Table 2 rows "LM" and "Prefix LM": one stack of the encoder-decoder's
  size, so P parameters where the encoder-decoder has 2P (apart from the embeddings)."""
  for size in ('tiny', 'small', 'base'):
    gin.clear_config()
    encdec = _config(f'models/t5_1_1/{size}.gin')
    gin.clear_config()
    lm = _config(f'models/decoder_only/{size}.gin')
    gin.clear_config()
    prefix = _config(f'models/prefix_lm/{size}.gin')
    assert lm.num_decoder_layers == encdec.num_decoder_layers == encdec.num_encoder_layers
    assert (lm.emb_dim, lm.num_heads, lm.mlp_dim) == (
      encdec.emb_dim,
      encdec.num_heads,
      encdec.mlp_dim,
    )
    assert prefix == dataclasses.replace(lm, architecture='prefix_lm')
  gin.clear_config()
  e, heads, m, layers, v = 512, 6 * 64, 1024, 8, 32128
  layer = 4 * e * heads + 3 * e * m + 2 * e  # self-attention, gated MLP, two norms
  small = _config('models/decoder_only/small.gin')
  assert _num_params(small) == 2 * v * e + layers * layer + 6 * 32 + e == 51_782_336


def test_size_files_override_base():
  config = _config('models/t5_1_1/xxl.gin')
  assert (config.emb_dim, config.num_heads, config.mlp_dim, config.num_encoder_layers) == (
    4096,
    64,
    10240,
    24,
  )
  config = _config('models/t5_1_0/11B.gin', ('DROPOUT_RATE = 0.0',))
  assert (config.num_heads, config.head_dim, config.mlp_dim, config.dropout_rate) == (
    128,
    128,
    65536,
    0.0,
  )


def test_unknown_binding_is_named(tmp_path):
  bad = tmp_path / 'bad.gin'
  bad.write_text("include 'models/t5_1_1/tiny.gin'\nT5Config.num_experts = 4\n")
  with pytest.raises(ValueError, match='num_experts'):
    gin.parse_config_file(str(bad))


def test_flops_hand_computed():
  config = network.T5Config(
    vocab_size=10,
    emb_dim=4,
    num_heads=2,
    head_dim=3,
    mlp_dim=5,
    num_encoder_layers=1,
    num_decoder_layers=1,
    mlp_activations=('relu',),
    dropout_rate=0.0,
    logits_via_embedding=True,
  )
  # I=7, T=3, E=4, H=6, M=5, V=10, ReLU:
  # encoder: q,o 2*2*7*4*6=672, k,v 672, scores+values 2*2*7*7*6=1176, mlp 2*2*7*4*5=560
  # decoder self: 288 + 288 + 216; cross: q,o 288, k,v 672, 504; mlp 240; logits 240.
  assert flops.forward_flops(config, 7, 3) == 5816
  assert flops.flops_per_token(config, 7, 3) == pytest.approx(3 * 5816 / 10)
  gated = network.T5Config(**{**vars(config), 'mlp_activations': ('gelu', 'linear')})
  assert flops.forward_flops(gated, 7, 3) == 5816 + 2 * 7 * 4 * 5 + 2 * 3 * 4 * 5
  # Adapters, A=2: wi and wo, 2*7*4*2 each in the encoder, 2*3*4*2 each in the decoder.
  adapted = network.T5Config(**{**vars(config), 'adapter_dim': 2})
  assert flops.forward_flops(adapted, 7, 3) == 5816 + 2 * (2 * 7 * 4 * 2) + 2 * (2 * 3 * 4 * 2)


def test_adapter_parameter_count():
  # T5 1.1 small (E=512, 8+8 layers) with d=128 adapters: 2 * 512 * 128 per layer.
  config = _config('models/t5_1_1/small.gin', ('T5Config.adapter_dim = 128',))
  assert _num_params(config) == 76_961_152 + 16 * 2 * 512 * 128


def _run_model_info(*args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  return subprocess.run(
    [sys.executable, str(REPO / 'tools' / 'model_info.py'), *args],
    capture_output=True,
    text=True,
    env=env,
    cwd=REPO,
    timeout=300,
  )


@pytest.mark.slow
def test_model_info_json():
  result = _run_model_info(
    '--gin_file=models/t5_1_1/small.gin',
    '--gin.T5Config.num_decoder_layers=4',
    '--gin.T5Config.adapter_dim=32',
    '--input_length=64',
    '--target_length=16',
    '--json',
  )
  assert result.returncode == 0, result.stderr
  info = json.loads(result.stdout.strip().splitlines()[-1])
  config = _config(
    'models/t5_1_1/small.gin', ('T5Config.num_decoder_layers = 4', 'T5Config.adapter_dim = 32')
  )
  assert info['num_params'] == _num_params(config)
  assert info['adapter_params'] == (8 + 4) * 2 * 512 * 32  # part of encoder and decoder
  assert info['num_params'] == sum(info['breakdown'].values())
  assert info['breakdown']['logits'] == 32128 * 512
  assert info['flops_per_token'] == pytest.approx(flops.flops_per_token(config, 64, 16))
  assert info['config']['num_decoder_layers'] == 4


@pytest.mark.slow
def test_model_info_unknown_binding_fails():
  result = _run_model_info('--gin_file=models/t5_1_1/tiny.gin', '--gin.T5Config.num_expert=2')
  assert result.returncode != 0
  assert 'num_expert' in result.stderr
