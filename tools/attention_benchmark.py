r"""T5 attention's forward and backward on a GPU: how cuDNN's fused attention takes its bias.

T5's attention adds two biases to its logits: the attention mask (padding, packing,
causality: data, no gradient) and the relative position bias (a learned parameter whose
gradient must flow). Summed into one [batch, heads, q, k] bias for
`jax.nn.dot_product_attention(implementation='cudnn')`, cuDNN reads that bias and
writes its gradient at full size in every layer. This tool times, at one
attention shape, the forward and backward (gradients of queries, keys, values and the
position bias) of the ways cuDNN can be given the same function:

* `cudnn_summed_bias`: the masks and the position bias summed (what the 'xla_gpu'
  kernel set does for packed rows and causal masks);
* `cudnn_position_bias_padding`: the position bias as [1, heads, q, k] and the padding
  as sequence lengths (cuDNN's PADDING mask: no mask tensor; what 'xla_gpu' does for
  unpacked rows' encoder self-attention and cross-attention);
* `cudnn_position_bias_packed`: the same with packed segments as cuDNN's segment
  offsets (jax's cuDNN call with `q_offsets`/`kv_offsets`; no mask tensor);
* `cudnn_no_bias`: no bias at all (what cuDNN does without T5's position bias: a floor);
* `xla_summed_bias`: XLA's attention with the summed bias (the 'reference' math).

Each variant's outputs and gradients are checked against `xla_summed_bias` on the same
inputs (relative L2 error), so a variant that computes another function shows it. A
variant the backend refuses is listed with its one-line error (on a CPU every cuDNN
variant is).

  python tools/attention_benchmark.py --json=/tmp/attention.json                # encoder shape
  python tools/attention_benchmark.py --batch=128 --length=114 --causal          # decoder shape
  python tools/attention_benchmark.py --batch=2 --length=16 --heads=2 --reps=1   # CPU check
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# The additive mask value of the layers (t5x_lite.nn.layers.MASK_BIAS's magnitude).
MASK = -1e10


def segments(batch: int, length: int, per_row: int, padding: bool) -> np.ndarray:
  """[batch, length] segment ids 1..per_row of equal lengths; with `padding`, the last
  row's last segment cut short by padding (id 0)."""
  ids = np.repeat(np.arange(1, per_row + 1), -(-length // per_row))[:length]
  out = np.tile(ids, (batch, 1)).astype(np.int32)
  if padding:
    out[-1, -(length // (2 * per_row)) :] = 0
  return out


def mask_bias(seg: np.ndarray, causal: bool) -> np.ndarray:
  """[batch, 1, q, k] float32: 0 where a query may see a key (same segment, not padding,
  not in the future with `causal`), MASK elsewhere."""
  same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
  if causal:
    same &= np.tril(np.ones(same.shape[1:], bool))[None]
  return np.where(same, 0.0, MASK).astype(np.float32)[:, None]


def offsets_and_lengths(seg: np.ndarray, max_segments: int) -> tuple[np.ndarray, np.ndarray]:
  """cuDNN's packing: per row the segments' start offsets [batch, M+1] and lengths
  [batch, M], -1 where a row has fewer segments."""
  batch = seg.shape[0]
  offsets = -np.ones((batch, max_segments + 1), np.int32)
  lengths = -np.ones((batch, max_segments), np.int32)
  for b in range(batch):
    ids = [i for i in np.unique(seg[b]) if i > 0]
    for j, i in enumerate(ids):
      where = np.nonzero(seg[b] == i)[0]
      offsets[b, j], lengths[b, j] = where[0], len(where)
    offsets[b, len(ids)] = offsets[b, len(ids) - 1] + lengths[b, len(ids) - 1]
  return offsets, lengths


def variants(
  seg: np.ndarray, causal: bool, per_row: int
) -> dict[str, Callable[[Any, Any, Any, Any], Any]]:
  """name -> attention(q, k, v, position_bias [1, heads, q, k]) computing the same function
  (cuDNN's are jax-traceable calls that raise where cuDNN is missing)."""
  masks = jnp.asarray(mask_bias(seg, causal))  # [batch, 1, q, k]
  lengths_1d = jnp.asarray((seg > 0).sum(1).astype(np.int32))  # [batch]
  offsets, lengths = offsets_and_lengths(seg, per_row)

  def summed(q, k, v, pos, implementation):
    bias = (masks + pos.astype(jnp.float32)).astype(q.dtype if implementation else jnp.float32)
    return jax.nn.dot_product_attention(
      q, k, v, bias=bias, scale=1.0, implementation=implementation or "xla"
    )

  def padding(q, k, v, pos):
    if per_row > 1:
      raise ValueError("packed rows: padding lengths alone would let segments see each other")
    return jax.nn.dot_product_attention(
      q,
      k,
      v,
      bias=pos,
      scale=1.0,
      is_causal=causal,
      query_seq_lengths=lengths_1d,
      key_value_seq_lengths=lengths_1d,
      implementation="cudnn",
    )

  def packed(q, k, v, pos):
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    mask_type = cudnn.MaskType.PADDING_CAUSAL if causal else cudnn.MaskType.PADDING
    off, lens = jnp.asarray(offsets), jnp.asarray(lengths)
    return cudnn.dot_product_attention(
      q, k, v, pos, None, lens, lens, off, off, scale=1.0, mask_type=mask_type
    )

  def no_bias(q, k, v, pos):
    del pos
    return jax.nn.dot_product_attention(
      q, k, v, scale=1.0, is_causal=causal, implementation="cudnn"
    )

  return {
    "cudnn_summed_bias": lambda q, k, v, pos: summed(q, k, v, pos, "cudnn"),
    "cudnn_position_bias_padding": padding,
    "cudnn_position_bias_packed": packed,
    "cudnn_no_bias": no_bias,
    "xla_summed_bias": lambda q, k, v, pos: summed(q, k, v, pos, None),
  }


def forward_backward(attention: Callable) -> Callable:
  """jit of (q, k, v, pos, cotangent) -> (out, dq, dk, dv, dpos)."""

  def fn(q, k, v, pos, cotangent):
    out, vjp = jax.vjp(attention, q, k, v, pos)
    return (out, *vjp(cotangent))

  return jax.jit(fn)


def _rel(a: Any, b: Any, valid: np.ndarray | None) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  if valid is not None:  # padded queries' outputs are undefined: compare real ones
    a, b = a[valid], b[valid]
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def measure(args: argparse.Namespace) -> dict[str, Any]:
  """Times every variant; returns the settings, each variant's figures and its errors."""
  b, t, h, d = args.batch, args.length, args.heads, args.head_dim
  dtype = jnp.dtype(args.dtype)
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  q, k, v, cot = (jax.random.normal(key, (b, t, h, d), dtype) for key in keys[:4])
  pos = (jax.random.normal(keys[4], (1, h, t, t)) * 2).astype(dtype)  # [1, heads, q, k]
  seg = segments(b, t, args.segments, args.padding)
  valid = (seg > 0)[:, :, None, None].repeat(h, 2).repeat(d, 3)  # [batch, q, heads, kv]
  # A padded query's output never reaches the loss (it is masked as a key everywhere,
  # and its targets weigh 0), so its cotangent is 0 in training: here too.
  cot = cot * jnp.asarray(valid, cot.dtype)
  flops = 4 * b * h * t * t * d * (0.5 if args.causal else 1.0) * 3.5  # fwd 2 matmuls, bwd 5
  results: dict[str, Any] = {}
  reference = None
  for name, attention in reversed(list(variants(seg, args.causal, args.segments).items())):
    fn = forward_backward(attention)
    try:
      start = time.perf_counter()
      outs = jax.block_until_ready(fn(q, k, v, pos, cot))
      compile_s = time.perf_counter() - start
    except Exception as e:  # noqa: BLE001  (the backend's refusal, reported as one line)
      results[name] = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"}
      continue
    times = []
    for i in range(args.warmup + args.reps):
      start = time.perf_counter()
      jax.block_until_ready(fn(q, k, v, pos, cot))
      if i >= args.warmup:
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    figures: dict[str, Any] = {
      "ms": seconds * 1e3,
      "tflops": flops / seconds / 1e12,
      "compile_s": compile_s,
    }
    if reference is None:
      reference = outs
    else:
      for label, x, y, mask in zip(
        ("out", "dq", "dk", "dv", "dpos"), outs, reference, (valid, None, None, None, None)
      ):
        figures[f"{label}_rel_err"] = _rel(x, y, mask)
    results[name] = figures
  return {
    "backend": jax.default_backend(),
    "device_kind": jax.devices()[0].device_kind,
    "jax": jax.__version__,
    "shape": {
      "batch": b,
      "length": t,
      "heads": h,
      "head_dim": d,
      "segments_per_row": args.segments,
    },
    "padding": args.padding,
    "causal": args.causal,
    "dtype": args.dtype,
    "flops_fwd_bwd": flops,
    "variants": dict(reversed(list(results.items()))),
  }


def table(result: dict[str, Any]) -> str:
  """One line per variant: time, TFLOP/s, largest relative error against XLA's."""
  lines = [
    f"{result['device_kind']} ({result['backend']}), {result['dtype']}, {result['shape']}, "
    f"causal={result['causal']}: forward + backward"
  ]
  for name, f in result["variants"].items():
    if "error" in f:
      lines.append(f"  {name:30s} refused: {f['error']}")
      continue
    errs = [v for key, v in f.items() if key.endswith("_rel_err")]
    err = f", max rel err vs xla {max(errs):.1e}" if errs else ""
    lines.append(f"  {name:30s} {f['ms']:9.3f} ms {f['tflops']:8.1f} TFLOP/s{err}")
  return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--length", type=int, default=512, help="queries = keys (self-attention)")
  parser.add_argument("--heads", type=int, default=12)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--segments", type=int, default=1, help="packed segments per row")
  parser.add_argument("--causal", action="store_true", help="decoder self-attention")
  parser.add_argument(
    "--padding",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="pad the last row's last segment (--no-padding: none)",
  )
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--json", default=None, help="also write the figures here")
  args = parser.parse_args(argv)
  if args.segments < 1 or args.length < 2 * args.segments:
    print(f"ERROR: --segments={args.segments}: needs 1 to --length/2", file=sys.stderr)
    return 2
  result = measure(args)
  print(table(result))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
