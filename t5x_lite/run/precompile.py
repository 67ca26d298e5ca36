"""Ahead-of-time compilation of the real train step for a TPU slice, on any machine.

  python -m t5x_lite.train --gin_file=... --precompile --topology=v5e:4x4

parses the same gin config as training, builds the same model, optimizer,
partitioning rules and batch shapes, and lowers and compiles the train step
(the very function `trainer.make_train_step` jits for training, with its
shardings and donation) for the named slice. No TPU and no arrays are needed:
libtpu (the `tpu` extra: `pip install -e '.[tpu]'`) compiles for compile-only
devices described by `jax.experimental.topologies`, and every input is a
`jax.ShapeDtypeStruct` carrying its sharding over a mesh of those devices.

It prints the per-chip memory XLA assigned (arguments, outputs, the part of them
aliased by donation, temporaries), the chip's HBM, whether the step fits and the
FLOPs per step, and exits non-zero, with what to change, when it does not fit.

Topology names are `<generation>:<chips per axis>` as libtpu takes them:
v5e and v6e slices are 2-D (`v5e:4x4` is a v5litepod-16), v4 and v5p slices are
3-D (`v4:2x2x2` is a v4-16: 8 chips). One JAX device is one chip on every
generation here (v4 and v5p in megacore mode, as on Cloud TPU).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Mapping
from typing import Any

import gin
import jax
import jax.numpy as jnp

from t5x_lite import base_model, models
from t5x_lite.kernels import registry
from t5x_lite.data import pipeline
from t5x_lite.training import optimizers, partitioning, throughput, trainer
from t5x_lite.run import train_lib
from t5x_lite.core.errors import UserError
from t5x_lite.core.types import Device

INSTALL_HINT = "pip install -e '.[tpu]'"
GIB = 2**30
# libtpu settings for compiling without chips; a real setting in the environment wins.
_COMPILE_ONLY_ENV = {
  "TPU_SKIP_MDS_QUERY": "1",  # no GCE metadata-server lookups
  "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",  # no chips are claimed: skip the one-process lock
  "TPU_WORKER_HOSTNAMES": "localhost",
}
_OOM_PATTERN = re.compile(r"RESOURCE_EXHAUSTED|[Rr]an out of memory")


@dataclasses.dataclass(frozen=True)
class TpuGeneration:
  """One TPU generation as the precompiler treats it.

  Attributes:
    name: the name users type ('v5e').
    libtpu_name: generation name in libtpu's topology string.
    hbm_gib: HBM per chip, GiB (Cloud TPU system architecture pages).
    hbm_gbps: HBM bandwidth per chip, GB/s (same pages).
    num_axes: axes of a slice shape (2: 'AxB', 3: 'AxBxC').
    chip_config_name: libtpu chip config; 'megacore' makes one device per chip.
    slices: the slice shapes Cloud TPU offers (listed in errors; libtpu may accept more).
  """

  name: str
  libtpu_name: str
  hbm_gib: float
  hbm_gbps: float
  num_axes: int
  chip_config_name: str
  slices: tuple[str, ...]

  @property
  def peak_flops(self) -> float:
    """Peak bfloat16 matmul FLOP/s per chip (`throughput.DATASHEET_PEAK_FLOPS`)."""
    peak = throughput.table_peak_flops(f"TPU {self.name}")
    assert peak is not None, f"TPU {self.name} is missing from throughput.DATASHEET_PEAK_FLOPS"
    return peak


_SLICES_2D = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
GENERATIONS: dict[str, TpuGeneration] = {
  g.name: g
  for g in (
    TpuGeneration(
      "v4",
      "v4",
      32,
      1200,
      3,
      "megacore",
      ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8"),
    ),
    TpuGeneration("v5e", "v5e", 16, 819, 2, "default", _SLICES_2D),
    TpuGeneration(
      "v5p",
      "v5p",
      95,
      2765,
      3,
      "megacore",
      ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8"),
    ),
    TpuGeneration("v6e", "v6e", 32, 1640, 2, "default", _SLICES_2D),
  )
}
_CHIPS_PER_HOST = (2, 2, 1)  # libtpu's default host bounds; smaller slices get their own shape


class PrecompileError(UserError, ValueError):
  """Bad precompile input: topology name, mesh size or missing libtpu."""


def accepted_topologies() -> list[str]:
  """Every standard slice name, e.g. 'v5e:4x4', generation by generation."""
  return [f"{g.name}:{s}" for g in GENERATIONS.values() for s in g.slices]


def parse_topology(name: str) -> tuple[TpuGeneration, tuple[int, ...]]:
  """'v5e:4x4' -> (the v5e generation, (4, 4)).

  Raises:
    PrecompileError: unknown generation or malformed shape, listing accepted names.
  """
  generation, _, shape = name.partition(":")
  gen = GENERATIONS.get(generation)
  dims = tuple(int(d) for d in shape.split("x")) if re.fullmatch(r"\d+(x\d+)*", shape) else ()
  if gen is None or len(dims) != gen.num_axes or min(dims) < 1:
    raise PrecompileError(
      f"Unknown TPU topology {name!r}. Accepted: <generation>:<shape> with generation in "
      f"{sorted(GENERATIONS)} (v5e/v6e: AxB, v4/v5p: AxBxC chips), e.g. "
      f"{', '.join(accepted_topologies())}."
    )
  return gen, dims


def require_libtpu() -> None:
  """Raises `PrecompileError` saying how to install libtpu when it is missing."""
  if importlib.util.find_spec("libtpu") is None:
    raise PrecompileError(
      f"--precompile compiles with libtpu, which is not installed. Install the `tpu` "
      f"extra: {INSTALL_HINT}"
    )


def topology_devices(name: str) -> list[Device]:
  """Compile-only devices (one per chip) of the slice `name`.

  Raises:
    PrecompileError: bad name, libtpu missing, or a shape libtpu rejects.
  """
  gen, dims = parse_topology(name)
  require_libtpu()
  for key, value in _COMPILE_ONLY_ENV.items():
    os.environ.setdefault(key, value)
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top

  padded = dims + (1,) * (3 - len(dims))
  host_bounds = tuple(min(d, h) for d, h in zip(padded, _CHIPS_PER_HOST))
  try:
    topology = topologies.get_topology_desc(
      f"{gen.libtpu_name}:{'x'.join(map(str, dims))}",
      "tpu",
      chip_config_name=gen.chip_config_name,
      chips_per_host_bounds=host_bounds,
    )
  except jax.errors.JaxRuntimeError as e:
    raise PrecompileError(
      f"libtpu rejected topology {name!r}: {e}. Standard slices: "
      f"{', '.join(accepted_topologies())}."
    ) from e
  return list(topology.devices)


def slice_partitioner(
  devices: list[Device], name: str, num_partitions: int, fsdp: bool
) -> partitioning.Partitioner:
  """The training partitioner over the slice's chips.

  Raises:
    PrecompileError: if `num_partitions` does not divide the chip count.
  """
  if num_partitions < 1 or len(devices) % num_partitions:
    raise PrecompileError(
      f"Model parallelism num_partitions={num_partitions} does not divide the "
      f"{len(devices)} chips of {name}; choose a divisor of {len(devices)}."
    )
  return partitioning.Partitioner(num_partitions, fsdp, devices=devices)


@dataclasses.dataclass(frozen=True)
class MemoryUse:
  """Per-chip bytes from `compiled.memory_analysis()`.

  Attributes:
    arguments: inputs resident during the step (state shard, batch shard, rng).
    outputs: outputs (new state shard, metrics).
    aliased: output bytes that reuse donated argument buffers (counted once).
    temporaries: activations, gradients and other buffers live within the step.
    peak: XLA's own peak estimate of the program.
  """

  arguments: int
  outputs: int
  aliased: int
  temporaries: int
  peak: int

  @property
  def total(self) -> int:
    """Bytes the step needs on each chip: the larger of the buffer sum and XLA's peak."""
    return max(self.arguments + self.outputs - self.aliased + self.temporaries, self.peak)

  @classmethod
  def from_compiled(cls, compiled: jax.stages.Compiled) -> MemoryUse:
    """Reads a compiled step's memory analysis."""
    stats = compiled.memory_analysis()
    assert stats is not None, "XLA gave no memory analysis for the compiled step"
    return cls(
      arguments=stats.argument_size_in_bytes,
      outputs=stats.output_size_in_bytes,
      aliased=stats.alias_size_in_bytes,
      temporaries=stats.temp_size_in_bytes,
      peak=getattr(stats, "peak_memory_in_bytes", 0),
    )


