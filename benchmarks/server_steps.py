"""`python -m compiled_llm serve ...` with the engine thread's timeline written as JSON lines (a diagnostic: it
wraps the server's private AsyncEngine methods, so it follows their names):

    ["add", posted_ms, taken_ms, done_ms]   a request posted by the event loop, taken by the engine thread
    ["step", start_ms, end_ms, outputs]     one engine step (host time; under async scheduling a step's device
                                            work shows in the next step's wait)

Milliseconds since this process started. Used to find where a cold server's first wave of requests loses time
(benchmarks/NOTES.md, session 37):

    STEP_LOG=/tmp/steps.jsonl python benchmarks/server_steps.py --model DIR --port 8011 ...

With STEP_PROFILE=N, the first N steps of each wave (a step after the engine thread sat idle for 0.2 s or more) run
under cProfile, written to STEP_LOG.wave{W}.step{I}.prof, and (before Python 3.12, or with STEP_PROFILE_LOOP=1
instead of the steps) the event loop's thread runs under cProfile throughout, one file a wave
(STEP_LOG.wave{W}.loop.prof, cut when the server has been idle for 0.2 s). `python benchmarks/server_steps.py diff
A B` prints the functions whose own time differs most between two such files
(the first wave's against the second's, to name what a cold server does once). On the CPU the loop's first
wave imported anyio's asyncio backend (~35 ms, holding the GIL the engine thread needs between its ops); the
app now loads it at start-up (server/app.py warm_streaming). A C function's own time includes its wait for the
GIL, so small differences in those are noise.
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


class LoopProfiles:
    """cProfile on the event loop's thread, one file a wave: a watcher thread asks the loop to cut the current
    profile once nothing has happened (no hand-over, no step) for IDLE_S."""

    def __init__(self, loop, prefix: str):
        self.loop, self.prefix, self.wave = loop, prefix, 0
        self.profile: cProfile.Profile | None = None
        self.active = self.cut_at = time.monotonic()
        self.loop.call_soon_threadsafe(self._next)
        threading.Thread(target=self._watch, name="loop-profiles", daemon=True).start()

    def touch(self) -> None:
        self.active = time.monotonic()

    def _next(self) -> None:  # on the loop's thread
        if self.profile is not None:
            self.profile.disable()
            self.profile.dump_stats(f"{self.prefix}.wave{self.wave}.loop.prof")
        self.wave += 1
        self.profile = cProfile.Profile()
        self.profile.enable()

    def _watch(self) -> None:
        while not self.loop.is_closed():
            time.sleep(IDLE_S / 4)
            if self.active > self.cut_at and time.monotonic() - self.active >= IDLE_S:
                self.cut_at = time.monotonic()
                try:
                    self.loop.call_soon_threadsafe(self._next)
                except RuntimeError:  # the loop closed meanwhile
                    return


def install() -> None:
    from compiled_llm.server import async_engine as ae

    add, run, start = ae.AsyncEngine._add, ae.AsyncEngine._run, ae.AsyncEngine.start
    profiled = int(os.environ.get("STEP_PROFILE", "0"))
    # from Python 3.12 cProfile is a sys.monitoring tool: one profile at a time in a process, so there the loop's
    # profile is taken only with STEP_PROFILE_LOOP=1, and then instead of the steps'
    loop_on = os.environ.get("STEP_PROFILE_LOOP", "1" if sys.version_info < (3, 12) else "0") == "1"
    profiled_steps = profiled if (sys.version_info < (3, 12) or not loop_on) else 0
    loop_profiles: list[LoopProfiles] = []
    touch = lambda: loop_profiles and loop_profiles[0].touch()  # noqa: E731

    def _start(self):
        start(self)
        if profiled and loop_on:
            loop_profiles.append(LoopProfiles(self._loop, os.environ.get("STEP_LOG", "/tmp/steps.jsonl")))

    def _add(self, cmd):
        taken = _ms()
        add(self, cmd)
        touch()
        _log(["add", _ms(cmd.arrival), taken, _ms()])

    def _run(self):
        step = self.engine.step
        wave = {"n": 0, "index": 0, "last": None}

        def timed_step():
            start = _ms()
            if wave["last"] is None or start - wave["last"] >= IDLE_S * 1000:
                wave["n"], wave["index"] = wave["n"] + 1, 0
            wave["index"] += 1
            if wave["index"] <= profiled_steps:
                profile = cProfile.Profile()
                out = profile.runcall(step)
                profile.dump_stats(f"{os.environ.get('STEP_LOG', '/tmp/steps.jsonl')}.wave{wave['n']}"
                                   f".step{wave['index']}.prof")
            else:
                out = step()
            wave["last"] = _ms()
            touch()
            _log(["step", start, wave["last"], len(out)])
            return out

        self.engine.step = timed_step
        run(self)

    ae.AsyncEngine._add, ae.AsyncEngine._run, ae.AsyncEngine.start = _add, _run, _start


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
