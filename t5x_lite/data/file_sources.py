"""seqio data sources over local files, so users register data without TFDS.

* `TextLinesSource`: plain text (optionally .gz), one example per non-empty
  line, streamed by tf.data: for pretraining corpora of any size.
* `TsvSource`: tab-separated rows; column names from the header row, or
  `columns=` (which renames a header's columns by position, or names the
  fields of a header-less file with `has_header=False`).
* `ParallelTextSource`: two line-aligned files (e.g. train.en.gz / train.de.gz).
* `JsonlSource`: one JSON object per line, selected fields; a field holding a list
  of strings is joined, cut to its first item, or kept whole (`list_policy`).

The last three parse their files in Python on first use (errors name the file
and line) and keep the records in memory, so their sizes are known for mixing
rates; they suit files up to a few million rows.

A UTF-8 byte-order mark at the start of a file is dropped.

`TsvSource`, `JsonlSource` and `ParallelTextSource` also serve slices of their splits,
named as TFDS names them: `train[:90%]` and `train[90%:]` (percentages), `train[:500]`
(record counts). A slice is taken from the split's records in a fixed pseudo-random
order that depends only on their number, so complementary slices partition the split and
a file sorted by label splits fairly (TFDS slices are contiguous instead); within a
slice the records keep their file order. Hold out a slice of the training data to choose
the best step on (`train[90%:]`) and the figure reported on validation is not one the
choice was made on.

Relative file names are resolved against a data directory at the time the
dataset is built (so gin files parsed after registration apply): the source's
`data_dir` argument if given, else the gin parameter `local_data_dir.path`,
else $T5X_LITE_DATA_DIR, else `../shared/data` relative to the working
directory (the layout of this project's example data).
"""

import functools
import gzip
import hashlib
import json
import os
import re
import zlib
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Optional, TypeAlias, cast

import gin
import seqio
import tensorflow as tf

from t5x_lite.core.errors import ConfigError, UserError

DATA_DIR_ENV = "T5X_LITE_DATA_DIR"
DEFAULT_DATA_DIR = os.path.join("..", "shared", "data")
DATA_DIR_GIN_PARAM = "local_data_dir.path"
# TextLinesSource counts lines for num_input_examples only below this size.
_MAX_BYTES_TO_COUNT = 256 * 2**20
# Some editors (and Excel's "UTF-8 CSV") start files with this character.
_BYTE_ORDER_MARK = "\ufeff"

# {feature: one value per record}: a string, or a list of strings (a list feature, e.g.
# the acceptable answers of a question, read as a variable-length string tensor).
Columns: TypeAlias = Mapping[str, list[str] | list[list[str]]]
LIST_POLICIES = ("join", "first", "all")


class DataFileError(UserError, ValueError):
  """A local data file is missing or malformed (the message names file and line)."""


@gin.configurable
def local_data_dir(path: Optional[str] = None) -> tuple[str, str]:
  """Returns (data directory, what set it) for relative data file names.

  Args:
    path: the directory (gin: `local_data_dir.path`; train.py --data_dir).

  Returns:
    The directory and a description of its origin, for error messages.
  """
  if path:
    return path, f"gin parameter {DATA_DIR_GIN_PARAM}"
  if os.environ.get(DATA_DIR_ENV):
    return os.environ[
      DATA_DIR_ENV
    ], f"environment variable {DATA_DIR_ENV} (gin parameter {DATA_DIR_GIN_PARAM} unset)"
  return DEFAULT_DATA_DIR, (
    f"the default of gin parameter {DATA_DIR_GIN_PARAM} ({DEFAULT_DATA_DIR} relative to "
    f"the working directory {os.getcwd()}; ${DATA_DIR_ENV} unset)"
  )


def resolve_path(file_name: str, data_dir: Optional[str] = None) -> str:
  """Resolves a data file name and checks that the file exists.

  Args:
    file_name: absolute path, gs:// path, or a name relative to the data dir.
    data_dir: explicit data dir; None uses `local_data_dir()`.

  Returns:
    The path.

  Raises:
    DataFileError: if the file does not exist; names the path and the
      parameter that set the directory.
  """
  if os.path.isabs(file_name) or "://" in file_name:
    path, origin = file_name, "an absolute file name"
  elif data_dir:
    path, origin = (
      os.path.join(data_dir, file_name),
      f"the source's data_dir argument ({data_dir})",
    )
  else:
    directory, origin = local_data_dir()
    path = os.path.join(directory, file_name)
  if not tf.io.gfile.exists(path):
    raise DataFileError(f"Data file not found: {path} (its directory was set by {origin}).")
  return path


