"""colab/*.ipynb: committed without outputs, and executed top to bottom at their smoke preset.

Each notebook is committed at `PRESET = "tiny"` (a run worth reading on a CPU runtime) and offers a
smaller `"smoke"` beside it: the same code path at the smallest sizes that still run every cell and
give every plot its data (a few steps, iterations, prompts and held-out tasks, a short warm start).
The fixture sets the parameters cell's `PRESET = "tiny"` to `"smoke"` in memory before executing,
and that notebook's test fails if the line is not there.

Every notebook runs in a fresh `python3` kernel (ipykernel) driven by nbclient; any cell
error fails its test. The kernels do not inherit conftest.py's jax set-up, so their
environment is given explicitly: CPU, one host device (no forced device count), LLVM at
its quickest level (cpu_env.COMPILE_BOUND_FLAGS: a smoke run is mostly compilation) except
for parl.ipynb, whose rollouts run long enough to pay for level 1 (cpu_env.COMPILE_FLAGS;
measured one notebook at a time, CPU-s at level 1 -> 0: parl 111 -> 122, fusion_and_muonclip
83 -> 70, rl_losses 60 -> 41, quickstart 43 -> 41, toggle 9 -> 10), one
workdir for the session, shared as on a Colab runtime (the RL notebooks share one SFT
warm start through it), and the test session's jax cache (conftest.py's), which the setup
cell keeps. One kernel runs at a time (longest first): the suite's other xdist worker keeps
the second core busy, and two kernels beside it put three busy processes on two cores (the
whole suite, 1,528 s and 2,980 CPU-s with two kernels at a time, 1,335 s and 2,603 CPU-s with
one, the same tests on the same day: docs/performance.md). (README's PARL command runs in
tests/test_stage_parl.py, as the preemption test's uninterrupted run.)
"""
import asyncio
import glob
import os
import re

import nbformat
import pytest
from cpu_env import xla_flags
from nbclient import NotebookClient

COLAB = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "colab"))
NAMES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(COLAB, "*.ipynb")))
RUN_BOUND = ("parl.ipynb",)      # the notebooks compiled at level 1; the others at level 0
LONGEST_FIRST = ("parl.ipynb", "fusion_and_muonclip.ipynb", "rl_losses.ipynb", "quickstart.ipynb", "toggle.ipynb")
KERNELS_AT_ONCE = 1
CELL_TIMEOUT_S = 900
COMMITTED_PRESET = re.compile(r'^PRESET = "tiny"', re.MULTILINE)   # the parameters cell's first line


def _load(name: str) -> nbformat.NotebookNode:
  return nbformat.read(os.path.join(COLAB, name), as_version=4)


def _at_smoke(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
  """`nb` with its parameters cell's `PRESET = "tiny"` set to `PRESET = "smoke"` (in memory)."""
  found = [c for c in nb.cells if c.cell_type == "code" and COMMITTED_PRESET.search(c.source)]
  assert len(found) == 1, f'{len(found)} code cells set PRESET = "tiny"; the smoke run needs exactly one'
  found[0].source = COMMITTED_PRESET.sub('PRESET = "smoke"', found[0].source)
  return nb


def _kernel_env(name: str, workdir: str) -> dict:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(compile_bound=name not in RUN_BOUND),
             K25JAX_COLAB_WORKDIR=workdir, MPLBACKEND="module://matplotlib_inline.backend_inline")
  return env


async def _execute_all(workdir: str) -> dict:
  """name -> the executed notebook, or the exception its execution raised."""
  slots = asyncio.Semaphore(KERNELS_AT_ONCE)
  order = [n for n in LONGEST_FIRST if n in NAMES] + [n for n in NAMES if n not in LONGEST_FIRST]

  async def execute(name):
    async with slots:
      try:
        nb = _at_smoke(_load(name))
        client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                resources={"metadata": {"path": COLAB}})
        await client.async_execute(env=_kernel_env(name, workdir))
      except Exception as e:  # pylint: disable=broad-except  (reported by the notebook's own test)
        return name, e
      return name, nb

  return dict(await asyncio.gather(*(execute(n) for n in order)))


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
  return asyncio.run(_execute_all(str(tmp_path_factory.mktemp("colab"))))


def test_every_ablation_has_a_notebook():
  assert set(LONGEST_FIRST) <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_committed_without_outputs(name):
  """Diffs stay reviewable: no outputs, no execution counts."""
  for i, cell in enumerate(_load(name).cells):
    if cell.cell_type == "code":
      assert cell.outputs == [] and cell.execution_count is None, f"{name} cell {i} has outputs; strip them"


@pytest.mark.parametrize("name", NAMES)
def test_markdown_says_what_the_plot_shows_and_what_the_paper_reported(name):
  text = "\n".join(c.source for c in _load(name).cells if c.cell_type == "markdown")
  assert "**What the plot shows.**" in text and "**For comparison.**" in text


@pytest.mark.parametrize("name", NAMES)
def test_parameters_cell_documents_the_smoke_preset(name):
  """The preset the notebook tests run is offered to readers too, in the cell that picks it."""
  cell = next(c for c in _at_smoke(_load(name)).cells if c.cell_type == "code" and 'PRESET = "smoke"' in c.source)
  assert '"smoke":' in cell.source, f'{name}: say what "smoke" is in the comment beside PRESET'


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_runs_top_to_bottom_and_plots_inline(name, executed):
  nb = executed[name]
  if isinstance(nb, Exception):
    raise nb                                   # a CellExecutionError names the cell and its traceback
  images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
  assert images, f"{name} shows no inline plot"
