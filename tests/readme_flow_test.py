"""The commands of README.md and docs/, run as a new user types them.

Every fenced shell command of the pages in `DOCUMENTS` runs in that order (the order
a reader follows, README first), in two halves that run side by side (`HALVES`: each
a run of pages; the second starts with the README's quickstart, the only earlier
command its pages use), from a copy of the repository root that already holds a
`runs/` folder, with the pages' own relative paths, through `bash` with the test
interpreter's directory first on PATH (as an activated venv has it). Code and gin
blocks whose heading names a file (`my_tasks.py`, `my_sentiment.gin`) are written to
that file first, as a reader following the guide would. Commands are shortened only
by the overrides the README documents (`SHORTENING` below, in its "What the
quickstart does"), and the only commands not run are those in `SKIPPED`, each with
the reason. A page edit that breaks a command, or a command with no rule here, fails
this test, naming the page and line (`docs/new_task.md:LINE`). Every docs page is in
`DOCUMENTS` or in `NOT_WALKED` with the test that runs it instead, and every link
between the pages resolves.

Data: `../shared/data` beside the copy holds tiny GLUE SST-2 files written here; the
task guide's own example rows are its data files.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from xla_flags import xla_flags

REPO = Path(__file__).resolve().parents[1]

# The pages whose commands run here, in the order a reader follows them.
DOCUMENTS = (
  "README.md",
  "docs/training.md",
  "docs/new_task.md",
  "docs/evaluate.md",
  "docs/checkpoints.md",
  "docs/finetune_sst2.md",
  "docs/comparisons.md",
  "docs/scaling.md",
  "docs/interfaces.md",
  "docs/testing.md",
)
# The docs pages not walked here, each with the test that runs it instead.
NOT_WALKED = {
  "docs/python_api.md": "its blocks are Python: tests/python_api_test.py runs them in order",
  "docs/recipes.md": "hour-long trainings on the real data: tests/recipes_test.py runs its "
  "commands on tiny files with a tiny model",
  "docs/performance.md": "benchmark runs of minutes each: tests/benchmark_test.py runs "
  "tools/benchmark.py tiny, tests/gpu_benchmark_test.py tools/gpu_benchmark.sh --dry_run, "
  "tests/attention_benchmark_test.py tools/attention_benchmark.py",
}
# The two halves, one per pytest-xdist worker, the first the longer (docs/training.md
# alone holds about twenty training commands; the other worker fills in around it with
# shorter tests): the second starts with the README's quickstart (the only earlier
# command its pages use) and then runs its own pages.
HALVES = (DOCUMENTS[:3], DOCUMENTS[3:])

# What the README documents for trying a command quickly, by entry point.
SHORTENING = {
  "python -m t5x_lite.train": "--gin.TRAIN_STEPS=3 --gin.EVAL_STEPS=1",
  "python -m t5x_lite.eval": "--gin.NUM_EXAMPLES=8",
}
# Commands that are not run here: (pattern in the command or its section, reason).
SKIPPED = (
  ("pytest", "runs this test suite"),
  (
    "--precompile",
    "compiles T5 1.1 small..xxl for a TPU slice (minutes to an hour); "
    "tests/precompile_test.py compiles the same path for a tiny model",
  ),
  ("c4_v220", "reads C4 from TFDS, which is not on this machine"),
  ("tools/benchmark.py", "times T5 1.1 small for minutes; tests/benchmark_test.py runs it tiny"),
  (
    "tools/t5x_peer_precompile.py",
    "compiles T5X's T5 1.1 base for a TPU slice in T5X's own virtualenv (minutes)",
  ),
  ("pip install", "the package and its extras are installed already"),
  (
    "recipes/",
    "trains the recipes on the real ../shared/data (an hour each); "
    "tests/recipes_test.py runs the same commands on tiny files with a tiny model",
  ),
  (
    "my_task.gin",
    "the general recipe starts from the recipes' pre-trained checkpoint; "
    "tests/recipes_test.py runs it on a tiny task",
  ),
  ("Run on a TPU pod or GPU cluster", "needs a TPU slice or a GPU cluster"),
  (
    "tools/compare.py",
    "trains 3 to 10 variants for an hour per table; tests/compare_test.py runs one row tiny",
  ),
)
_COMMAND_WORDS = ("python", "printf", "pip")
_FILE_IN_HEADING = re.compile(r"`([\w./-]+\.(?:py|gin))`")


@dataclasses.dataclass
class Block:
  """One fenced block of a page and the headings it sits under."""

  section: str  # the `##` heading
  heading: str  # the innermost heading
  lang: str
  text: str
  line: int


def markdown_blocks(text: str) -> list[Block]:
  """Fenced blocks of a Markdown text, in order (indented fences included)."""
  blocks, section, heading = [], "", ""
  lines = text.splitlines()
  i = 0
  while i < len(lines):
    stripped = lines[i].strip()
    if stripped.startswith("#") and not stripped.startswith("#!"):
      heading = stripped.lstrip("#").strip()
      if stripped.startswith("## "):
        section = heading
    elif stripped.startswith("```"):
      indent = len(lines[i]) - len(lines[i].lstrip())
      lang, start, body = stripped[3:].strip(), i + 1, []
      i += 1
      while not lines[i].strip().startswith("```"):
        body.append(lines[i][indent:])
        i += 1
      blocks.append(Block(section, heading, lang, "\n".join(body) + "\n", start))
    i += 1
  return blocks


def shell_commands(text: str) -> list[str]:
  """Logical commands of a shell block: continuation lines joined, comments dropped."""
  commands, current = [], ""
  for line in text.splitlines():
    if not current and (not line.strip() or line.lstrip().startswith("#")):
      continue
    if line.rstrip().endswith("\\"):
      current += line.rstrip()[:-1] + " "
      continue
    commands.append(_without_comment(current + line).strip())
    current = ""
  return commands


def _without_comment(command: str) -> str:
  """`command` without a trailing `# comment` (a `#` outside quotes after a space)."""
  quote = None
  for i, char in enumerate(command):
    if quote:
      quote = None if char == quote else quote
    elif char in "'\"":
      quote = char
    elif char == "#" and i > 0 and command[i - 1].isspace():
      return command[:i]
  return command


def _is_shell(block: Block) -> bool:
  """A `bash` or `sh` block, or an unlabelled one that starts with a command (not output,
  a file listing or data rows)."""
  first = block.text.lstrip().split(None, 1)
  if block.lang in ("bash", "sh"):
    return bool(first)
  return block.lang == "" and bool(first) and first[0].startswith(_COMMAND_WORDS)


def _skip_reason(command: str, block: Block) -> str | None:
  for pattern, reason in SKIPPED:
    if pattern in command or pattern == block.section:
      return reason
  return None


def _runnable(command: str) -> str:
  """The command without an install prefix (`... pip install ... && CMD`), shortened."""
  if "pip install" in command and "&&" in command:
    command = command.rsplit("&&", 1)[1].strip()
  for entry_point, overrides in SHORTENING.items():
    if command.startswith(entry_point):
      command = f"{command} {overrides}"
  return command


@dataclasses.dataclass
class Step:
  """One thing the reader does: run a command or write a file."""

  document: str  # the page, relative to the repository root
  line: int
  command: str | None = None
  file: str | None = None
  text: str = ""


def document_steps(document: str) -> tuple[list[Step], list[tuple[str, str]]]:
  """(steps to run, (command, reason) pairs skipped) of one page, in its order."""
  text = (REPO / document).read_text()
  steps, skipped = [], []
  for block in markdown_blocks(text):
    named = _FILE_IN_HEADING.findall(block.heading)
    if named and not _is_shell(block):
      steps.append(Step(document, block.line, file=named[-1], text=block.text))
      continue
    if block.heading.endswith("Your data") and not _is_shell(block):
      for name in re.findall(r"`([\w./-]+\.tsv)`", _paragraph_before(text, block.line)):
        steps.append(Step(document, block.line, file=name, text=block.text))
      continue
    if not _is_shell(block):
      continue
    for command in map(_runnable, shell_commands(block.text)):
      reason = _skip_reason(command, block)
      if reason:
        skipped.append((command, reason))
      else:
        steps.append(Step(document, block.line, command=command))
  return steps, skipped


def all_steps() -> tuple[list[Step], list[tuple[str, str]]]:
  """The steps and skipped commands of every page of DOCUMENTS, in reading order."""
  steps, skipped = [], []
  for document in DOCUMENTS:
    more, more_skipped = document_steps(document)
    steps += more
    skipped += more_skipped
  return steps, skipped


def _paragraph_before(text: str, line: int) -> str:
  """The non-empty lines just before a block's fence (1-based `line` of its body)."""
  before = text.splitlines()[: line - 1]
  paragraph: list[str] = []
  for previous in reversed(before[:-1]):
    if not previous.strip():
      break
    paragraph.insert(0, previous)
  return "\n".join(paragraph)


