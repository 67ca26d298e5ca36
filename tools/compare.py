r"""The T5 paper's comparisons, runnable: one command per table, a Markdown table + JSON.

  python tools/compare.py --table=architectures     # the paper's Table 2
  python tools/compare.py --table=objectives        # Tables 4-5 (objectives)
  python tools/compare.py --table=mixing            # Table 11 (mixing strategies)
  python tools/compare.py --table=finetuning        # section 3.5.1 (fine-tuning methods)

Each variant pre-trains the same model size for the same steps on the offline
CPython prose (tasks `cpython_<objective>`, tasks/offline.py), every row holding the
same 160 tokens (inputs + targets), then fine-tunes that checkpoint on SST-2 and RTE
(tasks `local_glue_sst2`, `local_glue_rte`, read from --data_dir) and reports the
pre-training validation loss, the downstream dev accuracies, parameters, training
FLOPs per token (`tools/model_info.py`) and wall times. The mixing table trains on
the `local_multitask` mixture (SST-2, RTE, Multi30k, SciTLDR) under each mixing
strategy instead and evaluates SST-2 and RTE without fine-tuning.

The fine-tuning table pre-trains nothing: every row runs one fine-tuning configuration
(--finetune_gin, default quickstart_sst2.gin: its checkpoint, task, steps and
schedule; recipes/sst2.gin for the recipes' model) with one method added: all
parameters, the same model from scratch, the decoder alone, adapters, gradual
unfreezing (a block every half of TRAIN_STEPS), a half-depth student distilled from
the all-parameters row, and that student without a teacher. --seeds=N runs each
N times (RANDOM_SEED 0..N-1) and reports the mean and standard error of --metric
(the best validation value where the configuration keeps one, else the last).

Every run goes through the real entry points (`python -m t5x_lite.train` / `.eval`)
into --output_dir/<table>/<variant>/, so a stopped comparison resumes where it was
(training resumes from its checkpoints; finished runs are not repeated) and each
run's metrics.jsonl and config.gin stay there. After every variant the table is
rewritten to --output_dir/<table>/results.{md,json}. A failed run stops the tool
with one `ERROR:` line naming the run and its log file.

The objectives table's `electra` row pre-trains an `ElectraModel` (runs/electra.gin,
task `cpython_electra`) for as many steps as give the training FLOPs of the span
corruption row's --pretrain_steps, its generator counted
(`ElectraModel.train_flops_per_step`), then fine-tunes the discriminator alone like
every row (the checkpoint's generator and RTD head are dropped). Its last row, `no
pre-training`, is the baseline: the same fine-tuning runs from random weights, so an
objective shows that it helps only where its row beats that one.

--seeds=N runs every row of every table N times (RANDOM_SEED 0..N-1, bound in each of
its runs) and reports the mean and standard error of each accuracy beside the seeds'
values. On the tiny model one seed's SST-2 accuracy moves by several points from seed
to seed (docs/comparisons.md), so a pre-training table needs several seeds before its
gaps mean anything. In the pre-training tables seed 0 keeps the row's own directory
(the one-seed table's, so it resumes into it) and seed k > 0 runs in `<row>_s<k>`.

Sizes: --model (a model size file of each architecture's family, default `tiny`),
--pretrain_steps, --finetune_steps, --batch_size; extra --gin_bindings (or
--gin.NAME=VALUE) apply to every run, e.g. --gin.T5Config.emb_dim=128. --only=<dirs>
runs some rows only (their directory names under --output_dir/<table>).
"""

from t5x_lite.core import console

if __name__ == "__main__":  # first, before TensorFlow and JAX load (logged later)
  console.quiet_startup()  # environment defaults, TensorFlow imported quietly

import dataclasses
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

from absl import app, flags

from t5x_lite.core import gin_config
from t5x_lite.core.errors import ConfigError

