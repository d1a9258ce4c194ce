"""Async scheduling (engine._step_async): each step is launched before the previous step's tokens are read,
with placeholders standing in for them. Whatever the mix of requests, the tokens, texts, logprobs and finish
reasons must equal a synchronous engine's, and every block must come back. The demo model, eager, float32."""

from __future__ import annotations

from unittest import mock

import pytest

from compiled_llm import LLM, SamplingParams
from compiled_llm.config import DEMO_MODEL_DIR

from async_utils import abort_while_in_flight

PROMPTS = ["Hello there", "The capital of France is", "1 2 3 4", "Once upon a time", "abc", "zzz qqq www"]


def make(async_scheduling: bool, **kw) -> LLM:
    kw = {"max_num_seqs": 4, "dtype": "float32", "enforce_eager": True, **kw}
    return LLM(model=str(DEMO_MODEL_DIR), async_scheduling=async_scheduling, **kw)


def outputs(llm: LLM, prompts, params) -> list[tuple]:
    outs = llm.generate(prompts, params)
    return [(c.token_ids, c.finish_reason, c.stop_reason, c.text,
             [sorted((t, round(lp.logprob, 4)) for t, lp in e.items()) for e in c.logprobs or []])
            for o in outs for c in o.outputs]


def assert_all_blocks_back(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.usage() == 0.0
    assert all(not s.pending_token for r in engine.requests.values() for s in r.seqs)


@pytest.fixture(scope="module")
def engines():
    return make(False), make(True)


def test_mixed_requests_equal_synchronous(engines):
    sync, fast = engines
    # the reference run first: its tokens give stops that end sequences mid-run (the launched step after
    # an EOS/stop is computed and dropped)
    base = [SamplingParams(temperature=0, max_tokens=n) for n in (5, 17, 1, 30, 9, 12)]
    ref = outputs(sync, PROMPTS, base)
    params = list(base)
    params[1] = SamplingParams(temperature=0, max_tokens=17, stop_token_ids=[ref[1][0][6]])
    params[3] = SamplingParams(temperature=0.8, seed=3, max_tokens=20, logprobs=2)
    params[4] = SamplingParams(temperature=0, max_tokens=9, stop=[ref[4][3][2:5]] if len(ref[4][3]) > 5 else None)
    params[5] = SamplingParams(temperature=0.7, seed=11, n=2, max_tokens=12, min_tokens=4)
    want = outputs(sync, PROMPTS, params)
    got = outputs(fast, PROMPTS, params)
    assert got == want
    assert want[1][1] == "stop" and len(want[1][0]) <= 7  # the stop token really ended it early
    assert fast.engine.async_steps > 0 and fast.engine.sync_steps == 0
    assert_all_blocks_back(fast)


def test_a_steady_decode_batch_takes_its_tokens_and_hidden_rows_as_they_are(engines):
    """A decode batch that keeps its sequences in order takes the previous step's sampled tokens as its input ids
    (no scatter into the uploaded ids) and its logits from the hidden states' rows as they are (no gather);
    when a sequence ends and the rows move, the scatter fills the others again. Tokens equal the synchronous
    engine's."""
    from compiled_llm.runtime import model_runner

    sync, fast = engines
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 12, 6, 12)]
    want = outputs(sync, PROMPTS[:4], params)
    runner, sampler = fast.engine.executor.runner, fast.engine.sampler
    seen, sampled = [], []
    real_execute, real_launch = runner.execute_prepared, sampler.launch

    def execute_prepared(input_ids, positions, ctx, rows, *args, **kw):
        seen.append((rows is None, input_ids.untyped_storage().data_ptr()))
        return real_execute(input_ids, positions, ctx, rows, *args, **kw)

    def launch(*args, **kw):
        out = real_launch(*args, **kw)
        sampled.append(out.token_ids.untyped_storage().data_ptr())
        return out

    with mock.patch.object(model_runner, "fill_pending", wraps=model_runner.fill_pending) as scatter, \
            mock.patch.object(runner, "execute_prepared", execute_prepared), \
            mock.patch.object(sampler, "launch", launch):
        got = outputs(fast, PROMPTS[:4], params)
    assert got == want
    assert len(seen) == 12 and not seen[0][0] and all(whole for whole, _ in seen[1:])  # the prompts' step gathers
    # steps 2-6 read the previous step's sampled ids in place; step 7 (the third request ended, the rows moved)
    # fills them in, and the rest read them in place again
    in_place = [ptr == sampled[i] for i, (_, ptr) in enumerate(seen[1:])]
    assert in_place == [True] * 5 + [False] + [True] * 5 and scatter.call_count == 1
    assert_all_blocks_back(fast)


