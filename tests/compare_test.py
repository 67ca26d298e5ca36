"""tools/compare.py: one variant of a table through the real entry points, on tiny files."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from xla_flags import xla_flags

pytestmark = pytest.mark.slow  # subprocess runs of the entry points

REPO = Path(__file__).resolve().parents[1]


def _write_glue(data_dir: Path) -> None:
  """Tiny SST-2 and RTE train/dev files in the GLUE layout."""
  for task in ("SST-2", "RTE"):
    (data_dir / "glue" / task).mkdir(parents=True)
  sst2 = [f"review number {i} is {'good' if i % 2 else 'bad'}\t{i % 2}" for i in range(12)]
  rte = [f"{i}\tpremise {i} .\thypothesis {i} .\tentailment" for i in range(8)]
  for split in ("train", "dev"):
    (data_dir / f"glue/SST-2/{split}.tsv").write_text("sentence\tlabel\n" + "\n".join(sst2) + "\n")
    (data_dir / f"glue/RTE/{split}.tsv").write_text(
      "index\tsentence1\tsentence2\tlabel\n" + "\n".join(rte) + "\n"
    )


def _compare(cwd: Path, *args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  env["XLA_FLAGS"] = xla_flags()  # one CPU device, as a user's run
  command = [sys.executable, str(REPO / "tools/compare.py"), *args]
  return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def test_a_prefix_lm_row_pretrains_fine_tunes_and_resumes(tmp_path):
  _write_glue(tmp_path / "data")
  args = (
    "--table=architectures",
    "--only=prefix_lm__lm",
    "--pretrain_steps=2",
    "--finetune_steps=1",
    "--batch_size=2",
    "--data_dir=data",
    "--output_dir=out",
  )
  first = _compare(tmp_path, *args)
  assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
  table = tmp_path / "out/architectures"
  (row,) = json.loads((table / "results.json").read_text())
  assert row["variant"] == "prefix LM, LM" and row["task"] == "cpython_prefix_lm"
  assert row["pretrain_validation_loss"] > 0 and row["flops_per_token"] > 0
  assert row["params"] == 545_056  # the decoder-only tiny with the 8192-id offline vocabulary
  assert 0 <= row["sst2_accuracy"] <= 100 and 0 <= row["rte_accuracy"] <= 100
  for run in ("pretrain", "sst2", "rte"):
    assert (table / f"prefix_lm__lm/{run}/metrics.jsonl").exists()
  assert "| prefix LM, LM |" in (table / "results.md").read_text()
  # A second run finds every run done and only rewrites the table.
  again = _compare(tmp_path, *args)
  assert again.returncode == 0, again.stderr[-3000:]
  assert json.loads((table / "results.json").read_text()) == [row]


def test_an_unknown_variant_is_one_error_line(tmp_path):
  result = _compare(tmp_path, "--table=objectives", "--only=bert", "--output_dir=out")
  assert result.returncode == 1
  assert (
    result.stderr.strip()
    .splitlines()[-1]
    .startswith("ERROR: --only=bert names no variant of objectives: span_corruption, ")
  )


def test_no_seeds_is_one_error_line(tmp_path):
  result = _compare(tmp_path, "--table=finetuning", "--seeds=0", "--output_dir=out")
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1] == "ERROR: --seeds=0: must be at least 1"


def test_the_electra_row_pretrains_for_span_corruptions_flops_and_fine_tunes(tmp_path):
  import gin

  from t5x_lite.checkpoint import checkpoints
  from t5x_lite.core import gin_config
  from t5x_lite.nn import flops, network

  _write_glue(tmp_path / "data")
  args = (
    "--table=objectives",
    "--only=electra",
    "--pretrain_steps=6",
    "--finetune_steps=1",
    "--batch_size=2",
    "--data_dir=data",
    "--output_dir=out",
  )
  result = _compare(tmp_path, *args)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  table = tmp_path / "out/objectives"
  (row,) = json.loads((table / "results.json").read_text())
  assert row["task"] == "cpython_electra" and row["flops_matched"]
  gin_config.parse_gin(["models/t5_1_1/tiny.gin"], ["T5Config.vocab_size = 8192"])
  config = network.T5Config()
  gin.clear_config()
  span_corruption = flops.flops_per_token(config, 128, 32)
  # The generator counts: more than the discriminator's own FLOPs per token.
  assert row["flops_per_token"] > flops.flops_per_token(config, 80, 80) > span_corruption
  assert row["pretrain_steps"] == round(6 * span_corruption / row["flops_per_token"]) < 6
  saved = sorted(p.name for p in (table / "electra/pretrain").iterdir() if p.name.isdigit())
  assert saved == [str(row["pretrain_steps"])]
  # The pre-training ran the ELECTRA model through the train entry point: its terms are
  # logged and the generator and RTD head are saved beside the network.
  metrics = (table / "electra/pretrain/metrics.jsonl").read_text()
  for name in ("electra_mlm", "electra_rtd", "electra_clm", "rtd_accuracy", "replaced_fraction"):
    assert f'"{name}"' in metrics, name
  shapes = checkpoints.saved_shapes(table / "electra/pretrain" / saved[0] / checkpoints.PARAMS)
  assert any(p.startswith("generator/") for p in shapes) and "rtd_head/kernel" in shapes
  assert 0 <= row["sst2_accuracy"] <= 100 and 0 <= row["rte_accuracy"] <= 100
  assert "(its generator counted)" in (table / "results.md").read_text()


def test_the_finetuning_tables_distilled_row_trains_its_teacher_first(tmp_path):
  _write_glue(tmp_path / "data")
  first = _compare(
    tmp_path,
    "--table=finetuning",
    "--only=distilled",
    "--data_dir=data",
    "--output_dir=out",
    # No checkpoint to start from, and a few steps that still decode the dev set.
    "--gin.INITIAL_CHECKPOINT_PATH=None",
    "--gin.TRAIN_STEPS=2",
    "--gin.EVAL_PERIOD=2",
    "--gin.train.infer_eval_period=2",
    "--gin.BATCH_SIZE=2",
  )
  assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
  table = tmp_path / "out/finetuning"
  (row,) = json.loads((table / "results.json").read_text())
  assert row["slug"] == "distilled" and row["method"].startswith("distillation: half-depth")
  # quickstart_sst2.gin's tiny model (2 + 2 layers) halved: the 1 + 1-layer student.
  assert row["trainable"] == "549,344 of 549,344"
  assert 0 <= row["scores"][0] <= 100
  student_log = (table / "distilled_s0.log").read_text()
  assert "T5Config.num_encoder_layers = 1" in (table / "distilled_s0/config.gin").read_text()
  assert (
    "TEACHER_CHECKPOINT_PATH = 'out/finetuning/full_s0'"
    in (table / "distilled_s0/config.gin").read_text()
  )
  assert "trainable parameters: 574080 of 574080" in (table / "full_s0.log").read_text()
  assert "Traceback" not in student_log
  assert "| distillation: half-depth student" in (table / "results.md").read_text()


def _fake_runs(table_dir: Path, row: int, *args: str) -> dict:
  """tests/compare_fake_runs.py: one row of a table run by a fake runner (the runs'
  arguments, the seeds' rows, the row and its table)."""
  command = [sys.executable, str(REPO / "tests/compare_fake_runs.py"), str(table_dir), str(row)]
  result = subprocess.run([*command, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("seeds", [1, 3])
def test_seeds_run_each_row_in_its_own_directory_with_its_seed(tmp_path, seeds):
  out = _fake_runs(tmp_path, 0, "--table=objectives", f"--seeds={seeds}")
  runs, row, table = out["runs"], out["row"], out["table"]
  assert out["variant"] == "span_corruption"
  # Three runs per seed (pre-training, SST-2, RTE); seed 0 in the row's own directory,
  # which a one-seed table has always used, seed k in <row>_s<k>.
  assert len(out["calls"]) == 3 * seeds
  for i, args in enumerate(out["calls"]):
    seed, directory = i // 3, "span_corruption" + (f"_s{i // 3}" if i >= 3 else "")
    model_dir = next(a for a in args if a.startswith("--gin.MODEL_DIR="))
    assert model_dir.startswith(f"--gin.MODEL_DIR={tmp_path}/{directory}/")
    bindings = [a for a in args if a.startswith("--gin_bindings=RANDOM_SEED")]
    assert bindings == ([f"--gin_bindings=RANDOM_SEED = {seed}"] if seeds > 1 else [])
  if seeds == 1:  # one seed: the row and table as before --seeds
    assert row == runs[0] and "seeds" not in row and "| 60.0 | 60.0 |" in table
    assert "standard error" not in table
    return
  # Accuracies 60, 64, 68: mean 64, standard error 4 / sqrt(3) = 2.3.
  assert row["sst2_accuracy"] == pytest.approx(64.0) and row["seeds"] == runs
  assert [r["seed"] for r in runs] == [0, 1, 2] and "seed" not in row
  assert row["sst2_accuracy_se"] == pytest.approx(4 / 3**0.5)
  assert row["pretrain_validation_loss"] == pytest.approx(6.0)
  assert "| 64.0 ± 2.3 (60.0, 64.0, 68.0) | 64.0 ± 2.3 (60.0, 64.0, 68.0) |" in table
  assert "mean ± standard error over 3 seeds" in table


def test_no_seeds_is_one_error_line_for_every_table(tmp_path):
  result = _compare(tmp_path, "--table=objectives", "--seeds=0", "--output_dir=out")
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1] == "ERROR: --seeds=0: must be at least 1"


def test_the_no_pretraining_row_fine_tunes_random_weights(tmp_path):
  out = _fake_runs(tmp_path, -1, "--table=objectives", "--seeds=2")
  assert out["variant"] == out["last_variant"] == "no pre-training"  # the table's last row
  # No pre-training run: SST-2 and RTE per seed, each from random weights.
  assert len(out["calls"]) == 4
  for args in out["calls"]:
    assert "--gin.INITIAL_CHECKPOINT_PATH=None" in args and "--gin_file=runs/finetune.gin" in args
  assert out["model_info_dirs"] == [
    f"{tmp_path}/no_pre_training/sst2",
    f"{tmp_path}/no_pre_training_s1/sst2",
  ]
  first = out["runs"][0]
  assert first["pretrain_steps"] == 0 and first["pretrain_validation_loss"] is None
  assert "| no pre-training | - | 1 | - | - | 62.0 ± 2.0 (60.0, 64.0) |" in out["table"]