@dataclasses.dataclass(frozen=True)
class PrecompileReport:
  """What compiling the train step for a slice found.

  Attributes:
    topology: slice name, e.g. 'v5e:4x4'.
    chips: chips in the slice.
    mesh: {'data': d, 'model': m}.
    generation: the slice's TPU generation (HBM, peak FLOP/s, bandwidth).
    memory: per-chip memory; None when the compiler ran out of memory.
    compiler_error: XLA's out-of-memory message, when compilation failed on it.
    xla_flops_per_chip: FLOPs of one step on one chip (`cost_analysis`), if known.
    xla_bytes_per_chip: HBM bytes one step reads and writes on one chip
      (`cost_analysis`'s 'bytes accessed'), if known.
    model_flops_per_step: matmul FLOPs of the whole step (`t5x_lite.nn.flops`).
    loops_counted_once: the step loops (scan_layers, microbatches); XLA's cost
      analysis counts a loop body once, so its FLOPs and bytes undercount the step.
  """

  topology: str
  chips: int
  mesh: Mapping[str, int]
  generation: TpuGeneration
  memory: MemoryUse | None
  compiler_error: str | None
  xla_flops_per_chip: float | None
  xla_bytes_per_chip: float | None
  model_flops_per_step: float
  loops_counted_once: bool = False

  @property
  def hbm_bytes(self) -> int:
    """HBM per chip."""
    return int(self.generation.hbm_gib * GIB)

  @property
  def fits(self) -> bool:
    """Compiled and needs at most the chip's HBM."""
    return self.memory is not None and self.memory.total <= self.hbm_bytes

  @property
  def roofline_seconds(self) -> float | None:
    """Lower bound on the step time: the slower of compute and HBM traffic at peak.

    Compute counts the larger of XLA's FLOPs and the model's matmul FLOPs per chip
    (XLA's miss loop trips); traffic is XLA's bytes accessed. None when the step
    loops: XLA counts a loop body's bytes once, so there is no traffic figure to
    bound by. Collectives and host input are not modelled.
    """
    if self.xla_bytes_per_chip is None or self.loops_counted_once:
      return None
    flops = max(self.xla_flops_per_chip or 0.0, self.model_flops_per_step / self.chips)
    compute = flops / self.generation.peak_flops
    memory = self.xla_bytes_per_chip / (self.generation.hbm_gbps * 1e9)
    return max(compute, memory)

  @property
  def projected_mfu(self) -> float | None:
    """Model FLOPs utilisation at the roofline step time."""
    seconds = self.roofline_seconds
    if not seconds:
      return None
    return self.model_flops_per_step / (self.chips * self.generation.peak_flops * seconds)

  def basis(self) -> str:
    """Which memory figure the verdict rests on, and why that one."""
    hbm = f"{self.hbm_bytes / GIB:.2f} GiB of HBM"
    if self.memory is None:
      return f"Verdict: XLA ran out of the chip's {hbm} while compiling."
    m = self.memory
    if m.total == m.peak and m.peak > m.arguments + m.outputs - m.aliased + m.temporaries:
      return f"Verdict by XLA's peak ({m.peak / GIB:.3f} GiB, above the buffer sum) against {hbm}."
    return (
      f"Verdict by arguments + outputs - aliased + temporaries ({m.total / GIB:.3f} GiB) "
      f"against {hbm}: the temporaries are what the program asks the runtime to allocate "
      f"for the step, so the sum is what the chip holds; XLA's peak ({m.peak / GIB:.3f} "
      "GiB) counts the bytes live at once, lower when that memory is fragmented."
    )

  def lines(self) -> list[str]:
    """Human-readable report, one fact per line."""
    mesh = " x ".join(f"{k}={v}" for k, v in self.mesh.items())
    chips = f"{self.chips} chip{'s' if self.chips != 1 else ''}"
    out = [
      f"Topology {self.topology}: {chips}, mesh {mesh}, HBM {self.hbm_bytes / GIB:.2f} GiB per chip"
    ]
    if self.memory is not None:
      m = self.memory
      out += [
        f"Per-chip memory: arguments {m.arguments / GIB:.3f} GiB, outputs "
        f"{m.outputs / GIB:.3f} GiB (donated/aliased {m.aliased / GIB:.3f} GiB), "
        f"temporaries {m.temporaries / GIB:.3f} GiB, XLA peak {m.peak / GIB:.3f} GiB",
        f"Per-chip total: {m.total / GIB:.3f} GiB of {self.hbm_bytes / GIB:.2f} GiB "
        f"({100 * m.total / self.hbm_bytes:.0f}%)",
      ]
    if self.compiler_error is not None:
      out.append(f"Compiler: {self.compiler_error}")
    loops = (
      " [loop bodies counted once: scan_layers/microbatches]" if self.loops_counted_once else ""
    )
    if self.xla_flops_per_chip is not None:
      out.append(
        f"FLOPs per step: XLA {self.xla_flops_per_chip:.4g} per chip "
        f"({self.xla_flops_per_chip * self.chips:.4g} on the slice){loops}; model "
        f"matmuls {self.model_flops_per_step:.4g} (t5x_lite.nn.flops)"
      )
    else:
      out.append(f"FLOPs per step: model matmuls {self.model_flops_per_step:.4g}")
    if self.loops_counted_once:
      out.append("Roofline: not projected; XLA counts a loop body's bytes once")
    seconds, mfu, traffic = self.roofline_seconds, self.projected_mfu, self.xla_bytes_per_chip
    if seconds is not None and mfu is not None and traffic is not None:
      gen = self.generation
      out.append(
        f"Roofline: {traffic / 1e9:.4g} GB accessed per chip; at "
        f"{gen.peak_flops / 1e12:g} TFLOP/s and {gen.hbm_gbps:g} GB/s per {gen.name} chip a step "
        f"takes at least {1e3 * seconds:.3g} ms, MFU at most {100 * mfu:.3g}%"
      )
    out.append(self.basis())
    out.append("FITS" if self.fits else "DOES NOT FIT")
    return out


