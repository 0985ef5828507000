"""How the benchmarks time ours against a peer so that the ratio measures the code, not the machine.

* One process times every contender, interleaved: after `warmup` calls of each, `steps`
  rounds of one call of every contender in turn (A B C A B C ...), so noise from outside
  hits all of them alike. Each gets its step times; the median is what is compared.
* The load: the CPU time other processes used while the rounds ran, in cores (the busy
  time of /proc/stat minus this process's own). With two threads, torch slows 4–6x
  beside another job and XLA far less, so a ratio timed beside other work measures the
  work beside it: a process that saw more than `max_load` cores of it is marked loaded.
* Several processes, one after the other (`run_processes`): the figure is the median
  over unloaded processes of each contender's median, with the range across processes.
* Page faults (`minor_page_faults`): memory a step gets fresh from the kernel is faulted in
  page by page, and a VM pays dearly for it (on the 2-core machine, ~2 µs of system time
  per 4 KB page: XLA:CPU maps its whole temporary buffer anew at every execution, torch
  its large tensors). The faults per call are recorded beside the times.
* Benchmarks that time in their own loops measure the load with `LoadMeter` and call
  `refuse_if_loaded` before writing.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

MAX_LOAD = 0.1   # cores other processes may use while a benchmark times


def busy_seconds() -> float:
  """CPU seconds the whole machine has been busy (all cores; /proc/stat minus idle and iowait)."""
  with open("/proc/stat") as f:
    fields = [int(x) for x in f.readline().split()[1:]]
  return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def own_seconds() -> float:
  times = os.times()
  return times.user + times.system


class LoadMeter:
  """`with LoadMeter() as load:` ... then `load.other_cores`: the cores other processes used
  meanwhile (the machine's busy CPU time minus this process's, over the wall time)."""

  def __enter__(self) -> "LoadMeter":
    self.other_cores = float("nan")
    self._busy, self._own, self._start = busy_seconds(), own_seconds(), time.perf_counter()
    return self

  def __exit__(self, *exc) -> None:
    wall = time.perf_counter() - self._start
    self.other_cores = max(0.0, (busy_seconds() - self._busy) - (own_seconds() - self._own)) / wall


def round_robin(closures: dict[str, Callable[[], object]], steps: int, warmup: int
                ) -> tuple[dict[str, list[float]], float]:
  """Step times of each closure over `steps` interleaved rounds after `warmup` calls each, and
  the cores other processes used meanwhile."""
  for fn in closures.values():
    for _ in range(warmup):
      fn()
  times = {name: [] for name in closures}
  with LoadMeter() as load:
    for _ in range(steps):
      for name, fn in closures.items():
        t = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - t)
  return times, load.other_cores


def minor_page_faults(closures: dict[str, Callable[[], object]], calls: int = 3) -> dict[str, int]:
  """The median count of minor page faults (pages first touched) of one call of each closure."""
  faults = {}
  for name, fn in closures.items():
    counts = []
    for _ in range(calls):
      before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      fn()
      counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    faults[name] = int(statistics.median(counts))
  return faults


def add_load_arguments(parser) -> None:
  """--max_load and --allow_load (`refuse_if_loaded`)."""
  parser.add_argument("--max_load", type=float, default=MAX_LOAD, help="cores other processes may use")
  parser.add_argument("--allow_load", action="store_true", help="write the result even if a run was loaded")


def add_process_arguments(parser) -> None:
  """--processes, the load arguments and the hidden --one=FILE of a child of `runs_or_child`."""
  parser.add_argument("--processes", type=int, default=3)
  add_load_arguments(parser)
  parser.add_argument("--one", default=None, help=argparse.SUPPRESS)   # a child process: write its run here


def runs_or_child(script: str, args, one_process: Callable, child_args: list[str]) -> list[dict] | None:
  """In a child (--one=FILE): writes `one_process(args)` there and returns None. Otherwise runs
  `args.processes` children of `script` with `child_args` and returns their runs."""
  if args.one:
    with open(args.one, "w") as f:
      json.dump(one_process(args), f)
    return None
  return run_processes(script, child_args, args.processes)


def run_processes(script: str, args: list[str], processes: int) -> list[dict]:
  """Runs `script --one=FILE *args` `processes` times, one after the other; their results."""
  runs = []
  with tempfile.TemporaryDirectory() as tmp:
    for i in range(processes):
      path = os.path.join(tmp, f"{i}.json")
      subprocess.run([sys.executable, script, f"--one={path}", *args], check=True)
      with open(path) as f:
        runs.append(json.load(f))
  return runs


def summarize(runs: list[dict], peers: list[str], work: float, max_load: float = MAX_LOAD) -> dict:
  """Per contender (runs[i]["times"]): the median over unloaded processes (all, if none was
  unloaded) of its median time, the range of its times, `work` per second, and its speed
  against the best of `peers` (the fastest median among them), overall and per process."""
  clean = [r for r in runs if r["other_cores"] <= max_load]
  use = clean or runs
  table = {}
  for name in runs[0]["times"]:
    medians = [statistics.median(r["times"][name]) for r in use]
    table[name] = {"median_s": statistics.median(medians), "process_medians_s": medians,
                   "range_s": [min(min(r["times"][name]) for r in use), max(max(r["times"][name]) for r in use)],
                   "per_s": work / statistics.median(medians)}
  best = min(peers, key=lambda name: table[name]["median_s"])
  for row in table.values():
    row["speed_vs_peer"] = table[best]["median_s"] / row["median_s"]
    row["speed_vs_peer_per_process"] = [min(table[p]["process_medians_s"][i] for p in peers) / o
                                        for i, o in enumerate(row["process_medians_s"])]
  return {"contenders": table, "peer": best, "peers": list(peers), "other_cores": [r["other_cores"] for r in runs],
          "loaded_processes": len(runs) - len(clean), "max_load": max_load}


def refuse_if_loaded(other_cores: list[float], max_load: float, allow_load: bool) -> bool:
  """Whether any timed stretch ran beside more than `max_load` cores of other work; if so and
  `allow_load` is off, exits 1 saying so (no ratio timed under load may land in a results file)."""
  loaded = sum(c > max_load for c in other_cores)
  if loaded and not allow_load:
    print(f"\n{loaded} of {len(other_cores)} timed stretches ran beside other work (more than {max_load} "
          f"cores: {[round(c, 2) for c in other_cores]}): nothing written; rerun on a quiet machine (or pass "
          "--allow_load to write it marked)", file=sys.stderr)
    sys.exit(1)
  return bool(loaded)


def write_unless_loaded(path: str, result: dict, allow_load: bool) -> None:
  """Writes `result` (marked "loaded") unless a process ran beside other work and `allow_load`
  is off (`refuse_if_loaded`)."""
  result["loaded"] = refuse_if_loaded(result["other_cores"], result["max_load"], allow_load)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(result, f, indent=2)
  print(f"\nwrote {path}")
