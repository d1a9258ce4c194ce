"""The engine: requests in, one scheduler step at a time, RequestOutputs out. Not thread safe.

Admission goes through the input processor (prompt -> a Request of n Sequences), each step through the
scheduler (which sequences run, how many tokens each), the executor (the forward on every rank), the
sampler, and the output processor (tokens -> stop checks, text, RequestOutputs). The engine owns the
requests in flight and says when a sequence's blocks go back (the scheduler frees them).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from compiled_llm.config import EngineConfig
from compiled_llm.ops.jit import MONITOR
from compiled_llm.outputs import RequestOutput
from compiled_llm.runtime.async_scheduling import PLACEHOLDER, InFlight, async_scheduling_possible, needs_host_history
from compiled_llm.runtime import prompt_logprobs
from compiled_llm.runtime.context_len import check_max_model_len
from compiled_llm.runtime.errors import EngineDeadError
from compiled_llm.runtime.executor import Executor, make_executor
from compiled_llm.runtime.input_processor import InputProcessor, load_tokenizer
from compiled_llm.runtime.kv_plan import build_kv_cache
from compiled_llm.runtime.output_processor import OutputProcessor, generation_eos_ids
from compiled_llm.runtime.sampler import PendingTokens, Sampler
from compiled_llm.runtime.scheduler import ScheduledSeq, Scheduler
from compiled_llm.runtime.structured_output import GrammarBackend
from compiled_llm.runtime.sequence import Request, Sequence
from compiled_llm.sampling_params import RequestOutputKind, SamplingParams

log = logging.getLogger("compiled_llm")


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self._dead: EngineDeadError | None = None
        self._builder_thread: int | None = threading.get_ident()  # None once a step's thread was checked
        self.executor: Executor | None = None
        check_max_model_len(config)  # before any weight is loaded
        self.executor = make_executor(config)
        model_path = config.resolved_model()
        self.model_name = Path(model_path).name
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer or model_path)
        mcfg = self.executor.model_config
        if config.max_model_len is None:
            config.max_model_len = mcfg.max_position_embeddings
        elif config.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")
        if not config.enable_chunked_prefill:
            config.max_num_batched_tokens = max(config.max_num_batched_tokens, config.max_model_len)
        self.eos_token_ids = set(mcfg.eos_token_id) | generation_eos_ids(Path(model_path))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.block_manager = build_kv_cache(config, self.executor)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill, policy=config.scheduling_policy)
        self.sampler = Sampler()
        self.input_processor = InputProcessor(config, self.tokenizer, self.executor.model, mcfg.vocab_size,
                                              self.executor.device)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, config.max_model_len,
                                                self.executor.sparse is not None)
        # structured output: xgrammar's compiler over this tokenizer (built on the first constrained request)
        self.grammars = GrammarBackend(self.tokenizer, mcfg.vocab_size, sorted(self.eos_token_ids))
        self.requests: dict[str, Request] = {}
        self.prompt_tokens_total = 0
        # async scheduling: the next step is prepared and launched while the last one runs on the device
        self.async_scheduling = async_scheduling_possible(config, self.executor)
        self._inflight: InFlight | None = None
        self._sync_requests: set[str] = set()  # requests whose sampling reads host-side history (penalties, grammars)
        self.async_steps = 0
        self.sync_steps = 0
        self.executor.freeze_heap()  # this process's heap and every other rank's (runtime/heap.py)

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """priority (scheduling_policy "priority"; vLLM's): lower is scheduled first; under "fcfs" it must be 0."""
        params = params or SamplingParams()
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError("priority needs the priority scheduling policy (--scheduling-policy priority)")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        # StructuredOutputError (a ValueError): xgrammar missing, or a schema it cannot compile
        grammar = self.grammars.compile(params.structured_output) if params.structured_output is not None else None
        req = self.input_processor.process(request_id, prompt, params, arrival_time or time.time())
        if grammar is not None:
            for seq in req.seqs:
                seq.grammar = self.grammars.new_state(grammar, params.structured_output.get("after_token_id"))
        for seq in req.seqs:
            seq.priority = priority
        if req.has_media:  # parallel engines: every rank gets the media once
            self._guarded(self.executor.register_media, request_id, req.mm)
        self.requests[request_id] = req
        if self.async_scheduling and needs_host_history(params):
            self._sync_requests.add(request_id)
        for seq in req.seqs:
            self.scheduler.add(seq)
        self.prompt_tokens_total += len(req.prompt_token_ids)

    def prepare_structured_output(self, spec: dict) -> None:
        """Compiles the grammar of a SamplingParams.structured_output into the engine's cache, from any thread, so
        that add_request finds it compiled; raises StructuredOutputError as add_request would. The server calls it
        in a worker thread before it hands a constrained request to the engine thread: there the first one
        imported xgrammar and built its tables of the vocabulary (~0.7 s at 262,144 tokens on a 2-core CPU) and
        each new schema compiled (~10 ms for a dozen fields) while every running request waited."""
        self.grammars.compile(spec)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self._sync_requests.discard(request_id)
        for seq in req.seqs:
            if seq.pending_token:  # async scheduling: its last token was never read; it is not output
                seq.token_ids.pop()
                seq.pending_token = False
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
        self._release_media([req])
        return self.output_processor.output(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self._inflight is not None

    # ---- one step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, execute, update: the outputs of the requests that advanced. Under async scheduling the
        outputs are those of the step launched by the previous call (see _step_async). A kernel compiled
        anywhere in the step after start-up warm-up (the forward, the logits, the sampler) is judged by
        --jit-monitor."""
        if self._dead is not None:
            raise self._dead
        if self._builder_thread is not None:
            self._check_step_thread()
        with MONITOR.watch(self.config.jit_monitor):
            return self._step()

    def _check_step_thread(self) -> None:
        """Warns, once, when a CPU engine is stepped on a thread other than the one that built it: OpenMP then
        keeps a thread team for each, and once the teams hold more threads than there are cores libgomp stops
        spinning between parallel regions, so every small op of a step waits for a worker to wake (2 cores, a
        tiny Gemma 4: steps ~3-4x slower). The server builds its engine on the thread that steps it
        (server/async_engine.py EngineThread)."""
        import torch

        here, builder = threading.get_ident(), self._builder_thread
        self._builder_thread = None
        if here != builder and self.executor.device.type == "cpu" and torch.get_num_threads() > 1:
            log.warning("this CPU engine was built on one thread and is stepped on another: with %d torch "
                        "threads, OpenMP's thread teams then exceed the cores and every step runs several times "
                        "slower; build and step the engine on one thread, or call torch.set_num_threads(1) "
                        "in the stepping thread", torch.get_num_threads())

    def _step(self) -> list[RequestOutput]:
        if self.async_scheduling and not self._sync_requests:
            return self._step_async()
        outputs = self._finish_inflight()  # back to synchronous steps: read what is still on its way first
        batch = self.scheduler.schedule()
        if not batch:
            return outputs
        spans = prompt_logprobs.spans(batch)  # rows the runner adds after the sampled ones
        logits = self._guarded(self.executor.execute, batch)
        if spans:
            logits, summary = prompt_logprobs.split(logits, batch, spans)
            prompt_logprobs.record(batch, spans, summary, self.output_processor.decode_token)
        self.sync_steps += 1
        return outputs + self._update(batch, logits)

    def _update(self, batch: list[ScheduledSeq], logits) -> list[RequestOutput]:
        """Sequences that completed their tokens sample one; ended ones give their blocks back; each request
        that advanced gets its output, and ended requests leave."""
        done = self.scheduler.advance(batch)
        rows = [self.output_processor.sampling_row(s) for s in done]
        results = self.sampler(logits, rows) if done else []
        return self._append(done, results)

    def _step_async(self) -> list[RequestOutput]:
        """One step that overlaps the host with the device: schedule and launch step N (the tokens step N-1
        sampled are copied into its inputs on the device), then, while it runs, read step N-1's tokens and do
        their host work (stop checks, text, outputs). Each sequence that samples in step N gets a placeholder
        token so the scheduler can plan step N+1; the real token replaces it when step N is read. A sequence
        that step N-1 ended was still computed in step N (its result is dropped; the KV it wrote went to
        blocks it had already released, ahead of any later step on the same stream). One whose next token
        ends it by length gets no placeholder, so it is not computed again."""
        batch = self.scheduler.schedule()
        launched = None
        if batch:
            prev = self._inflight
            logits = self._guarded(self.executor.execute, batch, prev.pending if prev else None)
            done = [item.seq for item in batch if not item.seq.is_finished
                    and item.seq.num_computed_tokens + item.num_tokens == len(item.seq)]
            rows = [self.output_processor.sampling_row(s) for s in done]
            sampled = self.sampler.launch(logits, rows, defer=True) if done else None
            launched = (batch, done, sampled)
            self.async_steps += 1
        outputs = self._finish_inflight()
        if launched is not None:
            batch, done, sampled = launched
            self.scheduler.advance(batch)  # the sequences step N-1 ended are skipped
            pending = {}
            for i, seq in enumerate(done):
                if seq.is_finished or self._ends_by_length(seq):
                    continue
                seq.token_ids.append(PLACEHOLDER)
                seq.pending_token = True
                pending[seq.seq_id] = i
            if sampled is not None:
                self._inflight = InFlight(done, sampled, PendingTokens(sampled.token_ids, pending))
        return outputs

    def _ends_by_length(self, seq: Sequence) -> bool:
        """Whether the token being sampled now ends the sequence whatever it is (max_tokens, max_model_len)."""
        return seq.num_output_tokens + 1 >= seq.max_tokens or len(seq) + 1 >= self.config.max_model_len

    def _finish_inflight(self) -> list[RequestOutput]:
        """Reads the launched step's tokens (waiting for the device if it is not done) and applies them."""
        f, self._inflight = self._inflight, None
        if f is None:
            return []
        results = f.sampled.results()
        live = []
        for seq, res in zip(f.done, results):
            if seq.is_finished:  # ended while the step ran (an abort)
                continue
            if seq.pending_token:
                seq.token_ids.pop()  # the placeholder
                seq.pending_token = False
            live.append((seq, res))
        return self._append([s for s, _ in live], [r for _, r in live])

    def _append(self, done: list[Sequence], results) -> list[RequestOutput]:
        now = time.time()
        touched: dict[str, Request] = {}
        for seq, res in zip(done, results):
            if self.output_processor.append_token(seq, res, now):
                self.scheduler.finish(seq)
            touched[seq.request_id] = self.requests[seq.request_id]
        outputs, ended = [], []
        for req in touched.values():
            req.metrics.last_token_time = now
            if req.finished or req.seqs[0].params.output_kind != RequestOutputKind.FINAL_ONLY:
                outputs.append(self.output_processor.output(req))
            if req.finished:
                req.metrics.finished_time = now
                del self.requests[req.request_id]
                self._sync_requests.discard(req.request_id)
                ended.append(req)
        self._release_media(ended)
        return outputs

    def _guarded(self, call, *args):
        """An executor call; a dead worker makes it, and every later step, raise EngineDeadError."""
        try:
            return call(*args)
        except EngineDeadError as e:
            self._dead = e
            raise

    def _release_media(self, reqs: list[Request]) -> None:
        """Ended requests' media registrations go on every rank (parallel engines; a preempted request keeps
        its registration). A dead worker shows at the next step, not here (abort runs in cleanup paths)."""
        rids = [r.request_id for r in reqs if r.has_media]
        if rids and self._dead is None:
            try:
                self.executor.release_media(rids)
            except EngineDeadError as e:
                self._dead = e

    # ---- health and shutdown -------------------------------------------------------------------
    def is_healthy(self) -> bool:
        """False once the engine cannot run any more (a worker process died): /health answers 503.
        Only reads flags, so another thread (the server's event loop) may call it."""
        return self._dead is None and self.executor.is_healthy()

    def shutdown(self) -> None:
        """Stops the worker processes of a parallel engine (nothing to do for one process)."""
        if self.executor is not None:
            self.executor.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass

    # ---- helpers ---------------------------------------------------------------------------
    def get_stats(self) -> dict:
        s = self.scheduler
        stats = {
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            "kv_cache_usage": self.block_manager.usage(),
            "num_free_blocks": self.block_manager.num_free_blocks(),
            "num_total_blocks": self.block_manager.num_total_blocks(),
            "prefix_cache_queries": s.prefix_queries,
            "prefix_cache_hits": s.prefix_hits,
            "num_preemptions": s.num_preemptions,
            "prompt_tokens_computed": s.prompt_tokens_computed,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.output_processor.generation_tokens_total,
        }
        if self.block_manager.snapshotting:  # hybrid models' recurrent-state snapshots for prefix hits
            stats.update(self.block_manager.snapshot_stats())
        if self.executor.sparse is not None:  # sparse_method, sparse_attended_tokens, sparse_cached_tokens
            stats.update(self.executor.sparse.stats())
        return stats

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self.input_processor.tokenize(prompt, add_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None, template_kwargs: dict | None = None,
                            continue_final_message: bool = False) -> str:
        return self.input_processor.apply_chat_template(messages, add_generation_prompt, chat_template,
                                                        template_kwargs=template_kwargs,
                                                        continue_final_message=continue_final_message)

    def new_input_processor(self) -> InputProcessor:
        """An input processor for another thread (the server's event loop and its helper threads): its own
        tokenizer and media processor; what it reads of the engine does not change after start-up. Chat
        templates, tokenization and media placeholders of the server go through it, never through this
        engine, which only the engine thread uses."""
        return self.input_processor.copy()