def test_preemption_and_prefix_cache_equal_synchronous():
    prompts = [PROMPTS[1] * 3 + f" {i}" for i in range(6)]  # a shared prefix: prefix-cache hits
    params = SamplingParams(temperature=0, max_tokens=24)
    kw = dict(block_size=4, num_kv_blocks=40, max_num_seqs=6, max_model_len=128)
    sync, fast = make(False, **kw), make(True, **kw)
    want = outputs(sync, prompts, params)
    got = outputs(fast, prompts, params)
    assert got == want
    stats = fast.engine.get_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert_all_blocks_back(fast)


def test_penalties_step_synchronously_then_async_resumes(engines):
    sync, fast = engines
    params = [SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=20)]
    want = outputs(sync, PROMPTS[:2], params)
    a0, s0 = fast.engine.async_steps, fast.engine.sync_steps
    got = outputs(fast, PROMPTS[:2], params)
    assert got == want
    assert fast.engine.sync_steps > s0  # while the penalised request lasted
    assert fast.engine.async_steps > a0  # after it ended
    assert not fast.engine._sync_requests
    assert_all_blocks_back(fast)


def test_abort_while_a_step_is_in_flight(engines):
    sync, fast = engines
    params = SamplingParams(temperature=0, max_tokens=15)
    want = outputs(sync, PROMPTS[:3], params)
    engine = fast.engine
    finals = abort_while_in_flight(engine, PROMPTS[:3], params, want)
    for i in (0, 2):
        assert finals[f"r{i}"].outputs[0].token_ids == want[i][0]
    assert engine.block_manager.usage() == 0.0


@pytest.mark.parametrize("method", [dict(sparse_method="streamingllm", sparse_window=12, sparse_sink_tokens=2),
                                    dict(sparse_method="omnikv", omnikv_budget=10, omnikv_recent=3,
                                         sparse_sink_tokens=2)], ids=["streamingllm", "omnikv"])
def test_sparse_kv_async_steps_equal_synchronous(method):
    """Sparse KV methods step asynchronously too (one process): StreamingLLM's window releases (a step's
    commit after the next one is launched: that step no longer reads the released blocks) and OmniKV's
    pick (written and read on the device within one forward) give the synchronous engine's tokens; chunked
    prefills (16-token steps) beside decode rows. At 64K x 16 on the H200 the synchronous sparse engines lost
    the host overlap that dense had (benchmarks/NOTES.md, session 14)."""
    kw = dict(method, block_size=4, max_num_batched_tokens=16)
    prompts = [p * 4 for p in PROMPTS]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (25, 17, 3, 30, 9, 12)]
    sync, fast = make(False, **kw), make(True, **kw)
    want = outputs(sync, prompts, params)
    assert outputs(fast, prompts, params) == want
    assert fast.engine.async_steps > 0 and fast.engine.sync_steps == 0
    assert fast.engine.get_stats()["sparse_attended_tokens"] > 0
    assert_all_blocks_back(fast)


def test_default_is_on_for_one_cuda_process_and_silently_off_elsewhere(caplog):
    """Unset, async scheduling turns on where it overlaps host and device (CUDA, one process or tensor parallel,
    sparse KV methods in one process: 697 -> 770 tok/s on one H200) and stays off without a word elsewhere;
    asked for where it cannot run (pipeline parallel, sparse KV under tensor parallelism), it says why."""
    from types import SimpleNamespace

    from compiled_llm.config import EngineConfig
    from compiled_llm.runtime.async_scheduling import async_scheduling_possible

    assert EngineConfig().async_scheduling is None

    def decide(asked, device="cuda", pp=1, sparse=None, tp=1):  # the config as resolve_device leaves it
        executor = SimpleNamespace(supports_async_scheduling=pp == 1, sparse=sparse,
                                   async_refusal="pipeline-parallel stages step synchronously")
        return async_scheduling_possible(SimpleNamespace(device=device, async_scheduling=asked,
                                                         tensor_parallel_size=tp), executor)

    caplog.clear()
    assert decide(None) and decide(True) and not decide(False)  # one process or tensor parallel
    assert not decide(None, device="cpu") and decide(True, device="cpu")
    assert not decide(None, pp=2) and decide(None, sparse="streamingllm") and decide(None, tp=2)
    assert not decide(None, sparse="omnikv", tp=2)
    assert not any("async scheduling" in r.getMessage() for r in caplog.records)
    assert not decide(True, pp=2)
    assert any("async scheduling is off: pipeline-parallel" in r.getMessage() for r in caplog.records)
    assert not decide(True, sparse="omnikv", tp=2)
    assert any("async scheduling is off: sparse KV methods under tensor" in r.getMessage() for r in caplog.records)


