r"""Converts between T5X checkpoints and t5x_lite checkpoints, both ways.

T5X -> t5x_lite (a T5X `checkpoint_<step>` directory, or a T5X model_dir for its newest
step; orbax or legacy msgpack/tensorstore layout; T5X's own examples/t5 network or
flaxformer's T5 1.0/1.1, unscanned):

  python tools/convert_t5x_checkpoint.py --t5x_checkpoint=/path/t5x_model_dir \
      --output_dir=/tmp/from_t5x

writes a checkpoint root whose step is T5X's step, holding `params`, `config` (the
T5Config read from the parameter shapes; `T5Config.*` gin bindings override fields,
e.g. --gin.T5Config.relative_attention_max_distance=128, which shapes do not tell) and,
when T5X saved Adafactor state, `opt_state`: T5X's second moments in the state of
`optimizers.adafactor` (configured by `adafactor.*` bindings of --gin_file/--gin), so
that `train.initial_checkpoint_path` with `RestoreConfig.restore_optimizer_state=True`
continues T5X's training. `--optimizer_state=false` converts the parameters only.

t5x_lite -> T5X (the newest intact step of a t5x_lite checkpoint root, or --step):

  python tools/convert_t5x_checkpoint.py --direction=to_t5x \
      --checkpoint_dir=runs/quickstart/checkpoints --output_dir=/tmp/t5x_model_dir

writes `<output_dir>/checkpoint_<step>/` in T5X's default orbax layout (`--t5x_format=
legacy`: the msgpack one), with the Adafactor state of a training checkpoint carried
over, or T5X's fresh (zero) Adafactor state for a params-only checkpoint or with
--optimizer_state=false. T5X restores it with `--gin.MODEL_DIR`/`RestoreCheckpointConfig.
path` pointing there, its model built from the matching T5X gin file.

A bad input (not a T5X checkpoint, a parameter missing or shaped unlike the config,
an optimizer state that cannot be carried exactly) is one `ERROR: <message>` line on
stderr with exit status 1.
"""

from __future__ import annotations

from t5x_lite.core import console

if __name__ == "__main__":  # first, before TensorFlow and JAX load (logged later)
  console.quiet_startup(import_tensorflow=False)  # environment defaults

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import gin
import jax
import numpy as np
from absl import app, flags
from flax import linen as nn

from t5x_lite.core import gin_config
from t5x_lite.nn import network
from t5x_lite.checkpoint import checkpoints
from t5x_lite.training import optimizers, partitioning
from t5x_lite.interop import t5x
from t5x_lite.core.errors import ConfigError
from t5x_lite.core.paths import not_a_directory

_DIRECTION = flags.DEFINE_enum(
  "direction", "from_t5x", ["from_t5x", "to_t5x"], "Convert T5X -> t5x_lite or back."
)
_T5X_CHECKPOINT = flags.DEFINE_string(
  "t5x_checkpoint", None, "from_t5x: T5X checkpoint_<step> directory or model_dir."
)
_CHECKPOINT_DIR = flags.DEFINE_string("checkpoint_dir", None, "to_t5x: t5x_lite checkpoint root.")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Output directory.", required=True)
_STEP = flags.DEFINE_integer("step", None, "Step to convert (default: the newest).")
_OPTIMIZER_STATE = flags.DEFINE_bool(
  "optimizer_state", True, "Carry Adafactor's second moments over (when the input has them)."
)
_T5X_FORMAT = flags.DEFINE_enum(
  "t5x_format", "orbax", ["orbax", "legacy"], "to_t5x: T5X checkpoint layout to write."
)
_T5X_LAYOUT = flags.DEFINE_enum(
  "t5x_layout",
  "auto",
  ["auto", "unscanned", "scanned"],
  "to_t5x: parameter layout; 'scanned' is flaxformer's scan_layers=True (layers on axis 1, "
  "a relative position bias per layer); auto: scanned iff T5Config.relpos_bias_per_layer.",
)
_MIN_DIM = flags.DEFINE_integer(
  "min_dim_size_to_factor",
  t5x.T5X_MIN_DIM_SIZE_TO_FACTOR,
  "to_t5x: T5X Adafactor's min_dim_size_to_factor (which parameters it factors).",
)


def _config(fields: dict[str, Any]) -> network.T5Config:
  """T5Config from `fields`, `T5Config.*` gin bindings winning; dropout 0 unless bound."""
  bound = gin.get_bindings(network.T5Config)
  fields = {"dropout_rate": 0.0, **fields}
  return network.T5Config(**{k: v for k, v in fields.items() if k not in bound})


