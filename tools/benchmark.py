r"""Side-by-side speed of t5x_lite, HF transformers (PyTorch) T5 and T5X itself.

Measures, after warm-up, the median over --reps repetitions of:
  * training step tokens/s (inputs + targets) with Adafactor: ours is the real
    `trainer.make_train_step`; HF is `T5ForConditionalGeneration` with
    `transformers.optimization.Adafactor` (scale_parameter=True, relative_step=False,
    warmup_init=False, clip_threshold=1.0, decay_rate=-0.8, beta1=None: T5's settings,
    as in our `optimizers.adafactor`) at the same constant learning rate. The two
    steps are timed in turn, one of each per repetition after both warm-ups, so that
    a machine whose speed drifts (shared VMs do, by 20% within minutes) slows both;
    each timed step follows --settle untimed steps of its own side, because in one
    process the first step after the other side's runs slow (ours by 0.7-1.4 s
    after torch's work, on a Zen 4 in bfloat16);
  * MFU = model FLOP/s (`t5x_lite.nn.flops`) / peak FLOP/s, as training logs it
    (`t5x_lite.training.throughput`): over the device's data-sheet peak for the
    precision the matmuls run at where the device is in `throughput.DATASHEET_PEAK_FLOPS`
    (a GPU, a TPU), with MFU over a large matmul measured here in the same dtype
    (`throughput.measure_matmul_flops` in jax for ours, torch for HF's) as the second
    figure ('train_mfu_measured_matmul'); on CPU over the measured matmul alone;
  * greedy and beam decode tokens/s: exactly --decode_length new tokens per example
    (min = max length in both; HF `generate(use_cache=True)`), tokens counted once per
    input example (not per beam), encoder included;
  * input pipeline examples/s (span corruption + packing: the pipeline training reads,
    timed by tools/data_benchmark.py) vs the examples/s our train step consumes
    (train rows/s x examples per packed row);
  * train-step compile time (jax's trace + lowering + backend compile events) and peak
    resident memory (`ru_maxrss`, process-wide: jax, torch and tf.data together).

`--kernels=xla_cpu,reference` measures our train step and decodes with each
`T5Config.kernels` set ('auto' picks the backend's): the first is the t5x_lite column,
every other one gets a column with the ratio of the first to it; all train steps are
timed in turn, and `kernels_<name>_greedy_token_agreement` says how often the greedy
decodes agree.

HF runs in this process, on the same random weights (ours, written with
`hf.save_hf`); torch uses as many threads as XLA's CPU backend (the cores this
process may run on).

`--loss_chunk_length=N` computes our loss N target positions at a time
(`EncoderDecoderModel.loss_chunk_length`). `--compile_only` compiles our train steps
(and decodes) and measures nothing: with JAX's persistent compilation cache
(JAX_COMPILATION_CACHE_DIR) a later run loads them ('compile_cache_hits' counts the
programs it loaded); tools/gpu_benchmark.sh compiles its runs so, in parallel, before
timing them one at a time. `--profile_dir=DIR` traces --profile_steps train steps of
each kernel set after the timing (`jax.profiler`, with a Perfetto trace.json.gz) into
DIR/<kernels>/, beside the compiled program's HLO text (hlo.txt) that
tools/profile_summary.py reads to name the top ops.

`--compare_t5x=PYTHON` also measures Google's T5X (google-research/t5x with flaxformer):
tools/t5x_peer_bench.py runs under PYTHON, the interpreter of a virtualenv with T5X
installed (`bash ../shared/peers/install_t5x.sh $HOME/t5x_peer` makes one), in its own
process, before our figures are taken. It builds flaxformer's T5 1.1 gin model of the
same sizes (T5 1.1 configs only), with its own random weights, and times T5X's Trainer
train step (Adafactor from the gin file, same learning rate) under
PjitPartitioner(num_partitions=1), and T5X's own decoding (`predict_batch_with_aux` with
`decoding.temperature_sample` at temperature 0, and `decoding.beam_search`), at the same
shapes, dtype, repetitions, CPUs, XLA_FLAGS (ours, `console.CPU_XLA_FLAGS` included) and
GLIBC_TUNABLES (`--huge_pages` restarts this tool with huge-page malloc; HF runs in this
process, so it has it too). Its embedding
is a gather (`--t5x_one_hot=false`, T5X's faster choice; the shipped gin is one-hot).
Its MFU is over a matmul peak measured in its process the same way.

  python tools/benchmark.py --compare_hf --json=/tmp/bench.json
  python tools/benchmark.py --gin_file=models/t5_1_1/tiny.gin --batch_size=2 \
      --input_length=32 --target_length=8 --decode_length=4 --reps=2 --compare_hf
  python tools/benchmark.py --kernels=xla_cpu,reference --skip=data --json=/tmp/kernels.json
  python tools/benchmark.py --compare_t5x=$HOME/t5x_peer/venv/bin/python --skip=data \
      --json=/tmp/bench_t5x.json
"""

from t5x_lite.core import console

if __name__ == "__main__":  # first, before TensorFlow and JAX load (logged later)
  # Environment defaults, no compilation cache (compile times are measured); TensorFlow: below.
  console.quiet_startup(import_tensorflow=False, compilation_cache=False)

import contextlib
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from absl import app, flags, logging

from t5x_lite import cli, models
from t5x_lite.core import errors, gin_config
from t5x_lite.kernels import registry
from t5x_lite.nn import flops, network
from t5x_lite.training import optimizers
from t5x_lite.interop import hf
from t5x_lite.training import partitioning, throughput, trainer

