"""The server over a tensor-parallel engine (two processes over gloo) when a worker dies mid-stream: the
running stream ends with an error event and [DONE] within seconds, /health answers 503 with the engine_dead
code, and a new request gets a 503 with an OpenAI-style body (issue 16, item 4; the engine-level check ran on
two H200s, benchmarks/NOTES.md session 10)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx

from server_utils import ServerProcess


def _spawned_children(pid: int) -> list[int]:
    """The server's worker processes (multiprocessing spawn children, not its resource tracker)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if "spawn_main" in cmd and "resource_tracker" not in cmd:
                out.append(int(child))
    return out


def test_killed_tp_worker_ends_the_stream_with_an_error_and_health_turns_503(tiny_ckpt):
    folder, _ = tiny_ckpt("dense")
    server = ServerProcess("--model", str(folder), "--tensor-parallel-size", "2", "--device", "cpu",
                           "--enforce-eager", "--block-size", "4", "--max-model-len", "512", startup_timeout=240)
    try:
        workers = _spawned_children(server.proc.pid)
        assert len(workers) == 1, (workers, server.output()[-2000:])
        body = {"prompt": "hello there", "max_tokens": 400, "ignore_eos": True, "stream": True}
        events, killed_at = [], None
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if killed_at is None and len(events) == 3:  # decoding: kill rank 1
                    os.kill(workers[0], signal.SIGKILL)
                    killed_at = time.monotonic()
        assert killed_at is not None, events
        elapsed = time.monotonic() - killed_at
        assert events[-1] == "[DONE]"
        errors = [json.loads(e)["error"] for e in events[:-1] if '"error"' in e]
        assert errors and "worker rank 1" in errors[0]["message"] and "SIGKILL" in errors[0]["message"], events[-3:]
        assert elapsed < 10, elapsed
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        late = httpx.post(server.url + "/v1/completions", json={"prompt": "again", "max_tokens": 2}, timeout=10)
        assert late.status_code == 503 and set(late.json()["error"]) == {"message", "type", "param", "code"}
    finally:
        server.kill()
