"""The test suite as two pytest processes side by side, each on a fixed half of the test files (`make test`).

    python scripts/run_tests.py [--shards N] [--record] [PATH or NODE ID ...] [-- PYTEST OPTION ...]

One pytest process used ~1.1 of the CI machine's two cores: the compile-heavy tests (Inductor's C++ builds, the
interpreter's kernels, the benchmark dry runs) run one thing at a time. Two processes use both.

The split is the same on every run. Each file weighs its tests' seconds in tests/durations.json (a file not
there weighs DEFAULT_SECONDS); files go longest first to the lighter half, and each half runs its files in path order
in one process, as the single-process suite runs them in its order. (pytest-xdist hands files to whichever worker
is free, so which files share a process would change with the machine's timing, and a test that passes or fails
with what ran before it in its process would pass on one run and fail on the next.)

Paths and node ids (default: tests) are grouped by file; a node id's file is split with its selected tests.
Everything after `--` goes to every process. Each process's output is printed whole when it ends; the exit
status is the first failing one. --record writes this run's times of the files it ran into tests/durations.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DURATIONS = ROOT / "tests" / "durations.json"
DEFAULT_SECONDS = 10.0


def test_files(paths: list[str]) -> dict[str, list[str]]:
    """{file: [its node ids, or the file itself]} in path order, for paths (folders, files, node ids)."""
    files: dict[str, list[str]] = {}
    for p in paths:
        file, _, _ = p.partition("::")
        path = ROOT / file
        if path.is_dir():
            for f in sorted(path.rglob("test_*.py")):
                files.setdefault(f.relative_to(ROOT).as_posix(), [f.relative_to(ROOT).as_posix()])
        elif path.is_file():
            ids = files.setdefault(path.relative_to(ROOT).as_posix(), [])
            if "::" in p and p not in ids:
                ids.append(p)
            elif "::" not in p:
                ids[:] = [path.relative_to(ROOT).as_posix()]
        else:
            raise SystemExit(f"run_tests.py: no such test path: {p}")
    return dict(sorted((f, ids or [f]) for f, ids in files.items()))


def weight(table: dict[str, dict[str, float]], file: str, ids: list[str]) -> float:
    """A file's recorded seconds: every test's, or those of the selected node ids (a name, or a name without its
    parameters, selects)."""
    tests = table.get(file)
    if tests is None:  # not recorded ({}: recorded, none of its tests in the default selection)
        return DEFAULT_SECONDS
    if ids == [file]:
        return sum(tests.values())
    names = {i.split("::")[-1] for i in ids}
    return sum(t for n, t in tests.items() if n in names or n.partition("[")[0] in names)


def split(files: dict[str, list[str]], table: dict[str, dict[str, float]], shards: int) -> list[list[str]]:
    """The files in `shards` parts of about equal weight: longest first onto the lightest (the lower index on a
    tie), each part in path order."""
    seconds = {f: weight(table, f, ids) for f, ids in files.items()}
    load = [0.0] * shards
    parts: list[list[str]] = [[] for _ in range(shards)]
    for f in sorted(files, key=lambda f: (-seconds[f], f)):
        i = min(range(shards), key=lambda i: (load[i], i))
        load[i] += seconds[f]
        parts[i].append(f)
    return [sorted(p) for p in parts if p]


def test_seconds(junit: Path) -> dict[str, dict[str, float]]:
    """{file: {test name: seconds}} from a pytest junit XML report (a testcase's classname is its module path,
    then its class if any; its time covers set-up, call and teardown)."""
    out: dict[str, dict[str, float]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        while module and not module[-1].startswith("test_"):  # a test class inside the module
            module.pop()
        if module:
            tests = out.setdefault("/".join(module) + ".py", {})
            tests[case.get("name", "")] = round(tests.get(case.get("name", ""), 0.0) + float(case.get("time", 0)), 2)
    return out


def main(argv: list[str]) -> int:
    cut = argv.index("--") if "--" in argv else len(argv)
    ours, pytest_opts = argv[:cut], argv[cut + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=int(os.environ.get("PYTEST_SHARDS", "2")))
    ap.add_argument("--record", action="store_true", help="this run's times into tests/durations.json")
    ap.add_argument("paths", nargs="*", default=["tests"])
    args = ap.parse_args(ours)
    files = test_files(args.paths)
    table = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    parts = split(files, table, max(1, args.shards))
    tmp = Path(tempfile.mkdtemp(prefix="run_tests_"))
    procs = []
    for i, part in enumerate(parts):
        ids = [n for f in part for n in files[f]]
        cmd = [sys.executable, "-m", "pytest", *pytest_opts, f"--junitxml={tmp / f'{i}.xml'}", *ids]
        log = open(tmp / f"{i}.log", "w")
        procs.append((subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), log, time.monotonic()))
        print(f"== part {i + 1}/{len(parts)}: {len(part)} files, ~{sum(weight(table, f, files[f]) for f in part):.0f} s"
              " as last recorded", flush=True)
    codes = []
    try:
        for i, (proc, log, t0) in enumerate(procs):
            rc = proc.wait()
            log.close()
            print(f"\n== part {i + 1}/{len(parts)}: exit {rc} after {time.monotonic() - t0:.0f} s", flush=True)
            sys.stdout.write((tmp / f"{i}.log").read_text())
            codes.append(rc)
    finally:
        for proc, _, _ in procs:
            if proc.poll() is None:
                proc.kill()
    if args.record:
        seconds: dict[str, dict[str, float]] = {}
        for i in range(len(parts)):
            if (tmp / f"{i}.xml").exists():
                seconds.update(test_seconds(tmp / f"{i}.xml"))
        for f, ids in files.items():  # a whole file's run replaces its entry; selected tests update theirs
            table[f] = seconds.get(f, {}) if ids == [f] else {**table.get(f, {}), **seconds.get(f, {})}
        DURATIONS.write_text(json.dumps(dict(sorted(table.items())), indent=1, sort_keys=True) + "\n")
    shutil.rmtree(tmp, ignore_errors=True)
    # 5: a part whose files held no selected test (-k, -m); a failure only where no part ran any
    failed = [rc for rc in codes if rc not in (0, 5)]
    return failed[0] if failed else 0 if 0 in codes else 5


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
