"""The async engine front and the app's failure handling, in process, with a fake engine."""

import asyncio
import json
import threading
import time

import pytest
from fastapi.testclient import TestClient

from compiled_llm.sampling_params import SamplingParams
from compiled_llm.server.app import create_app
from compiled_llm.server.async_engine import AsyncEngine, EngineDeadError
from compiled_llm.server.generation import Generation
from server_utils import FakeEngine

pytestmark = pytest.mark.timeout(60)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def _started(engine):
    aengine = AsyncEngine(engine)
    aengine.start()
    return aengine


def test_requests_share_steps_and_engine_runs_in_one_thread():
    engine = FakeEngine(step_delay=0.005)

    async def main():
        aengine = await _started(engine)
        gens = [Generation(aengine, f"r{i}", [f"prompt {i}"], SamplingParams(max_tokens=20)) for i in range(8)]
        for g in gens:
            await g.start()
        await asyncio.gather(*(g.run() for g in gens))
        await aengine.stop()
        return gens

    gens = run(main())
    assert max(engine.batch_sizes) == 8  # all eight decoded in the same steps
    assert len(engine.thread_ids) == 1 and threading.get_ident() not in engine.thread_ids
    for g in gens:
        assert len(g.choices[0].token_ids) == 20 and g.choices[0].finish_reason == "length"
        assert g.choices[0].text == "".join(chr(t - 3) for t in g.choices[0].token_ids)


def test_rejected_request_fails_alone():
    engine = FakeEngine()

    async def main():
        aengine = await _started(engine)
        good = Generation(aengine, "good", ["hello"], SamplingParams(max_tokens=30))
        await good.start()
        bad = Generation(aengine, "bad", [""], SamplingParams(max_tokens=5))
        with pytest.raises(Exception) as err:
            await bad.start()
        await good.run()
        healthy = aengine.healthy
        await aengine.stop()
        return good, err.value, healthy

    good, err, healthy = run(main())
    assert getattr(err, "status", None) == 400 and "empty" in str(err)
    assert healthy
    assert len(good.choices[0].token_ids) == 30


def test_abandoned_generation_is_aborted():
    engine = FakeEngine(step_delay=0.01)

    async def main():
        aengine = await _started(engine)
        gen = Generation(aengine, "long", ["x"], SamplingParams(max_tokens=200))
        await gen.start()

        async def consume():
            try:
                async for _ in gen.deltas():
                    pass
            finally:
                gen.close()

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for _ in range(100):
            if not engine.requests:
                break
            await asyncio.sleep(0.01)
        await aengine.stop()

    run(main())
    assert engine.aborted == ["long"] and not engine.requests


def test_engine_death_fails_in_flight_and_new_requests():
    engine = FakeEngine(step_delay=0.01)

    async def main():
        aengine = await _started(engine)
        victim = Generation(aengine, "victim", ["fine"], SamplingParams(max_tokens=500))
        await victim.start()
        crash = Generation(aengine, "crash", ["CRASH"], SamplingParams(max_tokens=5))
        await crash.start()
        with pytest.raises(EngineDeadError, match="simulated engine failure"):
            await victim.run()
        with pytest.raises(Exception) as late:
            await Generation(aengine, "late", ["again"], SamplingParams()).start()
        return aengine.healthy, late.value

    healthy, late = run(main())
    assert not healthy
    assert late.status == 503


def test_shutdown_aborts_in_flight():
    engine = FakeEngine(step_delay=0.01)

    async def main():
        aengine = await _started(engine)
        gen = Generation(aengine, "inflight", ["x"], SamplingParams(max_tokens=1000))
        await gen.start()
        task = asyncio.create_task(gen.run())
        await asyncio.sleep(0.05)
        await aengine.stop()
        with pytest.raises(EngineDeadError, match="shutting down"):
            await task

    run(main())
    assert engine.aborted == ["inflight"]


