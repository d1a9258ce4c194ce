"""The engine: requests in, one scheduler step at a time, RequestOutputs out. Not thread safe.

Admission goes through the input processor (prompt -> a Request of n Sequences), each step through the
scheduler (which sequences run, how many tokens each), the executor (the forward on every rank), the
sampler, and the output processor (tokens -> stop checks, text, RequestOutputs). The engine owns the
requests in flight and says when a sequence's blocks go back (the scheduler frees them).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from compiled_llm.config import EngineConfig
from compiled_llm.outputs import RequestOutput
from compiled_llm.runtime.block_manager import BlockManager, group_sinks, group_window
from compiled_llm.runtime.context_len import check_max_model_len
from compiled_llm.runtime.errors import EngineDeadError
from compiled_llm.runtime.executor import Executor, make_executor
from compiled_llm.runtime.input_processor import InputProcessor, load_tokenizer
from compiled_llm.runtime.output_processor import OutputProcessor, generation_eos_ids
from compiled_llm.runtime.sampler import Sampler
from compiled_llm.runtime.scheduler import ScheduledSeq, Scheduler
from compiled_llm.runtime.sequence import Request
from compiled_llm.sampling_params import SamplingParams

log = logging.getLogger("compiled_llm")


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self._dead: EngineDeadError | None = None
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
        self.block_manager = self._build_kv_cache()
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill)
        self.sampler = Sampler()
        self.input_processor = InputProcessor(config, self.tokenizer, self.executor.model, mcfg.vocab_size,
                                              self.executor.device)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, config.max_model_len,
                                                self.executor.sparse is not None)
        self.requests: dict[str, Request] = {}
        self.prompt_tokens_total = 0

    def _build_kv_cache(self) -> BlockManager:
        """Plans the blocks of every KV group on every rank, checks they hold max_model_len, allocates them
        (the compiler warms up there) and returns the block manager that hands them out."""
        config, executor = self.config, self.executor
        if executor.state_specs and config.enable_prefix_caching:
            # A cached prefix would need the recurrent state at that point, which is not kept.
            log.warning("prefix caching is off for this model: its recurrent (linear-attention) layers "
                        "keep per-sequence state that cached KV blocks cannot restore")
            config.enable_prefix_caching = False
        num_blocks = executor.plan_blocks(config.max_model_len)
        self._check_capacity(num_blocks)
        executor.allocate_kv_cache(num_blocks)
        sparse = executor.sparse
        tokens = {("full" if g is None else f"window {g}"): n * config.block_size for g, n in num_blocks.items()}
        log.info("KV cache: %s tokens per group, block size %d", tokens, config.block_size)
        return BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                            executor.group_block_bytes(), executor.num_state_slots,
                            hash_prompt_only=sparse is not None and not sparse.hash_generated_blocks)

    def _check_capacity(self, num_blocks: dict[int | None, int]) -> None:
        bs = self.config.block_size
        for g, n in num_blocks.items():
            need = self.config.max_model_len if g is None else min(
                self.config.max_model_len, group_window(g) + bs + -(-group_sinks(g) // bs) * bs)
            if n * bs < need + bs:
                raise ValueError(f"the KV cache holds {n * bs} tokens for "
                                 f"{'full' if g is None else f'window-{g}'} layers, fewer than max_model_len "
                                 f"({self.config.max_model_len}) needs; give it more memory or lower max_model_len")

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = self.input_processor.process(request_id, prompt, params, arrival_time or time.time())
        if req.has_media:  # parallel engines: every rank gets the media once
            self._guarded(self.executor.register_media, request_id, req.mm)
        self.requests[request_id] = req
        for seq in req.seqs:
            self.scheduler.add(seq)
        self.prompt_tokens_total += len(req.prompt_token_ids)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
        self._release_media([req])
        return self.output_processor.output(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, execute, update: the outputs of the requests that advanced."""
        if self._dead is not None:
            raise self._dead
        batch = self.scheduler.schedule()
        if not batch:
            return []
        logits = self._guarded(self.executor.execute, batch)
        return self._update(batch, logits)

    def _update(self, batch: list[ScheduledSeq], logits) -> list[RequestOutput]:
        """Sequences that completed their tokens sample one; ended ones give their blocks back; each request
        that advanced gets its output, and ended requests leave."""
        done = self.scheduler.advance(batch)
        rows = [self.output_processor.sampling_row(s) for s in done]
        results = self.sampler(logits, rows) if done else []
        now = time.time()
        touched: dict[str, Request] = {}
        for seq, res in zip(done, results):
            if self.output_processor.append_token(seq, res, now):
                self.scheduler.finish(seq)
            touched[seq.request_id] = self.requests[seq.request_id]
        outputs, ended = [], []
        for req in touched.values():
            outputs.append(self.output_processor.output(req))
            if req.finished:
                req.metrics.finished_time = now
                del self.requests[req.request_id]
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
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.output_processor.generation_tokens_total,
        }
        if self.executor.sparse is not None:  # sparse_method, sparse_attended_tokens, sparse_cached_tokens
            stats.update(self.executor.sparse.stats())
        return stats

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self.input_processor.tokenize(prompt, add_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None) -> str:
        return self.input_processor.apply_chat_template(messages, add_generation_prompt, chat_template)

    def new_input_processor(self) -> InputProcessor:
        """An input processor for another thread (the server's event loop and its helper threads): its own
        tokenizer and media processor; what it reads of the engine does not change after start-up. Chat
        templates, tokenization and media placeholders of the server go through it, never through this
        engine, which only the engine thread uses."""
        return self.input_processor.copy()