TABLES = ("architectures", "objectives", "mixing", "finetuning")
_TABLE = flags.DEFINE_enum("table", None, TABLES, "Which comparison to run.", required=True)
_OUTPUT_DIR = flags.DEFINE_string("output_dir", "./runs/compare", "Runs and tables go here.")
_MODEL = flags.DEFINE_string("model", "tiny", "Size file of each family (tiny, small, base).")
_PRETRAIN_STEPS = flags.DEFINE_integer("pretrain_steps", 600, "Pre-training steps per variant.")
_FINETUNE_STEPS = flags.DEFINE_integer("finetune_steps", 200, "Fine-tuning steps per task.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 16, "Global batch size of every run.")
_DATA_DIR = flags.DEFINE_string("data_dir", "../shared/data", "Where glue/SST-2 and glue/RTE are.")
_ONLY = flags.DEFINE_list("only", [], "Run only these variants (their directory names).")
_FINETUNE_GIN = flags.DEFINE_string(
  "finetune_gin", "quickstart_sst2.gin", "--table=finetuning: the configuration every row runs."
)
_METRIC = flags.DEFINE_string(
  "metric", "local_glue_sst2/accuracy", "--table=finetuning: the validation metric reported."
)
_SEEDS = flags.DEFINE_integer(
  "seeds", 1, "Runs of each row, RANDOM_SEED 0..N-1; above 1 a row reports mean ± SE."
)

# Every pre-training row holds 160 tokens, as in the quickstarts.
SHORT_TARGETS = {"inputs": 128, "targets": 32}  # span-style targets: about 25% of the text
LONG_TARGETS = {"inputs": 80, "targets": 80}  # the whole segment is the target
# i.i.d. runs of corrupted tokens each need their own sentinel in the targets.
IID_SPAN_TARGETS = {"inputs": 104, "targets": 56}
LM_ONLY = {"targets": 160}
DOWNSTREAM = {
  "local_glue_sst2": {"inputs": 128, "targets": 8},
  "local_glue_rte": {"inputs": 256, "targets": 8},
}
ELECTRA_GIN = "runs/electra.gin"
# The row whose pre-training FLOPs the rows with their own gin files match.
SPAN_CORRUPTION = ("cpython_span_corruption", SHORT_TARGETS)
# Objectives whose targets are the whole (corrupted) segment.
_WHOLE_SEGMENT_TARGETS = ("bert_style", "iid_denoising", "mass_style", "deshuffling")


@dataclasses.dataclass(frozen=True)
class Variant:
  """One row of a table.

  Attributes:
    name: the row's name (and its run directory).
    family: the gin model family: t5_1_1, decoder_only or prefix_lm.
    task: the pre-training task or mixture.
    lengths: its task feature lengths.
    bindings: gin bindings of this variant's pre-training and fine-tuning runs.
    pretrain_bindings: gin bindings of its pre-training run only.
    pretrain_gin_files: gin files its pre-training run adds (after runs/pretrain.gin);
      such a row pre-trains for the span corruption row's training FLOPs
      (`pretrain_steps`).
    pretrained: False for the baseline row that fine-tunes the model from its random
      initialisation, with no pre-training run (`NO_PRETRAINING`).
  """

  name: str
  family: str
  task: str
  lengths: dict
  bindings: tuple[str, ...] = ()
  pretrain_bindings: tuple[str, ...] = ()
  pretrain_gin_files: tuple[str, ...] = ()
  pretrained: bool = True


# The objectives table's baseline: the same fine-tuning from random weights. A
# pre-training objective helps only where its row beats this one.
NO_PRETRAINING = Variant("no pre-training", "t5_1_1", "", SHORT_TARGETS, pretrained=False)


def _objective_lengths(objective: str) -> dict:
  """Lengths (160 tokens in all) that truncate none of `objective`'s examples."""
  if objective in _WHOLE_SEGMENT_TARGETS:
    return LONG_TARGETS
  return IID_SPAN_TARGETS if objective == "iid_replace_spans" else SHORT_TARGETS


def variants(table: str) -> list[Variant]:
  """The rows of `table`."""
  if table == "architectures":
    half = ("T5Config.num_encoder_layers = 1", "T5Config.num_decoder_layers = 1")
    if _MODEL.value != "tiny":
      raise ConfigError(
        "--table=architectures halves the tiny model's 2 + 2 layers; use --model=tiny"
      )
    shared = ("T5Config.share_encoder_decoder = True",)
    rows = []
    for objective, task in (("denoising", "cpython_span_corruption"), ("LM", "cpython_prefix_lm")):
      rows += [
        Variant(f"encoder-decoder, {objective}", "t5_1_1", task, SHORT_TARGETS),
        Variant(f"encoder-decoder shared, {objective}", "t5_1_1", task, SHORT_TARGETS, shared),
        Variant(f"encoder-decoder half depth, {objective}", "t5_1_1", task, SHORT_TARGETS, half),
      ]
    return rows + [
      Variant(
        "decoder-only LM, denoising", "decoder_only", "cpython_span_corruption", SHORT_TARGETS
      ),
      Variant("decoder-only LM, LM", "decoder_only", "cpython_lm", LM_ONLY),
      Variant("prefix LM, denoising", "prefix_lm", "cpython_span_corruption", SHORT_TARGETS),
      Variant("prefix LM, LM", "prefix_lm", "cpython_prefix_lm", SHORT_TARGETS),
    ]
  if table == "objectives":
    from t5x_lite.data import objectives  # TensorFlow only when needed

    rows = [
      Variant(name, "t5_1_1", f"cpython_{name}", _objective_lengths(name))
      for name in objectives.UNSUPERVISED_OBJECTIVES
      if name != "lm"
    ]
    electra = Variant(
      "electra", "t5_1_1", "cpython_electra", LONG_TARGETS, pretrain_gin_files=(ELECTRA_GIN,)
    )
    return rows + [electra, NO_PRETRAINING]
  # K = 2^16 caps SST-2's 67k training examples only; the other three have 2k-29k.
  rates = {
    "examples-proportional, K = 2^16": ("strategy = 'proportional'", "maximum = 65536"),
    "temperature T = 2, K = 2^16": ("strategy = 'temperature'", "maximum = 65536"),
    "equal": ("strategy = 'equal'",),
  }
  return [
    Variant(
      name,
      "t5_1_1",
      "local_multitask",
      {"inputs": 256, "targets": 64},
      pretrain_bindings=tuple(f"local_multitask/mixing_rate.{b}" for b in bindings),
    )
    for name, bindings in rates.items()
  ]


def _slug(name: str) -> str:
  return "".join(c if c.isalnum() else "_" for c in name).strip("_").lower()


class Runner:
  """Runs the entry points for one table, logging each run next to its model dir."""

  def __init__(self, table_dir: str):
    self.table_dir = table_dir

  def run(self, args: list[str], log_path: str) -> float:
    """Runs `python <args>` unless `log_path`.done says it ran; returns its wall seconds."""
    done = log_path + ".done"
    if os.path.exists(done):
      with open(done) as f:
        return float(f.read())
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    start = time.perf_counter()
    with open(log_path, "w") as log:
      result = subprocess.run([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT)
    seconds = round(time.perf_counter() - start, 1)
    if result.returncode:
      raise ConfigError(
        f"{' '.join(args[:3])} ... failed (exit {result.returncode}); see {log_path}"
      )
    with open(done, "w") as f:
      f.write(str(seconds))
    return seconds


def _model_gin(variant: Variant) -> str:
  return f"--gin_file=models/{variant.family}/{_MODEL.value}.gin"


def _common(variant: Variant, seed: int) -> list[str]:
  bindings = [*flags.FLAGS.gin_bindings, *variant.bindings, *_seed_bindings(seed)]
  return [
    "--gin_file=quickstart_base.gin",
    f"--gin.BATCH_SIZE={_BATCH_SIZE.value}",
    f"--data_dir={_DATA_DIR.value}",
    *(f"--gin_bindings={b}" for b in bindings),
  ]


def _seed_bindings(seed: int) -> tuple[str, ...]:
  """RANDOM_SEED of every run of a row when --seeds asks for more than one (one seed
  leaves it to the gin files and --gin bindings, as before --seeds)."""
  return (f"RANDOM_SEED = {seed}",) if _SEEDS.value > 1 else ()


def row_directory(name: str, seed: int) -> str:
  """A pre-training table row's run directory for `seed`: seed 0 in the row's own."""
  return _slug(name) if seed == 0 else f"{_slug(name)}_s{seed}"


def mean_and_error(values: Sequence[float]) -> tuple[float, float]:
  """The mean of `values` and its standard error (NaN for a single value)."""
  mean = statistics.fmean(values)
  error = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan
  return mean, error


def seeds_row(runs: Sequence[dict]) -> dict:
  """One table row from the rows of its seeds: the first seed's description, the mean
  of every figure, the standard error of the accuracies and each seed's row ('seeds')."""
  if len(runs) == 1:
    return dict(runs[0])
  row = {k: v for k, v in runs[0].items() if k != "seed"}
  for key in ("pretrain_seconds", "pretrain_validation_loss", "sst2_seconds", "rte_seconds"):
    values = [r[key] for r in runs]
    row[key] = None if None in values else statistics.fmean(values)
  for key in ("sst2_accuracy", "rte_accuracy"):
    row[key], row[f"{key}_se"] = mean_and_error([r[key] for r in runs])
  row["seeds"] = list(runs)
  return row


def _last(metrics_path: str, split: str, key: str) -> float | None:
  """The last value of `key` among the `split` records of a metrics.jsonl."""
  value = None
  with open(metrics_path) as f:
    for line in f:
      record = json.loads(line)
      if record.get("split") == split and key in record:
        value = record[key]
  return value


class _SizedVocabulary:
  """Stands in for the offline vocabulary where only the model's shapes matter."""

  eos_id = 1

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size


def pretrain_flops_per_token(variant: Variant) -> float:
  """Training FLOPs per token of `variant`'s pre-training model, from its gin files and
  the --gin bindings (an ELECTRA row: the discriminator's and the generator's)."""
  import gin

  import t5x_lite.run.train_lib  # noqa: F401  (the configurables quickstart_base.gin binds)
  from t5x_lite import models
  from t5x_lite.nn import flops, network

  gin.clear_config()
  gin_files = [
    f"models/{variant.family}/{_MODEL.value}.gin",
    "quickstart_base.gin",
    *variant.pretrain_gin_files,
  ]
  gin_config.parse_gin(gin_files, [*flags.FLAGS.gin_bindings, *variant.bindings])
  config = network.T5Config()
  lengths = flops.network_lengths(
    config, variant.lengths.get("inputs", 0), variant.lengths["targets"]
  )
  if ELECTRA_GIN in variant.pretrain_gin_files:
    from t5x_lite import electra

    model = electra.build_electra_model(config, _SizedVocabulary(config.vocab_size))
  else:
    model = models.build_model(config, _SizedVocabulary(config.vocab_size))
  gin.clear_config()
  return model.train_flops_per_step(1, *lengths) / sum(lengths)


def pretrain_steps(variant: Variant) -> int:
  """--pretrain_steps; for a row with its own pre-training gin files, the steps whose
  training FLOPs equal the span corruption row's --pretrain_steps (rows hold the same
  160 tokens)."""
  if not variant.pretrain_gin_files:
    return _PRETRAIN_STEPS.value
  task, lengths = SPAN_CORRUPTION
  reference = Variant("span_corruption", variant.family, task, lengths, variant.bindings)
  ratio = pretrain_flops_per_token(reference) / pretrain_flops_per_token(variant)
  return max(1, round(_PRETRAIN_STEPS.value * ratio))


def _model_info(variant: Variant, pretrain_dir: str) -> dict:
  """Parameters and training FLOPs per token of the model the pre-training run saved
  (for `NO_PRETRAINING`, `pretrain_dir` is a fine-tuning run's and FLOPs are None)."""
  import jax  # the data-free part of the tool stays light to import

  from t5x_lite import models
  from t5x_lite.nn import flops
  from t5x_lite.checkpoint import checkpoints

  _, step_dir = checkpoints.find_steps(pretrain_dir, verify_checksums=False)[-1]
  config = checkpoints.model_config(step_dir)
  shapes = jax.eval_shape(lambda: models.init_params(config, jax.random.PRNGKey(0)))
  params = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(shapes))
  lengths = flops.network_lengths(
    config, variant.lengths.get("inputs", 0), variant.lengths["targets"]
  )
  per_token = flops.flops_per_token(config, *lengths) if variant.pretrained else None
  if variant.pretrain_gin_files:  # the pre-training model's own cost (a generator counted)
    per_token = pretrain_flops_per_token(variant)
  return {"params": params, "flops_per_token": per_token}


def run_variant(runner: Runner, variant: Variant, table: str, seed: int = 0) -> dict:
  """Pre-trains (or multi-task trains) one variant with one seed, fine-tunes or
  evaluates, returns its row."""
  root = os.path.join(runner.table_dir, row_directory(variant.name, seed))
  pretrain_dir = os.path.join(root, "pretrain")
  row = {"variant": variant.name, "task": variant.task, "lengths": variant.lengths}
  if _SEEDS.value > 1:
    row["seed"] = seed
  if not variant.pretrained:
    row |= {"pretrain_steps": 0, "flops_matched": False, "pretrain_seconds": 0.0}
    row["pretrain_validation_loss"] = None
    row |= _finetune_downstream(runner, variant, seed, root, "None")
    return {**row, **_model_info(variant, os.path.join(root, "sst2"))}
  steps = pretrain_steps(variant)
  row["pretrain_steps"], row["flops_matched"] = steps, bool(variant.pretrain_gin_files)
  row["pretrain_seconds"] = runner.run(
    [
      "-m",
      "t5x_lite.train",
      _model_gin(variant),
      "--gin_file=runs/pretrain.gin",
      *(f"--gin_file={gin_file}" for gin_file in variant.pretrain_gin_files),
      *_common(variant, seed),
      *(f"--gin_bindings={b}" for b in variant.pretrain_bindings),
      f"--gin.MODEL_DIR={pretrain_dir}",
      f"--gin.TRAIN_STEPS={steps}",
      f"--gin.EVAL_PERIOD={steps}",
      f"--gin.MIXTURE_OR_TASK_NAME={variant.task}",
      f"--gin.TASK_FEATURE_LENGTHS={variant.lengths}",
    ],
    os.path.join(root, "pretrain.log"),
  )
  row["pretrain_validation_loss"] = _last(
    os.path.join(pretrain_dir, "metrics.jsonl"), "eval", "loss"
  )
  if table != "mixing":
    row |= _finetune_downstream(runner, variant, seed, root, pretrain_dir)
    return {**row, **_model_info(variant, pretrain_dir)}
  for task, lengths in DOWNSTREAM.items():  # the mixing table: no fine-tuning
    short = task.removeprefix("local_glue_")
    eval_dir = os.path.join(root, f"eval_{short}")
    row[f"{short}_seconds"] = runner.run(
      [
        "-m",
        "t5x_lite.eval",
        "--gin_file=runs/eval.gin",
        f"--data_dir={_DATA_DIR.value}",
        f"--gin.CHECKPOINT_PATH={os.path.join(pretrain_dir, str(steps))}",
        f"--gin.EVAL_OUTPUT_DIR={eval_dir}",
        f"--gin.MIXTURE_OR_TASK_NAME={task}",
        f"--gin.TASK_FEATURE_LENGTHS={lengths}",
      ],
      os.path.join(root, f"eval_{short}.log"),
    )
    with open(os.path.join(eval_dir, f"metrics_step_{steps}.json")) as f:
      row[f"{short}_accuracy"] = json.load(f)["metrics"][task]["accuracy"]
  return {**row, **_model_info(variant, pretrain_dir)}


def _finetune_downstream(
  runner: Runner, variant: Variant, seed: int, root: str, initial_checkpoint: str
) -> dict:
  """Fine-tunes `initial_checkpoint` ('None': random weights) on each DOWNSTREAM task;
  each task's wall seconds and dev accuracy."""
  row = {}
  for task, lengths in DOWNSTREAM.items():
    short = task.removeprefix("local_glue_")
    model_dir = os.path.join(root, short)
    row[f"{short}_seconds"] = runner.run(
      [
        "-m",
        "t5x_lite.train",
        _model_gin(variant),
        "--gin_file=runs/finetune.gin",
        *_common(variant, seed),
        f"--gin.MODEL_DIR={model_dir}",
        f"--gin.INITIAL_CHECKPOINT_PATH={initial_checkpoint}",
        f"--gin.TRAIN_STEPS={_FINETUNE_STEPS.value}",
        f"--gin.EVAL_PERIOD={_FINETUNE_STEPS.value}",
        f"--gin.train.infer_eval_period={_FINETUNE_STEPS.value}",
        f"--gin.MIXTURE_OR_TASK_NAME={task}",
        f"--gin.TASK_FEATURE_LENGTHS={lengths}",
        "--gin.optimizers.constant.value=0.01",
      ],
      os.path.join(root, f"{short}.log"),
    )
    row[f"{short}_accuracy"] = _last(
      os.path.join(model_dir, "metrics.jsonl"), "eval", f"{task}/accuracy"
    )
  return row


def markdown(rows: Sequence[dict], table: str) -> str:
  """The results as a Markdown table."""
  trained = "multi-task steps" if table == "mixing" else "pre-training steps"
  head = (
    "| variant | task | params | train FLOPs/token | validation loss "
    "| SST-2 acc | RTE acc | wall s |\n|---|---|---|---|---|---|---|---|\n"
  )
  lines = []
  for r in rows:
    wall = r["pretrain_seconds"] + r["sst2_seconds"] + r["rte_seconds"]
    task = f"`{r['task']}` {r['lengths']}" if r["task"] else "-"
    flops_per_token, loss = r["flops_per_token"], r["pretrain_validation_loss"]
    lines.append(
      f"| {r['variant']} | {task} | {r['params']:,} | "
      f"{'-' if flops_per_token is None else f'{flops_per_token:.3g}'} | "
      f"{'-' if loss is None else f'{loss:.3f}'} | "
      f"{_accuracy(r, 'sst2')} | {_accuracy(r, 'rte')} | {wall:.0f} |"
    )
  matched = "".join(
    f"{r['variant']} pre-trains {r['pretrain_steps']} steps, the training FLOPs of span "
    f"corruption's {_PRETRAIN_STEPS.value} (its generator counted).\n"
    for r in rows
    if r.get("flops_matched")
  )
  note = f"\n{_PRETRAIN_STEPS.value} {trained} of {_BATCH_SIZE.value} rows, " + (
    "then SST-2 and RTE dev accuracy of that checkpoint.\n"
    if table == "mixing"
    else f"then {_FINETUNE_STEPS.value} fine-tuning steps per task (dev accuracy).\n"
  )
  seeds = (
    f"Accuracies: mean ± standard error over {_SEEDS.value} seeds (RANDOM_SEED "
    f"0..{_SEEDS.value - 1}), each seed's in brackets; loss and wall s: the seeds' mean.\n"
    if _SEEDS.value > 1
    else ""
  )
  return head + "\n".join(lines) + "\n" + note + matched + seeds


def _accuracy(row: dict, task: str) -> str:
  """A row's accuracy cell: the value, or over seeds the mean ± SE and each seed's."""
  if "seeds" not in row:
    return f"{row[f'{task}_accuracy']:.1f}"
  each = ", ".join(f"{r[f'{task}_accuracy']:.1f}" for r in row["seeds"])
  return f"{row[f'{task}_accuracy']:.1f} ± {row[f'{task}_accuracy_se']:.1f} ({each})"


@dataclasses.dataclass(frozen=True)
class Method:
  """One row of the fine-tuning table: what it adds to --finetune_gin.

  Attributes:
    name: the row's name.
    slug: its run directories, `<slug>_s<seed>`.
    gin_files: gin files added after --finetune_gin.
    bindings: gin bindings added last (after --gin_bindings).
    distilled: the teacher is the `full` row of the same seed.
  """

  name: str
  slug: str
  gin_files: tuple[str, ...] = ()
  bindings: tuple[str, ...] = ()
  distilled: bool = False


def finetuning_methods(train_steps: int, encoder_layers: int, decoder_layers: int) -> list[Method]:
  """The rows of the fine-tuning table for a configuration of `train_steps` steps and a
  model of these depths."""
  scratch = ("INITIAL_CHECKPOINT_PATH = None",)
  half = (
    f"T5Config.num_encoder_layers = {max(1, encoder_layers // 2)}",
    f"T5Config.num_decoder_layers = {max(1, decoder_layers // 2)}",
  )
  every = max(1, train_steps // 2)
  return [
    Method("all parameters", "full"),  # first: the distilled row's teacher
    Method("the same model from scratch, no checkpoint", "scratch", bindings=scratch),
    Method(
      "decoder only, encoder frozen",
      "decoder",
      bindings=("train.trainable_parameters = ['decoder/.*']",),
    ),
    Method("adapters, d = 64", "adapters", gin_files=("runs/adapters.gin",)),
    Method(
      f"gradual unfreezing, a block every {every} steps",
      "unfreeze",
      gin_files=("runs/gradual_unfreezing.gin",),
      bindings=(f"UNFREEZE_EVERY = {every}",),
    ),
    Method(
      "distillation: half-depth student from scratch, teacher: all parameters",
      "distilled",
      gin_files=("runs/distill.gin",),
      bindings=scratch + half,
      distilled=True,
    ),
    Method(
      "the same half-depth student without a teacher", "small_scratch", bindings=scratch + half
    ),
  ]


def finetune_settings() -> tuple[int, int, int]:
  """TRAIN_STEPS and the encoder and decoder depths of --finetune_gin with --gin_bindings."""
  import gin

  import t5x_lite.run.train_lib  # noqa: F401  (the configurables the gin files bind)
  from t5x_lite.nn import network

  gin.clear_config()
  gin_config.parse_gin([_FINETUNE_GIN.value], list(flags.FLAGS.gin_bindings))
  steps = int(gin.query_parameter("%TRAIN_STEPS"))
  config = network.T5Config()
  gin.clear_config()
  return steps, config.num_encoder_layers, config.num_decoder_layers


def _finetune_score(model_dir: str) -> float | None:
  """--metric of a fine-tuning run: the best validation value where the run kept one
  (best.json), else the last one logged."""
  best = os.path.join(model_dir, "best.json")
  if os.path.exists(best):
    with open(best) as f:
      kept = json.load(f)
    if kept["metric"] != _METRIC.value:
      raise ConfigError(f"{best} keeps the best {kept['metric']}; pass --metric={kept['metric']}")
    return kept["best_value"]
  return _last(os.path.join(model_dir, "metrics.jsonl"), "eval", _METRIC.value)


def _trainable(log_path: str) -> str:
  """'N of M' from a training log's `trainable parameters: N of M` line."""
  with open(log_path) as f:
    found = re.findall(r"trainable parameters: (\d+) of (\d+)", f.read())
  return f"{int(found[-1][0]):,} of {int(found[-1][1]):,}" if found else "?"


def run_method(runner: Runner, method: Method, seed: int, teacher: Method) -> dict:
  """Fine-tunes one row for one seed (a distilled row: `teacher`'s run first); its results."""
  model_dir = os.path.join(runner.table_dir, f"{method.slug}_s{seed}")
  args = [
    "-m",
    "t5x_lite.train",
    f"--gin_file={_FINETUNE_GIN.value}",
    *(f"--gin_file={gin_file}" for gin_file in method.gin_files),
    f"--data_dir={_DATA_DIR.value}",
    f"--gin.MODEL_DIR={model_dir}",
    f"--gin.RANDOM_SEED={seed}",
    *(f"--gin_bindings={b}" for b in (*flags.FLAGS.gin_bindings, *method.bindings)),
  ]
  if method.distilled:
    run_method(runner, teacher, seed, teacher)
    args.append(f"--gin.TEACHER_CHECKPOINT_PATH={runner.table_dir}/{teacher.slug}_s{seed}")
  log_path = model_dir + ".log"
  seconds = runner.run(args, log_path)
  return {
    "seconds": seconds,
    "score": _finetune_score(model_dir),
    "trainable": _trainable(log_path),
  }


def finetuning_markdown(rows: Sequence[dict]) -> str:
  """The fine-tuning table: per row, the seeds' scores, their mean and standard error."""
  lines = [
    f"| method | trainable parameters | {_METRIC.value} per seed | mean ± SE | wall s |",
    "|---|---|---|---|---|",
  ]
  for r in rows:
    scores = [s for s in r["scores"] if s is not None]
    mean, error = mean_and_error(scores) if scores else (math.nan, math.nan)
    lines.append(
      f"| {r['method']} | {r['trainable']} | "
      f"{', '.join('-' if s is None else f'{s:.1f}' for s in r['scores'])} | "
      f"{mean:.1f}{'' if math.isnan(error) else f' ± {error:.1f}'} | "
      f"{statistics.fmean(r['seconds']):.0f} |"
    )
  return "\n".join(lines) + f"\n\nEach row: {_FINETUNE_GIN.value} plus the method.\n"


def run_finetuning_table(table_dir: str) -> None:
  """Runs the chosen rows of the fine-tuning table, rewriting results.{md,json} after each."""
  methods = finetuning_methods(*finetune_settings())
  chosen = [m for m in methods if not _ONLY.value or m.slug in _ONLY.value]
  if not chosen:
    names = ", ".join(m.slug for m in methods)
    raise ConfigError(f"--only={','.join(_ONLY.value)} names no row of finetuning: {names}")
  runner, rows = Runner(table_dir), []
  for method in chosen:
    print(f"[finetuning] {method.name} ...", flush=True)
    runs = [run_method(runner, method, seed, methods[0]) for seed in range(_SEEDS.value)]
    rows.append(
      {
        "method": method.name,
        "slug": method.slug,
        "trainable": runs[0]["trainable"],
        "scores": [r["score"] for r in runs],
        "seconds": [r["seconds"] for r in runs],
      }
    )
    with open(os.path.join(table_dir, "results.json"), "w") as f:
      json.dump(rows, f, indent=1)
    with open(os.path.join(table_dir, "results.md"), "w") as f:
      f.write(finetuning_markdown(rows))
  print(finetuning_markdown(rows))


def main(argv: Sequence[str]) -> None:
  console.quiet_library_logs()
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  table = _TABLE.value
  table_dir = os.path.join(_OUTPUT_DIR.value, table)
  if _SEEDS.value < 1:
    raise ConfigError(f"--seeds={_SEEDS.value}: must be at least 1")
  if table == "finetuning":
    run_finetuning_table(table_dir)
    return
  runner, rows = Runner(table_dir), []
  chosen = [v for v in variants(table) if not _ONLY.value or _slug(v.name) in _ONLY.value]
  if not chosen:
    names = ", ".join(_slug(v.name) for v in variants(table))
    raise ConfigError(f"--only={','.join(_ONLY.value)} names no variant of {table}: {names}")
  for variant in chosen:
    print(f"[{table}] {variant.name} ...", flush=True)
    rows.append(seeds_row([run_variant(runner, variant, table, s) for s in range(_SEEDS.value)]))
    with open(os.path.join(table_dir, "results.json"), "w") as f:
      json.dump(rows, f, indent=1)
    with open(os.path.join(table_dir, "results.md"), "w") as f:
      f.write(markdown(rows, table))
  print(markdown(rows, table))


if __name__ == "__main__":
  gin_config.run_app(main)
