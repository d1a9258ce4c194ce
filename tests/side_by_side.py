"""Independent subprocesses of one test, run side by side: the test process only waits on them, so on the suite's
two cores two at a time take about half the wall time of one after another (the benchmark dry runs are each a
process start, imports and a single-threaded interpreter or eager loop).

    r1, r2 = run_side_by_side(dict(args=[...], timeout=300), dict(args=[...], env=env, timeout=300))

Each dict holds subprocess.run's keyword arguments; captured text output and the repository root as the working
folder unless it says otherwise. Each process gets OMP_NUM_THREADS=1 unless its environment sets it: a second
OpenMP thread waits whenever the other core is busy (tests/conftest.py), and here the other core is the other run.
"""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIDE = 2  # processes at a time (the CI machine has two cores)


def _run(kw: dict, keep_errors: bool = False) -> subprocess.CompletedProcess | subprocess.SubprocessError:
    env = dict(kw.get("env") or os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        return subprocess.run(**{"capture_output": True, "text": True, "cwd": ROOT, **kw, "env": env})
    except subprocess.TimeoutExpired as e:
        if keep_errors:
            return e
        raise


def run_side_by_side(*commands: dict, keep_errors: bool = False) -> list:
    """Runs the commands, at most SIDE (and the machine's core count) at a time, started in the order given;
    their results in that order. A run past its own timeout raises here, as subprocess.run's would, once the
    others are done; keep_errors: its TimeoutExpired stands in its result's place instead."""
    with ThreadPoolExecutor(max_workers=max(1, min(SIDE, os.cpu_count() or 1, len(commands)))) as pool:
        return list(pool.map(lambda kw: _run(kw, keep_errors), commands))