_COMPARE_HF = flags.DEFINE_bool("compare_hf", False, "Also measure HF transformers T5.")
_COMPARE_T5X = flags.DEFINE_string(
  "compare_t5x", None, "Also measure T5X: the Python interpreter of a venv with T5X installed."
)
_T5X_ONE_HOT = flags.DEFINE_bool(
  "t5x_one_hot", False, "T5X's one-hot embedding (its gin's) instead of the faster gather."
)
_JSON = flags.DEFINE_string("json", None, "Write all figures as a JSON object here.")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Examples per training / decoding batch.")
_INPUT_LEN = flags.DEFINE_integer("input_length", 512, "Encoder length (train and decode).")
_TARGET_LEN = flags.DEFINE_integer("target_length", 114, "Decoder length in training.")
_DECODE_LEN = flags.DEFINE_integer("decode_length", 64, "New tokens per decode (exactly).")
_BEAMS = flags.DEFINE_integer("num_beams", 4, "Beam size of the beam-search figure.")
_REPS = flags.DEFINE_integer("reps", 5, "Timed repetitions per figure (median reported).")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed repetitions before timing.")
_SETTLE = flags.DEFINE_integer(
  "settle", 1, "Untimed train steps of a side right before each of its timed ones (0: none)."
)
_DTYPE = flags.DEFINE_enum(
  "dtype",
  "auto",
  ["auto", "float32", "bfloat16"],
  "Activation dtype; auto: float32 on CPU, bfloat16 elsewhere.",
)
_MATMUL = flags.DEFINE_integer("matmul_size", 2048, "Square size of the peak matmul.")
_LR = flags.DEFINE_float("learning_rate", 0.01, "Constant learning rate of both optimizers.")
_DATA_TASK = flags.DEFINE_string(
  "data_task",
  "cpython_span_corruption",
  "Task or mixture of the input-pipeline figure ('' skips it).",
)
_DATA_BATCHES = flags.DEFINE_integer("data_batches", 30, "Batches timed in the pipeline.")
_SKIP = flags.DEFINE_list("skip", [], "Figures to skip: train, decode, data.")
_LOSS_CHUNK = flags.DEFINE_integer(
  "loss_chunk_length", None, "EncoderDecoderModel.loss_chunk_length of our model (None: whole)."
)
_COMPILE_ONLY = flags.DEFINE_bool(
  "compile_only", False, "Compile our train steps and decodes, measure nothing (see above)."
)
_PROFILE_DIR = flags.DEFINE_string(
  "profile_dir", None, "Trace our train steps of each kernel set here after timing them."
)
_PROFILE_STEPS = flags.DEFINE_integer("profile_steps", 3, "Train steps traced per kernel set.")
_KERNELS = flags.DEFINE_list(
  "kernels",
  ["auto"],
  "T5Config.kernels sets to measure: the first is the t5x_lite column, each other one "
  "(e.g. --kernels=xla_cpu,reference) gets a column with the ratio of the first to it.",
)

DEFAULT_GIN_FILE = "models/t5_1_1/small.gin"
_COMPILE_EVENTS = (
  "/jax/core/compile/jaxpr_trace_duration",
  "/jax/core/compile/jaxpr_to_mlir_module_duration",
  "/jax/core/compile/backend_compile_duration",
)


@dataclasses.dataclass(frozen=True)
class Settings:
  """What to measure.

  Attributes:
    config: the network config (its dtype is the measured dtype).
    batch_size: examples per batch.
    input_length: encoder length.
    target_length: decoder length of a training example.
    decode_length: new tokens per decoded example.
    num_beams: beam size.
    reps: timed repetitions.
    warmup: untimed repetitions.
    settle: untimed train steps of a side before each of its timed ones.
    matmul_size: size of the peak-FLOP/s matmul.
    learning_rate: constant learning rate.
    threads: CPU threads for torch (XLA's CPU backend uses one per core).
    compare_hf: measure HF transformers too.
    compare_t5x: the Python interpreter of a T5X venv ('' does not measure T5X).
    t5x_one_hot: T5X's one-hot embedding instead of its gather embedding.
    data_task: task of the pipeline figure ('' skips it).
    data_batches: batches timed in the pipeline.
    skip: figures not measured ('train', 'decode', 'data').
    compare_kernels: other `T5Config.kernels` sets measured beside the config's own
      (train and decode figures, keys prefixed 'kernels_<name>_').
    loss_chunk_length: our model's `loss_chunk_length` (None: the whole logits).
    compile_only: compile our programs (for a persistent cache), measure nothing.
    profile_dir: trace `profile_steps` train steps per kernel set here ('' does not).
    profile_steps: train steps traced per kernel set.
  """

  config: network.T5Config
  batch_size: int = 8
  input_length: int = 512
  target_length: int = 114
  decode_length: int = 64
  num_beams: int = 4
  reps: int = 5
  warmup: int = 2
  settle: int = 1
  matmul_size: int = 2048
  learning_rate: float = 0.01
  threads: int = 1
  compare_hf: bool = False
  compare_t5x: str = ""
  t5x_one_hot: bool = False
  data_task: str = "cpython_span_corruption"
  data_batches: int = 30
  skip: tuple[str, ...] = ()
  compare_kernels: tuple[str, ...] = ()
  loss_chunk_length: int | None = None
  compile_only: bool = False
  profile_dir: str = ""
  profile_steps: int = 3


