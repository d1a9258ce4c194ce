"""`python -m compiled_llm serve ...` with the engine thread's timeline written as JSON lines (a diagnostic: it
wraps the server's private AsyncEngine methods, so it follows their names):

    ["add", posted_ms, taken_ms, done_ms]   a request posted by the event loop, taken by the engine thread
    ["step", start_ms, end_ms, outputs]     one engine step (host time; under async scheduling a step's device
                                            work shows in the next step's wait)

Milliseconds since this process started. Used to find where a cold server's first wave of requests loses time
(benchmarks/NOTES.md, session 37):

    STEP_LOG=/tmp/steps.jsonl python benchmarks/server_steps.py --model DIR --port 8011 ...

With STEP_PROFILE=N, the first N steps of each wave (a step after the engine thread sat idle for 0.2 s or more)
run under cProfile, written to STEP_LOG.wave{W}.step{I}.prof; `python benchmarks/server_steps.py diff A B`
prints the functions whose own time differs most between two such files (the first wave's first step against
the second's, to name what a cold server does once).
"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import sys
import threading
import time

T0 = time.monotonic()
_LOCK = threading.Lock()
IDLE_S = 0.2  # a step after this long without one starts a wave


def _ms(t: float | None = None) -> float:
    return round(((time.monotonic() if t is None else t) - T0) * 1000, 2)


def _log(entry: list) -> None:
    with _LOCK, open(os.environ.get("STEP_LOG", "/tmp/steps.jsonl"), "a") as f:
        f.write(json.dumps(entry) + "\n")


def install() -> None:
    from compiled_llm.server import async_engine as ae

    add, run = ae.AsyncEngine._add, ae.AsyncEngine._run

    def _add(self, cmd):
        taken = _ms()
        add(self, cmd)
        _log(["add", _ms(cmd.arrival), taken, _ms()])

    def _run(self):
        step = self.engine.step
        profiled = int(os.environ.get("STEP_PROFILE", "0"))
        wave = {"n": 0, "index": 0, "last": None}

        def timed_step():
            start = _ms()
            if wave["last"] is None or start - wave["last"] >= IDLE_S * 1000:
                wave["n"], wave["index"] = wave["n"] + 1, 0
            wave["index"] += 1
            if wave["index"] <= profiled:
                profile = cProfile.Profile()
                out = profile.runcall(step)
                profile.dump_stats(f"{os.environ.get('STEP_LOG', '/tmp/steps.jsonl')}.wave{wave['n']}"
                                   f".step{wave['index']}.prof")
            else:
                out = step()
            wave["last"] = _ms()
            _log(["step", start, wave["last"], len(out)])
            return out

        self.engine.step = timed_step
        run(self)

    ae.AsyncEngine._add, ae.AsyncEngine._run = _add, _run


def diff(a: str, b: str, top: int = 25) -> list[tuple[float, float, float, str]]:
    """(own ms in a - in b, own ms in a, own ms in b, function) of the `top` functions that differ most."""
    sa, sb = pstats.Stats(a).stats, pstats.Stats(b).stats
    rows = []
    for key in set(sa) | set(sb):
        ta, tb = sa.get(key, (0, 0, 0))[2] * 1000, sb.get(key, (0, 0, 0))[2] * 1000
        file, line, name = key
        rows.append((round(ta - tb, 3), round(ta, 3), round(tb, 3), f"{name} {file}:{line}"))
    rows.sort(key=lambda r: -abs(r[0]))
    return rows[:top]


if __name__ == "__main__" and sys.argv[1:2] == ["diff"]:
    total = {f: round(pstats.Stats(f).total_tt * 1000, 2) for f in sys.argv[2:4]}
    print(f"step total ms: {total}\n{'a - b':>9} {'a':>9} {'b':>9}  function (own time, ms)")
    for d, ta, tb, name in diff(sys.argv[2], sys.argv[3]):
        print(f"{d:9.3f} {ta:9.3f} {tb:9.3f}  {name}")
elif __name__ == "__main__":
    install()
    from compiled_llm.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
