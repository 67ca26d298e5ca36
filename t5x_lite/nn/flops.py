"""Model FLOP counts of the T5 network, for throughput and MFU reporting.

Only matrix multiplications are counted, each as 2*m*n*k FLOPs (one multiply and
one add per term); norms, softmax, activations, dropout and embedding lookups are
ignored, as in the usual model-FLOPs convention (PaLM appendix B, levanter,
nanoGPT). With E = emb_dim, H = num_heads * head_dim, M = mlp_dim, W = number of
MLP input projections (1 for ReLU, 2 for gated GELU), A = adapter_dim (0 without
adapters), V = vocab_size, I = input length and T = target length, one example's
forward pass costs:

  mlp(L)        = 2 L E M (W + 1) + 2 L E A * 2     feed-forward, then the adapter
  attn(Lq, Lk)  = 2 Lq E H * 2        query and output projections
                + 2 Lk E H * 2        key and value projections
                + 2 Lq Lk H * 2       scores q.k and the weighted sum of values
  encoder       = num_encoder_layers * (attn(I, I) + mlp(I))
  decoder       = num_decoder_layers * (attn(T, T) + attn(T, I) + mlp(T))
  logits        = 2 T E V

A decoder-only model or prefix LM (`T5Config.architecture`) has no encoder and no
cross-attention: its T is the inputs and targets concatenated, and I = 0.

Causal self-attention is counted in full (T x T), as it is computed. A training
step (forward + backward) costs 3x the forward pass; flops_per_token divides that
by the I + T tokens of the example.
"""

from t5x_lite.nn.network import T5Config


def _mlp_flops(config: T5Config, length: int) -> float:
  mlp = 2.0 * length * config.emb_dim * config.mlp_dim * (len(config.mlp_activations) + 1)
  adapter = 4.0 * length * config.emb_dim * config.adapter_dim
  return mlp + adapter


def _attention_flops(config: T5Config, query_length: int, key_length: int) -> float:
  inner = config.num_heads * config.head_dim
  projections = 4.0 * (query_length + key_length) * config.emb_dim * inner
  scores_and_values = 4.0 * query_length * key_length * inner
  return projections + scores_and_values


def forward_flops(config: T5Config, input_length: int, target_length: int) -> float:
  """Matmul FLOPs of one forward pass over one (input, target) example.

  Args:
    config: the network config.
    input_length: encoder sequence length I (0 for a decoder-only model).
    target_length: decoder sequence length T.

  Returns:
    FLOPs (see the module docstring for the formula).
  """
  encoder_layer = _attention_flops(config, input_length, input_length) + _mlp_flops(
    config, input_length
  )
  cross_attention = 0.0
  if config.architecture == 'encoder_decoder':
    cross_attention = _attention_flops(config, target_length, input_length)
  decoder_layer = (
    _attention_flops(config, target_length, target_length)
    + cross_attention
    + _mlp_flops(config, target_length)
  )
  logits = 2.0 * target_length * config.emb_dim * config.vocab_size
  return (
    config.num_encoder_layers * encoder_layer + config.num_decoder_layers * decoder_layer + logits
  )


def flops_per_token(config: T5Config, input_length: int, target_length: int) -> float:
  """Training (forward + backward = 3x forward) FLOPs per input-plus-target token.

  Args:
    config: the network config.
    input_length: encoder sequence length I.
    target_length: decoder sequence length T.

  Returns:
    3 * forward_flops / (I + T).
  """
  return 3.0 * forward_flops(config, input_length, target_length) / (input_length + target_length)


def network_lengths(config: T5Config, input_length: int, target_length: int) -> tuple[int, int]:
  """(I, T) of `forward_flops` for a task's inputs and targets lengths.

  Encoder-decoder: unchanged. Decoder-only and prefix LM: (0, inputs + targets),
  the one concatenated sequence.
  """
  if config.architecture == 'encoder_decoder':
    return input_length, target_length
  return 0, input_length + target_length
