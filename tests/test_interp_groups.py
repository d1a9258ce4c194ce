"""tests/interp_groups.py itself: the interpreter groups of a test file run in two processes side by side, and each
group's result still reaches its own test, whichever process ran it and however that process ended."""

from __future__ import annotations

import textwrap

import interp_groups


def test_each_group_reports_its_own_result_from_either_process(tmp_path, monkeypatch):
    script = tmp_path / "groups.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(interp_groups.ROOT / "tests")!r})
        from interp_groups import main

        def run(group):
            print("output of", group)
            if group == "raises":
                raise ValueError("boom")
            if group == "exits":
                sys.exit(3)

        main(sys.argv[1:], run)
    """))
    groups = ["a", "raises", "b", "exits", "c"]
    assert interp_groups.shards(groups, 2) == [["a", "b", "c"], ["raises", "exits"]]
    assert interp_groups.shards(groups[:1], 2) == [["a"]]
    monkeypatch.setattr(interp_groups, "selected", lambda request, name: groups)
    results = interp_groups.run_groups(None, str(script), "test_groups")
    assert {g: results[g][0] for g in ("a", "b", "c", "raises")} == dict(a="passed", b="passed", c="passed",
                                                                         raises="FAILED")
    assert all(f"output of {g}" in results[g][1] for g in groups)
    assert "ValueError: boom" in results["raises"][1]
    # the second process died inside a group: that group says so, with its output
    assert results["exits"][0] == "no result: the process exited with 3 before group exits ended"
