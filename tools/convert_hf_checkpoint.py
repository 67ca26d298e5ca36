r"""Converts between HF transformers T5 checkpoints and t5x_lite orbax checkpoints.

HF -> t5x_lite (the output is a checkpoint root that fine-tuning, eval and infer
restore; step 0 holds the item `params` and the item `config`):

  python tools/convert_hf_checkpoint.py --hf_dir=/path/t5-v1_1-small \
      --output_dir=/tmp/t5_1_1_small_ckpt

t5x_lite -> HF (reads the newest intact step's `params`; the model config is the
one the checkpoint stores (`t5x_lite.checkpoint.checkpoints.model_config`), and `T5Config.*`
bindings of --gin_file / --gin_bindings override it field by field, so a
checkpoint without a stored config converts with its model's gin file):

  python tools/convert_hf_checkpoint.py --direction=to_hf \
      --checkpoint_dir=/tmp/model_dir/checkpoints --output_dir=/tmp/hf_out

Relative paths are relative to the working directory. A bad input (a missing or
unreadable file, an unsupported config, a corrupt checkpoint) is reported as one
`ERROR: <message>` line on stderr with exit status 1. Needs the `hf` extra
(`pip install -e '.[hf]'`: safetensors), and says so when it is missing.

Checkpoint layout (see t5x_lite/checkpoint/checkpoints.py, which reads and restores it):
`<root>/<step>/params` is a StandardSave of the plain parameter tree (no 'params'
wrapper), `<root>/<step>/config` a JsonSave of the `T5Config` fields, and
`<root>/<step>/files.json` the integrity manifest.
"""

from __future__ import annotations

from t5x_lite.core import console

if __name__ == "__main__":  # first, before TensorFlow and JAX load (logged later)
  console.quiet_startup(import_tensorflow=False)  # environment defaults

import dataclasses
import functools
import os
from collections.abc import Sequence

from absl import app, flags

from t5x_lite import models
from t5x_lite.core import errors, gin_config
from t5x_lite.checkpoint import checkpoints
from t5x_lite.training import partitioning
from t5x_lite.interop import hf
from t5x_lite.core.errors import ConfigError
from t5x_lite.core.paths import absolute_path, not_a_directory

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


def hf_to_orbax(hf_dir: str, output_dir: str, scan_layers: bool, param_dtype: str | None) -> None:
  """Converts an HF T5 directory into a step-0 t5x_lite checkpoint root."""
  if problem := not_a_directory("--output_dir", output_dir):
    raise ConfigError(problem)
  config, params = hf.load_hf(
    os.fspath(absolute_path(hf_dir)), scan_layers=scan_layers, param_dtype=param_dtype
  )
  step_dir = checkpoints.write_params_checkpoint(
    output_dir, params, step=0, config=dataclasses.asdict(config)
  )
  print(f"Wrote {step_dir}")


def orbax_to_hf(checkpoint_dir: str, output_dir: str, step: int | None) -> None:
  """Converts one step of a t5x_lite checkpoint root into an HF T5 directory.

  Args:
    checkpoint_dir: orbax checkpoint root or step directory.
    output_dir: HF output directory.
    step: step to convert; None converts the newest intact one.

  The model config is the checkpoint's (`checkpoints.model_config`), with any
  `T5Config.*` gin bindings overriding it field by field.
  """
  if problem := not_a_directory("--output_dir", output_dir):
    raise ConfigError(problem)
  [(_, step_dir)] = checkpoints.find_steps(checkpoint_dir, step="newest" if step is None else step)
  config = checkpoints.model_config(step_dir)
  hf.config_to_hf(config)  # raises for a network HF has no equivalent of
  abstract, _ = partitioning.Partitioner().abstract_params(
    functools.partial(models.init_params, config)
  )
  # find_steps verified the files already.
  params = checkpoints.restore_params(step_dir, abstract, verify_checksums=False)
  output_dir = os.fspath(absolute_path(output_dir))
  hf.save_hf(config, params, output_dir)
  print(f"Wrote {output_dir} from {step_dir}")


def main(argv: Sequence[str]) -> None:
  """Parses flags and runs the requested conversion."""
  console.quiet_library_logs()
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  errors.require_extra("hf", ("safetensors",), "tools/convert_hf_checkpoint.py")
  if _DIRECTION.value == "from_hf":
    if not _HF_DIR.value:
      raise app.UsageError("--direction=from_hf needs --hf_dir.")
    hf_to_orbax(_HF_DIR.value, _OUTPUT_DIR.value, _SCAN_LAYERS.value, _PARAM_DTYPE.value)
    return
  if not _CHECKPOINT_DIR.value:
    raise app.UsageError("--direction=to_hf needs --checkpoint_dir.")
  gin_config.parse_gin_flags()  # model gin files: T5Config.* overrides
  orbax_to_hf(_CHECKPOINT_DIR.value, _OUTPUT_DIR.value, _STEP.value)


if __name__ == "__main__":
  gin_config.run_app(main)
