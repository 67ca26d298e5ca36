r"""Lists registered seqio tasks/mixtures or shows a few examples at each stage.

  python tools/show_task.py --list
  python tools/show_task.py quickstart --num_examples 2 \
      --sequence_length inputs=128,targets=32 [--split validation]

For a task it prints, per example: the raw record from the data source, the
preprocessed text (the *_pretokenized features), the token ids with their
pieces, and then the batch the model sees after
`EncDecFeatureConverter(pack=True)` (`DecoderFeatureConverter` for a task with
targets alone): seqio's, as training builds them (`t5x_lite.data.packing`). For
a mixture it first prints each task's sampling rate, then the mixed examples.
Last, per task and feature, how many of the first --truncation_examples examples
of the split are longer than --sequence_length and would be truncated. Your own task modules can be
loaded with --module_import=my_tasks or a gin file that does `import my_tasks`;
--gin_bindings set e.g. the data directory: "local_data_dir.path = '/data'".
"""

from t5x_lite.core import console

if __name__ == "__main__":  # first, before TensorFlow and JAX load (logged later)
  console.quiet_startup()  # environment defaults, TensorFlow imported quietly

from collections.abc import Mapping, Sequence

import numpy as np
import seqio
import tensorflow as tf
from absl import app, flags, logging

from t5x_lite import cli
from t5x_lite.data import mixing, packing, pipeline
from t5x_lite.core.errors import ConfigError

_LIST = flags.DEFINE_bool("list", False, "Print every registered task and mixture, one a line.")
_NUM_EXAMPLES = flags.DEFINE_integer("num_examples", 2, "Examples to show per stage.")
_SPLIT = flags.DEFINE_string("split", "train", "Split to read.")
_SEQUENCE_LENGTH = flags.DEFINE_string(
  "sequence_length", "inputs=128,targets=32", "Task feature lengths, e.g. inputs=512,targets=114."
)
_SEED = flags.DEFINE_integer("seed", 0, "Seed for preprocessing randomness.")
_TRUNCATION_EXAMPLES = flags.DEFINE_integer(
  "truncation_examples",
  pipeline.TRUNCATION_SAMPLE,
  "Examples per task (the first ones of --split) checked for truncation; 0 skips the check.",
)


def parse_sequence_length(text: str) -> dict[str, int]:
  """'inputs=128,targets=32' -> {'inputs': 128, 'targets': 32}.

  Raises:
    ConfigError: for an item that is not name=int.
  """
  lengths = {}
  for item in filter(None, text.split(",")):
    key, sep, value = item.partition("=")
    if not sep or not value.strip().isdigit():
      raise ConfigError(f"Bad --sequence_length item {item!r}; expected name=int.")
    lengths[key.strip()] = int(value)
  return lengths


def _format_value(value, vocabulary) -> str:
  if isinstance(value, bytes):
    return repr(value.decode("utf-8", errors="replace"))
  value = np.asarray(value)
  if value.dtype.kind in "iu" and value.ndim == 1 and vocabulary is not None:
    return f"{value.tolist()}\n      pieces: {token_pieces(value, vocabulary)}"
  return str(value.tolist() if value.ndim else value)


def token_pieces(ids: Sequence[int], vocabulary: seqio.Vocabulary) -> list[str]:
  """Each id as its piece; sentinels as <extra_id_k>, special ids as <pad>/<eos>."""
  base = vocabulary.vocab_size - vocabulary.extra_ids
  # SentencePiece pieces show word starts ("▁the"); a DeferredVocabulary resolves first.
  tokenizer = getattr(getattr(vocabulary, "resolved", vocabulary), "tokenizer", None)
  pieces = []
  for i in map(int, ids):
    if i >= base:
      pieces.append(f"<extra_id_{vocabulary.vocab_size - 1 - i}>")
    elif i == vocabulary.pad_id:
      pieces.append("<pad>")
    elif i == vocabulary.eos_id:
      pieces.append("<eos>")
    elif tokenizer is not None:
      pieces.append(tokenizer.id_to_piece(i))
    else:
      pieces.append(str(vocabulary.decode([i])))
  return pieces


