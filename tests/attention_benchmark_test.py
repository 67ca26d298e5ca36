"""Tests for tools/attention_benchmark.py: the ways of giving cuDNN T5's attention biases.

The GPU figures are in docs/performance.md; here, on the CPU, every cuDNN variant is
refused in one line and XLA's runs, and the masks and cuDNN's packing offsets that the
variants are built from say the same thing.
"""

import json
import pathlib
import sys

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import attention_benchmark  # noqa: E402  (tools/attention_benchmark.py)


def test_masks_and_packing_offsets_describe_the_same_segments():
  seg = attention_benchmark.segments(2, 12, 3, padding=True)
  assert seg.tolist()[0] == [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
  assert seg.tolist()[1] == [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 0, 0]
  offsets, lengths = attention_benchmark.offsets_and_lengths(seg, 3)
  assert offsets.tolist() == [[0, 4, 8, 12], [0, 4, 8, 10]]
  assert lengths.tolist() == [[4, 4, 4], [4, 4, 2]]
  mask = attention_benchmark.mask_bias(seg, causal=True)[:, 0]  # [batch, q, k]
  visible = mask == 0
  assert visible[1, 5].tolist() == [False] * 4 + [True, True] + [False] * 6
  assert not visible[1, 10:].any()  # padding sees nothing
  assert not (visible & ~np.tril(np.ones((12, 12), bool))).any()  # causal
  assert not attention_benchmark.segments(2, 12, 3, padding=False).min() == 0


def test_on_the_cpu_xla_runs_and_every_cudnn_variant_is_one_refusal(tmp_path, capsys):
  out = tmp_path / "attention.json"
  argv = ["--batch=2", "--length=8", "--heads=2", "--head_dim=8", "--reps=1", "--warmup=0"]
  assert attention_benchmark.main([*argv, f"--json={out}"]) == 0
  result = json.loads(out.read_text())
  assert result["shape"] == {
    "batch": 2,
    "length": 8,
    "heads": 2,
    "head_dim": 8,
    "segments_per_row": 1,
  }
  variants = result["variants"]
  assert list(variants)[-1] == "xla_summed_bias" and variants["xla_summed_bias"]["ms"] > 0
  for name, figures in variants.items():
    if name.startswith("cudnn"):
      assert "\n" not in figures["error"]
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 1 + len(variants) and "refused" in lines[1]


def test_too_many_segments_is_one_error_line(capsys):
  assert attention_benchmark.main(["--length=8", "--segments=5"]) == 2
  assert capsys.readouterr().err.startswith("ERROR: --segments=5")
