"""The T5 paper's encoder-decoder with shared parameters (section 3.2.2, Table 2).

"Encoder-decoder, shared": the encoder's and the decoder's layers share their
parameters, so the model has the parameter count of one stack (the paper's P, where
the unshared model has 2P) and the compute of both (M FLOPs per token, as unshared).
Layer i of the decoder uses layer i of the encoder's self-attention, MLP, their two
pre-norms and (with `adapter_dim`) its adapter; what only the decoder has stays its
own: cross-attention and its pre-norm, the causal relative position bias, the final
norm and the logits.

`SharedTransformer` is `network.Transformer` with its params mapped
(`nn.map_variables`): the stored tree lacks the decoder's shared entries, and every
call fills them in from the encoder's before the network runs, so the gradient of a
shared parameter is the sum of both uses. Scanned layers share their stacked arrays
the same way.
"""

from collections.abc import Callable

import flax.linen as nn
import jax.numpy as jnp

from t5x_lite.core.types import Array, PyTree
from t5x_lite.nn import param_init
from t5x_lite.nn.network import T5Config, Transformer

# Encoder layer sub-tree -> the decoder layer's sub-tree that reuses it.
SHARED = {
  'attention': 'self_attention',
  'pre_attention_layer_norm': 'pre_self_attention_layer_norm',
  'mlp': 'mlp',
  'pre_mlp_layer_norm': 'pre_mlp_layer_norm',
  'adapter': 'adapter',
}


def _layer_names(encoder: dict) -> list[str]:
  """The encoder's layer sub-trees: `layers_{i}`, or `layers` when scanned."""
  return [name for name in encoder if name == 'layers' or name.startswith('layers_')]


def expand(params: dict) -> dict:
  """Stored params -> the full `network.Transformer` params (decoder entries filled in)."""
  if 'encoder' not in params or 'decoder' not in params:
    return params  # init: nothing created yet
  decoder = dict(params['decoder'])
  for layer in _layer_names(params['encoder']):
    decoder_layer = dict(decoder.get(layer, {}))
    for source, target in SHARED.items():
      if source in params['encoder'][layer]:
        decoder_layer[target] = params['encoder'][layer][source]
    decoder[layer] = decoder_layer
  return {**params, 'decoder': decoder}


def contract(params: dict) -> dict:
  """Full `network.Transformer` params -> the stored ones (decoder's shared entries removed)."""
  if 'encoder' not in params or 'decoder' not in params:
    return params
  decoder = dict(params['decoder'])
  for layer in _layer_names(params['encoder']):
    shared = {SHARED[name] for name in params['encoder'][layer] if name in SHARED}
    if layer in decoder:
      decoder[layer] = {k: v for k, v in decoder[layer].items() if k not in shared}
  return {**params, 'decoder': decoder}


def _on_params(fn: Callable[[dict], dict]) -> Callable[[dict], dict]:
  """`fn` over the 'params' collection of a {collection: tree} mapping (`nn.map_variables`')."""

  def mapped(variables: dict) -> dict:
    if 'params' not in variables:  # apply without mutable params: nothing to map
      return variables
    return {**variables, 'params': fn(variables['params'])}

  return mapped


# init=False: with init=True, flax first runs the network on the stored (contracted)
# params whenever any collection is mutable (a decoding step's 'cache'), and the
# decoder's shared entries are missing there. mutable=True maps created params back
# through `contract` instead, so `init` stores the contracted tree.
SharedTransformer = nn.map_variables(
  Transformer,
  'params',
  trans_in_fn=_on_params(expand),
  trans_out_fn=_on_params(contract),
  init=False,
  mutable=True,
  methods=['__call__', 'encode', 'decode'],
)
SharedTransformer.__doc__ = """`network.Transformer` whose decoder reuses the encoder's layers.

Same attributes and methods (`encode`, `decode`, `__call__`); its params are
`network.Transformer`'s without the decoder's shared entries (`SHARED`).
"""


def init_params(config: T5Config, rng: Array) -> PyTree:
  """Boxed initial params of `SharedTransformer(config)` (`nn.LogicallyPartitioned` leaves)."""
  tokens = jnp.ones((1, 1), jnp.int32)  # [batch, length]
  return param_init.init_params(
    SharedTransformer(config=config), rng, tokens, tokens, tokens, enable_dropout=False
  )