def time_median(fn: Callable[[], Any], reps: int, warmup: int) -> tuple[float, list[float]]:
  """Median wall seconds of `fn()` (which must block until its work is done)."""
  return time_in_turn({"": fn}, reps, warmup)[""]


def time_in_turn(
  fns: dict[str, Callable[[], Any]], reps: int, warmup: int, settle: int = 0
) -> dict[str, tuple[float, list[float]]]:
  """`time_median` of each fn, timed in turn: after each one's warm-up, rounds of one
  call of each, so that a machine whose speed drifts slows every side alike; each
  timed call follows `settle` untimed calls of the same fn."""
  for fn in fns.values():
    for _ in range(warmup):
      fn()
  times: dict[str, list[float]] = {name: [] for name in fns}
  for _ in range(reps):
    for name, fn in fns.items():
      for _ in range(settle):
        fn()
      start = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - start)
  return {name: (statistics.median(t), t) for name, t in times.items()}


def max_rss_mib() -> float:
  """Peak resident memory of this process so far, MiB (Linux reports KiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def random_batch(s: Settings, seed: int = 0) -> dict[str, np.ndarray]:
  """Unpacked, unpadded EncDecFeatureConverter features with random token ids."""
  rng = np.random.default_rng(seed)
  vocab = s.config.vocab_size
  inputs = rng.integers(2, vocab, (s.batch_size, s.input_length), dtype=np.int32)
  targets = rng.integers(2, vocab, (s.batch_size, s.target_length), dtype=np.int32)
  decoder_inputs = np.pad(targets[:, :-1], ((0, 0), (1, 0)))  # [batch, target_len]
  return {
    "encoder_input_tokens": inputs,
    "decoder_input_tokens": decoder_inputs,
    "decoder_target_tokens": targets,
    "decoder_loss_weights": np.ones_like(targets, np.float32),
  }


# ----------------------------------------------------------------------------- peak


def torch_matmul_peak(size: int, dtype: Any, reps: int, device: str) -> float:
  """FLOP/s of a [size, size] @ [size, size] torch matmul in `dtype` (median).

  The torch side of `throughput.measure_matmul_flops` (2 warm-up runs).
  """
  import torch

  x = torch.randn(size, size, device=device).to(dtype)  # [n, n]
  y = torch.randn(size, size, device=device).to(dtype)  # [n, n]

  def run() -> None:
    torch.mm(x, y)
    if device != "cpu":
      torch.cuda.synchronize()

  seconds, _ = time_median(run, reps, 2)
  return 2.0 * size**3 / seconds


# ------------------------------------------------------------------------------ ours


@dataclasses.dataclass(frozen=True)
class IdVocabulary:
  """Token ids as they are (pad 0, eos 1): the model reads only `eos_id` and
  `vocab_size`, and the benchmark feeds ids, so no tokenizer (or TensorFlow) loads."""

  vocab_size: int
  eos_id: int = 1


def make_model(
  config: network.T5Config, loss_chunk_length: int | None = None
) -> models.EncoderDecoderModel:
  """Our model over `IdVocabulary`."""
  vocab = IdVocabulary(config.vocab_size)
  return models.EncoderDecoderModel(
    network.Transformer(config), vocab, vocab, loss_chunk_length=loss_chunk_length
  )


@dataclasses.dataclass
class OursTrain:
  """Our train step, compiled and called once (`prepare_ours_train`).

  Attributes:
    run: one more step (None with `Settings.compile_only`: compiled, never called).
    figures: compile figures ('train_compile_s', 'train_first_call_s').
    losses: the loss of each step run so far (every kernel set runs as many steps on
      the same batch from the same parameters, so their losses should agree).
    compiled_text: the compiled step's HLO text (compiled again, or loaded from a
      persistent compilation cache when one is on).
  """

  run: Callable[[], None] | None
  figures: dict[str, float]
  compiled_text: Callable[[], str]
  losses: list[float] = dataclasses.field(default_factory=list)


def prepare_ours_train(
  s: Settings, model: models.EncoderDecoderModel, params_out: dict
) -> OursTrain:
  """Our real train step, compiled and called once (only compiled with `compile_only`).

  Stores the initial params (numpy) in params_out; the step raises if its loss is not
  finite.
  """
  partitioner = partitioning.Partitioner()
  optimizer = optimizers.adafactor(learning_rate=s.learning_rate)
  state, shardings = trainer.init_train_state(model, optimizer, jax.random.PRNGKey(0), partitioner)
  params_out["params"] = jax.device_get(state.params)
  step = trainer.make_train_step(model, optimizer, partitioner, shardings)
  batch = jax.device_put(random_batch(s), partitioner.batch_sharding)
  rng = jax.random.PRNGKey(1)
  compile_seconds = []

  def on_event(event: str, duration: float, **kwargs: Any) -> None:
    del kwargs
    if event in _COMPILE_EVENTS:
      compile_seconds.append(duration)

  jax.monitoring.register_event_duration_secs_listener(on_event)
  holder = {"state": state}
  losses: list[float] = []

  def run() -> None:
    holder["state"], metrics = step(holder["state"], batch, rng)
    losses.append(float(metrics["loss"]))  # also waits for the step
    if not np.isfinite(losses[-1]):
      raise RuntimeError("our train step produced a non-finite loss")

  def compiled_text() -> str:
    return step.lower(holder["state"], batch, rng).compile().as_text()

  start = time.perf_counter()
  if s.compile_only:
    step.lower(state, batch, rng).compile()
  else:
    run()
  first_call = time.perf_counter() - start
  jax.monitoring.unregister_event_duration_listener(on_event)
  figures = {"train_compile_s": sum(compile_seconds), "train_first_call_s": first_call}
  return OursTrain(None if s.compile_only else run, figures, compiled_text, losses)


def measure_ours_decode(
  s: Settings, model: models.EncoderDecoderModel, params: Any
) -> dict[str, Any]:
  """Greedy and beam decode of exactly decode_length tokens, jitted end to end."""
  batch = {
    "encoder_input_tokens": random_batch(s, seed=2)["encoder_input_tokens"],
    "decoder_input_tokens": np.zeros((s.batch_size, s.decode_length), np.int32),
  }
  lengths = {"max_decode_len": s.decode_length, "min_decode_len": s.decode_length}
  greedy = jax.jit(lambda p, b: model.predict_batch(p, b, decoder_params=lengths))
  beam = jax.jit(
    lambda p, b: model.predict_batch(
      p, b, decoder_params=lengths, num_decodes=s.num_beams, decode_fn="beam"
    )
  )
  out = {}
  if s.compile_only:
    for fn in (greedy, beam):
      fn.lower(params, batch).compile()
    return out
  for name, fn in (("greedy", greedy), ("beam", beam)):
    seconds, _ = time_median(
      lambda f=fn: jax.block_until_ready(f(params, batch)), s.reps, max(s.warmup, 1)
    )
    out[f"{name}_s"] = seconds
  out["greedy_tokens"] = np.asarray(greedy(params, batch))
  out["inputs"] = batch["encoder_input_tokens"]
  return out


# -------------------------------------------------------------------------------- HF


def _hf_device() -> str:
  import torch

  return "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"


def load_hf_model(s: Settings, params: Any) -> Any:
  """Our params written with `hf.save_hf` and loaded into transformers."""
  import torch
  import transformers

  with tempfile.TemporaryDirectory() as tmp:
    hf.save_hf(dataclasses.replace(s.config, param_dtype="float32"), params, tmp)
    hf_model = transformers.T5ForConditionalGeneration.from_pretrained(tmp, dtype=torch.float32)
  return hf_model.to(_hf_device())


def _autocast(s: Settings) -> Any:
  import contextlib

  import torch

  if s.config.dtype == "float32":
    return contextlib.nullcontext()
  return torch.autocast(_hf_device(), dtype=torch.bfloat16)


def prepare_hf_train(s: Settings, hf_model: Any) -> Callable[[], None]:
  """One HF training step (forward, backward, Adafactor) on the same shapes, as a call."""
  import torch
  from transformers.optimization import Adafactor

  device = _hf_device()
  batch = {k: torch.from_numpy(v).long().to(device) for k, v in random_batch(s).items()}
  hf_model.train()
  optimizer = Adafactor(
    hf_model.parameters(),
    lr=s.learning_rate,
    scale_parameter=True,
    relative_step=False,
    warmup_init=False,
    clip_threshold=1.0,
    decay_rate=-0.8,
    beta1=None,
    weight_decay=0.0,
  )

  def run() -> None:
    with _autocast(s):
      loss = hf_model(
        input_ids=batch["encoder_input_tokens"],
        decoder_input_ids=batch["decoder_input_tokens"],
        labels=batch["decoder_target_tokens"],
      ).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss.item()  # waits for the step

  return run


def measure_hf_decode(s: Settings, hf_model: Any, inputs: np.ndarray) -> dict[str, Any]:
  """HF generate (cache on) of exactly decode_length tokens, greedy and beam."""
  import torch

  hf_model.eval()
  ids = torch.from_numpy(inputs).long().to(_hf_device())
  out = {}
  for name, beams in (("greedy", 1), ("beam", s.num_beams)):
    kwargs = dict(
      max_new_tokens=s.decode_length,
      min_new_tokens=s.decode_length,
      num_beams=beams,
      do_sample=False,
      use_cache=True,
    )
    if beams > 1:
      kwargs["length_penalty"] = 0.6

    def run(kw=kwargs) -> Any:
      with torch.inference_mode(), _autocast(s):
        return hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)

    out[f"hf_{name}_s"], _ = time_median(run, s.reps, max(s.warmup, 1))
    if name == "greedy":
      out["hf_greedy_tokens"] = run()[:, 1:].cpu().numpy()  # drops the start token
  return out


# ------------------------------------------------------------------------------- T5X

_T5X_PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "t5x_peer_bench.py")


class T5XPeerError(errors.UserError, RuntimeError):
  """T5X could not be measured: the interpreter, the model or the peer process failed."""


def t5x_peer_flags(s: Settings) -> list[str]:
  """The command line of tools/t5x_peer_bench.py for the model and shapes of `s`."""
  c = s.config
  t5_1_1 = (
    c.mlp_activations == ("gelu", "linear")
    and not c.logits_via_embedding
    and (c.relative_attention_num_buckets, c.relative_attention_max_distance) == (32, 128)
    and not c.adapter_dim
    and not c.relpos_bias_per_layer
  )
  if not t5_1_1:
    raise T5XPeerError(
      "--compare_t5x needs a T5 1.1 model (gated GELU, untied logits, one relative position "
      "bias per stack with 32 buckets up to 128, no adapters), as in models/t5_1_1/*.gin: "
      "T5X's side is flaxformer's t5_1_1 gin"
    )
  values = {
    "embed_dim": c.emb_dim,
    "num_heads": c.num_heads,
    "head_dim": c.head_dim,
    "mlp_dim": c.mlp_dim,
    "num_encoder_layers": c.num_encoder_layers,
    "num_decoder_layers": c.num_decoder_layers,
    "vocab_size": c.vocab_size,
    "dtype": c.dtype,
    "dropout_rate": c.dropout_rate,
    "one_hot": str(s.t5x_one_hot).lower(),
    **{k: getattr(s, k) for k in ("batch_size", "input_length", "target_length")},
    **{k: getattr(s, k) for k in ("decode_length", "num_beams", "reps", "warmup")},
    **{k: getattr(s, k) for k in ("learning_rate", "matmul_size", "threads")},
    "backend": jax.default_backend(),
    "skip": ",".join(x for x in s.skip if x in ("train", "decode")),
  }
  return [f"--{k}={v}" for k, v in values.items()]


def run_t5x_peer(s: Settings) -> dict[str, Any]:
  """Runs tools/t5x_peer_bench.py under `s.compare_t5x`; its figures, keys prefixed 't5x_'.

  Raises:
    T5XPeerError: naming the interpreter and the peer's last stderr line.
  """
  # The same XLA options as ours (console.CPU_XLA_FLAGS included, on a CPU machine): a
  # comparison of the two codebases on one compiler, not of compiler settings; a forced
  # device count is dropped.
  xla_flags = os.environ.get("XLA_FLAGS", "").split()
  env = dict(os.environ)
  env["XLA_FLAGS"] = " ".join(
    f for f in xla_flags if not f.startswith("--xla_force_host_platform_device_count")
  )
  env["OMP_NUM_THREADS"] = str(s.threads)  # XLA:CPU: one thread per CPU, inherited
  command = [s.compare_t5x, _T5X_PEER, *t5x_peer_flags(s)]
  try:
    proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
  except OSError as e:
    raise T5XPeerError(
      f"--compare_t5x={s.compare_t5x}: cannot run it ({e.strerror}); make a T5X venv with "
      "`bash ../shared/peers/install_t5x.sh $HOME/t5x_peer`"
    ) from e
  lines = proc.stdout.strip().splitlines()
  if proc.returncode == 0 and lines and lines[-1].startswith("{"):
    return merge_t5x(json.loads(lines[-1]))
  stderr = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
  raise T5XPeerError(
    f"--compare_t5x={s.compare_t5x}: tools/t5x_peer_bench.py exited with status "
    f"{proc.returncode}: {stderr[-1] if stderr else '(nothing on stderr)'}"
  )


def merge_t5x(peer: dict[str, Any]) -> dict[str, Any]:
  """The peer's JSON figures as raw figures of the report: every key prefixed 't5x_'."""
  return {f"t5x_{k}": v for k, v in peer.items()}