def _open_binary(path: str):
  """Opens a file for reading bytes, gunzipping `*.gz`."""
  if path.endswith(".gz"):
    return gzip.open(tf.io.gfile.GFile(path, "rb"), "rb")
  return tf.io.gfile.GFile(path, "rb")


def numbered_lines(path: str) -> Iterator[tuple[int, str]]:
  """Yields (line number, line without newline) of a UTF-8 text file (.gz ok).

  A UTF-8 byte-order mark before the first line is dropped, so it never ends
  up in a header name or a first record.

  Raises:
    DataFileError: "file:line: not valid UTF-8 ...", or a damaged gzip file.
  """
  number = 0
  try:
    with _open_binary(path) as f:
      for number, raw in enumerate(f, start=1):
        try:
          # (TensorFlow's stubs have GFile yield str, even in "rb" mode.)
          line = raw.decode("utf-8")  # pyright: ignore[reportAttributeAccessIssue]
        except UnicodeDecodeError as e:
          raise DataFileError(
            f"{path}:{number}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte "
            f"{e.start + 1} of the line); save the file as UTF-8."
          ) from None
        if number == 1:
          line = line.removeprefix(_BYTE_ORDER_MARK)
        yield number, line.rstrip("\r\n")
  except (EOFError, gzip.BadGzipFile, zlib.error) as e:
    raise DataFileError(f"{path}:{number + 1}: damaged gzip data ({e}).") from None


def _no_examples(path: str, last_line: int, header: bool) -> DataFileError:
  """The error for a file that holds no examples, pointing after its last line."""
  if last_line == 0:
    return DataFileError(f"{path}:1: the file is empty; it needs at least one example.")
  what = "only a header row" if header and last_line == 1 else "no examples"
  return DataFileError(
    f"{path}:{last_line + 1}: the file ends here with {what}"
    f"{' (the header row, then empty lines)' if header and last_line > 1 else ''}; "
    "it needs at least one example."
  )


def read_tsv(
  path: str, columns: Optional[Sequence[str]] = None, has_header: bool = True
) -> dict[str, list[str]]:
  """Reads a TSV file into columns; empty lines are skipped.

  Column names come from the header row, or from `columns`:

  * `has_header=True`, no `columns`: the header row names the columns.
  * `has_header=False`, `columns`: the file has no header; `columns` names
    its fields in order.
  * `has_header=True` and `columns`: the header row is skipped and `columns`
    renames its fields by position (e.g. a header `sentence\tlbl` read with
    `columns=("sentence", "label")`); the header must have as many fields.

  Args:
    path: the file.
    columns: field names, in file order; None takes them from the header row.
    has_header: whether the first line is a header row.

  Returns:
    {column: [values]}.

  Raises:
    ConfigError: if `has_header` is False and `columns` is not given.
    DataFileError: if the header's field count differs from `columns`, on a
      row with the wrong number of fields, invalid UTF-8, or a file without
      examples ("file:line: ...").
  """
  if not has_header and not columns:
    raise ConfigError(f"{path}: has_header=False needs columns=(...) naming the fields.")
  names = list(columns) if columns else None
  out: Optional[dict[str, list[str]]] = None
  number = 0
  for number, line in numbered_lines(path):
    fields = line.split("\t")
    if number == 1 and has_header:
      if names is None:
        names = fields
      elif len(fields) != len(names):
        raise DataFileError(
          f"{path}:1: the header row has {len(fields)} fields {fields}, but "
          f"columns= names {len(names)} {names}; columns= renames the header's "
          "fields by position, so give one name per field."
        )
      continue
    assert names is not None  # from columns=, else from the header row (line 1)
    if out is None:
      out = {name: [] for name in names}
    if not line.strip():
      continue
    if len(fields) != len(names):
      raise DataFileError(
        f"{path}:{number}: expected {len(names)} tab-separated fields {names}, got {len(fields)}."
      )
    for name, value in zip(names, fields):
      out[name].append(value)
  if not out or not next(iter(out.values())):
    raise _no_examples(path, number, has_header)
  return out


