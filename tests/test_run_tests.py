"""scripts/run_tests.py, the suite's split into two processes (`make test`): the same split on every run, files
(not tests) split, node ids kept with their file, weights from the recorded times."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import run_tests  # noqa: E402


def test_files_are_grouped_with_their_node_ids_and_folders_expanded():
    files = run_tests.test_files(["tests/passes", "tests/test_audit.py", "tests/test_compiler.py::test_a",
                                  "tests/test_compiler.py::test_b[x]"])
    assert list(files) == sorted(files)
    assert files["tests/test_audit.py"] == ["tests/test_audit.py"]
    assert files["tests/test_compiler.py"] == ["tests/test_compiler.py::test_a", "tests/test_compiler.py::test_b[x]"]
    passes = [f for f in files if f.startswith("tests/passes/")]
    assert passes and all(Path(f).name.startswith("test_") for f in passes)
    # a whole file named after one of its tests: the whole file
    assert run_tests.test_files(["tests/test_audit.py::t", "tests/test_audit.py"]) == {
        "tests/test_audit.py": ["tests/test_audit.py"]}


def test_split_balances_by_recorded_seconds_and_is_the_same_every_time():
    table = {"a.py": {"t1": 100.0, "t2[x]": 20.0, "t2[y]": 30.0}, "b.py": {"t": 90.0}, "c.py": {"t": 40.0},
             "d.py": {"t": 35.0}}
    files = {f: [f] for f in ["a.py", "b.py", "c.py", "d.py", "e.py"]}  # e.py: not recorded, DEFAULT_SECONDS
    parts = run_tests.split(files, table, 2)
    assert parts == run_tests.split(dict(reversed(list(files.items()))), table, 2)
    assert parts == [["a.py", "e.py"], ["b.py", "c.py", "d.py"]]  # 150 + 10 against 90 + 40 + 35
    # node ids weigh their own tests (a name without parameters: all of them)
    assert run_tests.weight(table, "a.py", ["a.py::t2"]) == 50.0
    assert run_tests.weight(table, "a.py", ["a.py::t2[y]", "a.py::t1"]) == 130.0


def test_recorded_seconds_come_from_the_junit_report(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite>'
                   '<testcase classname="tests.test_x" name="test_a[1]" time="1.5"/>'
                   '<testcase classname="tests.passes.test_y.TestK" name="test_b" time="2.25"/>'
                   '</testsuite></testsuites>')
    assert run_tests.test_seconds(xml) == {"tests/test_x.py": {"test_a[1]": 1.5},
                                           "tests/passes/test_y.py": {"test_b": 2.25}}


def test_the_recorded_table_names_every_file_of_the_suite():
    # a file missing from tests/durations.json weighs a guess: the split would drift from balanced
    table = json.loads((ROOT / "tests" / "durations.json").read_text())
    assert sorted(run_tests.test_files(["tests"])) == sorted(table)


def test_a_failing_part_fails_the_run_and_both_parts_print(tmp_path):
    (tmp_path / "test_ok.py").write_text("def test_ok():\n    pass\n")
    (tmp_path / "test_bad.py").write_text("def test_bad():\n    assert 0\n")
    code = ("import sys, pathlib; sys.path.insert(0, sys.argv[1]); import run_tests as r; "
            "r.ROOT = pathlib.Path(sys.argv[2]); r.DURATIONS = r.ROOT / 'none.json'; "
            "sys.exit(r.main(['.', '--', '-q', '-p', 'no:cacheprovider']))")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "scripts"), str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "== part 1/2" in out.stdout and "== part 2/2" in out.stdout
    assert "1 failed" in out.stdout and "1 passed" in out.stdout