# ------------------------------------------------------------------------------ data


def measure_data(s: Settings) -> dict[str, float]:
  """Span corruption + packing throughput of `data_task` at the training lengths."""
  # TensorFlow loads here, after the model's figures (loaded in the process, it slowed
  # JAX's train step), its load-time noise dropped as the entry points drop it.
  with console.native_stderr_without(console.TENSORFLOW_IMPORT_NOISE):
    import data_benchmark  # tools/data_benchmark.py, beside this script (TensorFlow)
    import tasks  # noqa: F401  (registers the built-in tasks)

  lengths = {"inputs": s.input_length, "targets": s.target_length}
  result = data_benchmark.measure_pipeline(s.data_task, lengths, s.batch_size, s.data_batches)
  return {f"data_{k}": v for k, v in result.items()}


# ----------------------------------------------------------------------------- main


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
  if not numerator or not denominator:
    return None
  return numerator / denominator


# The matmul peak each side's MFU is computed against (each measured in its own framework);
# other kernel sets ('kernels_<name>_') are ours, against jax's.
_PEAK_KEYS = {"": "jax_peak_flops", "hf_": "torch_peak_flops", "t5x_": "t5x_peak_flops"}
# The data-sheet peak of each side's matmul precision (absent on CPU); T5X's runs in jax.
_DATASHEET_KEYS = {"hf_": "hf_datasheet_peak_flops"}
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