def _json_value(value, policy: str, where: str) -> str | list[str]:
  """A JSON field as a string, or with `policy` 'all' as a list of strings."""
  if policy not in LIST_POLICIES:
    raise ConfigError(f"{where}: list_policy must be one of {LIST_POLICIES}, got {policy!r}.")
  if isinstance(value, (int, float, bool)):
    value = str(value)
  if isinstance(value, str):
    return [value] if policy == "all" else value
  if isinstance(value, list) and all(isinstance(v, str) for v in value):
    if policy == "all":
      return value
    if value:
      return value[0] if policy == "first" else " ".join(value)
  raise DataFileError(
    f"{where}: expected a string or a non-empty list of strings, got {value!r:.80}."
  )


def read_jsonl(
  path: str, fields: Mapping[str, str], list_policy: Optional[Mapping[str, str]] = None
) -> Columns:
  """Reads selected fields of a JSON-lines file; empty lines are skipped.

  Args:
    path: the file.
    fields: {output feature: JSON key}.
    list_policy: {JSON key: policy} for values that are lists of strings:
      'join' (space-join, the default), 'first' (the first item), or 'all' (the
      whole list, possibly empty, as a list feature: a string value becomes a
      one-item list), e.g. {'answers': 'all'} to score against every answer.

  Returns:
    {output feature: [strings]}, or [lists of strings] for an 'all' field.

  Raises:
    DataFileError: on invalid JSON or UTF-8, a missing field, or a file without
      examples ("file:line: ...").
  """
  list_policy = list_policy or {}
  out = {name: [] for name in fields}
  number = 0
  for number, line in numbered_lines(path):
    if not line.strip():
      continue
    where = f"{path}:{number}"
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise DataFileError(f"{where}: invalid JSON ({e.msg}).") from e
    if not isinstance(record, dict):
      raise DataFileError(f"{where}: expected a JSON object.")
    for name, key in fields.items():
      if key not in record:
        raise DataFileError(f"{where}: missing field '{key}'.")
      out[name].append(
        _json_value(record[key], list_policy.get(key, "join"), f"{where}: field '{key}'")
      )
  if not next(iter(out.values()), [None]):
    raise _no_examples(path, number, header=False)
  return out


def read_parallel(source_path: str, target_path: str, source_key: str, target_key: str) -> Columns:
  """Reads two line-aligned files; pairs with an empty side are dropped.

  Raises:
    DataFileError: if the files have different numbers of lines or no pair.
  """
  sources = [line for _, line in numbered_lines(source_path)]
  targets = [line for _, line in numbered_lines(target_path)]
  if len(sources) != len(targets):
    raise DataFileError(
      f"{source_path} has {len(sources)} lines but {target_path} has {len(targets)}; "
      "parallel files must be line-aligned."
    )
  kept = [(s, t) for s, t in zip(sources, targets) if s.strip() and t.strip()]
  if not kept:
    raise _no_examples(source_path, len(sources), header=False)
  return {source_key: [s for s, _ in kept], target_key: [t for _, t in kept]}


def _column(values: list[str] | list[list[str]]) -> tf.Tensor | tf.RaggedTensor:
  """A column as [records] strings, or [records, (items)] for a list feature."""
  if values and isinstance(values[0], list):
    flat = [item for row in values for item in row]
    # (from_row_lengths is missing from TensorFlow's stubs.)
    return tf.RaggedTensor.from_row_lengths(  # pyright: ignore[reportAttributeAccessIssue]
      tf.constant(flat, tf.string, shape=[len(flat)]), [len(row) for row in values]
    )
  return tf.constant(values, tf.string, shape=[len(values)])


_SLICE = re.compile(r"^(?P<base>[^\[\]]+)\[(?P<start>[^:\[\]]*):(?P<stop>[^:\[\]]*)\]$")
_BOUND = re.compile(r"^(?P<value>\d+)(?P<percent>%?)$")


def split_slice(split: str) -> Optional[tuple[str, str, str]]:
  """(base split, start, stop) of a slice name such as 'train[:90%]', else None."""
  match = _SLICE.match(split)
  return (match["base"], match["start"], match["stop"]) if match else None


def _bound(text: str, n: int, split: str) -> Optional[int]:
  """A slice bound as a record index of a split of `n` records (None: open)."""
  if not text:
    return None
  match = _BOUND.match(text.strip())
  if not match:
    raise ConfigError(
      f"Split {split!r}: slice bounds are record counts or percentages, e.g. "
      "'train[:90%]', 'train[90%:]' or 'train[:500]'."
    )
  value = int(match["value"])
  if match["percent"]:
    if value > 100:
      raise ConfigError(f"Split {split!r}: a percentage bound is at most 100%.")
    return round(n * value / 100)
  return min(value, n)


