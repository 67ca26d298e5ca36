"""Tests for t5x_lite.data.file_sources: TSV headers, byte-order marks, columns=, splits."""

import gzip

import pytest

from t5x_lite.data import file_sources
from t5x_lite.core.errors import ConfigError, UserError

BOM = "\ufeff"


def _records(source: file_sources.TsvSource, split: str = "train") -> list[dict[str, str]]:
  ds = source.get_dataset(split=split, shuffle=False)
  return [{k: v.decode() for k, v in ex.items()} for ex in ds.as_numpy_iterator()]


@pytest.mark.parametrize("compressed", [False, True])
def test_byte_order_mark_is_not_part_of_the_first_header_name(tmp_path, compressed):
  text = BOM + "label\tsentence\n1\tgood\n0\tbad\n"
  path = tmp_path / ("train.tsv.gz" if compressed else "train.tsv")
  if compressed:
    with gzip.open(path, "wt", encoding="utf-8") as f:
      f.write(text)
  else:
    path.write_text(text, encoding="utf-8")
  assert file_sources.read_tsv(str(path)) == {"label": ["1", "0"], "sentence": ["good", "bad"]}
  source = file_sources.TsvSource({"train": path.name}, data_dir=str(tmp_path))
  assert _records(source)[0] == {"label": "1", "sentence": "good"}


def test_byte_order_mark_is_not_part_of_a_headerless_first_record(tmp_path):
  (tmp_path / "a.jsonl").write_text(BOM + '{"a": "x"}\n', encoding="utf-8")
  assert file_sources.read_jsonl(str(tmp_path / "a.jsonl"), {"inputs": "a"}) == {"inputs": ["x"]}
  (tmp_path / "a.tsv").write_text(BOM + "x\t1\n", encoding="utf-8")
  assert file_sources.read_tsv(str(tmp_path / "a.tsv"), ("text", "label"), has_header=False) == {
    "text": ["x"],
    "label": ["1"],
  }


def test_headerless_four_column_tsv_with_columns(tmp_path):
  rows = "".join(
    f"{i}\tpremise {i}\thypothesis {i}\t{'entailment' if i % 2 else 'not'}\n" for i in range(3)
  )
  (tmp_path / "train.tsv").write_text(rows)
  source = file_sources.TsvSource(
    {"train": "train.tsv"},
    columns=("idx", "sentence1", "sentence2", "label"),
    has_header=False,
    data_dir=str(tmp_path),
  )
  records = _records(source)
  assert len(records) == 3 and source.num_input_examples("train") == 3
  assert records[0] == {
    "idx": "0",
    "sentence1": "premise 0",
    "sentence2": "hypothesis 0",
    "label": "not",
  }


def test_columns_rename_the_header_row_by_position(tmp_path):
  (tmp_path / "train.tsv").write_text("sentence\tlbl\ngood\t1\n")
  renamed = file_sources.read_tsv(str(tmp_path / "train.tsv"), columns=("sentence", "label"))
  assert renamed == {"sentence": ["good"], "label": ["1"]}
  with pytest.raises(file_sources.DataFileError, match=r"train.tsv:1: the header row has 2 fields"):
    file_sources.read_tsv(str(tmp_path / "train.tsv"), columns=("a", "b", "c"))


def test_headerless_file_needs_columns(tmp_path):
  (tmp_path / "train.tsv").write_text("good\t1\n")
  with pytest.raises(ConfigError, match="has_header=False needs columns"):
    file_sources.read_tsv(str(tmp_path / "train.tsv"), has_header=False)


def test_unknown_split_is_a_user_error(tmp_path):
  (tmp_path / "train.tsv").write_text("sentence\tlabel\ngood\t1\n")
  source = file_sources.TsvSource({"train": "train.tsv"}, data_dir=str(tmp_path))
  with pytest.raises(UserError, match=r"Unknown split 'validation'; this source has \['train'\]"):
    source.num_input_examples("validation")


@pytest.mark.parametrize("compressed", [False, True])
def test_invalid_utf8_names_the_file_and_line(tmp_path, compressed):
  raw = "sentence\tlabel\ngood\t1\n".encode() + b"caf\xe9\t1\n"
  path = tmp_path / ("train.tsv.gz" if compressed else "train.tsv")
  path.write_bytes(gzip.compress(raw) if compressed else raw)
  with pytest.raises(file_sources.DataFileError) as raised:
    file_sources.read_tsv(str(path))
  assert str(raised.value) == (
    f"{path}:3: not valid UTF-8 (byte 0xe9 at byte 4 of the line); save the file as UTF-8."
  )