def test_http_engine_death_gives_503_and_error_shape():
    with TestClient(create_app(FakeEngine())) as client:
        assert client.get("/health").status_code == 200
        r = client.post("/v1/completions", json={"prompt": "CRASH", "max_tokens": 3})
        assert r.status_code == 503
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert "simulated engine failure" in r.json()["error"]["message"]
        h = client.get("/health")
        assert h.status_code == 503 and h.json()["error"]["code"] == "engine_dead"
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503
        m = client.get("/metrics").text
        assert 'compiled_llm_engine_healthy{model_name="fake-model"} 0' in m


def test_http_stream_engine_death_reports_error_in_stream():
    engine = FakeEngine(step_delay=0.01)
    with TestClient(create_app(engine)) as client:
        # The engine dies while this stream runs (a CRASH request joins the batch).
        with client.stream("POST", "/v1/completions",
                           json={"prompt": "ok", "max_tokens": 250, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            crash = threading.Thread(target=client.post, args=("/v1/completions",),
                                     kwargs={"json": {"prompt": "CRASH"}})
            crash.start()
            body = "\n".join(lines)
            crash.join()
        assert '"error"' in body and "simulated engine failure" in body
        assert body.rstrip().endswith("data: [DONE]")


def test_api_key_middleware_on_fake_engine():
    with TestClient(create_app(FakeEngine(), api_key="sekret")) as client:
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = client.get("/v1/models", headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "fake-model"
        # invalid JSON without a key is still 401: the key is checked first
        r = client.post("/v1/completions", content="{", headers={"content-type": "application/json"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/health").status_code == 200  # not under /v1


def test_streamed_text_never_includes_a_later_cut_stop_string():
    # The fake engine emits one character per step, so a 3-character stop string completes two
    # steps after it starts: without holdback its first characters would already have been streamed.
    with TestClient(create_app(FakeEngine())) as client:
        body = {"prompt": "abc", "max_tokens": 20, "temperature": 0}
        text = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        stop = text[5:8]
        streamed = []
        with client.stream("POST", "/v1/completions", json={**body, "stop": stop, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    streamed.append(json.loads(line[6:])["choices"][0]["text"])
        assert "".join(streamed) == text[:5]
        assert len([s for s in streamed if s]) >= 3  # it really streamed, piece by piece


def test_chat_stream_chunks_and_usage_on_fake_engine():
    with TestClient(create_app(FakeEngine())) as client:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2, "stream": True,
                "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2}
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
        usage = chunks[-1]["usage"]
        assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == 8
        texts = {0: "", 1: ""}
        for c in chunks[:-1]:
            assert c["usage"] is None
            ch = c["choices"][0]
            texts[ch["index"]] += ch["delta"].get("content") or ""
            if ch["delta"].get("content"):
                assert len(ch["logprobs"]["content"][0]["top_logprobs"]) == 2
        assert len(texts[0]) == len(texts[1]) == 4 and texts[0] != texts[1]


def test_one_bad_prompt_in_a_batch_rejects_the_request_and_aborts_the_rest():
    engine = FakeEngine()
    with TestClient(create_app(engine)) as client:
        r = client.post("/v1/completions", json={"prompt": ["fine", "", "also fine"], "max_tokens": 50})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt.1"
        for _ in range(100):
            if not engine.requests:
                break
            time.sleep(0.01)
        assert not engine.requests and len(engine.aborted) == 2
        ok = client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 3}).json()
        assert [c["index"] for c in ok["choices"]] == [0, 1] and ok["usage"]["completion_tokens"] == 6


def test_the_engine_is_stepped_on_the_thread_that_built_it(monkeypatch):
    """`serve` builds its engine on an EngineThread and steps it there (on the CPU, start-up on the main thread
    and steps on another left OpenMP with two thread teams, and a tiny model's steps ran ~3-4x slower); threads
    started after it (preprocessing, media) run torch's parallel ops on one thread while the engine thread keeps
    its team (async_engine.one_thread_elsewhere)."""
    import torch
    import uvicorn

    from compiled_llm.cli import build_parser
    from compiled_llm.runtime import engine as engine_module
    from compiled_llm.server.cli import run_server

    built = []

    class Engine(FakeEngine):
        def __init__(self, config):
            super().__init__()
            built.append((self, threading.get_ident()))
            self.num_threads = torch.get_num_threads()

    answers, later = [], []

    def serve(self):  # instead of listening: one request through the app, then shut down
        with TestClient(self.config.app) as client:
            answers.append(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3}).json())
        thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        self.started = True

    monkeypatch.setattr(engine_module, "LLMEngine", Engine)
    monkeypatch.setattr(uvicorn.Server, "run", serve)
    torch.set_num_threads(2)  # torch's default on these machines (the suite runs on one)
    try:
        assert run_server(build_parser().parse_args(["serve", "--device", "cpu"])) == 0
    finally:
        torch.set_num_threads(1)
    assert answers[0]["choices"][0]["finish_reason"] == "length"
    [(engine, builder)] = built
    assert builder != threading.get_ident()  # not the main thread
    assert engine.thread_ids == {builder}  # the request's admission and every step: the thread that built it
    assert engine.num_threads == 2 and later == [1]


def test_engine_thread_runs_calls_in_order_and_returns_their_exceptions():
    from compiled_llm.server.async_engine import EngineThread

    thread = EngineThread()
    assert thread.call(threading.get_ident) == thread.ident != threading.get_ident()
    with pytest.raises(ValueError, match="invalid literal"):
        thread.call(int, "x")
    order = []
    futures = [thread.submit(order.append, i) for i in range(5)]
    last = thread.submit(order.append, "last", last=True)
    last.result(timeout=10)
    thread.join(timeout=10)
    assert order == [0, 1, 2, 3, 4, "last"] and all(f.done() for f in futures) and not thread.is_alive()


def test_the_app_loads_what_the_first_requests_need_before_serving(monkeypatch):
    """The app's start-up imports anyio's asyncio backend, which starlette's streamed responses would otherwise
    import in the first wave, on the event loop, holding the GIL while the engine runs the first step (session
    38: ~35 ms of a 2-core CPU's first wave; checked in a fresh process, where nothing imported it before),
    renders the chat template once (its compile would fall in the first chat request) and builds the grammar
    compiler (~0.7 s at a 262K vocabulary)."""
    import subprocess
    import sys

    from compiled_llm.runtime.errors import StructuredOutputError
    from compiled_llm.server import app as app_module

    pytest.importorskip("xgrammar")

    code = ("import asyncio, sys\n"
            "from compiled_llm.server.app import warm_streaming\n"
            "assert 'anyio._backends._asyncio' not in sys.modules\n"
            "asyncio.run(warm_streaming())\n"
            "assert 'anyio._backends._asyncio' in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    calls = []
    real = app_module.warm_streaming

    async def counted():
        calls.append(1)
        await real()

    monkeypatch.setattr(app_module, "warm_streaming", counted)
    rendered = []
    engine = FakeEngine()
    make_inputs = engine.new_input_processor

    def new_input_processor():
        inputs = make_inputs()
        render = inputs.apply_chat_template
        inputs.apply_chat_template = lambda m, g=True, t=None, tools=None: (rendered.append((m, t)), render(m, g, t))[1]
        return inputs

    engine.new_input_processor = new_input_processor
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    with TestClient(create_app(engine, chat_template=template)) as client:
        assert calls == [1]  # in the lifespan, before the first request
        assert rendered == [([{"role": "user", "content": "hi"}], template)]  # the template compiled once
        assert [spec for spec, _ in engine.prepared] == [{"json_object": True}]  # xgrammar's tables built
        assert client.get("/health").status_code == 200
    refusing = "{{ raise_exception('a system turn first') }}"
    unprepared = FakeEngine()

    def no_tokenizer(spec):
        raise StructuredOutputError("structured output needs a tokenizer")

    unprepared.prepare_structured_output = no_tokenizer
    with TestClient(create_app(unprepared, chat_template=refusing)) as client:  # both left to their first request
        assert client.get("/health").status_code == 200