def slice_indices(n: int, start: str, stop: str, split: str) -> list[int]:
  """Record indices, in file order, of the slice [start:stop] of a split of `n` records.

  The slice is cut from the records in a fixed pseudo-random order (each index ranked by
  a hash of itself), so it depends only on `n`, and complementary slices partition the
  split.

  Args:
    n: the split's number of records.
    start: the start bound ('' for the beginning, '90%' or '500').
    stop: the stop bound ('' for the end).
    split: the slice's name, for errors.

  Returns:
    Sorted indices into the split's records.

  Raises:
    ConfigError: for a malformed bound.
  """
  return sorted(_hashed_order(n)[_bound(start, n, split) : _bound(stop, n, split)])


@functools.lru_cache(maxsize=4)
def _hashed_order(n: int) -> tuple[int, ...]:
  """0..n-1 ranked by a hash of each index: one order shared by every slice of n records."""
  return tuple(
    sorted(range(n), key=lambda i: hashlib.blake2b(str(i).encode(), digest_size=8).digest())
  )


class SplitNames(tuple):
  """A source's split names; `in` also finds slices of them ('train[:90%]').

  seqio asks `split in task.splits` before it reads or evaluates a split; iterating
  gives the declared names only.
  """

  def __contains__(self, split: object) -> bool:
    if tuple.__contains__(self, split):
      return True
    sliced = split_slice(split) if isinstance(split, str) else None
    return sliced is not None and tuple.__contains__(self, sliced[0])


class InMemorySource(seqio.FunctionDataSource):
  """A source whose records are built in Python, kept in memory, and split.

  Args:
    load: maps a split name to its records as {feature: [strings]}.
    splits: split names.
  """

  def __init__(self, load: Callable[[str], Columns], splits: Sequence[str]):
    self._load = load
    self._loaded: dict[Hashable, Columns] = {}
    super().__init__(dataset_fn=self._dataset_fn, splits=splits)

  @property
  def splits(self) -> SplitNames:
    """The declared split names; `in` also accepts slices of them."""
    return SplitNames(super().splits)

  def _cache_key(self, split: str) -> Hashable:
    """Records are rebuilt when this changes (files sources: paths and mtimes)."""
    return split

  def records(self, split: str) -> Columns:
    """The split's records, or a slice's (built on first call)."""
    declared = tuple(self.splits)
    sliced = None if split in declared else split_slice(split)
    if split not in declared and (sliced is None or sliced[0] not in declared):
      raise ConfigError(
        f"Unknown split {split!r}; this source has {list(declared)} and slices of them "
        "(e.g. 'train[:90%]')."
      )
    if sliced is None:
      key = self._cache_key(split)
      if key not in self._loaded:
        self._loaded[key] = self._load(split)
      return self._loaded[key]
    base, start, stop = sliced
    whole = self.records(base)
    key = (self._cache_key(base), split)
    if key not in self._loaded:
      n = len(next(iter(whole.values()), []))
      indices = slice_indices(n, start, stop, split)
      if not indices:
        raise ConfigError(f"Split {split!r} selects none of the {n} records of {base!r}.")
      # Each column keeps its kind (strings, or lists of strings) through the slice.
      self._loaded[key] = cast(
        Columns, {name: [values[i] for i in indices] for name, values in whole.items()}
      )
    return self._loaded[key]

  def num_input_examples(self, split: str) -> int:
    return len(next(iter(self.records(split).values()), []))

  def _dataset_fn(
    self, split: str, shuffle_files: bool, seed: Optional[int] = None
  ) -> tf.data.Dataset:
    records = self.records(split)
    # (TensorFlow's stubs take no RaggedTensor among the slices.)
    ds = tf.data.Dataset.from_tensor_slices({k: _column(v) for k, v in records.items()})  # pyright: ignore[reportArgumentType]
    if shuffle_files:
      ds = ds.shuffle(max(self.num_input_examples(split), 1), seed=seed)
    return ds


class FileRecordsSource(InMemorySource):
  """Records parsed from local files, re-read when the resolved files change.

  Args:
    split_to_files: {split: file names (relative to the data dir, or absolute)}.
    parse: resolved paths of one split -> its records.
    data_dir: directory for relative names; None uses `local_data_dir()`.
  """

  def __init__(
    self,
    split_to_files: Mapping[str, Sequence[str]],
    parse: Callable[[list[str]], Columns],
    data_dir: Optional[str] = None,
  ):
    self._split_to_files = dict(split_to_files)
    self._data_dir = data_dir
    super().__init__(lambda split: parse(self.paths(split)), splits=list(split_to_files))

  def paths(self, split: str) -> list[str]:
    """The split's files, resolved against the data dir at call time."""
    return [resolve_path(name, self._data_dir) for name in self._split_to_files[split]]

  def _cache_key(self, split: str) -> Hashable:
    return split, tuple((p, tf.io.gfile.stat(p).mtime_nsec) for p in self.paths(split))