def advice(report: PrecompileReport) -> str:
  """What to change when the step does not fit, in gin bindings."""
  return (
    f"The train step does not fit in {report.hbm_bytes / GIB:.2f} GiB per chip on "
    f"{report.topology}. To cut per-chip memory (try in this order, re-running "
    "--precompile):\n"
    f"  - more model parallelism: --gin.Partitioner.num_partitions=N (now {report.mesh['model']}; "
    f"N must divide {report.chips}) splits heads, MLP and vocab over N chips;\n"
    "  - fully-sharded parameters: --gin.Partitioner.fsdp=True shards parameters and optimizer "
    "state over the data axis too;\n"
    "  - rematerialisation: --gin.T5Config.remat_policy=minimal (or full) recomputes "
    "activations in the backward pass; bfloat16 activations "
    "(--gin.T5Config.dtype=bfloat16) halve them;\n"
    "  - a chunked loss: --gin.EncoderDecoderModel.loss_chunk_length=N (a decoder-only "
    "model's: DecoderOnlyModel.loss_chunk_length) computes the logits N target positions "
    "at a time, never the whole float32 [batch, length, vocab];\n"
    "  - microbatches: --gin.train.num_microbatches=K accumulates gradients over K "
    "slices of the batch (the per-chip batch must divide by K);\n"
    "  - or a bigger slice (more chips) / a generation with more HBM."
  )