def _sst2_fixture(data_dir: Path) -> None:
  """Tiny GLUE SST-2 files in the layout of ../shared/data (header row, sentence<TAB>label)."""
  sst2 = data_dir / "glue" / "SST-2"
  sst2.mkdir(parents=True)
  good = ["a gorgeous , witty film .", "deeply moving and funny .", "a delight from start to end ."]
  bad = ["a tedious , joyless mess .", "it drags on and on .", "flat , dull and far too long ."]
  rows = [f"{s}\t1" for s in good] + [f"{s}\t0" for s in bad]
  for name in ("train.tsv", "dev.tsv"):
    (sst2 / name).write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")


def _not_copied(directory: str, names: list[str]) -> set[str]:
  """What a fresh clone lacks: git data, the venv, caches and the top-level runs/."""
  skipped = {
    n
    for n in names
    if n in (".git", ".venv", "__pycache__", ".pytest_cache") or n.endswith(".egg-info")
  }
  if Path(directory) == REPO:
    skipped |= {n for n in names if n in ("runs", "my_data", "inputs.jsonl", "reviews.jsonl")}
  return skipped


def _user_env() -> dict[str, str]:
  """A user's environment: the test's interpreter first on PATH, one CPU device.

  Two additions, neither of which changes what the commands do or print: the suite's
  JAX persistent compilation cache (`tests/conftest.py`, every program cached), so the
  many commands that compile the same tiny programs compile each once per machine (a
  cache hit loads the executable the compiler produced for the identical program), and
  the suite's fast-compiling XLA flags (`xla_flags.FAST_COMPILE`).
  """
  env = {
    k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "PYTHONPATH")
  }
  env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
  env["XLA_FLAGS"] = xla_flags()
  for name in (
    "JAX_COMPILATION_CACHE_DIR",
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES",
  ):
    assert env.get(name), f"{name} is set by tests/conftest.py"
  return env


