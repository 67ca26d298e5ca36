r"""Trains a SentencePiece vocabulary with T5's ids (pad 0, eos 1, unk 2, no bos).

From text files (one example per non-empty line, .gz ok):

  python tools/train_vocab.py --input_files=corpus1.txt,corpus2.txt.gz \
      --vocab_size=32000 --output=/tmp/my_spm.model

From a registered seqio task's raw text field:

  python tools/train_vocab.py --task=local_glue_sst2 --text_field=sentence \
      --gin_bindings="local_data_dir.path = '/data'" --vocab_size=8000 --output=/tmp/sst2.model

Use the result with `seqio.SentencePieceVocabulary(path, extra_ids=100)`, or
for every task with the gin binding
`get_vocabulary.sentencepiece_model_file = '/tmp/my_spm.model'`.
Training is single-threaded and reads text in order, so it is reproducible.
Relative paths are relative to the working directory. A bad input (a missing file,
an unknown task or field, a vocabulary too large for the text) is reported as one
`ERROR: <message>` line on stderr with exit status 1.
"""

from t5x_lite.core import console

if __name__ == "__main__":  # first, before TensorFlow and JAX load (logged later)
  console.quiet_startup()  # environment defaults, TensorFlow imported quietly

import itertools
import os
from collections.abc import Iterator, Sequence

import gin
import seqio
import tensorflow as tf
from absl import app, flags

from t5x_lite.core import cache, errors
from t5x_lite.data import file_sources, pipeline, vocab
from t5x_lite.core.paths import absolute_path, not_a_directory, shown
from t5x_lite.core.errors import ConfigError

_INPUT_FILES = flags.DEFINE_list("input_files", [], "Text files, one example per line.")
_TASK = flags.DEFINE_string("task", None, "A registered seqio task to read text from.")
_TEXT_FIELD = flags.DEFINE_string("text_field", "text", "The task source's raw text feature.")
_SPLIT = flags.DEFINE_string("split", "train", "The task split to read.")
_MAX_EXAMPLES = flags.DEFINE_integer("max_examples", None, "Read at most this many examples.")
_VOCAB_SIZE = flags.DEFINE_integer("vocab_size", 8000, "Pieces, including pad/eos/unk.")
_MODEL_TYPE = flags.DEFINE_enum(
  "model_type", "unigram", ["unigram", "bpe"], "SentencePiece model type."
)
_CHARACTER_COVERAGE = flags.DEFINE_float("character_coverage", 1.0, "Character coverage.")
_OUTPUT = flags.DEFINE_string("output", None, "Output .model file.", required=True)
_MODULE_IMPORT = flags.DEFINE_multi_string("module_import", [], "Modules that register tasks.")
_GIN_BINDINGS = flags.DEFINE_multi_string("gin_bindings", [], "Gin bindings (e.g. the data dir).")


def file_text(paths: Sequence[str]) -> Iterator[str]:
  """Non-empty lines of the files, in order.

  Raises:
    file_sources.DataFileError: naming the first file that does not exist.
  """
  for path in paths:
    if not tf.io.gfile.exists(path):
      raise file_sources.DataFileError(f"--input_files: {shown(path)} not found.")
  for path in paths:
    for _, line in file_sources.numbered_lines(path):
      if line.strip():
        yield line


def task_text(task_name: str, text_field: str, split: str) -> Iterator[str]:
  """The raw `text_field` of a task's source, unshuffled.

  Raises:
    ConfigError: naming an unknown task, split or field.
  """
  if task_name not in seqio.TaskRegistry.names():
    raise ConfigError(
      f"--task={task_name} is not a registered seqio task (register it in a "
      "module given with --module_import)."
    )
  task = seqio.TaskRegistry.get(task_name)
  if split not in task.splits:
    raise ConfigError(f"Task {task_name} has no split {split!r} (has {list(task.splits)}).")
  ds = task.source.get_dataset(split=split, shuffle=False)
  for example in ds.as_numpy_iterator():
    if text_field not in example:
      raise ConfigError(
        f"Task {task_name} has no raw field {text_field!r}; it has {sorted(example)}."
      )
    yield example[text_field].decode("utf-8")


def _check_output(path: str) -> str:
  """The absolute output path; raises ConfigError if it cannot be written."""
  if os.path.isdir(path):
    raise ConfigError(f"--output={shown(path)} is a directory, not a file.")
  if problem := not_a_directory("The directory of --output", os.path.dirname(path) or "."):
    raise ConfigError(problem)
  return os.fspath(absolute_path(path))


def _task_setup() -> None:
  """Registers the built-in tasks and --module_import's, then parses --gin_bindings."""
  import tasks  # noqa: F401  (registers the built-in tasks)

  pipeline.import_task_modules(_MODULE_IMPORT.value)
  try:
    gin.parse_config(_GIN_BINDINGS.value)
  except (SyntaxError, ValueError) as e:
    raise ConfigError(f"--gin_bindings: {' '.join(str(e).split())}") from e


def _train(text: Iterator[str]) -> bytes:
  """Trains on `text`; an error reading it is re-raised as itself.

  Raises:
    ConfigError: SentencePiece refused the options, e.g. a vocabulary too large
      for the text.
  """
  read_errors = []

  def read() -> Iterator[str]:
    try:
      yield from text
    except Exception as e:  # SentencePiece would turn it into a RuntimeError
      read_errors.append(e)
      raise

  try:
    return vocab.train_sentencepiece(
      read(),
      vocab_size=_VOCAB_SIZE.value,
      model_type=_MODEL_TYPE.value,
      character_coverage=_CHARACTER_COVERAGE.value,
    )
  except RuntimeError as e:
    if read_errors:
      raise read_errors[0] from None
    raise ConfigError(f"SentencePiece training failed: {e}") from e


def main(argv: Sequence[str]) -> None:
  console.quiet_library_logs()
  del argv
  if bool(_INPUT_FILES.value) == bool(_TASK.value):
    raise app.UsageError("Give exactly one of --input_files and --task.")
  output = _check_output(_OUTPUT.value)
  if _TASK.value:
    _task_setup()
    text = task_text(_TASK.value, _TEXT_FIELD.value, _SPLIT.value)
  else:
    text = file_text(_INPUT_FILES.value)
  model = _train(itertools.islice(text, _MAX_EXAMPLES.value))
  cache.atomic_write(output, model)
  size = seqio.SentencePieceVocabulary(output, extra_ids=vocab.NUM_EXTRA_IDS).vocab_size
  print(f"Wrote {output}: {_VOCAB_SIZE.value} pieces, {size} ids with 100 extra ids.")


if __name__ == "__main__":
  app.run(errors.reporting(main))
