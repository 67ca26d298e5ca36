r"""Converts between HF transformers T5 checkpoints and t5x_lite orbax checkpoints.

HF -> t5x_lite (the output is a checkpoint root that fine-tuning, eval and infer
restore; step 0 holds the item `params` and the item `config`):

  python tools/convert_hf_checkpoint.py --hf_dir=/path/t5-v1_1-small \
      --output_dir=/tmp/t5_1_1_small_ckpt

t5x_lite -> HF (reads the latest step's `params`; the model config comes from the
checkpoint's `config` item or, for training checkpoints, `train_meta`'s
`model_config`, and from --gin_file only when the checkpoint stores none):

  python tools/convert_hf_checkpoint.py --direction=to_hf \
      --checkpoint_dir=/tmp/model_dir/checkpoints --output_dir=/tmp/hf_out

Relative paths are relative to the working directory. A bad input (a missing or
unreadable file, an unsupported config, a corrupt checkpoint) is reported as one
`ERROR: <message>` line on stderr with exit status 1.

Checkpoint layout (see t5x_lite/checkpoints.py, which writes and restores it):
`<root>/<step>/params` is a StandardSave of the plain parameter tree (no 'params'
wrapper), `<root>/<step>/config` a JsonSave of the `T5Config` fields, and
`<root>/<step>/files.json` the integrity manifest.
"""

from __future__ import annotations

from t5x_lite import console  # first: quiets TensorFlow and JAX start-up

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import app, flags
from etils import epath

from t5x_lite import checkpoints, errors, hf_interop
from t5x_lite.checkpoint_manifest import absolute_path, not_a_directory
from t5x_lite.errors import ConfigError
from t5x_lite.network import T5Config, Transformer

_DIRECTION = flags.DEFINE_enum(
  "direction", "from_hf", ["from_hf", "to_hf"], "Convert HF -> orbax or orbax -> HF."
)
_HF_DIR = flags.DEFINE_string("hf_dir", None, "from_hf: HF T5ForConditionalGeneration directory.")
_CHECKPOINT_DIR = flags.DEFINE_string("checkpoint_dir", None, "to_hf: orbax checkpoint root.")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Output directory.", required=True)
_STEP = flags.DEFINE_integer(
  "step", None, "to_hf: step to convert (default: the newest intact one)."
)
_SCAN_LAYERS = flags.DEFINE_bool(
  "scan_layers", False, "from_hf: store the stacked (scan_layers=True) parameter layout."
)
_PARAM_DTYPE = flags.DEFINE_string(
  "param_dtype", None, "from_hf: cast params to this dtype (default: keep the HF dtype)."
)
_GIN_FILES = flags.DEFINE_multi_string(
  "gin_file",
  [],
  "to_hf: model gin file(s) binding T5Config.*, used when the checkpoint stores no model config.",
)
_GIN_BINDINGS = flags.DEFINE_multi_string(
  "gin_bindings", [], "to_hf: extra gin bindings ('T5Config.NAME = VALUE')."
)
# The same defaults as t5x_lite.cli, which is not imported because it pulls in seqio
# (and TensorFlow), which a conversion does not need.
_REPO_GIN_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gin")
_GIN_SEARCH_PATHS = flags.DEFINE_list(
  "gin_search_paths",
  [".", _REPO_GIN_DIR, os.path.join(_REPO_GIN_DIR, "models")],
  "Directories searched for --gin_file and gin `include`s.",
)

# Where training checkpoints (t5x_lite.train_lib) keep the T5Config fields.
TRAIN_META_CONFIG_KEY = "model_config"


def _read_json_item(item_dir: epath.Path) -> Any:
  """Restores one JsonSave item directory."""
  with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as checkpointer:
    return checkpointer.restore(item_dir, args=ocp.args.JsonRestore())