def _half(steps: list[Step], half: int) -> list[Step]:
  """The steps of HALVES[half]; the second half starts with the README's quickstart."""
  own = [s for s in steps if s.document in HALVES[half]]
  return own if half == 0 else [steps[0], *own]


def test_readme_has_the_flows_this_test_promises():
  steps, skipped = all_steps()
  halves = [_half(steps, 0), _half(steps, 1)]
  assert sum(HALVES, ()) == DOCUMENTS and all(HALVES)
  assert len(halves[0]) + len(halves[1]) == len(steps) + 1  # the quickstart runs in both
  assert halves[0][0] == halves[1][0] == steps[0] and steps[0].document == "README.md"
  assert halves[1][1].document == HALVES[1][0]  # after the quickstart, its own first page
  commands = [s.command for s in steps if s.command]
  files = [s.file for s in steps if s.file]
  assert commands[0] == (
    "python -m t5x_lite.train --gin_file=quickstart.gin " + SHORTENING["python -m t5x_lite.train"]
  )
  for expected in (
    "quickstart_finetune.gin",
    "tools/plot_metrics.py",
    "tools/show_task.py",
    "tools/model_info.py",
    "t5x_lite.eval",
    "t5x_lite.infer",
    "runs/adapters.gin",
    "runs/distill.gin",
    "quickstart_prefix_lm.gin",
    "local_glue_sst2",
    "my_sentiment",
    "tools/convert_hf_checkpoint.py",
    "tools/convert_t5x_checkpoint.py",
  ):
    assert any(expected in c for c in commands), expected
  assert {"my_tasks.py", "my_sentiment.gin"} <= set(files)
  assert any(f.endswith(".tsv") for f in files)
  walked = {s.document for s in steps if s.command}
  assert set(DOCUMENTS[:6]) <= walked  # the guides' pages; the rest are skipped or prose
  assert any("pytest" in c for c, _ in skipped)
  # Every rule of SKIPPED skips a command of some page (walked here, or by its own test):
  # none is left over from an edited page.
  for document in NOT_WALKED:
    skipped += document_steps(document)[1]
  assert [r for _, r in SKIPPED if r not in {reason for _, reason in skipped}] == []


