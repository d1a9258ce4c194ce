"""Kernel groups run under the Triton interpreter: TRITON_INTERPRET must be set before triton is first imported,
so a test file's groups run as that file's script in a subprocess. One subprocess per test file runs every
group the session selected from it, in order (a process start with its torch / triton imports costs 2-3 s on
two cores, more than most groups take): each group's result and output are reported on their own, and each
group's test reads its own, so a failure still names its group and shows that group's output.

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
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "@@group"


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


def run_groups(request, script: str, test_name: str, timeout: float = 540.0) -> dict[str, tuple[str, str]]:
    """Runs the selected groups of test_name in one subprocess of script: {group: (status, output)}, status
    'passed', 'FAILED' or a line saying why the group gave no result (the process died or timed out first)."""
    groups = selected(request, test_name)
    if not groups:
        return {}
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    try:
        r = subprocess.run([sys.executable, str(Path(script).resolve()), *groups], env=env, cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
        out, ended = r.stdout, f"the process exited with {r.returncode}"
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        ended = f"the process ran past {timeout:.0f} s and was killed"
    results: dict[str, tuple[str, str]] = {}
    pattern = re.compile(rf"^{MARK} (\S+) start$(.*?)^{MARK} \1 (passed|FAILED)", re.M | re.S)
    for m in pattern.finditer(out):
        results[m.group(1)] = (m.group(3), m.group(2))
    for group in groups:
        if group not in results:
            start = out.find(f"{MARK} {group} start")
            results[group] = (f"no result: {ended} before group {group} ended", out[start:] if start >= 0 else out)
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
