"""T5X's side of `tools/benchmark.py --compare_t5x`: T5X's own train step and decoding, timed.

This program does NOT use t5x_lite. It runs under the interpreter of a separate virtualenv that
holds Google's T5X (google-research/t5x) and flaxformer, made by
`bash ../shared/peers/install_t5x.sh $HOME/t5x_peer`; tools/benchmark.py starts it in its own
process and merges the one JSON line it prints (the last line of stdout) into its report:

  $HOME/t5x_peer/venv/bin/python tools/t5x_peer_bench.py --embed_dim=32 --num_heads=4 \\
      --head_dim=8 --mlp_dim=64 --num_encoder_layers=2 --num_decoder_layers=2 \\
      --batch_size=2 --input_length=32 --target_length=8 --decode_length=4 --num_beams=2

The t5x and flaxformer source trees are found at `$T5X_PEER_SRC/{t5x,flaxformer}`, or else at
`<venv>/../src/` relative to the interpreter (the layout of install_t5x.sh).

The model is flaxformer's T5 1.1 gin (`flaxformer/t5x/configs/t5/models/t5_1_1_{small,base}.gin`,
the file whose sizes match; other sizes are t5_1_1_base.gin with its size macros overridden),
dropout as given, `ACTIVATION_DTYPE` = --dtype, and `embedding.Embed.one_hot` = --one_hot
(default false: the gather embedding, T5X's faster choice on CPU; the shipped gin says true).
The vocabulary is a seqio.PassThroughVocabulary of --vocab_size ids (the benchmark feeds ids).

Measured, after --warmup untimed runs, as the median of --reps timed runs (block_until_ready):
  * the train step: T5X's `Trainer` (Adafactor from the gin file, constant learning rate) under
    `PjitPartitioner(num_partitions=1)`, from a `TrainStateInitializer` state, compiled ahead
    of time with `Trainer.compile_train` (its compile time is reported too);
  * greedy and beam decoding with T5X's own `EncoderDecoderModel.predict_batch_with_aux`
    partitioned by the same partitioner: greedy is `decoding.temperature_sample` at
    temperature 0, beam is `decoding.beam_search` with `num_decodes` = --num_beams (alpha 0.6).
    The EOS id is --vocab_size, an id no logit stands for, so every example decodes exactly
    --decode_length new tokens (T5X has no minimum-length argument);
  * a [matmul_size, matmul_size] matmul in --dtype accumulating in float32 (the peak of the
    T5X side's MFU, measured the way t5x_lite's `throughput.measure_matmul_flops` does);
  * the peak resident memory of this process (`ru_maxrss`), MiB.
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

# Flaxformer's T5 1.1 size files and the size macros each one sets.
GIN_DIR = "flaxformer/t5x/configs/t5/models"
GIN_SIZES = {
  "t5_1_1_small": {
    "EMBED_DIM": 512,
    "NUM_HEADS": 6,
    "HEAD_DIM": 64,
    "MLP_DIM": 1024,
    "NUM_ENCODER_LAYERS": 8,
    "NUM_DECODER_LAYERS": 8,
  },
  "t5_1_1_base": {
    "EMBED_DIM": 768,
    "NUM_HEADS": 12,
    "HEAD_DIM": 64,
    "MLP_DIM": 2048,
    "NUM_ENCODER_LAYERS": 12,
    "NUM_DECODER_LAYERS": 12,
  },
}
NUM_EMBEDDINGS = 32128  # the gin files' vocabulary size
BEAM_ALPHA = 0.6  # brevity penalty, T5X's beam_search default (HF's length_penalty on our side)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  """The command line: model sizes, shapes, dtype and repetitions (see the module doc)."""
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  for name in GIN_SIZES["t5_1_1_base"]:
    p.add_argument(f"--{name.lower()}", type=int, required=True)
  p.add_argument("--vocab_size", type=int, default=NUM_EMBEDDINGS)
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--one_hot", default="false", choices=("true", "false"))
  p.add_argument("--dropout_rate", type=float, default=0.0)
  p.add_argument("--batch_size", type=int, default=8)
  p.add_argument("--input_length", type=int, default=512)
  p.add_argument("--target_length", type=int, default=114)
  p.add_argument("--decode_length", type=int, default=64)
  p.add_argument("--num_beams", type=int, default=4)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--learning_rate", type=float, default=0.01)
  p.add_argument("--matmul_size", type=int, default=2048)
  p.add_argument("--threads", type=int, default=0, help="CPUs to run on; 0: all allowed")
  p.add_argument("--backend", default="cpu", help="JAX_PLATFORMS of this process")
  p.add_argument("--skip", default="", help="comma-separated: train, decode")
  return p.parse_args(argv)


def setup_environment(args: argparse.Namespace) -> None:
  """Platform and CPU set of this process; must run before jax is imported."""
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  os.environ["JAX_PLATFORMS"] = args.backend
  if args.backend == "cpu":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
  cpus = sorted(os.sched_getaffinity(0))
  if 0 < args.threads < len(cpus):  # XLA:CPU runs one thread per CPU it may use
    os.sched_setaffinity(0, cpus[: args.threads])


def source_root() -> str:
  """Where the t5x and flaxformer source trees live."""
  venv = os.path.dirname(os.path.dirname(os.path.abspath(sys.executable)))
  return os.environ.get("T5X_PEER_SRC") or os.path.join(os.path.dirname(venv), "src")


def gin_file_and_bindings(args: argparse.Namespace) -> tuple[str, list[str]]:
  """Flaxformer's T5 1.1 gin file for the sizes in `args` and the bindings on top of it."""
  sizes = {name: getattr(args, name.lower()) for name in GIN_SIZES["t5_1_1_base"]}
  name = next((n for n, s in GIN_SIZES.items() if s == sizes), "t5_1_1_base")
  bindings = [
    "from __gin__ import dynamic_registration",
    "import seqio",
    "from flaxformer.components import embedding",
  ]
  bindings += [f"{k} = {v}" for k, v in sizes.items() if GIN_SIZES[name][k] != v]
  bindings += [
    f"ACTIVATION_DTYPE = '{args.dtype}'",
    f"DROPOUT_RATE = {args.dropout_rate}",
    f"NUM_EMBEDDINGS = {args.vocab_size}",
    f"embedding.Embed.one_hot = {args.one_hot == 'true'}",
    # Token ids in, token ids out: no SentencePiece model to load.
    "VOCABULARY = @seqio.PassThroughVocabulary()",
    "seqio.PassThroughVocabulary.size = %NUM_EMBEDDINGS",
  ]
  return f"{GIN_DIR}/{name}.gin", bindings


