"""T5X's side of the per-chip memory comparison, with XLA's cost analysis added.

Two T5X networks, each compiled for a TPU slice on compile-only devices (libtpu, no
TPU needed), in the T5X venv that ../shared/peers/install_t5x.sh makes:

* `--network=flaxformer` (default): flaxformer's T5 1.1 as T5X ships it (unscanned).
  Runs ../shared/peers/t5x_precompile.py unchanged and adds to its JSON the compiled
  step's `cost_analysis()` (FLOPs and bytes accessed per chip), which the roofline
  columns of docs/scaling.md's per-chip memory table need and the peer script does not
  record. Arguments after `--` go to the peer script as they are (see its docstring):

    $HOME/t5x_peer/venv/bin/python tools/t5x_peer_precompile.py \
        --json_out=t5x_base_2x4.json -- --size=base --topology=v5e:2x4

* `--network=scalable_t5`: T5X's own scanned T5 1.1 for large slices
  (t5x/examples/scalable_t5/t5_1_1/<size>.gin: layers under `nn.scan`, remat
  'minimal' as shipped, per-layer relative position biases, bfloat16 attention
  logits), small to xxl. This script builds it itself, the same way the peer script
  builds the flaxformer one: gin model, abstract TrainState from T5X's
  TrainStateInitializer, T5X's PjitPartitioner over a (data, model) mesh of the
  slice, T5X's Trainer, and its partitioned train step lowered and compiled.
  `--fsdp` gives T5X's 2-D parameter sharding (`standard_logical_axis_rules(
  parameter_partitioning_dims=2)`: parameters' 'embed' axis over 'data'):

    $HOME/t5x_peer/venv/bin/python tools/t5x_peer_precompile.py --network=scalable_t5 \
        --json_out=t5x_xl.json --size=xl --topology=v5e:4x4 --num_partitions=4 --fsdp

Both write one JSON with the same keys (per-chip `arguments`, `outputs`, `alias`,
`temps`, `peak`, `total` in bytes, `xla_flops_per_chip`, `xla_bytes_per_chip`).
"""

import argparse
import json
import os
import re
import runpy
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_SCRIPT = os.path.join(REPO, "..", "shared", "peers", "t5x_precompile.py")
GIB = 2**30
HBM_GIB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32}
# Environment for compiling without chips (libtpu compile-only devices); host work on CPU.
COMPILE_ONLY_ENV = {
  "TF_CPP_MIN_LOG_LEVEL": "3",
  "TPU_SKIP_MDS_QUERY": "1",
  "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
  "TPU_WORKER_HOSTNAMES": "localhost",
  "JAX_PLATFORMS": "cpu",
}


def cost_figures(compiled) -> dict:
  """Per-chip FLOPs and bytes accessed from `compiled.cost_analysis()` (None if absent)."""
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else {}
  costs = {}
  for name, key in (("xla_flops_per_chip", "flops"), ("xla_bytes_per_chip", "bytes accessed")):
    value = (analysis or {}).get(key)
    costs[name] = float(value) if value is not None and value >= 0 else None
  return costs


def run_flaxformer_peer(script: str, json_out: str, peer_args: list[str]) -> None:
  """Runs the peer's t5x_precompile.py in this process and adds the cost analysis."""
  if not os.path.isfile(script):
    sys.exit(f"ERROR: T5X precompile script not found: {script} (pass --script)")
  import jax  # pylint: disable=g-import-not-at-top  # the T5X venv's jax

  costs = {}
  memory_analysis = jax.stages.Compiled.memory_analysis

  def memory_analysis_and_costs(compiled):
    costs.update(cost_figures(compiled))
    return memory_analysis(compiled)

  jax.stages.Compiled.memory_analysis = memory_analysis_and_costs
  peer_json = json_out + ".peer"
  sys.argv = [script, *peer_args, f"--json_out={peer_json}"]
  try:
    runpy.run_path(script, run_name="__main__")
  except SystemExit as e:
    if e.code:
      raise
  with open(peer_json) as f:
    result = json.load(f)
  os.remove(peer_json)
  result.update(costs)
  with open(json_out, "w") as f:
    json.dump(result, f, indent=1)
  print(json.dumps(costs), flush=True)


def t5x_source_root() -> str:
  """The T5X source tree: $T5X_PEER_SRC/t5x, or <venv>/../src/t5x (install_t5x.sh's layout)."""
  src = os.environ.get("T5X_PEER_SRC") or os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(sys.executable)))), "src"
  )
  root = os.path.join(src, "t5x")
  if not os.path.isdir(os.path.join(root, "t5x", "examples", "scalable_t5")):
    sys.exit(f"ERROR: no T5X source tree at {root} (set T5X_PEER_SRC to install_t5x.sh's src)")
  return root


