"""The README's Layout names every package module, in layers the imports respect."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "t5x_lite"


def _layers() -> list[list[str]]:
  """Module names per `t5x_lite/ <layer>` heading of the README's Layout block."""
  readme = (ROOT / "README.md").read_text(encoding="utf-8")
  block = readme.split("## Layout", 1)[1].split("```", 2)[1]
  layers: list[list[str]] = []
  for line in block.splitlines():
    if line.startswith("t5x_lite/"):
      layers.append([])
    elif line.startswith("  ") and layers:
      # The module names start the line; the description follows two spaces later.
      names = re.split(r"\s{2,}", line.strip())[0].split()
      layers[-1] += [n[:-3] for n in names if n.endswith(".py")]
    elif line and not line.startswith(" "):
      break  # gin/, tasks/, tools/
  return layers


def _type_checking_imports(tree: ast.Module) -> set[ast.AST]:
  """Import nodes under `if TYPE_CHECKING:`: annotations only, never run."""
  return {
    node
    for block in ast.walk(tree)
    if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
    for statement in block.body
    for node in ast.walk(statement)
  }


def _imports(module: str) -> set[str]:
  """Package modules that `t5x_lite/<module>.py` imports when it runs."""
  tree = ast.parse((PACKAGE / f"{module}.py").read_text(encoding="utf-8"))
  found = set()
  typing_only = _type_checking_imports(tree)
  for node in ast.walk(tree):
    if node in typing_only:
      continue
    if isinstance(node, ast.ImportFrom) and node.module == "t5x_lite":
      found |= {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("t5x_lite."):
      found.add(node.module.split(".")[1])
    elif isinstance(node, ast.Import):
      found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("t5x_lite.")}
  return found - {module}


def test_layout_lists_every_module_once():
  listed = [m for layer in _layers() for m in layer]
  modules = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
  assert len(listed) == len(set(listed)), listed
  assert sorted(listed) == modules


def test_modules_import_only_their_own_or_earlier_layers():
  layer_of = {m: i for i, layer in enumerate(_layers()) for m in layer}
  upward = [
    f"{module} ({layer_of[module]}) imports {dep} ({layer_of[dep]})"
    for module in layer_of
    for dep in sorted(_imports(module))
    if layer_of[dep] > layer_of[module]
  ]
  assert not upward, upward


def test_no_import_cycles():
  graph = {m: _imports(m) for m in (p.stem for p in PACKAGE.glob("*.py"))}
  done: set[str] = set()

  def visit(module: str, path: tuple[str, ...]) -> None:
    assert module not in path, f"import cycle: {' -> '.join(path + (module,))}"
    if module in done:
      return
    for dep in graph.get(module, ()):
      visit(dep, path + (module,))
    done.add(module)

  for module in graph:
    visit(module, ())
