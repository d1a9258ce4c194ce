"""`python -m compiled_llm serve ...` with the engine thread's timeline written as JSON lines (a diagnostic: it
wraps the server's private AsyncEngine methods, so it follows their names):

    ["add", posted_ms, taken_ms, done_ms]   a request posted by the event loop, taken by the engine thread
    ["step", start_ms, end_ms, outputs]     one engine step (host time; under async scheduling a step's device
                                            work shows in the next step's wait)

Milliseconds since this process started. Used to find where a cold server's first wave of requests loses time
(benchmarks/NOTES.md, session 37):

    STEP_LOG=/tmp/steps.jsonl python benchmarks/server_steps.py --model DIR --port 8011 ...
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

T0 = time.monotonic()
_LOCK = threading.Lock()


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

        def timed_step():
            start = _ms()
            out = step()
            _log(["step", start, _ms(), len(out)])
            return out

        self.engine.step = timed_step
        run(self)

    ae.AsyncEngine._add, ae.AsyncEngine._run = _add, _run


if __name__ == "__main__":
    install()
    from compiled_llm.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