def test_server_front_streams_async_steps_like_synchronous_ones(engines):
    """The server's engine thread (AsyncEngine) drives an async-scheduling engine as it drives any other (the
    default on a GPU): concurrent streamed requests with stop strings and logprobs get the synchronous
    engine's tokens and texts, an abandoned stream is aborted mid-flight, and every block comes back."""
    import asyncio

    from compiled_llm.server.async_engine import AsyncEngine
    from compiled_llm.server.generation import Generation

    sync, fast = engines
    params = [SamplingParams(temperature=0.0, max_tokens=12, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=20, stop=["e"]),
              SamplingParams(temperature=0.8, seed=7, max_tokens=10, n=2)]
    want = [outputs(sync, [PROMPTS[i]], p) for i, p in enumerate(params)]
    steps_before = fast.engine.async_steps

    async def main():
        aengine = AsyncEngine(fast.engine)
        aengine.start()
        gens = [Generation(aengine, f"s{i}", [PROMPTS[i]], p) for i, p in enumerate(params)]
        gone = Generation(aengine, "gone", [PROMPTS[4]], SamplingParams(temperature=0.0, max_tokens=200,
                                                                         ignore_eos=True))
        for g in [*gens, gone]:
            await g.start()

        async def abandon():
            try:
                async for _ in gone.deltas():
                    break
            finally:
                gone.close()

        await asyncio.gather(*(g.run() for g in gens), abandon())
        for _ in range(200):
            if not fast.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        await aengine.stop()
        return gens

    gens = asyncio.run(asyncio.wait_for(main(), 60))
    for g, w in zip(gens, want):
        got = [(c.token_ids, c.finish_reason, c.text) for c in g.choices]
        assert got == [(t, f, x) for t, f, _, x, _ in w]
    assert fast.engine.async_steps > steps_before + 10
    assert_all_blocks_back(fast)


def test_pack_host_round_trip():
    """A step's host arrays in one buffer (one copy to the GPU a step): every array comes back with its values,
    dtype and shape, each at a 16-byte-aligned offset, empty and 2-D arrays included, and the views do not
    overlap (writing one leaves the others)."""
    import numpy as np
    import torch

    from compiled_llm.ops.upload import pack_host, to_device_packed, unpack

    items = [([5, -1, 7], torch.long), (torch.arange(6, dtype=torch.long).view(2, 3), torch.long),
             ([3, 9], torch.int32), ([0, 1, 2], torch.int32), ([], torch.long),
             (np.array([[4, -1], [6, 8]], dtype=np.int32), torch.int32), (list(range(1, 12)), torch.long)]
    host, layout = pack_host(items)
    views = unpack(host, layout)
    for (data, dt), v, (off, nbytes, _, _) in zip(items, views, layout):
        want = torch.as_tensor(np.asarray(data.numpy() if isinstance(data, torch.Tensor) else data)).to(dt)
        assert v.dtype == dt and v.shape == want.shape and torch.equal(v, want)
        assert off % 16 == 0 and nbytes == want.numel() * want.element_size()
        assert nbytes == 0 or v.data_ptr() == host.data_ptr() + off  # a view of the one buffer
    views[0].fill_(0)
    assert views[6].tolist() == list(range(1, 12)) and views[2].tolist() == [3, 9]
    # off the GPU each array is its own tensor, with the same values
    cpu = to_device_packed(items, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(cpu[1:], views[1:]))