def lower_train_step(
  model: base_model.BaseModel,
  optimizer: optimizers.Optimizer,
  input_shapes: Mapping[str, tuple[int, ...]],
  partitioner: partitioning.Partitioner,
  num_microbatches: int,
) -> jax.stages.Lowered:
  """Lowers the train step that training runs: `trainer.make_train_step`'s function.

  Every input is a ShapeDtypeStruct carrying its sharding (the state from
  `trainer.abstract_train_state`, which makes no PRNG key), so nothing is
  allocated and the partitioner's devices may be compile-only.

  Args:
    model: the model.
    optimizer: the optimizer.
    input_shapes: global [batch, length] shape of every model feature.
    partitioner: mesh over the slice's chips and the logical-axis rules.
    num_microbatches: gradient-accumulation slices.

  Returns:
    The lowered step, ready for `.compile()`.
  """
  state, shardings = trainer.abstract_train_state(model, optimizer, partitioner)
  batch = {
    name: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=partitioner.batch_sharding)
    for name, shape in input_shapes.items()
  }  # [batch, length] each
  rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=partitioner.replicated)
  step = trainer.make_train_step(model, optimizer, partitioner, shardings, num_microbatches)
  return step.lower(state, batch, rng)


def _xla_costs(compiled: jax.stages.Compiled) -> tuple[float | None, float | None]:
  """(FLOPs, bytes accessed) of one execution on one chip, from XLA's cost analysis."""
  costs = compiled.cost_analysis()
  if isinstance(costs, (list, tuple)):
    costs = costs[0] if costs else {}

  def non_negative(key: str) -> float | None:
    value = (costs or {}).get(key)
    return float(value) if value is not None and value >= 0 else None

  return non_negative("flops"), non_negative("bytes accessed")