def test_a_file_without_examples_names_the_file_and_line(tmp_path):
  cases = {"empty.tsv": "", "header.tsv": "sentence\tlabel\n", "blank.tsv": "sentence\tlabel\n\n\n"}
  for name, text in cases.items():
    (tmp_path / name).write_text(text)
  with pytest.raises(file_sources.DataFileError, match="empty.tsv:1: the file is empty"):
    file_sources.read_tsv(str(tmp_path / "empty.tsv"))
  with pytest.raises(file_sources.DataFileError, match="header.tsv:2: .* only a header row"):
    file_sources.read_tsv(str(tmp_path / "header.tsv"))
  with pytest.raises(file_sources.DataFileError, match="blank.tsv:4: .* no examples"):
    file_sources.read_tsv(str(tmp_path / "blank.tsv"))
  (tmp_path / "empty.jsonl").write_text("\n")
  with pytest.raises(file_sources.DataFileError, match="empty.jsonl:2: .* no examples"):
    file_sources.read_jsonl(str(tmp_path / "empty.jsonl"), {"inputs": "a"})
  with pytest.raises(file_sources.DataFileError, match="empty.tsv:1: the file is empty"):
    file_sources.read_parallel(str(tmp_path / "empty.tsv"), str(tmp_path / "empty.tsv"), "a", "b")


def _labelled_tsv(tmp_path, n: int = 100):
  """A TSV sorted by label: the first half 0, the second 1."""
  rows = [f"s{i}\t{int(i >= n // 2)}" for i in range(n)]
  (tmp_path / "train.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
  (tmp_path / "dev.tsv").write_text("sentence\tlabel\n" + "\n".join(rows[:8]) + "\n")
  return file_sources.TsvSource(
    {"train": "train.tsv", "validation": "dev.tsv"}, data_dir=str(tmp_path)
  )


def test_complementary_slices_partition_a_split_and_a_sorted_file_splits_fairly(tmp_path):
  source = _labelled_tsv(tmp_path)
  kept, held = source.records("train[:90%]"), source.records("train[90%:]")
  whole = source.records("train")["sentence"]
  assert len(kept["sentence"]) == 90 and len(held["sentence"]) == 10
  assert sorted(kept["sentence"] + held["sentence"]) == sorted(whole)
  assert not set(kept["sentence"]) & set(held["sentence"])
  assert set(held["label"]) == {"0", "1"}  # not the file's last tenth, all label 1
  # Within a slice the records keep their file order.
  assert held["sentence"] == [s for s in whole if s in set(held["sentence"])]
  assert source.num_input_examples("train[:90%]") == 90
  assert len(source.records("train[10:30]")["sentence"]) == 20
  assert source.records("train[:100%]")["sentence"] == whole
  # The order depends only on the number of records: the same slice of another file.
  other = file_sources.slice_indices(100, "90%", "", "train[90%:]")
  assert [whole[i] for i in other] == held["sentence"]


def test_slices_are_splits_to_seqio_and_read_as_datasets(tmp_path):
  source = _labelled_tsv(tmp_path)
  assert "train[90%:]" in source.splits and "validation[:4]" in source.splits
  assert "test[:4]" not in source.splits and "train[" not in source.splits
  assert list(source.splits) == ["train", "validation"]
  dataset = source.get_dataset("train[:25%]", shuffle=False)
  sentences = [x["sentence"].decode() for x in dataset.as_numpy_iterator()]
  assert sentences == source.records("train[:25%]")["sentence"] and len(sentences) == 25


@pytest.mark.parametrize(
  "split, message",
  [
    ("test[:5]", r"Unknown split 'test\[:5\]'; this source has \['train', 'validation'\]"),
    ("train[:x]", r"Split 'train\[:x\]': slice bounds are record counts or percentages"),
    ("train[:101%]", r"a percentage bound is at most 100%"),
    ("train[95%:95%]", r"^Split 'train\[95%:95%\]' selects none of the 100 records of 'train'\.$"),
  ],
)
def test_a_bad_slice_is_one_line_naming_it(tmp_path, split, message):
  with pytest.raises(ConfigError, match=message):
    _labelled_tsv(tmp_path).records(split)
