"""Types and names: the package type-checks, and its modules are built by keyword.

The type check is basedpyright (pyright's rules, basic mode) over t5x_lite/ as
pyrightconfig.json configures it; a third-party stub gap is silenced on its own line
with `# pyright: ignore[rule]`, and an ignore that is no longer needed fails too.
"""

import ast
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "t5x_lite"


def _basedpyright() -> str:
  """The basedpyright beside this Python (its virtualenv), else the one on PATH."""
  beside = pathlib.Path(sys.executable).parent / "basedpyright"
  found = str(beside) if beside.exists() else shutil.which("basedpyright")
  if found is None:
    pytest.fail("basedpyright is not installed: pip install -e '.[test]'")
  return found


def test_package_type_checks():
  result = subprocess.run(
    [_basedpyright(), "--pythonpath", sys.executable],
    cwd=ROOT,
    capture_output=True,
    text=True,
    check=False,
  )
  errors = [line.strip() for line in result.stdout.splitlines() if " - error: " in line]
  assert result.returncode == 0, (
    f"basedpyright (run `basedpyright` from the repository root) reports "
    f"{len(errors)} errors:\n" + "\n".join(errors or [result.stdout + result.stderr])
  )
  assert "0 errors" in result.stdout, result.stdout  # it checked, and found nothing


def _module_classes(trees: dict[pathlib.Path, ast.Module]) -> set[str]:
  """Names of the package's flax modules: nn.Module subclasses, directly or through
  another of them, and names bound to a flax transform of one (`nn.map_variables(X, ...)`)."""
  bases = {
    node.name: {ast.unparse(b).split(".")[-1] for b in node.bases}
    for tree in trees.values()
    for node in ast.walk(tree)
    if isinstance(node, ast.ClassDef)
  }
  transformed = {
    (target.id, ast.unparse(node.value.args[0]).split(".")[-1])
    for tree in trees.values()
    for node in ast.walk(tree)
    if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and node.value.args
    for target in node.targets
    if isinstance(target, ast.Name)
  }
  found = {"Module"}
  while True:
    more = {name for name, parents in bases.items() if parents & found}
    more |= {name for name, wrapped in transformed if wrapped in found}
    if more <= found:
      return found - {"Module"}
    found |= more


def test_modules_and_config_are_constructed_with_keywords():
  trees = {path: ast.parse(path.read_text(encoding="utf-8")) for path in PACKAGE.rglob("*.py")}
  constructed = _module_classes(trees) | {"T5Config"}
  assert {"Transformer", "SharedTransformer", "MultiHeadAttention", "Projection"} <= constructed
  positional = [
    f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:80]}"
    for path, tree in trees.items()
    for node in ast.walk(tree)
    if isinstance(node, ast.Call)
    and ast.unparse(node.func).split(".")[-1] in constructed
    and node.args
  ]
  assert not positional, "construct with keyword arguments (config=..., ...):\n" + "\n".join(
    positional
  )
