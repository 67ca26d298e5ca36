"""Batch inference for `python -m t5x_lite.infer`: inputs -> predictions or scores as JSONL.

Inputs, one of:

* `input_file`: `.jsonl` (one JSON object per line with a string field `inputs`,
  optionally `targets`) or `.tsv` (a header row naming an `inputs` column,
  optionally `targets`). The text goes to the model as written (no task
  preprocessing): tokenized with the configured vocabulary, truncated to
  `task_feature_lengths['inputs'] - 1` tokens, EOS appended.
* `mixture_or_task_name` + `split`: the task's preprocessed examples, in order
  (the split is read into memory).

Output: `output_file`, one JSON object per input line, in input order:

  mode 'predict': {"input": str, "prediction": str, "score": float[, "target": str]}
                  score = the decode's log-probability (beam: length-penalised)
  mode 'score':   {"input": str, "target": str, "score": float}
                  score = sum of the target's token log-likelihoods

Relative paths (checkpoint, input and output files) are relative to the working
directory. A checkpoint root (MODEL_DIR) is read at its newest intact step: corrupt
newer steps are skipped with a warning naming the bad file.

Resuming: lines already in `output_file` are kept and only the missing ones are
computed and appended (a partly written last line is dropped first), so a re-run
after an interruption is cheap. The last kept line must belong to the same input,
else the run stops instead of mixing two input files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import gin
import jax
import numpy as np
import seqio
import tqdm
from absl import logging

from t5x_lite import base_model, models
from t5x_lite.data import file_sources, pipeline
from t5x_lite.checkpoint import checkpoints, stored_vocabulary
from t5x_lite.training import partitioning
from t5x_lite.run import model_runner
from t5x_lite.core.paths import not_a_directory, not_writable, shown
from t5x_lite.core.errors import ConfigError, WriteError
from t5x_lite.core.types import GIN_REQUIRED

MODES = ("predict", "score")


@dataclasses.dataclass(frozen=True)
class Example:
  """One input: its text, optional target text and their token ids (EOS included)."""

  input_text: str
  target_text: str | None
  input_ids: np.ndarray
  target_ids: np.ndarray | None


# ------------------------------------------------------------------ reading inputs


def _jsonl_has_targets(path: str) -> bool:
  """Whether the first non-empty line of a JSONL file is an object with `targets`."""
  for _, line in file_sources.numbered_lines(path):
    if line.strip():
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        return False  # read_jsonl reports the line
      return isinstance(record, dict) and "targets" in record
  return False


def read_input_file(path: str) -> tuple[list[str], list[str] | None]:
  """(inputs, targets or None) of a `.jsonl` or `.tsv` file.

  Raises:
    file_sources.DataFileError: naming a missing file, `file:line` of a malformed
      line, or the file when it has no `inputs` field/column.
  """
  if not os.path.isfile(path):
    what = "is a directory" if os.path.isdir(path) else "does not exist"
    raise file_sources.DataFileError(f"Input file {what}: {shown(path)}")
  if path.endswith((".jsonl", ".json")):
    fields = {"inputs": "inputs"}
    if _jsonl_has_targets(path):
      fields["targets"] = "targets"
    columns = file_sources.read_jsonl(path, fields)
  elif path.endswith(".tsv"):
    columns = file_sources.read_tsv(path)
    if "inputs" not in columns:
      raise file_sources.DataFileError(
        f"{path}: the header row needs an 'inputs' column, got {sorted(columns)}."
      )
  else:
    raise file_sources.DataFileError(f"{path}: expected a .jsonl or .tsv input file.")
  # Strings only: read_jsonl joins lists unless a field's list policy is 'all'.
  return columns["inputs"], columns.get("targets")  # pyright: ignore[reportReturnType]


def encode_text(vocabulary: seqio.Vocabulary, text: str, length: int) -> np.ndarray:
  """Token ids of `text` truncated to length - 1, then EOS (seqio append_eos_after_trim)."""
  ids = list(vocabulary.encode(text))[: length - 1] + [vocabulary.eos_id]
  return np.asarray(ids, np.int32)


def file_examples(
  path: str, model: base_model.BaseModel, lengths: Mapping[str, int]
) -> list[Example]:
  """Tokenized examples of an input file (see `read_input_file`)."""
  inputs, targets = read_input_file(path)
  targets = targets if targets is not None else [None] * len(inputs)
  return [
    Example(
      text,
      target,
      encode_text(model.input_vocabulary, text, lengths["inputs"]),
      None if target is None else encode_text(model.output_vocabulary, target, lengths["targets"]),
    )
    for text, target in zip(inputs, targets)
  ]


def _text(example: Mapping[str, Any], feature: str, vocabulary: seqio.Vocabulary) -> str:
  """The pretokenized text of a task feature, else its decoded tokens."""
  raw = example.get(f"{feature}_pretokenized")
  if raw is not None:
    return raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
  return vocabulary.decode(example[feature].tolist())


def task_examples(name: str, split: str, lengths: Mapping[str, int]) -> list[Example]:
  """The preprocessed examples of a task split, in order.

  Raises:
    ConfigError: for an unknown name, a mixture (infer runs one task), a split the
      task lacks, or a preprocessor asking for a feature the task's data lacks.
  """
  task = pipeline.get_mixture_or_task(name)
  if isinstance(task, seqio.Mixture):
    raise ConfigError(
      f"{name} is a mixture; infer runs one task, e.g. one of {sorted(t.name for t in task.tasks)}."
    )
  if split not in task.splits:
    raise ConfigError(f"Task {name} has no split {split!r} (has {list(task.splits)}).")
  features = task.output_features
  with pipeline.naming_failing_task(name, split, lengths):
    dataset = task.get_dataset(
      sequence_length=dict(lengths), split=split, shuffle=False, num_epochs=1
    )
  return [
    Example(
      _text(ex, "inputs", features["inputs"].vocabulary),
      _text(ex, "targets", features["targets"].vocabulary) if "targets" in ex else None,
      ex["inputs"].astype(np.int32),
      ex["targets"].astype(np.int32) if "targets" in ex else None,
    )
    for ex in dataset.as_numpy_iterator()
  ]


def make_batch(
  examples: Sequence[Example], lengths: Mapping[str, int], architecture: str = "encoder_decoder"
) -> dict[str, np.ndarray]:
  """Unpacked model features of `examples`, zero-padded to `lengths`.

  Encoder-decoder: EncDecFeatureConverter's features. Decoder-only and prefix LM:
  PrefixLMFeatureConverter's, inputs and targets concatenated in one row of
  inputs + targets tokens, `decoder_causal_attention` over the inputs and the BOS, loss
  on the targets. Examples without targets get empty targets (decoding only needs
  the length).
  """
  rows, inputs_len, targets_len = len(examples), lengths["inputs"], lengths["targets"]
  decoder_only = architecture != "encoder_decoder"
  encoder = np.zeros((rows, inputs_len), np.int32)  # [rows, inputs_len]
  width = inputs_len + targets_len if decoder_only else targets_len
  targets = np.zeros((rows, width), np.int32)  # [rows, width]
  loss_weights = np.zeros((rows, width), np.int32)  # [rows, width]
  causal = np.zeros((rows, width), np.int32)  # [rows, width]
  for i, ex in enumerate(examples):
    input_ids = ex.input_ids[:inputs_len]
    encoder[i, : len(input_ids)] = input_ids
    start = len(input_ids) if decoder_only else 0
    causal[i, : start + 1] = 1
    target_ids = [] if ex.target_ids is None else ex.target_ids[:targets_len]
    row = np.concatenate([input_ids, target_ids]) if decoder_only else target_ids
    targets[i, : len(row)] = row
    loss_weights[i, start : len(row)] = 1
  decoder_inputs = np.zeros_like(targets)  # [rows, width]: BOS 0, then targets shifted
  decoder_inputs[:, 1:] = targets[:, :-1]
  batch = {
    "decoder_input_tokens": decoder_inputs,
    "decoder_target_tokens": targets,
    "decoder_loss_weights": loss_weights,
  }
  if decoder_only:
    return {**batch, "decoder_causal_attention": causal}
  return {"encoder_input_tokens": encoder, **batch}


# ------------------------------------------------------------------ resumable output


def _input_of(line: str) -> Any:
  """The `input` field of an output line; None when the line is not a JSON object."""
  try:
    record = json.loads(line)
  except json.JSONDecodeError:
    return None
  return record.get("input") if isinstance(record, dict) else None


class ResumableJsonl:
  """An output JSONL file that keeps its complete lines and appends the rest."""

  def __init__(self, path: str, inputs: Sequence[str]):
    """Opens `path`, drops a partly written last line, checks the kept lines.

    Args:
      path: the output file (created with its directory if missing); relative to
        the working directory unless absolute.
      inputs: the input texts, in order; line i must hold `inputs[i]`.

    Raises:
      ConfigError: when the file has more lines than there are inputs, or its last
        line was written for a different input.
    """
    self.path = path = os.path.abspath(path)
    self.done = 0
    last: str | None = None
    if os.path.exists(path):
      with open(path, "rb") as f:
        content = f.read()
      complete = content[: content.rfind(b"\n") + 1]
      if len(complete) != len(content):
        with open(path, "r+b") as f:
          f.truncate(len(complete))
      lines = complete.decode("utf-8").splitlines()
      self.done, last = len(lines), (lines[-1] if lines else None)
    if self.done > len(inputs):
      raise ConfigError(
        f"{path} has {self.done} lines but there are only {len(inputs)} "
        "inputs; was it written for another input?"
      )
    if last is not None and _input_of(last) != inputs[self.done - 1]:
      raise ConfigError(
        f"{path}:{self.done} was written for a different input than "
        f"input {self.done}; use a new output file."
      )
    os.makedirs(os.path.dirname(path), exist_ok=True)
    self._file = open(path, "a", encoding="utf-8") if jax.process_index() == 0 else None

  def append(self, records: Sequence[Mapping[str, Any]]) -> None:
    """Writes records as lines and flushes (process 0 only)."""
    if self._file is not None:
      self._file.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
      self._file.flush()
    self.done += len(records)

  def close(self) -> None:
    """Closes the file."""
    if self._file is not None:
      self._file.close()


# ------------------------------------------------------------------ the run


def _records(
  runner: model_runner.ModelRunner,
  params: Any,
  batch_examples: Sequence[Example],
  batch: Mapping[str, np.ndarray],
  mode: str,
  vocabulary: seqio.Vocabulary,
) -> tuple[list[dict[str, Any]], int]:
  """Output records of one batch and the number of tokens generated."""
  if mode == "score":
    scores = runner.score(params, batch)
    return [
      {"input": ex.input_text, "target": ex.target_text, "score": float(s)}
      for ex, s in zip(batch_examples, scores)
    ], 0
  tokens, scores = runner.predict(params, batch)
  records = []
  for ex, row, score in zip(batch_examples, tokens, scores):
    record = {
      "input": ex.input_text,
      "prediction": vocabulary.decode(row.tolist()),
      "score": float(score),
    }
    if ex.target_text is not None:
      record["target"] = ex.target_text
    records.append(record)
  return records, int(np.count_nonzero(tokens))


def _check_output_file(path: str) -> None:
  """Raises naming OUTPUT_FILE when it, or its directory, cannot be written.

  Raises:
    ConfigError: OUTPUT_FILE is a directory, or its directory a file.
    WriteError: it, or its directory, cannot be written (a read-only disk).
  """
  if os.path.isdir(path):
    raise ConfigError(f"OUTPUT_FILE {shown(path)} is a directory, not a file")
  directory = os.path.dirname(path) or "."
  if problem := not_a_directory("OUTPUT_FILE's directory", directory):
    raise ConfigError(problem)
  if problem := not_writable("OUTPUT_FILE's directory", directory):
    raise WriteError(problem)
  if os.path.exists(path):
    try:
      with open(path, "ab"):  # appended to by a resumed run
        pass
    except OSError as e:
      raise WriteError(f"OUTPUT_FILE {shown(path)} is not writable ({e.strerror})") from e


def _check_inputs(examples: Sequence[Example], mode: str, source: str) -> None:
  """Score mode needs a target for every input."""
  if mode not in MODES:
    raise ConfigError(f"mode must be one of {MODES}, got {mode!r}.")
  missing = [i for i, ex in enumerate(examples) if ex.target_text is None]
  if mode == "score" and missing:
    raise ConfigError(
      f"mode 'score' needs targets, but {source} has none for input "
      f"{missing[0] + 1} (a 'targets' field / column)."
    )


@gin.configurable
def infer(
  *,
  checkpoint_path: str = GIN_REQUIRED,
  output_file: str = GIN_REQUIRED,
  task_feature_lengths: Mapping[str, int] = GIN_REQUIRED,
  input_file: str | None,
  mixture_or_task_name: str | None,
  split: str,
  batch_size: int,
  mode: str,
  decode: model_runner.DecodeConfig,
) -> dict[str, float]:
  """Decodes or scores every input and appends the missing output lines.

  Args:
    checkpoint_path: a step directory or a checkpoint root (its newest intact step is
      used).
    output_file: the JSONL output (see the module docstring).
    task_feature_lengths: {'inputs': n, 'targets': m}; m is the decode length.
    input_file: a .jsonl / .tsv input file; or
    mixture_or_task_name: a registered task whose `split` is read.
    split: the task split.
    batch_size: global rows per model call.
    mode: 'predict' or 'score'.
    decode: decoding options.

  Every argument is bound in gin/runs/infer.gin. The model is `models.build_model`
  of the step's stored config, overridden by `T5Config.*` gin bindings
  (`checkpoints.model_config`); the mesh is the gin-configured
  `partitioning.Partitioner`.

  Returns:
    {'examples': new lines written, 'examples_per_sec', 'tokens_per_sec'}.

  Raises:
    CheckpointError: no checkpoint at `checkpoint_path`, or a corrupt one.
    ConfigError, file_sources.DataFileError: bad options or inputs, naming them.
  """
  if (input_file is None) == (mixture_or_task_name is None):
    raise ConfigError("Set exactly one of INPUT_FILE and MIXTURE_OR_TASK_NAME.")
  _check_output_file(output_file)
  [(step, step_dir)] = checkpoints.find_steps(checkpoint_path)  # verified
  stored_vocabulary.adopt(step_dir)  # the vocabulary it was trained with, unless gin binds one
  model = models.build_model(checkpoints.model_config(step_dir))
  checkpoints.check_vocabulary(step_dir, model.output_vocabulary)
  if input_file is not None:
    examples, source = file_examples(input_file, model, task_feature_lengths), input_file
  else:
    assert mixture_or_task_name is not None  # exactly one of the two is set (checked above)
    examples = task_examples(mixture_or_task_name, split, task_feature_lengths)
    source = f"{mixture_or_task_name}:{split}"
  _check_inputs(examples, mode, source)
  output = ResumableJsonl(output_file, [ex.input_text for ex in examples])
  try:
    if output.done == len(examples):
      logging.info("%s already has all %d lines.", output_file, output.done)
      return {"examples": 0.0, "examples_per_sec": 0.0, "tokens_per_sec": 0.0}
    logging.info(
      "Inference on %s with step %d of %s: %d of %d lines to go.",
      source,
      step,
      checkpoint_path,
      len(examples) - output.done,
      len(examples),
    )
    return _run(model, step_dir, examples, output, task_feature_lengths, batch_size, mode, decode)
  finally:
    output.close()


def _run(
  model: base_model.BaseModel,
  step_dir: Any,
  examples: Sequence[Example],
  output: ResumableJsonl,
  lengths: Mapping[str, int],
  batch_size: int,
  mode: str,
  decode: model_runner.DecodeConfig,
) -> dict[str, float]:
  """Restores params and writes the missing lines with a progress bar."""
  partitioner = partitioning.Partitioner()
  abstract, shardings = partitioner.abstract_params(model.init_params)
  params = checkpoints.restore_params(step_dir, abstract, verify_checksums=False)  # verified
  runner = model_runner.ModelRunner(model, partitioner, shardings, decode, batch_size)
  todo = examples[output.done :]
  generated, start = 0, time.perf_counter()
  with tqdm.tqdm(
    total=len(examples),
    initial=output.done,
    unit="ex",
    file=sys.stderr,
    desc=mode,
    disable=jax.process_index() != 0,
  ) as bar:
    for first in range(0, len(todo), batch_size):
      chunk = todo[first : first + batch_size]
      records, tokens = _records(
        runner,
        params,
        chunk,
        make_batch(chunk, lengths, model.network_config.architecture),
        mode,
        model.output_vocabulary,
      )
      output.append(records)
      generated += tokens
      bar.update(len(chunk))
      bar.set_postfix(tok_s=f"{generated / (time.perf_counter() - start):.0f}")
  seconds = time.perf_counter() - start
  stats = {
    "examples": float(len(todo)),
    "examples_per_sec": len(todo) / seconds,
    "tokens_per_sec": generated / seconds,
  }
  logging.info(
    "Wrote %d lines to %s: %.1f examples/s, %.0f generated tokens/s (compilation included).",
    len(todo),
    output.path,
    stats["examples_per_sec"],
    stats["tokens_per_sec"],
  )
  return stats