def _kernel_peers(compare_kernels: Sequence[str]) -> list[str]:
  """The figure-key stems of the other kernel sets: 'kernels_<name>'."""
  return [f"kernels_{name}" for name in compare_kernels]


def derive(s: Settings, raw: dict[str, Any]) -> dict[str, Any]:
  """Rates, MFU and speedups from the raw timings."""
  tokens_per_step = s.batch_size * (s.input_length + s.target_length)
  flops_per_step = flops.flops_per_token(s.config, s.input_length, s.target_length) * (
    tokens_per_step
  )
  decoded = s.batch_size * s.decode_length
  out = {"train_tokens_per_step": tokens_per_step, "train_flops_per_step": flops_per_step}
  peaks = {**_PEAK_KEYS, **{f"{k}_": "jax_peak_flops" for k in _kernel_peers(s.compare_kernels)}}
  for prefix, peak_key in peaks.items():
    step = raw.get(f"{prefix}train_step_s")
    measured = raw.get(peak_key)
    datasheet = raw.get(_DATASHEET_KEYS.get(prefix, "datasheet_peak_flops"))
    if step:
      out[f"{prefix}train_tokens_per_s"] = tokens_per_step / step
      out[f"{prefix}train_model_flops_per_s"] = flops_per_step / step
      out[f"{prefix}train_mfu"] = _ratio(flops_per_step / step, datasheet or measured)
      if datasheet:
        out[f"{prefix}train_mfu_measured_matmul"] = _ratio(flops_per_step / step, measured)
    for name in ("greedy", "beam"):
      if raw.get(f"{prefix}{name}_s"):
        out[f"{prefix}{name}_tokens_per_s"] = decoded / raw[f"{prefix}{name}_s"]
  for peer in _kernel_peers(s.compare_kernels):
    for when in ("first", "last"):
      ours, theirs = raw.get(f"train_{when}_loss"), raw.get(f"{peer}_train_{when}_loss")
      if ours is not None and theirs:
        out[f"{peer}_train_{when}_loss_rel_diff"] = abs(ours - theirs) / abs(theirs)
  for peer in ("hf", "t5x", *_kernel_peers(s.compare_kernels)):
    for name in ("train", "greedy", "beam"):
      out[f"{name}_speedup_vs_{peer}"] = _ratio(
        out.get(f"{name}_tokens_per_s"), out.get(f"{peer}_{name}_tokens_per_s")
      )
  if raw.get("train_step_s") and raw.get("data_rows_per_s"):
    examples_per_row = raw["data_examples_per_s"] / raw["data_rows_per_s"]
    out["train_examples_per_s"] = s.batch_size * examples_per_row / raw["train_step_s"]
    out["data_vs_train_consumption"] = raw["data_examples_per_s"] / out["train_examples_per_s"]
  return out


