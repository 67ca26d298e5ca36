"""The package's layers: every module in one, imports only downwards, no cycles.

LAYERS is the rule: lowest first, each a list of subpackages (every module in the
folder) and top-level modules of t5x_lite. A module may import its own layer and the
layers before it. README.md's package map describes the same folders in prose.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "t5x_lite"

LAYERS: list[tuple[str, list[str]]] = [
  ("core", ["core"]),  # errors, paths, cache, start-up, gin parsing, types
  ("kernels", ["kernels"]),  # backend implementations of the network's primitives
  ("nn", ["nn"]),  # the network math
  ("data", ["data"]),  # sources, vocabulary, objectives, mixing, the pipeline
  # distillation.py restores its teacher through checkpoint.checkpoints; electra.py names
  # its pre-training-only params after checkpoint.checkpoints.PRETRAINING_ONLY_PARAMS.
  ("checkpoint", ["checkpoint"]),
  # The contract (base_model) and its members; the trainer and the loop call the contract.
  (
    "model",
    [
      "base_model",
      "models",
      "distillation",
      "distillation_modes",
      "codistillation",
      "electra",
    ],
  ),
  ("training", ["training"]),
  # interop.t5x converts Adafactor state through training.factored_moments.
  ("interop", ["interop"]),
  # run.train_lib evaluates during training through run.eval_lib.
  ("run", ["run"]),
  ("entry points", ["cli", "train", "eval", "infer"]),  # cli.setup imports data.pipeline
]


def _modules() -> list[str]:
  """Dotted names of every module of the package, `__init__` files excluded."""
  return sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts)
    for p in PACKAGE.rglob("*.py")
    if p.stem != "__init__"
  )


def _layer_of(module: str) -> int:
  """The LAYERS index of `t5x_lite.<unit>[.<name>]` (KeyError if its unit is unlisted)."""
  unit = module.split(".")[1]
  return {u: i for i, (_, units) in enumerate(LAYERS) for u in units}[unit]


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
  """Package modules that `module` imports when it runs (at import time or in a function)."""
  path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
  tree = ast.parse(path.read_text(encoding="utf-8"))
  known = set(_modules())
  found = set()
  typing_only = _type_checking_imports(tree)
  for node in ast.walk(tree):
    if node in typing_only:
      continue
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("t5x_lite"):
      assert node.level == 0, f"{module}: relative import"
      # `from t5x_lite.nn import layers` imports a module; `from t5x_lite.nn.layers import
      # Dense` a name of one.
      for alias in node.names:
        name = f"{node.module}.{alias.name}"
        found.add(name if name in known else node.module)
    elif isinstance(node, ast.Import):
      found |= {a.name for a in node.names if a.name.startswith("t5x_lite.")}
  unknown = found - known
  assert not unknown, f"{module} imports {sorted(unknown)}, which are not modules"
  return found - {module}


def test_every_module_is_in_exactly_one_layer():
  units = [u for _, layer in LAYERS for u in layer]
  assert len(units) == len(set(units)), units
  folders = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
  top_level = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
  assert sorted(units) == sorted(folders + top_level)
  for module in _modules():
    _layer_of(module)  # raises KeyError for a module outside every layer


def test_only_listed_modules_sit_directly_in_the_package():
  top_level = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
  listed = {u for _, layer in LAYERS for u in layer if (PACKAGE / f"{u}.py").exists()}
  assert top_level == listed, f"move {sorted(top_level - listed)} into a layer's folder"


def test_subpackage_inits_import_nothing():
  for init in PACKAGE.rglob("__init__.py"):
    tree = ast.parse(init.read_text(encoding="utf-8"))
    assert ast.get_docstring(tree), f"{init}: say what the layer owns"
    assert len(tree.body) == 1, f"{init}: only a docstring (importing changes nothing)"


def test_modules_import_only_their_own_or_earlier_layers():
  upward = [
    f"{module} ({LAYERS[_layer_of(module)][0]}) imports {dep} ({LAYERS[_layer_of(dep)][0]})"
    for module in _modules()
    for dep in sorted(_imports(module))
    if _layer_of(dep) > _layer_of(module)
  ]
  assert not upward, upward


def test_no_import_cycles():
  graph = {m: _imports(m) for m in _modules()}
  done: set[str] = set()

  def visit(module: str, path: tuple[str, ...]) -> None:
    assert module not in path, f"import cycle: {' -> '.join(path + (module,))}"
    if module in done:
      return
    for dep in graph[module]:
      visit(dep, path + (module,))
    done.add(module)

  for module in graph:
    visit(module, ())
