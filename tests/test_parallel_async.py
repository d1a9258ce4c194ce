"""Async scheduling under tensor parallel, on the CPU over gloo (two processes).

Rank 0 sends step N+1 before it reads step N's tokens: the step names the input rows that take them and rank 0
broadcasts them over the TP group (executor/worker.py `_fill_pending`). Only rank 0 samples, so greedy and
seeded draws must equal the synchronous engine's; the same engine runs both ways (the flag flipped), which
saves a start. The CPU runs each step as it is launched: the overlap itself shows only on a GPU
(scripts/gpu_smoke.py --sections big --tp 2).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from compiled_llm import SamplingParams
from compiled_llm.runtime.errors import EngineDeadError

from async_utils import abort_while_in_flight
from test_parallel import GREEDY, generate_ids, make_llm, parallel_llm, reference  # noqa: F401 (fixture)


def run(llm, ps, params, async_on: bool) -> list[tuple]:
    engine = llm.engine
    engine.async_scheduling = async_on
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params)
    finally:
        engine.async_scheduling = True
    return [(c.token_ids, c.finish_reason,
             [sorted((t, round(lp.logprob, 4)) for t, lp in e.items()) for e in c.logprobs or []])
            for o in outs for c in o.outputs]


def assert_idle(engine) -> None:
    assert not engine.has_unfinished_requests() and engine._inflight is None
    assert engine.block_manager.usage() == 0.0


def test_tp2_expert_parallel_async_equals_one_process(tiny_ckpt, parallel_llm):  # first: one engine at a time
    ps, ref, _, _ = reference(tiny_ckpt, "all")
    llm = parallel_llm("all", tensor_parallel_size=2, enable_expert_parallel=True, async_scheduling=True)
    assert llm.engine.async_scheduling
    assert generate_ids(llm, ps) == ref
    assert llm.engine.async_steps > 0 and llm.engine.sync_steps == 0


@pytest.fixture(scope="module")
def tp2(tiny_ckpt):
    reference(tiny_ckpt, "all")  # the one-process engine first: it would see this engine's parallel state
    llm = make_llm(tiny_ckpt("all")[0], tensor_parallel_size=2, async_scheduling=True)
    yield llm
    llm.engine.shutdown()


def test_tp2_async_greedy_takes_the_fast_path_and_equals_sync_and_one_process(tiny_ckpt, tp2, monkeypatch):
    """Decode steps go out with fill rows (the placeholders' tokens come from rank 0's device, not the host)
    and the engine counts async steps only."""
    from compiled_llm.runtime.executor import multiproc

    ps, ref, _, _ = reference(tiny_ckpt, "all")
    engine = tp2.engine
    assert engine.executor.supports_async_scheduling and engine.async_scheduling
    sent = []
    send = multiproc.broadcast_object
    monkeypatch.setattr(multiproc, "broadcast_object", lambda msg: (sent.append(msg), send(msg))[1])
    a0, s0 = engine.async_steps, engine.sync_steps
    got = run(tp2, ps, GREEDY, True)
    assert [t for t, _, _ in got] == ref
    assert engine.async_steps - a0 >= GREEDY.max_tokens and engine.sync_steps == s0
    steps = [args[0] for method, args, _ in sent if method == "execute"]
    filled = [s for s in steps if s.fill_at is not None]
    assert len(filled) >= GREEDY.max_tokens - 2  # every decode step after the first
    assert all(t.device.type == "cpu" for s in filled for t in (s.input_ids, s.fill_at, s.fill_from))
    assert all(len(s.fill_at) == len(s.fill_from) <= len(ps) for s in filled)
    monkeypatch.undo()
    assert run(tp2, ps, GREEDY, False) == got
    assert_idle(engine)


def test_tp2_async_seeded_sampling_equals_sync(tiny_ckpt, tp2):
    ps = reference(tiny_ckpt, "all")[0]
    params = [SamplingParams(temperature=0.8, seed=7, max_tokens=10, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=8, min_tokens=3, top_k=20),
              SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)]
    want = run(tp2, ps, params, False)
    a0 = tp2.engine.async_steps
    got = run(tp2, ps, params, True)
    assert got == want and tp2.engine.async_steps > a0
    assert len(got) == 4  # n=2 gave two sequences
    assert_idle(tp2.engine)


def test_tp2_penalties_step_synchronously_then_async_resumes(tiny_ckpt, tp2):
    ps = reference(tiny_ckpt, "all")[0]
    params = [SamplingParams(temperature=0, max_tokens=4, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, frequency_penalty=0.5, ignore_eos=True)]
    want = run(tp2, ps, params, False)
    engine = tp2.engine
    a0, s0 = engine.async_steps, engine.sync_steps
    assert run(tp2, ps, params, True) == want
    assert engine.sync_steps > s0  # while the penalised requests lasted
    assert engine.async_steps > a0  # after they ended
    assert not engine._sync_requests
    assert_idle(engine)


def test_tp2_abort_while_a_step_is_in_flight(tiny_ckpt, tp2):
    ps = reference(tiny_ckpt, "all")[0]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = run(tp2, ps, params, False)
    engine = tp2.engine
    finals = abort_while_in_flight(engine, ps, params, want)
    assert [finals[f"r{i}"].outputs[0].token_ids for i in (0, 2)] == [want[0][0], want[2][0]]
    assert_idle(engine)
    assert run(tp2, ps, params, True) == want  # the ranks still agree after the abort


def test_tp2_async_killed_worker_fails_fast(tiny_ckpt, tp2):  # last: it ends the module's engine
    ps = reference(tiny_ckpt, "all")[0]
    engine = tp2.engine
    pid = engine.executor.worker_pids()[1]
    for i, p in enumerate(ps):
        engine.add_request(f"k{i}", p, GREEDY)
    for _ in range(3):
        engine.step()
    assert engine._inflight is not None  # a step is launched and unread when the worker dies
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=rf"worker rank 1 \(pid {pid}\) was killed by SIGKILL"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < 10
    assert not engine.is_healthy()
    with pytest.raises(EngineDeadError):  # and it stays dead, without waiting
        engine.step()