def datasheet_peaks(s: Settings) -> dict[str, Any]:
  """The data-sheet peaks MFU is taken against (`throughput.table_peak_flops`; None off
  the table, e.g. on CPU): ours at jax's matmul precision, HF's at torch's."""
  device = jax.devices()[0]
  precision = throughput.matmul_precision(
    s.config.dtype, device.platform, jax.config.jax_default_matmul_precision
  )
  out = {
    "matmul_precision": precision,
    "datasheet_peak_flops": throughput.table_peak_flops(device.device_kind, precision),
  }
  if s.compare_hf and _hf_device() != "cpu":
    import torch

    hf_precision = "bfloat16" if s.config.dtype == "bfloat16" else "float32"
    if hf_precision == "float32" and torch.backends.cuda.matmul.allow_tf32:
      hf_precision = "tensorfloat32"
    out["hf_matmul_precision"] = hf_precision
    out["hf_datasheet_peak_flops"] = throughput.table_peak_flops(device.device_kind, hf_precision)
  return out


def our_models(s: Settings) -> dict[str, models.EncoderDecoderModel]:
  """Our model per figure-key prefix: '' with the config's kernels, 'kernels_<name>_'
  with each other set."""
  sets = {"": s.config.kernels}
  sets |= {
    f"{peer}_": name for peer, name in zip(_kernel_peers(s.compare_kernels), s.compare_kernels)
  }
  return {
    prefix: make_model(dataclasses.replace(s.config, kernels=name), s.loss_chunk_length)
    for prefix, name in sets.items()
  }


def _initial_params(model: models.EncoderDecoderModel) -> Any:
  return jax.device_get(nn.meta.unbox(model.init_params(jax.random.PRNGKey(0))))


def compile_ours(s: Settings, ours: dict[str, models.EncoderDecoderModel]) -> dict[str, Any]:
  """`Settings.compile_only`: compiles each model's train step and decodes, times nothing."""
  raw: dict[str, Any] = {}
  for prefix, model in ours.items():
    holder: dict[str, Any] = {}
    if "train" not in s.skip:
      with _phase(raw, f"{prefix}train setup"):
        figures = prepare_ours_train(s, model, holder).figures
      raw.update({prefix + k: v for k, v in figures.items()})
    if "decode" not in s.skip:
      with _phase(raw, f"{prefix}decode"):
        measure_ours_decode(s, model, holder.get("params") or _initial_params(model))
  return raw


def profile_ours(s: Settings, trains: dict[str, OursTrain]) -> dict[str, str]:
  """Traces `profile_steps` steps of each train step into profile_dir/<kernels>/, with
  its compiled HLO text as hlo.txt (for tools/profile_summary.py)."""
  out = {}
  for prefix, train in trains.items():
    name = prefix[len("kernels_") : -1] if prefix else registry.select(s.config.kernels).name
    folder = os.path.join(s.profile_dir, name)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "hlo.txt"), "w") as f:
      f.write(train.compiled_text())
    with jax.profiler.trace(folder, create_perfetto_trace=True):
      for _ in range(s.profile_steps):
        train.run()
    out[f"{prefix}profile_dir"] = folder
  return out


@contextlib.contextmanager
def _phase(raw: dict[str, Any], name: str) -> Iterator[None]:
  """Adds one phase's wall seconds to `raw['phase_s'][name]` and logs them as it ends,
  so that the log of a run stopped for time says how far it got and where the time went."""
  start = time.perf_counter()
  yield
  seconds = time.perf_counter() - start
  phases = raw.setdefault("phase_s", {})
  phases[name] = phases.get(name, 0.0) + seconds
  logging.info("benchmark phase %s: %.1f s", name, seconds)


