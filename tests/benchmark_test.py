"""Smoke test of tools/benchmark.py: a tiny config, a couple of steps, every figure.

Speed is never asserted here (DESIGN.md section 6); the test checks that the tool
runs end to end (ours, HF transformers, the input pipeline), writes the documented
JSON keys and that every rate is a positive number.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # subprocess runs of the entry points

REPO = pathlib.Path(__file__).resolve().parents[1]

pytest.importorskip("torch")
pytest.importorskip("transformers")

RATES = (
  "train_tokens_per_s",
  "hf_train_tokens_per_s",
  "train_mfu",
  "hf_train_mfu",
  "greedy_tokens_per_s",
  "hf_greedy_tokens_per_s",
  "beam_tokens_per_s",
  "hf_beam_tokens_per_s",
  "jax_peak_flops",
  "torch_peak_flops",
  "train_compile_s",
  "train_speedup_vs_hf",
  "greedy_speedup_vs_hf",
  "beam_speedup_vs_hf",
  "data_examples_per_s",
  "train_examples_per_s",
  "data_vs_train_consumption",
  "max_rss_mib",
  "max_rss_mib_ours",
)


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> tuple[dict, str]:
  out = tmp_path_factory.mktemp("bench") / "bench.json"
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the tool runs on the real (single) CPU device
  proc = subprocess.run(
    [
      sys.executable,
      str(REPO / "tools" / "benchmark.py"),
      "--gin_file=models/t5_1_1/tiny.gin",
      "--batch_size=2",
      "--input_length=16",
      "--target_length=8",
      "--decode_length=3",
      "--num_beams=2",
      "--reps=2",
      "--warmup=1",
      "--matmul_size=128",
      "--data_batches=2",
      "--compare_hf",
      f"--json={out}",
    ],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(out.read_text()), proc.stdout


def test_json_has_positive_figures(result):
  figures, _ = result
  for key in RATES:
    assert isinstance(figures[key], (int, float)) and figures[key] > 0, key
  assert 0 < figures["train_mfu"] < 1.5


def test_same_model_both_sides(result):
  figures, _ = result
  assert figures["num_params"] == figures["hf_num_params"]
  # Same weights, same greedy argmax: the decodes agree almost everywhere.
  assert figures["greedy_token_agreement"] >= 0.5
  assert figures["train_tokens_per_step"] == 2 * (16 + 8)
  assert figures["settings"]["decode_length"] == 3


def test_table_printed(result):
  _, stdout = result
  for label in (
    "train tokens/s",
    "greedy decode tokens/s",
    "beam decode tokens/s",
    "train MFU",
    "data / train consumption",
  ):
    assert label in stdout
