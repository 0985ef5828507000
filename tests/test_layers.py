"""The layers of the package: configs are data, stages are leaves, kernels sit below the model, no import loops."""
import ast
import os
import subprocess
import sys

import pytest

from configs import common
from k25jax.agents import dsl
from k25jax.data import legacy_chat as chat, visual_synthetic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("k25jax", "pallas_kernels")
CONFIGS = sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".py") and f != "__init__.py")


def _modules() -> dict[str, str]:
  """Module name → file, for every module of the packages."""
  found = {}
  for package in PACKAGES:
    for folder, _, files in os.walk(os.path.join(ROOT, package)):
      for name in files:
        if name.endswith(".py"):
          path = os.path.join(folder, name)
          module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
          found[module.removesuffix(".__init__")] = path
  return found


def _imports(module: str, path: str, known: set[str]) -> set[str]:
  """The package modules `module` imports, at module level or inside functions (a `from a import b`
  depends on `a`, and on `a.b` when that is a module)."""
  package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
  names = set()
  for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
      names.add(base)
      names.update(f"{base}.{alias.name}" for alias in node.names)
  deps = set()
  for name in names:
    while name and name not in known:
      name = name.rpartition(".")[0]
    if name and name != module and not name.startswith(module + "."):   # a package's own sub-modules
      deps.add(name)
  return deps


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
  modules = _modules()
  return {m: _imports(m, p, set(modules)) for m, p in modules.items()}


def test_no_import_loops(graph):
  """Depth-first search for a back edge; reports the loop it closes."""
  state, stack = {}, []

  def visit(m):
    state[m] = "open"
    stack.append(m)
    for d in sorted(graph[m]):
      if state.get(d) == "open":
        pytest.fail("import loop: " + " -> ".join(stack[stack.index(d):] + [d]))
      if d not in state:
        visit(d)
    stack.pop()
    state[m] = "done"

  for m in sorted(graph):
    if m not in state:
      visit(m)


def test_stages_are_leaves_and_kernels_sit_below_the_model(graph):
  stages = {m for m in graph if m.startswith("k25jax.stages.")}
  assert len(stages) == 7
  for m in stages:
    assert not (graph[m] & stages), f"{m} imports another stage: {sorted(graph[m] & stages)}"
  for m in (m for m in graph if m.startswith("pallas_kernels")):
    assert not any(d.startswith("k25jax.model") for d in graph[m]), f"{m} imports the model: {sorted(graph[m])}"


@pytest.mark.parametrize("name", CONFIGS)
def test_loading_a_config_imports_no_jax(name):
  presets = {"pretrain": ("tiny", "small", "joint", "k25"), "midtrain": ("tiny", "k25", "k25,262k"),
             "rl": ("tiny", "tiny,toggle", "k25", "vision", "vision,no_tool"),
             "sft": ("tiny", "tiny,visual")}.get(name, (None,))
  code = (f"import importlib, sys\nm = importlib.import_module('configs.{name}')\n"
          f"[m.get_config(p) for p in {presets!r}] if hasattr(m, 'get_config') else None\n"
          "assert 'jax' not in sys.modules, sorted(k for k in sys.modules if k.startswith('jax'))[:5]")
  result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]


def test_the_configs_constants_match_the_package():
  assert common.CHAT_VOCAB_SIZE == chat.ChatTokenizer().vocab_size
  assert common.VISUAL_TASKS == visual_synthetic.TASKS
  from configs import parl
  assert parl.DSL_VOCAB_SIZE == dsl.VOCAB_SIZE
