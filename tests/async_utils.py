"""The abort-with-a-step-in-flight scenario, shared by the one-process and the tensor-parallel async tests."""

from __future__ import annotations


def abort_while_in_flight(engine, prompts, params, want) -> dict:
    """Adds the prompts as r0, r1, ..., steps until step N+1 is launched before step N's tokens are read, then
    aborts r1: its output must be finished, hold no unread placeholder (-1) and be a prefix of its tokens in
    `want` (the same requests without the abort). Runs the rest to the end; returns the final outputs by id."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    finals = {}
    for _ in range(4):
        for out in engine.step():
            finals[out.request_id] = out
    assert engine._inflight is not None
    aborted = engine.abort_request("r1")
    got = aborted.outputs[0].token_ids
    assert aborted.finished and -1 not in got and got == want[1][0][:len(got)]
    while engine.has_unfinished_requests():
        for out in engine.step():
            finals[out.request_id] = out
    assert "r1" not in engine.requests
    return finals