def read_stored_config(step_dir: epath.Path) -> T5Config | None:
  """The model config stored in a step directory, or None if it has none.

  Looks at the `config` item (HF conversions) and then at `model_config` in the
  `train_meta` item (training checkpoints).
  """
  if (step_dir / checkpoints.CONFIG).is_dir():
    fields = _read_json_item(step_dir / checkpoints.CONFIG)
  elif (step_dir / checkpoints.TRAIN_META).is_dir():
    fields = _read_json_item(step_dir / checkpoints.TRAIN_META).get(TRAIN_META_CONFIG_KEY)
  else:
    fields = None
  # T5Config turns the JSON list of activations back into a tuple.
  return None if fields is None else T5Config(**fields)


def abstract_params(config: T5Config) -> Any:
  """Plain abstract params of the network, on the first local device."""
  tokens = jnp.ones((1, 1), jnp.int32)  # [batch, length]
  variables = jax.eval_shape(
    lambda: Transformer(config).init(
      {"params": jax.random.key(0), "dropout": jax.random.key(0)},
      tokens,
      tokens,
      tokens,
      enable_dropout=False,
    )
  )
  sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
    nn.meta.unbox(variables["params"]),
  )


def config_from_gin(
  gin_files: Sequence[str], bindings: Sequence[str], search_paths: Sequence[str]
) -> T5Config:
  """Builds the `T5Config` that the given model gin files bind.

  Raises:
    ConfigError: a missing gin file or a bad binding, on one line.
  """
  for path in search_paths:
    gin.add_config_file_search_path(path)
  try:
    gin.parse_config_files_and_bindings(gin_files, bindings, skip_unknown=True)
    return T5Config()
  except (OSError, SyntaxError, ValueError, TypeError) as e:
    raise ConfigError(" ".join(str(e).split())) from e


def hf_to_orbax(hf_dir: str, output_dir: str, scan_layers: bool, param_dtype: str | None) -> None:
  """Converts an HF T5 directory into a step-0 t5x_lite checkpoint root."""
  if problem := not_a_directory("--output_dir", output_dir):
    raise ConfigError(problem)
  config, params = hf_interop.load_hf(
    os.fspath(absolute_path(hf_dir)), scan_layers=scan_layers, param_dtype=param_dtype
  )
  step_dir = checkpoints.write_params_checkpoint(
    output_dir, params, step=0, config=dataclasses.asdict(config)
  )
  print(f"Wrote {step_dir}")


def orbax_to_hf(
  checkpoint_dir: str, output_dir: str, step: int | None, config: T5Config | None
) -> None:
  """Converts one step of a t5x_lite checkpoint root into an HF T5 directory.

  Args:
    checkpoint_dir: orbax checkpoint root.
    output_dir: HF output directory.
    step: step to convert; None converts the newest intact one.
    config: model config to use when the checkpoint has no `config` item.
  """
  if problem := not_a_directory("--output_dir", output_dir):
    raise ConfigError(problem)
  step_dir = checkpoints.resolve_step_dir(checkpoint_dir, step)
  config = read_stored_config(step_dir) or config
  if config is None:
    raise ConfigError(f"{step_dir} stores no model config: pass the model's --gin_file.")
  # resolve_step_dir verified the files already.
  params = checkpoints.restore_params(step_dir, abstract_params(config), verify_checksums=False)
  output_dir = os.fspath(absolute_path(output_dir))
  hf_interop.save_hf(config, params, output_dir)
  print(f"Wrote {output_dir} from {step_dir}")


def main(argv: Sequence[str]) -> None:
  """Parses flags and runs the requested conversion."""
  console.quiet_library_logs()
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if _DIRECTION.value == "from_hf":
    if not _HF_DIR.value:
      raise app.UsageError("--direction=from_hf needs --hf_dir.")
    hf_to_orbax(_HF_DIR.value, _OUTPUT_DIR.value, _SCAN_LAYERS.value, _PARAM_DTYPE.value)
    return
  if not _CHECKPOINT_DIR.value:
    raise app.UsageError("--direction=to_hf needs --checkpoint_dir.")
  config = None
  if _GIN_FILES.value or _GIN_BINDINGS.value:
    config = config_from_gin(_GIN_FILES.value, _GIN_BINDINGS.value, _GIN_SEARCH_PATHS.value)
  orbax_to_hf(_CHECKPOINT_DIR.value, _OUTPUT_DIR.value, _STEP.value, config)


if __name__ == "__main__":
  app.run(errors.reporting(main))