def precompile_train_step(
  model: base_model.BaseModel,
  optimizer: optimizers.Optimizer,
  dataset_cfg: pipeline.DatasetConfig,
  topology: str,
  *,
  num_partitions: int = 1,
  fsdp: bool = False,
  num_microbatches: int = 1,
) -> PrecompileReport:
  """Compiles the train step for `topology` and measures it.

  Args:
    model: the model.
    optimizer: the optimizer.
    dataset_cfg: training data config (global batch size, feature lengths).
    topology: slice name, e.g. 'v5e:4x4'.
    num_partitions: model-parallel size of the mesh.
    fsdp: shard parameters over the data axis too.
    num_microbatches: gradient-accumulation slices.

  Returns:
    The report; `report.fits` says whether the step fits in HBM.

  Raises:
    PrecompileError: bad topology, mesh or missing libtpu.
  """
  gen, _ = parse_topology(topology)
  devices = topology_devices(topology)
  partitioner = slice_partitioner(devices, topology, num_partitions, fsdp)
  dataset_cfg = pipeline.for_model(dataset_cfg, model.network_config)
  lengths = pipeline.model_feature_lengths(dataset_cfg)
  # A decoder-only model's inputs are inside its decoder_target_tokens.
  inputs, targets = lengths.get("encoder_input_tokens", 0), lengths["decoder_target_tokens"]
  model_flops = model.train_flops_per_step(dataset_cfg.batch_size, inputs, targets)
  with registry.compiling_for("tpu"):  # T5Config.kernels 'auto': the TPU's kernels
    lowered = lower_train_step(
      model, optimizer, pipeline.model_input_shapes(dataset_cfg), partitioner, num_microbatches
    )
  memory, error, xla_flops, xla_bytes = None, None, None, None
  # JAX's persistent compilation cache cannot load a compile-only topology's executable
  # back (it warns and compiles again), so the step is compiled without it.
  cache_on = jax.config.jax_enable_compilation_cache  # pyright: ignore[reportAttributeAccessIssue]
  jax.config.update("jax_enable_compilation_cache", False)
  try:
    compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    if not _OOM_PATTERN.search(str(e)):
      raise
    error = str(e).strip().splitlines()[0]
  else:
    memory = MemoryUse.from_compiled(compiled)
    xla_flops, xla_bytes = _xla_costs(compiled)
  finally:
    jax.config.update("jax_enable_compilation_cache", cache_on)
  return PrecompileReport(
    topology=topology,
    chips=len(devices),
    mesh=dict(partitioner.mesh.shape),
    generation=gen,
    memory=memory,
    compiler_error=error,
    xla_flops_per_chip=xla_flops,
    xla_bytes_per_chip=xla_bytes,
    model_flops_per_step=model_flops,
    loops_counted_once=model.network_config.scan_layers or num_microbatches > 1,
  )


def bound_arguments(fn: Any) -> dict[str, Any]:
  """The arguments a gin-configurable `fn` gets when called bare: defaults, then gin."""
  args = {name: p.default for name, p in inspect.signature(fn).parameters.items()}
  args.update(gin.get_bindings(fn))
  return args


def run(topology: str | None) -> int:
  """`--precompile`: compiles the gin-configured train step for `topology`, reports.

  Call after gin is parsed (`cli.setup()`).

  Args:
    topology: the --topology flag.

  Returns:
    Exit status: 0 if the step fits, 1 if it does not (advice on stderr).

  Raises:
    PrecompileError: missing/unknown topology, bad mesh, missing libtpu or an
      incomplete gin config.
  """
  if not topology:
    raise PrecompileError(
      f"--precompile needs --topology, one of: {', '.join(accepted_topologies())}."
    )
  parse_topology(topology)
  require_libtpu()
  # Host work (shape inference) stays on the CPU. (jax.config's options are attributes it
  # sets at run time, unknown to type checkers.)
  if not jax.config.jax_platforms:  # pyright: ignore[reportAttributeAccessIssue]
    jax.config.update("jax_platforms", "cpu")
  args = bound_arguments(train_lib.train)
  partitioner_args = bound_arguments(partitioning.Partitioner)
  dataset_cfg = args["train_dataset_cfg"]
  if not isinstance(dataset_cfg, pipeline.DatasetConfig) or not isinstance(
    dataset_cfg.task_feature_lengths, Mapping
  ):
    raise PrecompileError(
      "The gin config must set train.train_dataset_cfg with "
      "TASK_FEATURE_LENGTHS (and BATCH_SIZE), as for training."
    )
  report = precompile_train_step(
    args["model"] or models.build_model(),
    args["optimizer"]
    .with_trainable(args["trainable_parameters"])
    .with_gradual_unfreezing(args["gradual_unfreezing_steps"]),
    dataset_cfg,
    topology,
    num_partitions=partitioner_args["num_partitions"],
    fsdp=partitioner_args["fsdp"],
    num_microbatches=args["num_microbatches"],
  )
  print("\n".join(report.lines()), flush=True)
  if report.fits:
    return 0
  print(advice(report), file=sys.stderr, flush=True)
  return 1
