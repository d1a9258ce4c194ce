"""How big the KV cache is and how it is split between KV groups: on the CPU a byte budget; on the GPU
measured as vLLM does (runtime/memory.py has the arithmetic): one eager profile step of the largest batch
before the cache exists, then the rest of the engine's share of the GPU. A mixin of the model runner, whose
model, layer specs and cache builders it uses."""

from __future__ import annotations

import logging
import os
import time

import torch

from compiled_llm.ops.attention import cached_rot_keys
from compiled_llm.ops.context import AttentionMetadata, ForwardContext, GroupMetadata, set_forward_context
from compiled_llm.runtime.block_manager import BlockManager
from compiled_llm.runtime.block_pool import group_sinks, group_window
from compiled_llm.runtime.memory import (GPU_MARGIN_BYTES, gib, kv_cache_budget, one_sequence_bytes, prompt_graph_bytes,
                                         sequence_blocks)

log = logging.getLogger("compiled_llm")

DEFAULT_CPU_KV_BYTES = 1 << 30


ROT_KEYS_ENV = "COMPILED_LLM_KV_ROT_KEYS"  # 0: K=V layers keep the value only (keys rebuilt on every read)


def mark_rot_keys(specs: dict, enabled: bool = True) -> list[int]:
    """Sets AttentionSpec.rot_keys on the K=V layers whose keys rotate in part of each half (Gemma 4's global
    layers: 64 of 256 dims), so that their cached rows also keep those dims' rotated keys: the decode kernel
    then reads 128 more elements a row (+25% of such a layer's cache) instead of rebuilding the rotation for
    every key at every step. Not for StreamingLLM or OmniKV layers (their kernels rebuild the keys, and an
    offloaded cache is sized as the value alone). enabled: EngineConfig.kv_rotated_keys (and the environment's
    COMPILED_LLM_KV_ROT_KEYS=0 turns it off too, for A/B runs). Returns the layers marked."""
    enabled = enabled and os.environ.get(ROT_KEYS_ENV, "1") != "0"
    marked = []
    for i, s in specs.items():
        s.rot_keys = 0
        if enabled and not (s.sink_tokens or s.omnikv is not None or s.offloaded):
            s.rot_keys = cached_rot_keys(s)
        if s.rot_keys:
            marked.append(i)
    return marked


