"""The repository is formatted and linted by ruff as configured in ruff.toml."""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _ruff(*args: str) -> subprocess.CompletedProcess:
  ruff = shutil.which("ruff")
  if ruff is None:
    pytest.fail("ruff is not installed: pip install -e '.[test]'")
  return subprocess.run([ruff, *args], cwd=ROOT, capture_output=True, text=True, check=False)


def test_code_is_formatted():
  result = _ruff("format", "--check", ".")
  assert result.returncode == 0, f"run `ruff format .`:\n{result.stdout}{result.stderr}"


def test_code_passes_the_linter():
  result = _ruff("check", ".")
  assert result.returncode == 0, f"run `ruff check .`:\n{result.stdout}{result.stderr}"