def _adafactor(config: network.T5Config) -> optimizers.Optimizer:
  """`optimizers.adafactor` as gin configures it, for `config`'s parameter axes."""
  boxed = jax.eval_shape(
    functools.partial(network.init_params, dataclasses.replace(config, scan_layers=False)),
    jax.ShapeDtypeStruct((2,), np.uint32),
  )
  # The schedule's value is not state; only its step count is.
  return optimizers.adafactor(learning_rate=1.0).with_param_axes(nn.get_partition_spec(boxed))


def from_t5x(path: str, output_dir: str, step: int | None, optimizer_state: bool) -> None:
  """Converts one T5X step into a t5x_lite checkpoint root."""
  if problem := not_a_directory("--output_dir", output_dir):
    raise ConfigError(problem)
  step_dir = t5x.find_step_dir(path, step)
  params, param_states, number = t5x.read_state(step_dir)
  config = _config(t5x.config_fields(params))
  ours = t5x.params_from_t5x(params, config)
  opt_state = None
  if optimizer_state and param_states:
    init = _adafactor(config).init(ours)
    opt_state = t5x.opt_state_from_t5x(param_states, number, config, init)
  written = checkpoints.write_params_checkpoint(
    output_dir, ours, step=number, config=dataclasses.asdict(config), opt_state=opt_state
  )
  carried = "params and Adafactor state" if opt_state is not None else "params"
  print(f"Wrote {written} ({carried}) from {step_dir}")


def to_t5x(checkpoint_dir: str, output_dir: str, step: int | None, optimizer_state: bool) -> None:
  """Converts one step of a t5x_lite checkpoint root into a T5X checkpoint."""
  if problem := not_a_directory("--output_dir", output_dir):
    raise ConfigError(problem)
  [(number, step_dir)] = checkpoints.find_steps(
    checkpoint_dir, step="newest" if step is None else step
  )
  config = checkpoints.model_config(step_dir)
  if config.architecture != "encoder_decoder" or config.share_encoder_decoder:
    raise ConfigError(
      f"{step_dir} holds a {config.architecture} model"
      f"{' with shared encoder-decoder layers' if config.share_encoder_decoder else ''}; "
      "the T5X conversion covers T5's plain encoder-decoder only"
    )
  if config.scan_layers:
    raise ConfigError(
      f"{step_dir} holds scanned layers; T5X's unscanned layout needs an unscanned checkpoint "
      "(fine-tune or convert it with T5Config.scan_layers=False first)"
    )
  abstract, _ = partitioning.Partitioner().abstract_params(
    functools.partial(network.init_params, config)
  )
  params = checkpoints.restore_params(step_dir, abstract, verify_checksums=False)
  scanned = _T5X_LAYOUT.value == "scanned" or (
    _T5X_LAYOUT.value == "auto" and config.relpos_bias_per_layer
  )
  if scanned and not config.relpos_bias_per_layer:
    raise ConfigError(
      "--t5x_layout=scanned needs a relative position bias per layer (flaxformer's scanned T5 "
      f"has one); {step_dir} has one per stack (T5Config.relpos_bias_per_layer=False)"
    )
  t5x_params = t5x.params_to_t5x(params, config, scanned)
  has_state = (step_dir / checkpoints.OPT_STATE).is_dir()
  if optimizer_state and has_state:
    target = jax.eval_shape(_adafactor(config).init, abstract)
    opt_state = checkpoints.restore_item(
      step_dir / checkpoints.OPT_STATE, target, checkpoints.OPT_STATE
    )
    states = t5x.opt_state_to_t5x(opt_state, config, _MIN_DIM.value, scanned)
  else:
    states = t5x.fresh_t5x_param_states(config, _MIN_DIM.value, scanned)
  written = t5x.write_checkpoint(
    output_dir, t5x_params, states, number, legacy=_T5X_FORMAT.value == "legacy"
  )
  carried = "Adafactor state carried" if optimizer_state and has_state else "fresh Adafactor state"
  print(f"Wrote {written} ({carried}) from {step_dir}")


def main(argv: Sequence[str]) -> None:
  """Parses flags and runs the requested conversion."""
  console.quiet_library_logs()
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  gin_config.parse_gin_flags()  # T5Config.* overrides, adafactor.* settings
  if _DIRECTION.value == "from_t5x":
    if not _T5X_CHECKPOINT.value:
      raise app.UsageError("--direction=from_t5x needs --t5x_checkpoint.")
    from_t5x(_T5X_CHECKPOINT.value, _OUTPUT_DIR.value, _STEP.value, _OPTIMIZER_STATE.value)
    return
  if not _CHECKPOINT_DIR.value:
    raise app.UsageError("--direction=to_t5x needs --checkpoint_dir.")
  to_t5x(_CHECKPOINT_DIR.value, _OUTPUT_DIR.value, _STEP.value, _OPTIMIZER_STATE.value)


if __name__ == "__main__":
  gin_config.run_app(main)
