"""One rank's model shard and KV cache, and the media its requests registered.

The driver (rank 0, inside the engine) holds a RankWorker, and so does every worker process. The driver
runs the same method on every rank (`MultiProcExecutor.collective_rpc`): control calls at start-up and
for media, and `execute` each step, which runs this rank's part of the forward and passes hidden states
between pipeline stages.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from compiled_llm.config import EngineConfig
from compiled_llm.distributed.communication import recv_tensors, send_tensors
from compiled_llm.distributed.parallel_state import get_parallel_state
from compiled_llm.models.interfaces import supports_pp
from compiled_llm.multimodal import transport
from compiled_llm.multimodal.runner import merge, soft_tokens
from compiled_llm.ops.context import ForwardContext
from compiled_llm.runtime.executor.launch import rank_config
from compiled_llm.runtime.executor.wire import MediaRefs, StepInput, rank_extras, to_device
from compiled_llm.runtime.heap import freeze_startup_heap
from compiled_llm.runtime.model_runner import ModelRunner
from compiled_llm.runtime import prompt_logprobs

# Test hook: "RANK:REQUEST_ID" makes that rank refuse that request's media registration.
MEDIA_FAULT_ENV = "COMPILED_LLM_MEDIA_REGISTRATION_FAULT"


@dataclass
class RegisteredMedia:
    """One request's media on one rank: (modality, soft-token count, tensors) per item, and the soft tokens
    computed so far (kept until the prompt is done; a preempted request recomputes them)."""

    items: list[tuple[str, int, dict[str, torch.Tensor]]]
    embeds: dict[int, torch.Tensor]


class RankWorker:
    """A rank's model shard and KV cache; the driver holds one, and so does every worker process."""

    def __init__(self, config: EngineConfig):
        self.ps = get_parallel_state()
        if str(config.device).startswith("cuda"):
            torch.cuda.set_device(self.ps.local_rank)
        self.runner = ModelRunner(rank_config(config, self.ps.local_rank))
        self.media: dict[str, RegisteredMedia] = {}  # request id -> its media (first stage only)

    # control calls (the driver runs them on every rank through `MultiProcExecutor.collective_rpc`)
    def kv_info(self) -> tuple[set, dict]:
        return set(self.runner.kv_groups), self.runner.group_block_bytes()

    def set_kv_groups(self, groups: set) -> None:
        self.runner.kv_groups = set(groups)

    def plan_blocks(self, max_model_len: int, settings: dict) -> dict:
        for name, value in settings.items():  # what the engine resolved after the shards were built
            setattr(self.runner.config, name, value)
        return self.runner.plan_blocks(max_model_len)

    def freeze_heap(self) -> bool:
        """This rank's process is started: its heap out of the collector's way (runtime/heap.py). Returns
        whether it is frozen."""
        freeze_startup_heap()
        return gc.get_freeze_count() > 0

    def allocate_kv_cache(self, num_blocks: dict) -> bool:
        self.runner.allocate_kv_cache({g: n for g, n in num_blocks.items() if g in self.runner.kv_groups})
        return True

    def param_counts(self) -> dict[str, int]:
        return {name: p.numel() for name, p in self.runner.model.named_parameters()}

    def compiler_summary(self) -> dict | None:
        """Per-pass matches and compiled pieces (None when the model runs eager)."""
        c = self.runner.compiler
        return None if c is None else c.summary()

    def info(self) -> dict:
        ps, model = self.ps, self.runner.model
        return {"rank": ps.rank, "tp_rank": ps.tp_rank, "pp_rank": ps.pp_rank, "pid": os.getpid(),
                "layers": model.stage_layers() if supports_pp(model) else (None, None),
                "device": str(self.runner.device)}

    def sync_debug(self, on: bool) -> list[tuple[str, int]] | None:
        """GPU tools: on, counts this rank's blocking host syncs (torch's sync debug mode) until called off,
        which returns the sites, most frequent first. Under async scheduling a worker that blocks on its
        stream stops the overlap as surely as the driver (scripts/gpu_smoke.py reads every rank)."""
        import warnings
        from collections import Counter

        if not torch.cuda.is_available():
            return None
        if on:
            self._sync_catch = warnings.catch_warnings(record=True)
            self._sync_seen = self._sync_catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            return None
        torch.cuda.set_sync_debug_mode(0)
        self._sync_catch.__exit__(None, None, None)
        return Counter(f"{os.path.basename(w.filename)}:{w.lineno}" for w in self._sync_seen).most_common(12)

    # media of multimodal requests: registered once when admitted, released when they end
    def register_media(self, request_id: str, manifest: transport.Manifest) -> str | None:
        """Copies the request's processor tensors into this rank's registry. Returns None, or the error text:
        it never raises, so a bad registration cannot end the worker loop. Later pipeline stages keep
        nothing (the towers live on the first stage)."""
        try:
            if os.environ.get(MEDIA_FAULT_ENV) == f"{self.ps.rank}:{request_id}":
                raise RuntimeError(f"media registration fault injected on rank {self.ps.rank}")
            if self.ps.is_first_stage:
                self.media[request_id] = RegisteredMedia(transport.unpack(manifest, self.runner.device), {})
            return None
        except Exception as e:  # noqa: BLE001 - reported to the driver, which rolls back on every rank
            return f"{type(e).__name__}: {e}"

    def release_media(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.media.pop(rid, None)

    def media_requests(self) -> list[str]:
        return sorted(self.media)

    def _media_embeds(self, input_ids: torch.Tensor, media: MediaRefs) -> torch.Tensor:
        model, feats = self.runner.model, []
        for rid, k, lo, hi in media.refs:
            entry = self.media[rid]
            modality, num_tokens, tensors = entry.items[k]
            feats.append(soft_tokens(model, entry.embeds, k, modality, tensors, num_tokens)[lo:hi])
        for rid in media.done:
            if rid in self.media:
                self.media[rid].embeds.clear()
        return merge(model, input_ids, media.rows, feats)

    # the step
    def _fill_pending(self, step: StepInput, tokens: torch.Tensor | None) -> None:
        """Async scheduling: the placeholders of the step's input ids get the previous step's sampled tokens.
        Only rank 0 samples (so greedy and seeded draws are the one-process engine's); it broadcasts the
        tokens this step needs over the tensor-parallel group on the device, in the stream order of the
        step's other collectives, so that no rank waits for them on the host. Pipeline-parallel engines
        step synchronously (never here)."""
        ps = self.ps
        if ps.rank == 0:
            picked = tokens[step.fill_from].to(torch.long)
        else:
            picked = torch.empty(step.fill_at.shape[0], dtype=torch.long, device=self.runner.device)
        if ps.tp_size > 1:
            dist.broadcast(picked, src=ps.global_rank(ps.pp_rank, 0), group=ps.tp_group)
        step.input_ids[step.fill_at] = picked

    @torch.inference_mode()
    def execute(self, step: StepInput, tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Runs this rank's part of the step; returns the logits on rank 0, None elsewhere. tokens (rank 0,
        async scheduling): the previous step's sampled tokens, on the device."""
        ps, r = self.ps, self.runner
        dev = r.device
        step = to_device(step, dev)
        if step.fill_at is not None:
            self._fill_pending(step, tokens)
        n = step.input_ids.shape[0]
        ctx = ForwardContext(step.meta, r.kv_caches, r.specs, rank_extras(step.extra, r.state_caches))
        intermediate = None
        if not ps.is_first_stage:
            shapes = r.model.intermediate_shapes(n, r.dtype)
            intermediate = recv_tensors(shapes, ps.global_rank(ps.pp_rank - 1, ps.tp_rank), dev)
        embeds = None
        if step.media is not None and ps.is_first_stage:  # towers run here, on this rank's registered copy
            embeds = self._media_embeds(step.input_ids, step.media)
        out = r.execute_prepared(step.input_ids, step.positions, ctx, step.rows, intermediate, embeds, step.prompt)
        if not ps.is_last_stage:
            send_tensors(out, ps.global_rank(ps.pp_rank + 1, ps.tp_rank))
            out = None
        vocab = r.model_config.vocab_size
        num_rows = prompt_logprobs.result_rows(step.rows.shape[0], step.prompt, vocab)
        if ps.pp_size > 1 and num_rows:
            last = ps.global_rank(ps.pp_size - 1, 0)
            if ps.rank == 0:
                out = torch.empty(num_rows, vocab, dtype=torch.float32, device=dev)
                dist.recv(out, last)
            elif ps.rank == last:
                dist.send(out.contiguous(), 0)
        return out if ps.rank == 0 else None