def run_scalable_t5(args: argparse.Namespace) -> None:
  """Compiles T5X's scalable_t5 train step for the slice and writes the JSON."""
  for key, value in COMPILE_ONLY_ENV.items():
    os.environ.setdefault(key, value)
  root = t5x_source_root()
  t_start = time.perf_counter()
  import gin  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import seqio  # pylint: disable=g-import-not-at-top
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  from t5x import partitioning  # pylint: disable=g-import-not-at-top
  from t5x import trainer as trainer_lib  # pylint: disable=g-import-not-at-top
  from t5x import utils  # pylint: disable=g-import-not-at-top

  generation, shape = args.topology.split(":")
  dims = [int(d) for d in shape.split("x")]
  padded = dims + [1] * (3 - len(dims))
  try:
    topology = topologies.get_topology_desc(
      args.topology,
      "tpu",
      chip_config_name="megacore" if generation in ("v4", "v5p") else "default",
      chips_per_host_bounds=tuple(min(d, h) for d, h in zip(padded, (2, 2, 1))),
    )
  except jax.errors.JaxRuntimeError as e:
    sys.exit(f"ERROR: libtpu rejected --topology={args.topology}: {str(e).splitlines()[0]}")
  devices = list(topology.devices)
  if len(devices) % args.num_partitions:
    sys.exit(f"ERROR: --num_partitions={args.num_partitions} does not divide {len(devices)} chips")
  mesh = topologies.make_mesh(
    topologies.TopologyDescription(devices),
    (len(devices) // args.num_partitions, args.num_partitions),
    ("data", "model"),
  )

  # T5X's default_mesh reads jax.devices(), which never lists compile-only devices.
  class SlicePartitioner(partitioning.PjitPartitioner):
    @property
    def mesh(self):
      return mesh

    @property
    def _local_chunker(self):
      return partitioning.LocalChunker(mesh)

  gin_file = f"t5x/examples/scalable_t5/t5_1_1/{args.size}.gin"
  bindings = [
    f"DROPOUT_RATE = {args.dropout}",
    f"network.T5Config.dtype = '{args.dtype}'",
    f"network.T5Config.scan_layers = {args.scan}",
    f"network.T5Config.remat_policy = '{args.remat}'",
    *args.gin_binding,
  ]
  cwd = os.getcwd()
  os.chdir(root)  # the gin files include each other by paths relative to the tree
  try:
    gin.parse_config_files_and_bindings([gin_file], bindings, finalize_config=False)
  except ValueError as e:
    sys.exit(f"ERROR: gin bindings {bindings} for {gin_file}: {str(e).splitlines()[0]}")
  finally:
    os.chdir(cwd)
  model = gin.query_parameter("%MODEL").scoped_configurable_fn()

  lengths = seqio.EncDecFeatureConverter(pack=True).get_model_feature_lengths(
    {"inputs": args.inputs_len, "targets": args.targets_len}
  )
  input_shapes = {k: (args.batch, v) for k, v in lengths.items()}
  partitioner = SlicePartitioner(
    num_partitions=args.num_partitions,
    logical_axis_rules=partitioning.standard_logical_axis_rules(
      parameter_partitioning_dims=2 if args.fsdp else 1
    ),
  )
  init = utils.TrainStateInitializer(
    optimizer_def=model.optimizer_def,
    init_fn=model.get_initial_variables,
    input_shapes=input_shapes,
    input_types={k: jnp.int32 for k in input_shapes},
    partitioner=partitioner,
  )
  state_shape = init.global_train_state_shape
  n_params = int(sum(np.prod(x.shape) for x in jax.tree.leaves(state_shape.params)))
  print(f"{gin_file} {bindings}: {n_params:,} parameters; mesh {dict(mesh.shape)}", flush=True)
  trainer = trainer_lib.Trainer(
    model=model,
    train_state=state_shape,  # abstract: only its shapes are used
    partitioner=partitioner,
    eval_names=[],
    summary_dir=None,
    train_state_axes=init.train_state_axes,
    rng=jax.random.PRNGKey(0),
    # T5X's pre-training schedule (t5x/configs/runs/pretrain.gin).
    learning_rate_fn=utils.create_learning_rate_scheduler(
      factors="constant * rsqrt_decay", base_learning_rate=1.0, warmup_steps=10000
    ),
    num_microbatches=None,
  )
  batch = {k: jax.ShapeDtypeStruct(s, jnp.int32) for k, s in input_shapes.items()}
  t0 = time.perf_counter()
  lowered = trainer._partitioned_train_step.lower(state_shape, batch)  # pylint: disable=protected-access
  try:
    compiled, error = lowered.compile(), None
  except jax.errors.JaxRuntimeError as e:
    if not re.search(r"RESOURCE_EXHAUSTED|[Rr]an out of memory", str(e)):
      raise
    compiled, error = None, str(e).strip()
  compile_s = time.perf_counter() - t0
  trainer.close()

  hbm = HBM_GIB.get(generation, 0) * GIB
  result = {
    "codebase": "t5x",
    "network": "scalable_t5",
    "size": args.size,
    "topology": args.topology,
    "mesh": dict(mesh.shape),
    "fsdp": args.fsdp,
    "gin_file": gin_file,
    "gin_bindings": bindings,
    "layer_remat": args.remat,
    "scan_layers": args.scan,
    "batch_features": input_shapes,
    "num_params": n_params,
    "compile_s": compile_s,
    "hbm_bytes": hbm,
    "jax": jax.__version__,
  }
  if compiled is None:
    result.update(compiler_error=error.splitlines()[0], fits=False)
    print("Compiler:", error[:3000], "\nDOES NOT FIT")
  else:
    m = compiled.memory_analysis()
    arg, out, alias, tmp = (
      m.argument_size_in_bytes,
      m.output_size_in_bytes,
      m.alias_size_in_bytes,
      m.temp_size_in_bytes,
    )
    peak = getattr(m, "peak_memory_in_bytes", 0)
    total = max(arg + out - alias + tmp, peak)
    result.update(
      arguments=arg,
      outputs=out,
      alias=alias,
      temps=tmp,
      peak=peak,
      total=total,
      fits=total <= hbm,
      **cost_figures(compiled),
    )
    print(
      f"Per-chip memory: arguments {arg / GIB:.3f} GiB, outputs {out / GIB:.3f} GiB "
      f"(aliased {alias / GIB:.3f}), temporaries {tmp / GIB:.3f} GiB, XLA peak "
      f"{peak / GIB:.3f} GiB; total {total / GIB:.3f} GiB of {hbm / GIB:.2f} -> "
      f"{'FITS' if total <= hbm else 'DOES NOT FIT'} (compile {compile_s:.0f} s)"
    )
  result["wall_s"] = time.perf_counter() - t_start
  with open(args.json_out, "w") as f:
    json.dump(result, f, indent=1)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json_out", required=True, help="where the JSON goes")
  parser.add_argument("--network", default="flaxformer", choices=("flaxformer", "scalable_t5"))
  parser.add_argument("--script", default=DEFAULT_SCRIPT, help="the peer's t5x_precompile.py")
  scalable = parser.add_argument_group("--network=scalable_t5")
  scalable.add_argument("--size", default="base", choices=("small", "base", "large", "xl", "xxl"))
  scalable.add_argument("--topology", default="v5e:2x4")
  scalable.add_argument("--num_partitions", type=int, default=1)
  scalable.add_argument("--fsdp", action="store_true", help="2-D parameter sharding")
  scalable.add_argument("--remat", default="minimal", choices=("none", "minimal", "full"))
  scalable.add_argument(
    "--scan", default=True, type=lambda s: s.lower() == "true", help="true (shipped) or false"
  )
  scalable.add_argument("--dtype", default="bfloat16")
  scalable.add_argument("--dropout", type=float, default=0.0)
  scalable.add_argument("--batch", type=int, default=128)
  scalable.add_argument("--inputs_len", type=int, default=512)
  scalable.add_argument("--targets_len", type=int, default=114)
  scalable.add_argument(
    "--gin_binding",
    action="append",
    default=[],
    help="extra gin binding (repeatable), e.g. 'network.T5Config.num_encoder_layers = 2'",
  )
  argv = sys.argv[1:]
  split = argv.index("--") if "--" in argv else len(argv)
  args = parser.parse_args(argv[:split])
  peer_args = argv[split + 1 :]
  if args.network == "scalable_t5":
    if peer_args:
      parser.error("arguments after -- are for --network=flaxformer's peer script")
    if not re.fullmatch(r"(v4|v5e|v5p|v6e):\d+(x\d+)+", args.topology):
      parser.error(f"--topology={args.topology}: expected <v4|v5e|v5p|v6e>:<chips per axis>")
    run_scalable_t5(args)
  else:
    run_flaxformer_peer(args.script, args.json_out, peer_args)


if __name__ == "__main__":
  main()