class TsvSource(FileRecordsSource):
  """TSV files per split; features are the columns (all strings).

  See `read_tsv` for how `columns` and `has_header` combine.

  Args:
    split_to_file: {split: file name (relative to the data dir, or absolute)}.
    columns: field names in file order; None reads them from each file's
      header row; with a header row, renames its fields by position.
    has_header: whether files start with a header row (False needs `columns`).
    data_dir: directory for relative names; None uses `local_data_dir()`.
  """

  def __init__(
    self,
    split_to_file: Mapping[str, str],
    columns: Optional[Sequence[str]] = None,
    has_header: bool = True,
    data_dir: Optional[str] = None,
  ):
    super().__init__(
      {split: [name] for split, name in split_to_file.items()},
      lambda paths: read_tsv(paths[0], columns, has_header),
      data_dir,
    )


class JsonlSource(FileRecordsSource):
  """JSON-lines files per split; see `read_jsonl` for `fields`/`list_policy`."""

  def __init__(
    self,
    split_to_file: Mapping[str, str],
    fields: Mapping[str, str],
    list_policy: Optional[Mapping[str, str]] = None,
    data_dir: Optional[str] = None,
  ):
    super().__init__(
      {split: [name] for split, name in split_to_file.items()},
      lambda paths: read_jsonl(paths[0], fields, list_policy),
      data_dir,
    )


class ParallelTextSource(FileRecordsSource):
  """Line-aligned file pairs per split, e.g. {'train': ('train.en.gz', 'train.de.gz')}."""

  def __init__(
    self,
    split_to_files: Mapping[str, tuple[str, str]],
    source_key: str,
    target_key: str,
    data_dir: Optional[str] = None,
  ):
    super().__init__(
      split_to_files,
      lambda paths: read_parallel(paths[0], paths[1], source_key, target_key),
      data_dir,
    )


def _read_text_lines(path: tf.Tensor) -> tf.data.Dataset:
  compression = tf.where(tf.strings.regex_full_match(path, r".*\.gz"), "GZIP", "")
  ds = tf.data.TextLineDataset(path, compression_type=compression)
  ds = ds.filter(lambda line: tf.strings.length(tf.strings.strip(line)) > 0)
  return ds.map(lambda line: {"text": line})


class TextLinesSource(seqio.FileDataSource):
  """Plain-text files (optionally .gz) streamed by tf.data: {'text': line}.

  Empty lines are dropped. With several files per split, hosts can shard by
  file. `num_input_examples` counts non-empty lines when the files total
  under 256 MiB, else it is None.

  Args:
    split_to_files: {split: file name or list of names (globs allowed)}.
    data_dir: directory for relative names; None uses `local_data_dir()`.
  """

  def __init__(
    self, split_to_files: Mapping[str, str | Sequence[str]], data_dir: Optional[str] = None
  ):
    self._split_to_names = {
      split: [names] if isinstance(names, str) else list(names)
      for split, names in split_to_files.items()
    }
    self._data_dir = data_dir
    self._counts: dict[str, Optional[int]] = {}
    super().__init__(read_file_fn=_read_text_lines, split_to_filepattern=self._split_to_names)

  def list_shards(self, split: str) -> list[str]:
    files = []
    for name in self._split_to_names[split]:
      if any(c in name for c in "*?["):
        if self._data_dir:
          directory, origin = self._data_dir, "the source's data_dir argument"
        else:
          directory, origin = local_data_dir()
        pattern = name if os.path.isabs(name) else os.path.join(directory, name)
        matched = sorted(tf.io.gfile.glob(pattern))
        if not matched:
          raise DataFileError(
            f"No data file matches {pattern} (its directory was set by {origin})."
          )
        files.extend(matched)
      else:
        files.append(resolve_path(name, self._data_dir))
    return files

  def num_input_examples(self, split: str) -> Optional[int]:
    if split not in self._counts:
      files = self.list_shards(split)
      if sum(tf.io.gfile.stat(f).length for f in files) > _MAX_BYTES_TO_COUNT:
        self._counts[split] = None
      else:
        self._counts[split] = sum(1 for f in files for _, line in numbered_lines(f) if line.strip())
    return self._counts[split]
