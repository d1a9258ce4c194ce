"""The engine: requests in, one scheduler step at a time, RequestOutputs out. Not thread safe."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from compiled_llm.config import EngineConfig
from compiled_llm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from compiled_llm.runtime.block_manager import BlockManager, group_sinks, group_window
from compiled_llm.runtime.detokenizer import IncrementalDetokenizer, find_stop_string
from compiled_llm.runtime.errors import EngineDeadError
from compiled_llm.runtime.executor import Executor, make_executor
from compiled_llm.runtime.sampler import Sampler, SamplingRow
from compiled_llm.runtime.scheduler import Scheduler
from compiled_llm.runtime.sequence import Sequence, Status
from compiled_llm.sampling_params import SamplingParams

log = logging.getLogger("compiled_llm")


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def generation_eos_ids(folder: Path) -> set[int]:
    """End-of-sequence ids from generation_config.json (chat checkpoints add end-of-turn there)."""
    path = folder / "generation_config.json"
    if not path.exists():
        return set()
    eos = json.loads(path.read_text()).get("eos_token_id")
    return {eos} if isinstance(eos, int) else set(eos or [])


class _Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], seqs: list[Sequence],
                 arrival_time: float):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.seqs = seqs
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.has_media = any(s.mm is not None for s in seqs)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self._dead: EngineDeadError | None = None
        self.executor: Executor | None = None
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

        if self.executor.state_specs and config.enable_prefix_caching:
            # A cached prefix would need the recurrent state at that point, which is not kept.
            log.warning("prefix caching is off for this model: its recurrent (linear-attention) layers "
                        "keep per-sequence state that cached KV blocks cannot restore")
            config.enable_prefix_caching = False
        num_blocks = self.executor.plan_blocks(config.max_model_len)
        self._check_capacity(num_blocks)
        self.executor.allocate_kv_cache(num_blocks)
        sparse = self.executor.sparse
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                          self.executor.group_block_bytes(), self.executor.num_state_slots,
                                          hash_prompt_only=sparse is not None and not sparse.hash_generated_blocks)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill)
        self.sampler = Sampler()
        self.requests: dict[str, _Request] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        tokens = {("full" if g is None else f"window {g}"): n * config.block_size for g, n in num_blocks.items()}
        log.info("KV cache: %s tokens per group, block size %d", tokens, config.block_size)

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
    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        mm = None
        if isinstance(prompt, dict):  # {"prompt": text, "multi_modal_data": {...}} (docs/multimodal.md)
            if self.tokenizer is None:
                raise ValueError("this engine was started without a tokenizer: multimodal prompts need one")
            from compiled_llm.multimodal.processor import process_multimodal_prompt

            text, ids, mm = process_multimodal_prompt(self, prompt)
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine was started without a tokenizer: give prompt token ids")
            if not prompt:
                raise ValueError("the prompt is empty")
            text, ids = prompt, self.tokenize(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.executor.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"the prompt has {len(ids)} tokens; max_model_len is {limit}, which must leave room "
                             "for at least one generated token")
        max_tokens = limit - len(ids) if params.max_tokens is None else min(params.max_tokens, limit - len(ids))
        if mm is not None:  # parallel engines: every rank gets the media once
            try:
                self.executor.register_media(request_id, mm)
            except EngineDeadError as e:
                self._dead = e
                raise
        now = arrival_time or time.time()
        seqs = []
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.executor.device).manual_seed(params.seed + i)
            seq = Sequence(request_id, i, ids, params, max_tokens, now, gen)
            seq.mm = mm
            if self.tokenizer is not None:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens,
                                                         params.spaces_between_special_tokens)
            seqs.append(seq)
        self.requests[request_id] = _Request(request_id, text, ids, seqs, now)
        for seq in seqs:
            self.scheduler.add(seq)
        self.prompt_tokens_total += len(ids)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
        self._release_media([req])
        return self._output(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self._dead is not None:
            raise self._dead
        batch = self.scheduler.schedule()
        if not batch:
            return []
        try:
            logits = self.executor.execute(batch)
        except EngineDeadError as e:  # a worker died: this and every later step fail
            self._dead = e
            raise
        done = [item.seq for item in batch if item.seq.num_computed_tokens + item.num_tokens == len(item.seq)]
        for item in batch:
            item.seq.num_computed_tokens += item.num_tokens
            self.block_manager.commit(item.seq)
        rows = [SamplingRow(s.params, s.prompt_token_ids, s.output_token_ids, s.generator, self._stop_ids(s))
                for s in done]
        results = self.sampler(logits, rows) if done else []
        now = time.time()
        touched: dict[str, _Request] = {}
        for seq, res in zip(done, results):
            self._append_token(seq, res, now)
            touched[seq.request_id] = self.requests[seq.request_id]
        outputs, ended = [], []
        for req in touched.values():
            outputs.append(self._output(req))
            if req.finished:
                req.metrics.finished_time = now
                del self.requests[req.request_id]
                ended.append(req)
        self._release_media(ended)
        return outputs

    def _release_media(self, reqs: list[_Request]) -> None:
        """Ended requests' media registrations go on every rank (parallel engines; a preempted request keeps
        its registration). A dead worker shows at the next step, not here (abort runs in cleanup paths)."""
        rids = [r.request_id for r in reqs if r.has_media]
        if rids and self._dead is None:
            try:
                self.executor.release_media(rids)
            except EngineDeadError as e:
                self._dead = e

    def _stop_ids(self, seq: Sequence) -> set[int]:
        ids = set(seq.params.stop_token_ids)
        if not seq.params.ignore_eos:
            ids |= self.eos_token_ids
        return ids

    def _append_token(self, seq: Sequence, res, now: float) -> None:
        p = seq.params
        token = res.token_id
        seq.token_ids.append(token)
        self.generation_tokens_total += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        if p.logprobs is not None:
            entry = {token: Logprob(res.logprob, res.rank, self._decode_one(token))}
            for rank, (tid, lp) in enumerate(res.top_logprobs, start=1):
                entry.setdefault(tid, Logprob(lp, rank, self._decode_one(tid)))
            seq.logprobs.append(entry)
            seq.cumulative_logprob += res.logprob
        n_out = seq.num_output_tokens
        past_min = n_out >= p.min_tokens
        if past_min and not p.ignore_eos and token in self.eos_token_ids:
            return self._finish(seq, "stop", None)
        if past_min and token in p.stop_token_ids:
            return self._finish(seq, "stop", token)
        new_text = seq.detokenizer.append(token) if seq.detokenizer else ""
        seq.text = seq.detokenizer.text if seq.detokenizer else ""
        if past_min and p.stop and new_text:
            hit = find_stop_string(seq.text, len(new_text), p.stop, p.include_stop_str_in_output)
            if hit:
                seq.text = seq.text[:hit[1]]
                return self._finish(seq, "stop", hit[0])
        if n_out >= seq.max_tokens or len(seq) >= self.config.max_model_len:
            if seq.detokenizer:
                seq.text += seq.detokenizer.flush()
            return self._finish(seq, "length", None)

    def _decode_one(self, token: int) -> str | None:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None

    def _finish(self, seq: Sequence, reason: str, stop_reason) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.scheduler.finish(seq)

    def _output(self, req: _Request) -> RequestOutput:
        outs = []
        for s in req.seqs:
            outs.append(CompletionOutput(
                index=s.index, text=s.text, token_ids=list(s.output_token_ids),
                cumulative_logprob=s.cumulative_logprob if s.params.logprobs is not None else None,
                logprobs=list(s.logprobs) if s.params.logprobs is not None else None,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason))
        first = min((s.first_token_time for s in req.seqs if s.first_token_time), default=None)
        req.metrics.first_token_time = first
        req.metrics.num_cached_tokens = max(s.num_cached_tokens for s in req.seqs)
        if self.executor.sparse is not None:
            req.metrics.sparse_attended_tokens = sum(s.sparse_attended_tokens for s in req.seqs)
            req.metrics.sparse_cached_tokens = sum(s.sparse_cached_tokens for s in req.seqs)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.finished, req.metrics,
                             num_cached_tokens=req.metrics.num_cached_tokens)

    # ---- health and shutdown -------------------------------------------------------------------
    def is_healthy(self) -> bool:
        """False once the engine cannot run any more (a worker process died): /health answers 503."""
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
            "generation_tokens_total": self.generation_tokens_total,
        }
        if self.executor.sparse is not None:  # sparse_method, sparse_attended_tokens, sparse_cached_tokens
            stats.update(self.executor.sparse.stats())
        return stats

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None) -> str:
        if not messages:
            raise ValueError("messages is empty")
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool", "developer"):
                raise ValueError(f"unknown message role {m.get('role') if isinstance(m, dict) else m!r}")
        kwargs = {"chat_template": chat_template} if chat_template else {}
        if not chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; pass one (--chat-template)")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  **kwargs)