def test_every_docs_page_is_walked_or_excluded_with_a_reason():
  pages = sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.md"))
  assert set(DOCUMENTS).isdisjoint(NOT_WALKED)
  assert [p for p in pages if p not in DOCUMENTS and p not in NOT_WALKED] == []
  assert [p for p in (*DOCUMENTS, *NOT_WALKED) if not (REPO / p).is_file()] == []
  assert all(reason.strip() for reason in NOT_WALKED.values())


_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(text: str) -> set[str]:
  """GitHub's anchors of a page's headings (outside code blocks)."""
  anchors: set[str] = set()
  fence = False
  for line in text.splitlines():
    if line.strip().startswith("```"):
      fence = not fence
    elif not fence and re.match(r"#{1,6} ", line):
      slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
      anchor, n = slug, 1
      while anchor in anchors:
        anchor, n = f"{slug}-{n}", n + 1
      anchors.add(anchor)
  return anchors


def test_links_between_the_pages_resolve():
  pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
  broken = []
  for page in pages:
    text = page.read_text()
    prose = "\n".join(
      b for i, b in enumerate(re.split(r"^\s*```.*$", text, flags=re.M)) if i % 2 == 0
    )
    for target in _LINK.findall(re.sub(r"`[^`\n]*`", "", prose)):
      if re.match(r"[a-z]+:", target):
        continue  # http:, https:, mailto:
      path, _, anchor = target.partition("#")
      resolved = (page.parent / path).resolve() if path else page
      where = f"{page.relative_to(REPO)}: {target}"
      if not resolved.exists():
        broken.append(f"{where} (no such file)")
      elif anchor and anchor not in _anchors(resolved.read_text()):
        broken.append(f"{where} (no such heading)")
  assert broken == []


def test_readme_is_a_front_page():
  lines = (REPO / "README.md").read_text().splitlines()
  assert len(lines) <= 250, f"README.md has {len(lines)} lines; move reference to docs/"
  headings = [line for line in lines if line.startswith("## ")]
  assert headings[0] == "## Install and run the quickstart"
  assert headings[-1] == "## Documentation"


@pytest.mark.slow
@pytest.mark.parametrize("half", [0, 1], ids=["readme_to_new_task", "evaluate_on"])
def test_readme_commands_run_as_written(tmp_path, half):
  root = tmp_path / "t5x_lite"
  shutil.copytree(REPO, root, ignore=_not_copied)
  (root / "runs").mkdir()  # what the quickstart leaves; gin includes must not see it
  _sst2_fixture(tmp_path / "shared" / "data")
  steps = _half(all_steps()[0], half)
  env = _user_env()
  for step in steps:
    if step.file:
      path = root / step.file
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_text(step.text)
      continue
    start = time.time()
    result = subprocess.run(
      ["bash", "-c", step.command], cwd=root, env=env, capture_output=True, text=True, timeout=900
    )
    output = result.stdout + result.stderr
    where = f"{step.document}:{step.line}"
    print(f"{time.time() - start:5.0f} s  {where}  {step.command[:90]}")  # with -s or -rP
    assert result.returncode == 0, (
      f"{where}: `{step.command}` exited {result.returncode} after "
      f"{time.time() - start:.0f} s:\n{output[-4000:]}"
    )
    assert "Traceback" not in output, f"{where}: `{step.command}`:\n{output[-4000:]}"
