"""Multi-host training for real: two local processes run `python -m t5x_lite.train`.

Each process gets 4 fake CPU devices (XLA_FLAGS), gloo collectives and a loopback
coordinator, exactly as one would start one process per host. The data are the
offline `cpython_code_to_docstring` task, unpacked and unshuffled, so a global batch
holds the same examples however they are split between hosts: process p reads
examples p, p + 2, p + 4, ... (its own shard), and the one-process run reads them
all in order. Equal losses therefore show that every host read its own shard, the
global batch was assembled from both, and gradients were reduced across processes.

Runs (module fixture, about two minutes on 2 cores):
  reference  1 process x 8 devices, mesh data=8, steps 1-4.
  multi      2 processes x 4 devices, mesh data=8, steps 1-2, joint checkpoint at 2.
  resumed    2 processes, mesh data=4 x model=2 (`Partitioner.num_partitions=2`), resumes
             the step-2 checkpoint of `multi` and trains steps 3-4.
"""

import json
import os
import socket
import subprocess
import sys

import gin
import jax
import numpy as np
import pytest
import tasks  # noqa: F401  (registers cpython_code_to_docstring for _restore's gin)
from xla_flags import xla_flags

from t5x_lite import models
from t5x_lite.core import gin_config
from t5x_lite.checkpoint import checkpoints, train_checkpointer
from t5x_lite.training import partitioning, trainer
from t5x_lite.run import model_dir_lock, train_lib

pytestmark = pytest.mark.slow  # subprocess runs of the entry points

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = """
include 'quickstart.gin'
MIXTURE_OR_TASK_NAME = 'cpython_code_to_docstring'
TASK_FEATURE_LENGTHS = {'inputs': 32, 'targets': 8}
BATCH_SIZE = 16
EVAL_PERIOD = 0
train/DatasetConfig.pack = False
train/DatasetConfig.shuffle = False
train.log_period = 1
TrainCheckpointer.save_period = 2
"""
TIMEOUT_S = 600


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(devices: int) -> dict[str, str]:
  env = dict(os.environ)
  env.update(
    XLA_FLAGS=xla_flags(devices),
    JAX_PLATFORMS="cpu",
    JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
    TF_CPP_MIN_LOG_LEVEL="3",
  )
  return env


def _train(
  config: str,
  model_dir: str,
  steps: int,
  log_dir: str,
  processes: int,
  *extra: str,
  exit_code: int = 0,
) -> list[str]:
  """Runs the train entry point in `processes` processes (8 devices in all); each must
  exit with `exit_code`. Returns their outputs."""
  command = [
    sys.executable,
    "-m",
    "t5x_lite.train",
    f"--gin_file={config}",
    f"--gin.MODEL_DIR={model_dir}",
    f"--gin.TRAIN_STEPS={steps}",
    *extra,
  ]
  port = _free_port()
  procs, logs = [], []
  for index in range(processes):
    flags = (
      [
        f"--coordinator_address=127.0.0.1:{port}",
        f"--process_count={processes}",
        f"--process_index={index}",
      ]
      if processes > 1
      else []
    )
    log_path = os.path.join(log_dir, f"{os.path.basename(model_dir)}_{steps}_{index}.log")
    logs.append(log_path)
    with open(log_path, "w") as log:  # files, not pipes: a full pipe would stall a peer
      procs.append(
        subprocess.Popen(
          command + flags, cwd=REPO, env=_env(8 // processes), stdout=log, stderr=subprocess.STDOUT
        )
      )
  try:
    codes = [p.wait(timeout=TIMEOUT_S) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  outputs = []
  for code, log_path in zip(codes, logs):
    with open(log_path) as f:
      outputs.append(f.read())
    assert code == exit_code, f"{log_path} exited {code}:\n{outputs[-1][-4000:]}"
  return outputs


def _losses(model_dir: str) -> dict[int, float]:
  with open(os.path.join(model_dir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  train = [r for r in records if r["split"] == "train"]
  steps = [r["step"] for r in train]
  assert len(steps) == len(set(steps)), f"duplicate metric lines (several writers?): {steps}"
  return {r["step"]: r["loss"] for r in train}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("multihost")
  config = str(root / "multihost.gin")
  with open(config, "w") as f:
    f.write(CONFIG)
  dirs = {name: str(root / name) for name in ("reference", "multi")}
  _train(config, dirs["reference"], 4, str(root), 1)
  _train(config, dirs["multi"], 2, str(root), 2)
  _train(config, dirs["multi"], 4, str(root), 2, "--gin.Partitioner.num_partitions=2")
  dirs["config"] = config
  return dirs


def test_two_processes_match_one_process(runs):
  reference, multi = _losses(runs["reference"]), _losses(runs["multi"])
  assert sorted(reference) == [1, 2, 3, 4]
  for step in (1, 2):
    assert multi[step] == pytest.approx(reference[step], rel=1e-4), step
  assert reference[1] != pytest.approx(reference[2], rel=1e-3)  # the steps differ


def test_resume_on_data4_model2_mesh_continues_training(runs):
  reference, multi = _losses(runs["reference"]), _losses(runs["multi"])
  assert sorted(multi) == [1, 2, 3, 4]
  for step in (3, 4):
    assert multi[step] == pytest.approx(reference[step], rel=1e-4), step


def _restore(config: str, model_dir: str, step: int, partitioner: partitioning.Partitioner):
  gin.clear_config()
  gin_config.parse_gin([config], [])
  model = models.build_model()
  bindings = gin.get_bindings(train_lib.train)
  abstract, _ = trainer.abstract_train_state(model, bindings["optimizer"], partitioner)
  ckpt = train_checkpointer.TrainCheckpointer(model_dir)
  try:
    return ckpt.restore(step, abstract.params, abstract.opt_state)
  finally:
    ckpt.close()
    gin.clear_config()


def test_joint_checkpoint_restores_in_one_process(runs):
  partitioner = partitioning.Partitioner(num_partitions=1)
  for step in (2, 4):
    multi = _restore(runs["config"], runs["multi"], step, partitioner)
    reference = _restore(runs["config"], runs["reference"], step, partitioner)
    leaves = jax.tree.leaves(multi.params)
    assert len(leaves) > 10 and all(x.is_fully_addressable for x in leaves)
    for got, want in zip(leaves, jax.tree.leaves(reference.params)):
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)
    assert multi.meta["step"] == step
  iterator_files = os.listdir(os.path.join(runs["multi"], "2", checkpoints.DATA_ITERATOR))
  for index in (0, 1):  # each host saved its own input position
    assert any(name.startswith(f"process_{index}-of-2") for name in iterator_files)


def test_a_locked_model_dir_stops_every_process_of_the_job(runs, tmp_path):
  model_dir = str(tmp_path / "locked")
  with model_dir_lock.ModelDirLock(model_dir):  # another run, here this test's process
    outputs = _train(runs["config"], model_dir, 2, str(tmp_path), 2, exit_code=1)
  errors = [[line for line in out.splitlines() if line.startswith("ERROR:")] for out in outputs]
  assert [len(e) for e in errors] == [1, 1], outputs
  assert (
    f"is in use by another training run (host {socket.gethostname()}, pid {os.getpid()},"
    in (errors[0][0])
  )
  assert "could not be locked by process 0 of this job" in errors[1][0]
  assert not any("Traceback" in out for out in outputs), outputs
