"""Kernel groups run under the Triton interpreter: TRITON_INTERPRET must be set before triton is first imported,
so a test file's groups run as that file's script in subprocesses. Two subprocesses per test file, side by side,
run the groups the session selected from it, dealt between them in order (a process start with its torch / triton
imports costs 2-3 s on two cores, more than most groups take): each group's result and output are reported on
their own, and each group's test reads its own, so a failure still names its group and shows that group's output.

    script side:  if __name__ == "__main__": main(sys.argv[1:] or DEFAULT, lambda g: globals()[f"check_{g}"]())
    pytest side:  a module fixture `results = run_groups(request, __file__, "test_name")`, then
                  `check(results, group)` in the parametrized test
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "@@group"
SHARDS = 2  # processes a test file's groups run in at most (the CI machine has two cores)


def main(groups: list[str], run_one, before_each=None) -> None:
    """In the subprocess: runs each group (before_each() first, e.g. a fixed seed), printing its output between
    its own start and end marker lines; a failing group's traceback goes into its section and the next group
    still runs. Exits 1 if any group failed."""
    failed = False
    for group in groups:
        print(f"{MARK} {group} start", flush=True)
        t0 = time.time()
        try:
            if before_each is not None:
                before_each()
            run_one(group)
        except Exception:
            traceback.print_exc(file=sys.stdout)
            print(f"{MARK} {group} FAILED", flush=True)
            failed = True
        else:
            print(f"{MARK} {group} passed in {time.time() - t0:.1f}s", flush=True)
    sys.exit(1 if failed else 0)


def selected(request, test_name: str) -> list[str]:
    """The `group` parameters of test_name's items in this session (after -k / -m / --deselect), in order."""
    return [item.callspec.params["group"] for item in request.session.items
            if getattr(item, "module", None) is request.module and getattr(item, "originalname", None) == test_name]


def shards(groups: list[str], count: int) -> list[list[str]]:
    """The groups dealt round-robin into at most count non-empty lists (each keeps the groups' order)."""
    count = max(1, min(count, len(groups)))
    return [groups[i::count] for i in range(count)]


def run_groups(request, script: str, test_name: str, timeout: float = 540.0) -> dict[str, tuple[str, str]]:
    """Runs the selected groups of test_name in subprocesses of script, one a CPU core up to SHARDS, side by side
    (the interpreter runs one thread: on the suite's two cores two processes halve the wall time of the files
    whose groups take minutes): {group: (status, output)}, status 'passed', 'FAILED' or a line saying why the
    group gave no result (its process died or timed out first). Which groups share a process is fixed by their
    order, so a run is the same run every time."""
    groups = selected(request, test_name)
    if not groups:
        return {}
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    procs = []
    results: dict[str, tuple[str, str]] = {}
    pattern = re.compile(rf"^{MARK} (\S+) start$(.*?)^{MARK} \1 (passed|FAILED)", re.M | re.S)
    try:  # (the starts inside it too: a second start that fails leaves no first process behind)
        for part in shards(groups, min(SHARDS, os.cpu_count() or 1)):
            log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a process is never held up by a full pipe
            procs.append((part, log, subprocess.Popen([sys.executable, str(Path(script).resolve()), *part], env=env,
                                                      cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)))
        deadline = time.monotonic() + timeout
        for part, log, proc in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                ended = f"the process exited with {proc.returncode}"
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                ended = f"the process ran past {timeout:.0f} s and was killed"
            log.seek(0)
            out = log.read()
            for m in pattern.finditer(out):
                results[m.group(1)] = (m.group(3), m.group(2))
            for group in part:
                if group not in results:
                    start = out.find(f"{MARK} {group} start")
                    results[group] = (f"no result: {ended} before group {group} ended",
                                      out[start:] if start >= 0 else out)
    finally:  # an interrupted session leaves no interpreter process behind
        for _, log, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    return results


def check(results: dict[str, tuple[str, str]], group: str) -> str:
    """Fails with the group's own output unless it passed; returns that output."""
    status, out = results[group]
    assert status == "passed", f"group {group}: {status}\n{out[-8000:]}"
    return out


@contextlib.contextmanager
def nan_empty(*modules):
    """The given modules see a torch whose empty() is filled with NaN, so an output row that no kernel writes
    (and no zero fill covers) shows in the result."""
    import torch

    class NaNTorch:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*shape, **kw):
            return torch.full(shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape,
                              float("nan"), **kw)

    saved = [m.torch for m in modules]
    for m in modules:
        m.torch = NaNTorch()
    try:
        yield
    finally:
        for m, t in zip(modules, saved):
            m.torch = t
