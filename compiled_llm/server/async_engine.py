"""Async front of the engine: the engine steps in its own thread, requests talk to it through an inbox.

The engine is not thread safe, so only the engine thread touches it. add/abort commands go into a
locked inbox that the thread drains between steps; every step's outputs go back to the event loop in
one loop.call_soon_threadsafe call, each into the asyncio.Queue of the HTTP request that owns it.
All running requests share each step (continuous batching).

Chat templates, tokenization and media placeholder expansion run in worker threads (server/preprocess.py),
each with an input processor of its own (`engine.new_input_processor()`); the event loop keeps one more for
token texts. Of the engine itself the loop reads only `is_healthy()` (flags) and the config, which does
not change after start-up, and a worker thread compiles constrained requests' grammars into its cache
(`prepare_structured_output`, locked) before they are handed over.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from compiled_llm.outputs import Logprob, RequestOutput
from compiled_llm.sampling_params import SamplingParams
from compiled_llm.server.metrics import Metrics
from compiled_llm.server.preprocess import PREPROCESS_THREADS, Preprocessor

logger = logging.getLogger(__name__)


from compiled_llm.runtime.errors import EngineDeadError as _RuntimeEngineDead  # noqa: E402


class EngineDeadError(_RuntimeEngineDead):
    """The engine thread stopped (crash, shutdown or a dead worker); no request can make progress."""


class EngineThread(threading.Thread):
    """The daemon thread that runs the engine: the calls submitted to it, one after another, the last of them
    the step loop (it ends the thread). The server builds its engine here too (`call(LLMEngine, config)`), so
    that start-up and the steps share one thread. On the CPU that matters: OpenMP keeps a team of threads for
    every thread that runs parallel regions, and once the teams hold more threads than there are cores, libgomp
    stops spinning between regions; with start-up on the main thread and the steps on another, every small op
    of a step paid a worker's wake-up (2 cores, a tiny Gemma 4 at 8 x 64 tokens, 16 out: 540-590 ms against
    144-148 on the thread that built it)."""

    def __init__(self):
        super().__init__(name="engine", daemon=True)
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self.start()

    def run(self) -> None:
        while True:
            fn, args, future, last = self._calls.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - goes back to the caller
                    future.set_exception(exc)
            if last:
                return

    def submit(self, fn, *args, last: bool = False) -> Future:
        future: Future = Future()
        self._calls.put((fn, args, future, last))
        return future

    def call(self, fn, *args):
        """fn(*args) on this thread; its result, or its exception raised here."""
        return self.submit(fn, *args).result()


def one_thread_elsewhere() -> None:
    """Called once the engine is built on its EngineThread: every thread that runs a torch parallel region from
    now on (the preprocessing pool's, whose media processors run torch ops on every media prompt) runs it on one
    thread, while the engine thread keeps the team it made at start-up (torch reads its process-wide
    thread count when a thread first runs a parallel region). The reason is EngineThread's: each such thread's
    OpenMP team counts against the cores, and past them libgomp stops spinning between regions. 2 cores, a
    standalone check: once two pool threads had run one image-sized op, the engine thread's small ops (a 64 x 64
    index_add_ and linear) took 280-290 us against 20-24 before; with this, 20-21 us."""
    import torch

    torch.set_num_threads(1)


@dataclass
class SeqUpdate:
    index: int
    text: str  # cumulative text
    new_token_ids: list[int]
    new_logprobs: list[dict[int, Logprob]] | None
    num_tokens: int
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class Update:
    request_id: str
    num_prompt_tokens: int
    num_cached_tokens: int
    seqs: list[SeqUpdate]
    finished: bool
    # SamplingParams.prompt_logprobs: the prompt's entries, in the first update after the prompt is computed
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class _Tracked:
    """Engine-thread bookkeeping of one request."""

    sink: asyncio.Queue
    n: int
    arrival: float
    sent: dict[int, int] = field(default_factory=dict)  # tokens already forwarded per sample
    first_token: dict[int, float] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)
    counted_prompt: bool = False
    sent_prompt_logprobs: bool = False


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    sink: asyncio.Queue
    ack: asyncio.Future
    arrival: float
    priority: int = 0


class AsyncEngine:
    def __init__(self, engine, metrics: Metrics | None = None, thread: EngineThread | None = None):
        """thread: the EngineThread that built the engine, to step it too (see EngineThread); default a new one."""
        self.engine = engine
        self._engine_thread = thread
        self.metrics = metrics or Metrics(engine.model_name)
        # The server tokenizes in the event loop while the engine thread detokenizes: the server's own
        # input processor has its own tokenizer, so the (Rust) tokenizer is never used from two threads.
        self.inputs = engine.new_input_processor()
        # Templates, tokenization and media expansion of incoming prompts: worker threads, processors of their own.
        self.preprocess = Preprocessor([engine.new_input_processor() for _ in range(PREPROCESS_THREADS)])
        self._cond = threading.Condition()
        self._inbox: list = []
        self._error: EngineDeadError | None = None
        self._tracked: dict[str, _Tracked] = {}
        self._stats: dict = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._refresh_stats()

    # --- event-loop side ---------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = self._engine_thread or EngineThread()
        self._thread.submit(self._run, last=True)

    async def stop(self, timeout: float = 30.0) -> None:
        self.preprocess.shutdown()
        self._post("stop", check=False)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)

    @property
    def error(self) -> EngineDeadError | None:
        if self._error is None and self._thread is not None and not self._thread.is_alive():
            return EngineDeadError("engine thread is not running")
        return self._error

    @property
    def tokenizer(self):
        return self.inputs.tokenizer

    @property
    def healthy(self) -> bool:
        # a dead parallel worker shows in the engine itself even before a step fails
        return self._thread is not None and self.error is None and self.engine.is_healthy()

    @property
    def stats(self) -> dict:
        return self._stats

    async def add(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                  sink: asyncio.Queue, priority: int = 0) -> None:
        """Queue a request; returns once the engine accepted it (raises what add_request raised).
        Outputs then arrive in ``sink`` as Update objects, or one exception if the engine dies."""
        ack = self._loop.create_future()
        self._post(_Add(request_id, prompt, params, sink, ack, time.monotonic(), priority))
        try:
            await ack
        except asyncio.CancelledError:
            self.abort(request_id)
            raise

    async def prepare_structured_output(self, spec: dict) -> None:
        """Compiles a structured_output spec's grammar in a worker thread (LLMEngine.prepare_structured_output,
        safe off the engine thread), so the engine thread's admission finds it compiled."""
        await asyncio.to_thread(self.engine.prepare_structured_output, spec)

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op once finished); safe to call from finally blocks."""
        self._post(("abort", request_id), check=False)

    def _post(self, cmd, check: bool = True) -> None:
        with self._cond:
            if check and self._error is not None:
                raise self._error
            if self._error is None:
                self._inbox.append(cmd)
                self._cond.notify()

    # --- engine thread -------------------------------------------------------------
    def _run(self) -> None:
        try:
            import torch

            with torch.no_grad():
                while True:
                    busy = self.engine.has_unfinished_requests()
                    if self._handle(self._take(block=not busy)):
                        self._finish_all(EngineDeadError("the server is shutting down"), abort=True)
                        return
                    if self.engine.has_unfinished_requests():
                        self._dispatch(self.engine.step())
                    self._refresh_stats()
        except BaseException as exc:  # noqa: BLE001 - any failure ends the engine
            logger.exception("engine thread died")
            self._finish_all(EngineDeadError(f"engine thread died: {type(exc).__name__}: {exc}"), abort=False)

    def _take(self, block: bool) -> list:
        with self._cond:
            if block and not self._inbox:
                self._cond.wait(timeout=1.0)
            cmds, self._inbox = self._inbox, []
        return cmds

    def _handle(self, cmds: list) -> bool:
        stop = False
        for cmd in cmds:
            if isinstance(cmd, _Add):
                self._add(cmd)
            elif cmd == "stop":
                stop = True
            else:
                self._abort(cmd[1])
        return stop

    def _add(self, cmd: _Add) -> None:
        if cmd.ack.cancelled():
            return
        try:
            kw = {"priority": cmd.priority} if cmd.priority else {}
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, **kw)
        except Exception as exc:  # noqa: BLE001 - goes back to this request only
            self._loop.call_soon_threadsafe(_resolve, cmd.ack, exc)
            return
        self._tracked[cmd.request_id] = _Tracked(cmd.sink, cmd.params.n, cmd.arrival)
        self._loop.call_soon_threadsafe(_resolve, cmd.ack, None)

    def _abort(self, request_id: str) -> None:
        t = self._tracked.pop(request_id, None)
        if t is None:
            return
        try:
            self.engine.abort_request(request_id)
        except Exception:  # noqa: BLE001 - already finished inside the engine
            logger.debug("abort of %s failed", request_id, exc_info=True)
        self.metrics.count_status("abort", t.n - len(t.done))
        self.metrics.observe_e2e(time.monotonic() - t.arrival)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        batch = []
        for ro in outputs:
            t = self._tracked.get(ro.request_id)
            if t is None:
                continue
            batch.append((t.sink, self._update(ro, t, now)))
            if ro.finished:
                del self._tracked[ro.request_id]
                self.metrics.observe_e2e(now - t.arrival)
                if ro.metrics is not None:
                    self.metrics.observe_finished(ro.metrics, len(ro.prompt_token_ids),
                                                  sum(len(co.token_ids) for co in ro.outputs))
        if batch:
            self._loop.call_soon_threadsafe(_deliver, batch)

    def _update(self, ro: RequestOutput, t: _Tracked, now: float) -> Update:
        m = self.metrics
        if not t.counted_prompt:
            t.counted_prompt = True
            m.add_tokens(prompt=len(ro.prompt_token_ids))
        seqs = []
        for co in ro.outputs:
            # Copy only the new tail: the engine may keep appending to these lists.
            sent = t.sent.get(co.index, 0)
            new_ids = list(co.token_ids[sent:])
            num = sent + len(new_ids)
            t.sent[co.index] = num
            new_lps = list(co.logprobs[sent:num]) if co.logprobs is not None else None
            if new_ids:
                m.add_tokens(generated=len(new_ids))
                if co.index not in t.first_token:
                    t.first_token[co.index] = now
                    if len(t.first_token) == 1:
                        m.observe_ttft(now - t.arrival)
            if co.finish_reason is not None and co.index not in t.done:
                t.done.add(co.index)
                m.count_status(co.finish_reason)
                if num > 1 and co.index in t.first_token:
                    m.observe_tpot((now - t.first_token[co.index]) / (num - 1))
            seqs.append(SeqUpdate(co.index, co.text, new_ids, new_lps, num, co.finish_reason, co.stop_reason))
        cached = ro.num_cached_tokens or (ro.metrics.num_cached_tokens if ro.metrics else 0)
        prompt_lps = None
        if ro.prompt_logprobs is not None and not t.sent_prompt_logprobs and (
                len(ro.prompt_logprobs) == len(ro.prompt_token_ids) or ro.finished):
            t.sent_prompt_logprobs, prompt_lps = True, list(ro.prompt_logprobs)
        return Update(ro.request_id, len(ro.prompt_token_ids), cached, seqs, ro.finished, prompt_lps)

    def _refresh_stats(self) -> None:
        try:
            self._stats = dict(self.engine.get_stats())
        except Exception:  # noqa: BLE001 - stats are best effort
            logger.debug("get_stats failed", exc_info=True)

    def _finish_all(self, error: EngineDeadError, abort: bool) -> None:
        with self._cond:
            self._error = error
            pending, self._inbox = self._inbox, []
        loop = self._loop
        batch = []
        for rid, t in list(self._tracked.items()):
            if abort:
                try:
                    self.engine.abort_request(rid)
                except Exception:  # noqa: BLE001
                    pass
                self.metrics.count_status("abort", t.n - len(t.done))
            batch.append((t.sink, error))
        self._tracked.clear()
        if abort:
            self._refresh_stats()
        try:
            for cmd in pending:
                if isinstance(cmd, _Add):
                    loop.call_soon_threadsafe(_resolve, cmd.ack, error)
            if batch:
                loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:  # the event loop is already closed
            pass


def _resolve(fut: asyncio.Future, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def _deliver(batch: list) -> None:
    for sink, item in batch:
        sink.put_nowait(item)