def _print_examples(title: str, ds: tf.data.Dataset, n: int, features: Mapping) -> None:
  print(f"== {title}")
  for index, example in enumerate(ds.take(n).as_numpy_iterator()):
    print(f"  -- example {index}")
    for key in sorted(example):
      feature = features.get(key.removesuffix("_pretokenized"))
      vocabulary = (
        feature.vocabulary if feature is not None and not key.endswith("_pretokenized") else None
      )
      print(f"    {key}: {_format_value(example[key], vocabulary)}")


def _print_truncation(name: str, split: str, lengths: Mapping[str, int], seed: int, n: int) -> None:
  """Prints `pipeline.truncation_report` of the first `n` examples per task."""
  config = pipeline.DatasetConfig(name, dict(lengths), batch_size=1, split=split, seed=seed)
  print(
    f"== truncation at --sequence_length (the first {n} examples of each task's "
    f"{split!r} split, or all if fewer)"
  )
  for per_feature in pipeline.truncation_report(config, n).values():
    for truncation in per_feature.values():
      print(f"  {truncation}")


def show(
  name: str,
  num_examples: int,
  split: str,
  lengths: Mapping[str, int],
  seed: int,
  truncation_examples: int = pipeline.TRUNCATION_SAMPLE,
) -> None:
  """Prints the stages of `name` (task or mixture) for `num_examples` examples.

  Then, unless `truncation_examples` is 0, how many of that many examples per
  task are longer than `lengths`.

  Raises:
    ConfigError: for an unknown name, or a preprocessor that asks for a
      feature its input lacks.
  """
  provider = pipeline.get_mixture_or_task(name)
  if split not in provider.splits:
    raise ConfigError(f"{name} has no split {split!r}; it has {sorted(provider.splits)}.")
  with pipeline.naming_failing_task(name, split, lengths, seed):
    _show_stages(provider, num_examples, split, lengths, seed)
  if truncation_examples:
    _print_truncation(name, split, lengths, seed, truncation_examples)


def _show_stages(
  provider: seqio.Task | seqio.Mixture,
  num_examples: int,
  split: str,
  lengths: Mapping[str, int],
  seed: int,
) -> None:
  """Prints raw records (tasks), mixing rates (mixtures), preprocessed and packed examples."""
  name = provider.name
  features = provider.output_features
  if isinstance(provider, seqio.Mixture):
    print(f"== mixture {name}: sampling rates")
    for task_name, rate in mixing.normalized_rates(provider).items():
      print(f"  {task_name}: {rate:.4f}")
    mixed = provider.get_dataset(lengths, split=split, shuffle=False, seed=seed)
  else:
    raw = provider.source.get_dataset(split=split, shuffle=False)
    _print_examples(f"raw records ({name}, {split})", raw, num_examples, {})
    mixed = provider.get_dataset(lengths, split=split, shuffle=False, seed=seed)
  _print_examples("preprocessed text and tokens", mixed, num_examples, features)
  # A task with targets alone (the `lm` objective) feeds decoder-only models only.
  converter_cls = packing.EncDecFeatureConverter
  if "inputs" not in features:
    converter_cls = packing.DecoderFeatureConverter
    lengths = {"targets": lengths["targets"]}
  packed = converter_cls(pack=True)(mixed, task_feature_lengths=lengths)
  model_features = {
    k: seqio.Feature(features["targets"].vocabulary)
    for k in ("encoder_input_tokens", "decoder_target_tokens")
    if k in packed.element_spec
  }
  stage = f"after {converter_cls.__name__}(pack=True)"
  _print_examples(stage, packed, num_examples, model_features)


def main(argv: Sequence[str]) -> None:
  import tasks  # noqa: F401  (registers the built-in tasks)

  logging.set_verbosity(logging.WARNING)

  # The entry points' --module_import/--gin_file/--gin_bindings/--tfds_data_dir/--data_dir.
  cli.setup()
  if _LIST.value:
    print("\n".join(pipeline.registered_names()))
    return
  if len(argv) != 2:
    raise app.UsageError("Give one task or mixture name (or --list).")
  show(
    argv[1],
    _NUM_EXAMPLES.value,
    _SPLIT.value,
    parse_sequence_length(_SEQUENCE_LENGTH.value),
    _SEED.value,
    _TRUNCATION_EXAMPLES.value,
  )


if __name__ == "__main__":
  cli.run(main)