def run_benchmark(s: Settings) -> dict[str, Any]:
  """Measures every figure of `s`; returns one flat dict (raw and derived)."""
  raw: dict[str, Any] = {
    "backend": jax.default_backend(),
    "device_kind": jax.devices()[0].device_kind,
    "num_devices": jax.device_count(),
    "threads": s.threads,
    "dtype": s.config.dtype,
    "kernels": registry.select(s.config.kernels).name,
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "config": dataclasses.asdict(s.config),
    "settings": {k: v for k, v in dataclasses.asdict(s).items() if k != "config"},
  }
  hits: list[str] = []

  def on_cache_hit(event: str, **kwargs: Any) -> None:
    del kwargs
    if event == _CACHE_HIT:
      hits.append(event)

  jax.monitoring.register_event_listener(on_cache_hit)
  try:
    if s.compile_only:
      raw.update(compile_ours(s, our_models(s)))
    else:
      raw.update(measure(s))
  finally:
    jax.monitoring.unregister_event_listener(on_cache_hit)
  raw["compile_cache_hits"] = len(hits)
  raw["max_rss_mib"] = max_rss_mib()
  return raw if s.compile_only else {**raw, **derive(s, raw)}


def measure(s: Settings) -> dict[str, Any]:
  """The raw figures of `s` (`run_benchmark` without compile_only)."""
  raw: dict[str, Any] = {}
  if s.compare_t5x:  # first: a peer that cannot run fails before the long measurements
    raw.update(run_t5x_peer(s))
  dtype = jax.numpy.dtype(s.config.dtype)
  with _phase(raw, "peak matmul"):
    raw["jax_peak_flops"] = throughput.measure_matmul_flops(s.matmul_size, dtype, s.reps)
  raw.update(datasheet_peaks(s))
  # by key prefix: "" ours, "kernels_<name>_" ours with other kernels, "hf_"
  ours = our_models(s)
  model = ours[""]
  holder: dict[str, Any] = {}
  trains: dict[str, OursTrain] = {}
  if "train" not in s.skip:
    for prefix, other in ours.items():
      with _phase(raw, f"{prefix}train setup"):  # initialisation, compile, first call
        trains[prefix] = prepare_ours_train(s, other, holder if not prefix else {})
      raw.update({prefix + k: v for k, v in trains[prefix].figures.items()})
  else:
    holder["params"] = _initial_params(model)
  train_steps = {prefix: train.run for prefix, train in trains.items()}
  raw["num_params"] = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(holder["params"]))
  if "decode" not in s.skip:
    with _phase(raw, "decode"):
      ours_decode = measure_ours_decode(s, model, holder["params"])
    raw.update({k: v for k, v in ours_decode.items() if k.endswith("_s")})
    for prefix, other in ours.items():
      if not prefix:
        continue
      with _phase(raw, f"{prefix}decode"):
        decoded = measure_ours_decode(s, other, holder["params"])
      raw.update({prefix + k: v for k, v in decoded.items() if k.endswith("_s")})
      agreement = np.mean(decoded["greedy_tokens"] == ours_decode["greedy_tokens"])
      raw[f"{prefix}greedy_token_agreement"] = float(agreement)
  raw["max_rss_mib_ours"] = max_rss_mib()
  if s.compare_hf:
    import torch

    torch.set_num_threads(s.threads)
    torch_dtype = torch.float32 if s.config.dtype == "float32" else torch.bfloat16
    with _phase(raw, "hf setup"):
      raw["torch_peak_flops"] = torch_matmul_peak(s.matmul_size, torch_dtype, s.reps, _hf_device())
      hf_model = load_hf_model(s, holder["params"])
    raw["hf_num_params"] = sum(p.numel() for p in hf_model.parameters())
    if "decode" not in s.skip:
      hf_decode = measure_hf_decode(s, hf_model, ours_decode["inputs"])
      raw.update({k: v for k, v in hf_decode.items() if k.endswith("_s")})
      raw["greedy_token_agreement"] = float(
        np.mean(ours_decode["greedy_tokens"] == hf_decode["hf_greedy_tokens"])
      )
    if "train" not in s.skip:
      train_steps["hf_"] = prepare_hf_train(s, hf_model)
  with _phase(raw, "timed train steps"):
    timed = time_in_turn(train_steps, s.reps, s.warmup, s.settle)
  for prefix, (seconds, times) in timed.items():
    raw[f"{prefix}train_step_s"], raw[f"{prefix}train_step_times_s"] = seconds, times
  for prefix, train in trains.items():  # the same steps for each set: losses to compare
    raw[f"{prefix}train_first_loss"] = train.losses[0]
    raw[f"{prefix}train_last_loss"] = train.losses[-1]
  if s.profile_dir and trains:
    with _phase(raw, "profile"):
      raw.update(profile_ours(s, trains))
  if s.data_task and "data" not in s.skip:
    raw.update(measure_data(s))
  return raw


# label, our figure (a peer's has its prefix; the peak has a key per side), ratio stem.
_ROWS = (
  ("train tokens/s", "train_tokens_per_s", "train"),
  ("train MFU", "train_mfu", None),
  ("train step s", "train_step_s", None),
  ("greedy decode tokens/s", "greedy_tokens_per_s", "greedy"),
  ("beam decode tokens/s", "beam_tokens_per_s", "beam"),
  ("peak matmul GFLOP/s", "peak_flops", None),
  ("parameters", "num_params", None),
)
_EXTRAS = (
  ("train compile s", "train_compile_s"),
  ("train first call s", "train_first_call_s"),
  ("T5X train compile s", "t5x_train_compile_s"),
  ("data examples/s", "data_examples_per_s"),
  ("train examples/s", "train_examples_per_s"),
  ("data / train consumption", "data_vs_train_consumption"),
  ("greedy token agreement", "greedy_token_agreement"),
  ("max RSS MiB (ours only)", "max_rss_mib_ours"),
  ("max RSS MiB (all)", "max_rss_mib"),
  ("max RSS MiB (T5X process)", "t5x_max_rss_mib"),
)