class KVCachePlanner:
    """Needs from the runner: config, device, dtype, specs, kv_groups, block_size, state_specs,
    num_state_slots, sparse, model, memory_profile, _kv_tensors, _state_tensors, _add_extras."""

    def group_block_bytes(self, offloaded: bool = False) -> dict[int | None, int]:
        """Bytes one block takes across the device-resident layers of each KV group (offloaded: across the
        layers whose cache is pinned host memory instead, OmniKV's sparse layers under offload)."""
        out: dict[int | None, int] = {}
        elt = torch.empty((), dtype=self.dtype).element_size()
        for s in self.specs.values():
            if s.writes_cache and s.offloaded == offloaded:
                per = (1 if s.k_eq_v else 2) * self.block_size * s.num_kv_heads * s.cache_dim * elt
                out[s.kv_group] = out.get(s.kv_group, 0) + per
        return out

    def plan_blocks(self, max_model_len: int) -> dict[int | None, int]:
        """Split the memory budget between KV groups. Sliding groups get what every running sequence's
        window plus one step's tokens needs (twice, to keep prefix hits), the full group the rest; under a
        tight budget the sliding groups keep one sequence's blocks, so whenever the budget holds one
        max_model_len sequence every group does."""
        bytes_per = self.group_block_bytes()
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return {g: cfg.num_kv_blocks for g in bytes_per}
        gpu = self.device.type == "cuda"
        if gpu:
            budget = self.gpu_kv_budget(max_model_len, bytes_per)
        else:
            budget = cfg.kv_cache_memory_bytes or DEFAULT_CPU_KV_BYTES
        if self.state_bytes() >= budget:
            snaps = self.num_snapshot_slots
            raise ValueError(f"the recurrent state of {self.num_state_slots - snaps} sequences"
                             f"{f' and {snaps} prefix-cache snapshots' if snaps else ''} takes {self.state_bytes()} "
                             f"bytes, more than the cache budget ({budget}); lower max_num_seqs or "
                             "prefix_state_snapshots, or give the cache more memory")
        budget -= self.state_bytes()
        bs = self.block_size
        sliding = {g: b for g, b in bytes_per.items() if g is not None}
        full_bytes = bytes_per.get(None, 0)
        counts: dict[int | None, int] = {}
        even = budget // sum(bytes_per.values())
        floor = {g: sequence_blocks(g, max_model_len, bs) for g in bytes_per}  # one max_model_len sequence
        for g, b in sliding.items():
            per_seq = -(-(group_window(g) + bs) // bs) + 1 + -(-group_sinks(g) // bs)
            need = cfg.max_num_seqs * per_seq + -(-cfg.max_num_batched_tokens // bs)
            counts[g] = max(floor[g], min(even, 2 * need)) if full_bytes else need
        if full_bytes:
            if sum(counts[g] * sliding[g] for g in sliding) > budget - floor[None] * full_bytes:  # tight
                counts.update({g: floor[g] for g in sliding})
            rest = budget - sum(counts[g] * sliding[g] for g in sliding)
            counts[None] = max(0, rest // full_bytes)  # 0: too little memory, which the engine's check reports
        else:  # windowed groups only (e.g. StreamingLLM on every full layer): the budget in proportion to need
            need_bytes = sum(counts[g] * sliding[g] for g in sliding)
            counts = {g: counts[g] * budget // need_bytes for g in sliding}
        host = self.group_block_bytes(offloaded=True)
        self.host_kv_blocks = {}  # OmniKV offload: the blocks the host memory holds per group
        if host:  # the full group's blocks also have their sparse layers' bytes in host memory
            cap = self.host_kv_budget()
            for g, b in host.items():
                fits = self.host_kv_blocks[g] = cap // b
                if fits < sequence_blocks(g, max_model_len, bs):
                    raise ValueError(f"the host memory for OmniKV's offloaded KV ({gib(cap)}) holds fewer tokens "
                                     f"({fits * bs}) than one max_model_len sequence ({max_model_len}); raise "
                                     "omnikv_host_memory_gb, lower max_model_len or use --no-omnikv-offload")
                if fits < counts[g]:
                    log.info("the offloaded KV's host memory (%s) holds %d blocks, fewer than the device's %d: "
                             "the host memory sets the full-attention layers' blocks", gib(cap), fits, counts[g])
                    counts[g] = fits
        if gpu:
            self._report_memory_plan(counts)
        return counts

    def host_kv_budget(self) -> int:
        """Bytes of pinned host memory the offloaded KV may take: omnikv_host_memory_gb, else 80% of what
        the host has available now."""
        from compiled_llm.runtime.host_memory import available_host_bytes

        cap = self.sparse.cfg.host_memory_bytes
        return cap if cap is not None else int(0.8 * available_host_bytes())

    # ---- GPU memory profile ------------------------------------------------------------------
    def gpu_kv_budget(self, max_model_len: int, block_bytes: dict[int | None, int]) -> int:
        """The KV cache's bytes on the GPU (runtime/memory.py): measured, then planned; kept in
        memory_profile. Raises ValueError when one max_model_len sequence would not fit."""
        m = self.measure_memory(max_model_len)
        # what a decode step needs beyond the profiled prefill step: OmniKV's filter-layer scores (runtime/sparse_kv.py)
        m["decode_workspace_bytes"] = (self.sparse.decode_workspace_bytes(self.config.max_num_seqs, max_model_len)
                                       if self.sparse is not None else 0)
        compiled = getattr(self.compiler, "compiled", None)
        sizes = compiled.sizes if compiled is not None and compiled.state.cudagraphs else []
        m["prompt_graph_bytes"] = prompt_graph_bytes(m["activation_peak_bytes"], sizes, self.config.max_num_seqs,
                                                     self.config.max_num_batched_tokens)
        need = one_sequence_bytes(block_bytes, max_model_len, self.block_size) + self.state_bytes()
        budget = kv_cache_budget(m["total_bytes"], self.config.gpu_memory_utilization, m["in_use_bytes"],
                                 max(m["activation_peak_bytes"], m["decode_workspace_bytes"]) + m["prompt_graph_bytes"],
                                 need, max_model_len)
        self.memory_profile = dict(m, margin_bytes=GPU_MARGIN_BYTES, kv_cache_bytes=budget)
        return budget

    def measure_memory(self, max_model_len: int) -> dict[str, int]:
        """Total memory; what torch holds after loading (the weights); the activation peak of one full step
        above that (profile_run under reset peak statistics); and what is in use on the device once that
        run's memory went back (weights, CUDA context, kernels and workspaces it loaded, other processes)."""
        dev = self.device
        torch.cuda.empty_cache()
        weights = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        self.profile_run(max_model_len)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - weights
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        return {"total_bytes": total, "in_use_bytes": total - free, "weights_bytes": weights,
                "activation_peak_bytes": max(peak, 0)}

    @torch.inference_mode()
    def profile_run(self, max_model_len: int) -> None:
        """One eager forward of the largest step: max_num_batched_tokens new tokens at the end of the longest
        prompt (max_model_len - 1 tokens; several such sequences when one cannot hold the step), then the
        logits of up to max_num_seqs rows. Attention sees the whole context, so context-sized buffers count
        too. It runs over a throwaway KV cache of one block per layer (every slot and block-table entry
        points into it) and throwaway state slots: the cache and state the engine serves from are neither
        read nor written, and nothing of the run is kept. Eager, because compiling and graph capture come
        after the KV cache exists."""
        if self.compiler is not None:  # the compile cache in use and the JIT kernels built, before the eager step
            self.compiler.begin()
        t0 = time.perf_counter()
        context = max(1, max_model_len - 1)
        new = min(self.config.max_num_batched_tokens, context)
        num_seqs = -(-self.config.max_num_batched_tokens // new)
        kv = self._kv_tensors({g: 1 for g in self.kv_groups}, offload=False)
        states = self._state_tensors(num_seqs)
        ctx = self._profile_context(kv, states, num_seqs, new, context)
        total = num_seqs * new
        ids = torch.zeros(total, dtype=torch.long, device=self.device)
        positions = torch.arange(context - new, context, device=self.device).repeat(num_seqs)
        from compiled_llm.distributed.parallel_state import get_parallel_state

        kwargs = {}
        if not get_parallel_state().is_first_stage:  # a later pipeline stage starts from the previous one's output
            shapes = self.model.intermediate_shapes(total, self.dtype)
            kwargs["intermediate"] = {k: torch.zeros(shape, dtype=dt, device=self.device) for k, (shape, dt) in shapes.items()}
        with set_forward_context(ctx):
            hidden = self.model(ids, positions, **kwargs)
        if not isinstance(hidden, dict):  # the last stage: logits of as many rows as a step can finish
            self.model.compute_logits(hidden[:min(self.config.max_num_seqs, total)]).float()
        log.info("profile run: one %d-token step (%d x %d new tokens of a %d-token context), eager, in %.1fs",
                 total, num_seqs, new, context, time.perf_counter() - t0)

    def _profile_context(self, kv_caches: dict, state_caches: dict, num_seqs: int, new_tokens: int,
                         context_len: int) -> ForwardContext:
        """num_seqs sequences of context_len tokens whose last new_tokens are this step's, every slot and
        block-table entry in block 0 (what is read there is garbage of the right shape)."""
        bs, dev = self.block_size, self.device
        width = -(-context_len // bs)
        positions = torch.arange(context_len - new_tokens, context_len, device=dev).repeat(num_seqs)
        groups = {g: GroupMetadata(torch.zeros(num_seqs, width, dtype=torch.int32, device=dev), positions % bs)
                  for g in self.kv_groups}
        meta = AttentionMetadata(query_start_loc=[i * new_tokens for i in range(num_seqs + 1)],
                                 seq_lens=[context_len] * num_seqs, block_size=bs, groups=groups, positions=positions)
        return self._add_extras(ForwardContext(meta, kv_caches, self.specs), state_caches, num_seqs,
                                has_state=context_len > new_tokens)

    def _report_memory_plan(self, counts: dict[int | None, int]) -> None:
        """Logs the GPU memory split and keeps the blocks per group with the measured numbers."""
        m = self.memory_profile
        m["kv_blocks"] = dict(counts)
        blocks = {("full" if g is None else f"window {g}"): n for g, n in counts.items()}
        log.info("GPU memory: %g x %s total; in use after loading %s (weights %s), activation peak %s of a "
                 "%d-token step, decode workspace %s, prompt graphs %s, margin %s; KV cache %s: blocks per group %s",
                 self.config.gpu_memory_utilization, gib(m["total_bytes"]), gib(m["in_use_bytes"]),
                 gib(m["weights_bytes"]), gib(m["activation_peak_bytes"]), self.config.max_num_batched_tokens,
                 gib(m.get("decode_workspace_bytes", 0)), gib(m.get("prompt_graph_bytes", 0)), gib(m["margin_bytes"]),
                 gib(m["kv_cache_bytes"]), blocks)

    def state_bytes(self) -> int:
        """Bytes of all recurrent-state slots, prefix snapshots included (taken from the KV budget)."""
        return self.num_state_slots * sum(s.slot_bytes(self.dtype) for s in self.state_specs.values())


def build_kv_cache(config, executor) -> BlockManager:
    """Plans the blocks of every KV group on every rank, checks they hold max_model_len, allocates them
    (the compiler warms up there) and returns the block manager that hands them out."""
    if executor.state_specs and config.enable_prefix_caching:
        if executor.num_snapshot_slots == 0:  # a cached prefix needs the recurrent state at its end
            log.info("prefix caching is off for this model: its recurrent-state snapshots are off "
                     "(--prefix-state-snapshots 0)")
            config.enable_prefix_caching = False
        else:
            log.info("prefix caching with recurrent-state snapshots at block boundaries: %d snapshot slots",
                     executor.num_snapshot_slots)
    try:
        num_blocks = executor.plan_blocks(config.max_model_len)
        check_capacity(config, num_blocks)
        executor.allocate_kv_cache(num_blocks)
    except BaseException:
        executor.runner.abandon_compile()  # the compile cache opened for the profile step closes as on an error
        raise
    sparse = executor.sparse
    tokens = {("full" if g is None else f"window {g}"): n * config.block_size for g, n in num_blocks.items()}
    log.info("KV cache: %s tokens per group, block size %d", tokens, config.block_size)
    return BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                        executor.group_block_bytes(), executor.num_state_slots,
                        hash_prompt_only=sparse is not None and not sparse.hash_generated_blocks,
                        num_snapshot_slots=executor.num_snapshot_slots)


def check_capacity(config, num_blocks: dict[int | None, int]) -> None:
    """Each group's blocks must hold what one max_model_len sequence needs of it (a window group: its window)."""
    bs = config.block_size
    for g, n in num_blocks.items():
        need = config.max_model_len if g is None else min(
            config.max_model_len, group_window(g) + bs + -(-group_sinks(g) // bs) * bs)
        if n * bs < need + bs:
            raise ValueError(f"the KV cache holds {n * bs} tokens for "
                             f"{'full' if g is None else f'window-{g}'} layers, fewer than max_model_len "
                             f"({config.max_model_len}) needs; give it more memory or lower max_model_len")