def build_model(args: argparse.Namespace) -> tuple[Any, str, list[str]]:
  """MODEL (a t5x.models.EncoderDecoderModel) from flaxformer's gin, with its file and bindings."""
  import gin

  gin_file, bindings = gin_file_and_bindings(args)
  # gin cannot resolve the package-relative includes of flaxformer's gin files (its configs
  # are a namespace package), so parse them with the source tree as the working directory.
  cwd = os.getcwd()
  os.chdir(os.path.join(source_root(), "flaxformer"))
  try:
    gin.parse_config_files_and_bindings([gin_file], bindings, finalize_config=False)
  finally:
    os.chdir(cwd)
  return gin.query_parameter("%MODEL").scoped_configurable_fn(), gin_file, bindings


def time_median(fn: Callable[[], Any], reps: int, warmup: int) -> tuple[float, list[float]]:
  """Median wall seconds of `fn()` (which must block until its work is done)."""
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times), times


def random_batch(args: argparse.Namespace, seed: int = 0) -> dict[str, np.ndarray]:
  """Unpacked, unpadded EncDecFeatureConverter features with random token ids."""
  rng = np.random.default_rng(seed)
  shape_in = (args.batch_size, args.input_length)
  shape_out = (args.batch_size, args.target_length)
  targets = rng.integers(2, args.vocab_size, shape_out, dtype=np.int32)
  return {
    "encoder_input_tokens": rng.integers(2, args.vocab_size, shape_in, dtype=np.int32),
    "decoder_input_tokens": np.pad(targets[:, :-1], ((0, 0), (1, 0))),  # [batch, target_len]
    "decoder_target_tokens": targets,
    "decoder_loss_weights": np.ones(shape_out, np.int32),
  }


def matmul_peak(args: argparse.Namespace) -> float:
  """FLOP/s of a [n, n] @ [n, n] matmul in --dtype accumulating in float32 (median)."""
  import jax
  import jax.numpy as jnp

  n = args.matmul_size
  x, y = jax.random.normal(jax.random.PRNGKey(0), (2, n, n), jnp.dtype(args.dtype))  # 2 x [n, n]
  matmul = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
  seconds, _ = time_median(lambda: matmul(x, y).block_until_ready(), args.reps, 2)
  return 2.0 * n**3 / seconds


def measure_train(
  args: argparse.Namespace, model: Any, partitioner: Any, initializer: Any, state: Any
) -> tuple[dict[str, Any], Any]:
  """T5X's Trainer train step on a fixed random batch; returns the figures and the params."""
  import jax
  from t5x import trainer as trainer_lib
  from t5x import utils

  trainer = trainer_lib.Trainer(
    model=model,
    train_state=state,
    partitioner=partitioner,
    eval_names=[],
    summary_dir=None,
    train_state_axes=initializer.train_state_axes,
    rng=jax.random.PRNGKey(1),
    learning_rate_fn=utils.create_learning_rate_scheduler(
      factors="constant", base_learning_rate=args.learning_rate
    ),
    num_microbatches=None,
  )
  batch = random_batch(args)
  start = time.perf_counter()
  trainer.compile_train(batch)
  compile_s = time.perf_counter() - start
  step = trainer._compiled_train_step  # pylint: disable=protected-access
  holder = {"state": trainer.train_state}

  def run() -> None:
    holder["state"], holder["metrics"] = step(holder["state"], batch)  # donates the state
    jax.block_until_ready((holder["state"], holder["metrics"]))

  seconds, times = time_median(run, args.reps, args.warmup)
  loss = float(np.asarray(holder["metrics"]["loss"].compute()))
  trainer.close()
  if not np.isfinite(loss):
    raise RuntimeError(f"T5X's train step produced a non-finite loss: {loss}")
  figures = {"train_step_s": seconds, "train_step_times_s": times, "train_compile_s": compile_s}
  return figures, holder["state"].params