def _fmt(value: Any) -> str:
  if value is None:
    return "-"
  if isinstance(value, int) or abs(value) >= 1000:
    return f"{value:,.0f}"
  return f"{value:.3g}"


def format_table(r: dict[str, Any]) -> str:
  """A plain-text table of the main figures (T5X's columns when it was measured, one
  column per other kernel set)."""
  peers = [("HF torch", "HF", "hf")] + ([("T5X", "T5X", "t5x")] if "t5x_num_params" in r else [])
  compare_kernels = r.get("settings", {}).get("compare_kernels", ())
  peers += [
    (name, name, peer) for name, peer in zip(compare_kernels, _kernel_peers(compare_kernels))
  ]
  widths = [max(10, len(a) + 6) for _, a, _ in peers]  # of the ratio columns
  lines = [
    f"{'':26}{'t5x_lite':>14}"
    + "".join(f"{n:>14}{'ours/' + a:>{w}}" for (n, a, _), w in zip(peers, widths))
  ]
  rows = list(_ROWS)
  if r.get("datasheet_peak_flops"):
    rows.insert(2, ("train MFU, measured matmul", "train_mfu_measured_matmul", None))
  for label, key, ratio in rows:
    scale = 1e-9 if "GFLOP" in label else 1.0
    line = f"{label:26}"
    for prefix, w in zip([""] + [f"{p}_" for _, _, p in peers], [0] + widths):
      value = r.get(
        _PEAK_KEYS.get(prefix, "jax_peak_flops") if key == "peak_flops" else prefix + key
      )
      line += f"{_fmt(None if value is None else value * scale):>14}"
      if prefix:
        line += f"{_fmt(r.get(f'{ratio}_speedup_vs_{prefix[:-1]}')) if ratio else '':>{w}}"
    lines.append(line)
  lines += [f"{label:26}{_fmt(r.get(key)):>14}" for label, key in _EXTRAS if key in r]
  if "kernels" in r:
    lines.append(f"t5x_lite kernels: {r['kernels']} (--kernels)")
  lines.append(mfu_note(r))
  if "t5x_one_hot" in r:
    embedding = "one-hot (--t5x_one_hot)" if r["t5x_one_hot"] else "gather (--t5x_one_hot=false)"
    gin_file, bindings = r["t5x_gin_file"].split("/")[-1], r["t5x_gin_bindings"]
    count = sum("=" in b for b in bindings)
    lines.append(f"T5X: {gin_file} + {count} gin bindings (--json: t5x_gin_bindings)")
    lines.append(f"T5X: {embedding} embedding, its own random weights, our XLA_FLAGS")
  return "\n".join(lines)


def mfu_note(r: dict[str, Any]) -> str:
  """What the MFU rows are taken against, in one line."""
  peak = r.get("datasheet_peak_flops")
  if not peak:
    return (
      f"MFU: over the matmul measured in this run (no data-sheet peak for {r.get('device_kind')})"
    )
  return (
    f"MFU: over the {r['matmul_precision']} data-sheet peak of {r['device_kind']} "
    f"({peak / 1e12:g} TFLOP/s); 'measured matmul': over the matmul measured in this run"
  )


def _resolve_dtype(name: str) -> str:
  if name != "auto":
    return name
  return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if _COMPARE_HF.value:
    errors.require_extra("hf", ("torch", "transformers", "safetensors"), "--compare_hf")
  if _COMPARE_HF.value or _COMPARE_T5X.value:  # on a GPU, jax would take 75% up front
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  console.quiet_library_logs()  # gin's search-path lines; logs the start-up choices
  gin_config.parse_gin_flags(default_files=[DEFAULT_GIN_FILE])
  kernels, *compare_kernels = _KERNELS.value or ["auto"]
  config = dataclasses.replace(
    network.T5Config(), dtype=_resolve_dtype(_DTYPE.value), kernels=kernels
  )
  for name in compare_kernels:  # a bad name fails before any measurement
    dataclasses.replace(config, kernels=name)
  settings = Settings(
    config=config,
    batch_size=_BATCH.value,
    input_length=_INPUT_LEN.value,
    target_length=_TARGET_LEN.value,
    decode_length=_DECODE_LEN.value,
    num_beams=_BEAMS.value,
    reps=_REPS.value,
    warmup=_WARMUP.value,
    settle=_SETTLE.value,
    matmul_size=_MATMUL.value,
    learning_rate=_LR.value,
    threads=len(os.sched_getaffinity(0)),
    compare_hf=_COMPARE_HF.value,
    compare_t5x=_COMPARE_T5X.value or "",
    t5x_one_hot=_T5X_ONE_HOT.value,
    data_task=_DATA_TASK.value,
    data_batches=_DATA_BATCHES.value,
    skip=tuple(_SKIP.value),
    compare_kernels=tuple(compare_kernels),
    loss_chunk_length=_LOSS_CHUNK.value,
    compile_only=_COMPILE_ONLY.value,
    profile_dir=_PROFILE_DIR.value or "",
    profile_steps=_PROFILE_STEPS.value,
  )
  result = run_benchmark(settings)
  if settings.compile_only:
    print(f"compiled; {result['compile_cache_hits']} programs loaded from the compilation cache")
  else:
    print(format_table(result))
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(result, f, indent=2, sort_keys=True)


if __name__ == "__main__":
  cli.run(main, sys.argv)
