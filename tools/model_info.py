r"""Prints parameter counts and FLOPs per token of a gin-configured T5 network.

Shapes come from `jax.eval_shape`, so nothing is allocated and XXL works on a laptop.

Usage (gin paths are relative to the search paths, by default the repo's gin/ and
gin/models/ dirs; the gin flags are those of the entry points, `t5x_lite.core.gin_config`):

  python tools/model_info.py --gin_file=models/t5_1_1/small.gin --json
  python tools/model_info.py --gin_file=models/t5_1_1/base.gin \
      --gin.T5Config.num_encoder_layers=6 --input_length=1024

With --json the last stdout line is a JSON object with num_params,
flops_per_token, forward_flops, a per-stack breakdown and adapter_params (the
adapter layers' share of the encoder and decoder counts). A bad gin file or
binding is reported as one `ERROR: <message>` line on stderr with exit status 1.
"""

from t5x_lite.core import console

if __name__ == "__main__":  # first, before TensorFlow and JAX load (logged later)
  console.quiet_startup(import_tensorflow=False)  # environment defaults

import dataclasses
import functools
import json
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from absl import app, flags
from flax.core import meta

from t5x_lite import models
from t5x_lite.core import gin_config
from t5x_lite.nn import flops, network
from t5x_lite.core.errors import ConfigError

_INPUT_LENGTH = flags.DEFINE_integer('input_length', 512, 'Encoder sequence length.')
_TARGET_LENGTH = flags.DEFINE_integer('target_length', 114, 'Decoder sequence length.')
_JSON = flags.DEFINE_bool('json', False, 'Print a JSON summary as the last stdout line.')


def _abstract_params(config: network.T5Config) -> dict:
  key = jax.ShapeDtypeStruct((2,), jnp.uint32)
  return meta.unbox(jax.eval_shape(functools.partial(models.init_params, config), key))


def _count(tree) -> int:
  return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


def param_breakdown(config: network.T5Config) -> dict[str, int]:
  """Parameter counts per part: embedding, encoder, decoder (without logits), logits.

  Adapter layers (`T5Config.adapter_dim`) count in their stack.
  """
  params = _abstract_params(config)
  decoder = dict(params['decoder'])
  logits = _count(decoder.pop('logits_dense', {}))
  return {
    'embedding': _count(params['token_embedder']),
    'encoder': _count(params.get('encoder', {})),
    'decoder': _count(decoder),
    'logits': logits,
  }


def model_info(config: network.T5Config, input_length: int, target_length: int) -> dict:
  """Parameter counts and FLOPs of `config` as a JSON-serialisable dict.

  A decoder-only model or prefix LM reads inputs and targets as one sequence of
  input_length + target_length tokens.
  """
  breakdown = param_breakdown(config)
  lengths = flops.network_lengths(config, input_length, target_length)
  return {
    'num_params': sum(breakdown.values()),
    'breakdown': breakdown,
    'adapter_params': _count(network.adapter_params(_abstract_params(config))),
    'input_length': input_length,
    'target_length': target_length,
    'flops_per_token': flops.flops_per_token(config, *lengths),
    'forward_flops': flops.forward_flops(config, *lengths),
    'config': dataclasses.asdict(config),
  }


def configured_network() -> network.T5Config:
  """The T5Config that --gin_file and --gin_bindings describe.

  Raises:
    ConfigError: a missing gin file, a syntax error, an unknown name or a bad
      value, on one line naming it.
  """
  gin_config.parse_gin_flags()
  try:
    return network.T5Config()
  except (ValueError, TypeError) as e:
    raise ConfigError(' '.join(str(e).split())) from e


def main(argv: Sequence[str]) -> None:
  console.quiet_library_logs()
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  config = configured_network()
  info = model_info(config, _INPUT_LENGTH.value, _TARGET_LENGTH.value)
  for key, value in info['config'].items():
    print(f'{key:>32}: {value}')
  for part, value in info['breakdown'].items():
    print(f'{part + " params":>32}: {value:,}')
  print(f'{"total params":>32}: {info["num_params"]:,}')
  if info['adapter_params']:
    print(f'{"of which adapter params":>32}: {info["adapter_params"]:,}')
  print(
    f'{"train FLOPs per token":>32}: {info["flops_per_token"]:.4g} '
    f'(inputs {info["input_length"]}, targets {info["target_length"]})'
  )
  if _JSON.value:
    print(json.dumps(info))


if __name__ == '__main__':
  gin_config.run_app(main)