def predict_fn(model: Any, decoder_params: dict[str, Any], num_decodes: int) -> Callable:
  """`(params, batch) -> [batch, decode_length]` tokens: the best decode of each example."""

  def predict(params: Any, batch: dict[str, Any]) -> Any:
    # predict_batch_with_aux adds keys to decoder_params: a fresh dict per trace.
    decodes, _ = model.predict_batch_with_aux(
      params, batch, decoder_params=dict(decoder_params), num_decodes=num_decodes
    )
    return decodes

  return predict


def measure_decode(
  args: argparse.Namespace, model: Any, partitioner: Any, params: Any, params_axes: Any
) -> dict[str, Any]:
  """Greedy and beam decoding with T5X's predict_batch_with_aux, exactly decode_length tokens."""
  import jax
  from t5x import decoding, models

  batch = {
    "encoder_input_tokens": random_batch(args, seed=2)["encoder_input_tokens"],
    # Its length is T5X's max decode length; all zeros: no prompt.
    "decoder_input_tokens": np.zeros((args.batch_size, args.decode_length), np.int32),
  }
  eos = {"eos_id": args.vocab_size}  # no logit has this id: EOS is never decoded
  kinds = (
    ("greedy", decoding.temperature_sample, {**eos, "temperature": 0.0}, 1),
    ("beam", decoding.beam_search, {**eos, "alpha": BEAM_ALPHA}, args.num_beams),
  )
  out: dict[str, Any] = {}
  for name, decode_fn, decoder_params, num_decodes in kinds:
    decoder = models.EncoderDecoderModel(
      module=model.module,
      input_vocabulary=model.input_vocabulary,
      output_vocabulary=model.output_vocabulary,
      optimizer_def=model.optimizer_def,
      decode_fn=decode_fn,
    )

    fn = partitioner.partition(
      predict_fn(decoder, decoder_params, num_decodes),
      in_axis_resources=(params_axes, partitioner.data_partition_spec),
      out_axis_resources=partitioner.data_partition_spec,
    )
    out[f"{name}_s"], _ = time_median(
      lambda f=fn: jax.block_until_ready(f(params, batch)), args.reps, max(args.warmup, 1)
    )
    tokens = np.asarray(fn(params, batch))  # [batch, decode_length]
    if tokens.shape != (args.batch_size, args.decode_length) or (tokens == eos["eos_id"]).any():
      raise RuntimeError(f"T5X {name} decode returned {tokens.shape}, not exactly the length")
    out[f"{name}_tokens_shape"] = list(tokens.shape)
  return out


def run(args: argparse.Namespace) -> dict[str, Any]:
  """Builds the model, measures every figure not skipped; returns them as one dict."""
  import jax
  import jax.numpy as jnp
  from t5x import partitioning, utils

  model, gin_file, bindings = build_model(args)
  skip = {s for s in args.skip.split(",") if s}
  partitioner = partitioning.PjitPartitioner(
    num_partitions=1, logical_axis_rules=partitioning.standard_logical_axis_rules()
  )
  shapes = {k: v.shape for k, v in random_batch(args).items()}
  initializer = utils.TrainStateInitializer(
    optimizer_def=model.optimizer_def,
    init_fn=model.get_initial_variables,
    input_shapes=shapes,
    input_types={k: jnp.int32 for k in shapes},
    partitioner=partitioner,
  )
  state = initializer.from_scratch(jax.random.PRNGKey(0))
  params = state.params
  result: dict[str, Any] = {
    "backend": jax.default_backend(),
    "device_kind": jax.devices()[0].device_kind,
    "threads": len(os.sched_getaffinity(0)),
    "jax_version": jax.__version__,
    "gin_file": gin_file,
    "gin_bindings": bindings,
    "one_hot": args.one_hot == "true",
    "num_params": int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params))),
    "peak_flops": matmul_peak(args),
  }
  if "train" not in skip:
    figures, params = measure_train(args, model, partitioner, initializer, state)
    result.update(figures)
  if "decode" not in skip:
    result.update(
      measure_decode(args, model, partitioner, params, initializer.train_state_axes.params)
    )
  result["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
  return result


def main(argv: list[str] | None = None) -> None:
  args = parse_args(argv)
  setup_environment(args)
  try:
    result = run(args)
  except Exception as e:
    # The traceback, then the error itself as the last line of stderr (which benchmark.py
    # reports): gin appends its file locations after the message.
    traceback.print_exc()
    message = str(e).strip().splitlines()
    print(f"{type(e).__name__}: {message[0] if message else ''}", file=sys.stderr, flush=True)
    sys.exit(1)
  print(json.dumps(result), flush=True)


if __name__ == "__main__":
  main()
