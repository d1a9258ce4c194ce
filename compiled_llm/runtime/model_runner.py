"""Builds the model, owns the KV-cache tensors, and turns a scheduled batch into one forward pass."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import torch

from compiled_llm.config import EngineConfig
from compiled_llm.models.interfaces import recurrent_state_specs
from compiled_llm.models.loader import init_dummy_weights, load_weights, resolve_dtype
from compiled_llm.models.registry import resolve_model_class
from compiled_llm.multimodal.runner import BIDIR_KEY, has_media, prepare_media
from compiled_llm.ops.context import AttentionMetadata, ForwardContext, GroupMetadata, set_forward_context
from compiled_llm.ops.registry import describe, model_facts, select_providers
from compiled_llm.ops.sparse import SPARSE_KEY
from compiled_llm.ops.state import STATE_KEY, StateMetadata, allocate_states
from compiled_llm.runtime.block_manager import group_sinks, group_window
from compiled_llm.runtime.memory import GPU_MARGIN_BYTES, gib, kv_cache_budget, one_sequence_bytes, sequence_blocks
from compiled_llm.runtime.scheduler import ScheduledSeq
from compiled_llm.runtime.sparse_kv import SparseKV, SparseKVConfig

log = logging.getLogger("compiled_llm")

DEFAULT_CPU_KV_BYTES = 1 << 30


def read_hf_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.exists():
        raise ValueError(f"no config.json in {folder} (is it a Hugging Face checkpoint folder?)")
    return json.loads(path.read_text())


def mrope_batch_positions(batch: list[ScheduledSeq], flat: torch.Tensor) -> torch.Tensor:
    """[3, tokens] positions of a step where some sequence has M-RoPE prompt positions (a prompt with media):
    its tokens take them (index + delta past the prompt); other sequences' positions repeat on all three."""
    out, offset = [], 0
    for item in batch:
        seq, n = item.seq, item.num_tokens
        mm = seq.mm
        if mm is not None and mm.mrope is not None:
            out.append(mm.positions(seq.num_computed_tokens, seq.num_computed_tokens + n))
        else:
            out.append(flat[offset:offset + n].expand(3, -1))
        offset += n
    return torch.cat(out, dim=1)


def quiet_cpp_extension_import() -> None:
    """Inductor's C++ builds on the CPU import torch.utils.cpp_extension, which logs "No CUDA runtime is found,
    using CUDA_HOME=..." on any machine with a CUDA toolkit but no usable GPU. On a CPU run that is expected,
    not a fault, and it reads like one: the module is imported here once, with that one logger quieted."""
    if "torch.utils.cpp_extension" in sys.modules:
        return
    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        import torch.utils.cpp_extension  # noqa: F401
    finally:
        logger.setLevel(level)


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        SparseKVConfig.from_engine_config(config)  # bad sparse-KV parameters fail before the model loads
        folder = Path(config.resolved_model())
        if not folder.is_dir():
            raise ValueError(f"model folder {folder} does not exist")
        self.hf_config = read_hf_config(folder)
        model_cls = resolve_model_class(self.hf_config)
        self.model_config = model_cls.config_from_hf(self.hf_config)
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.model_config.torch_dtype)
        if config.load_format not in ("auto", "dummy"):
            raise ValueError(f"unknown load_format {config.load_format!r}; use auto or dummy")
        self.model = model = self._build_model(model_cls, folder)
        self.specs = model.attention_specs()
        self.sparse = SparseKV.build(config, self.specs, self.device)  # marks the specs; None without a method
        # the KV groups the block tables cover (under pipeline parallelism: every stage's, set by the driver)
        self.kv_groups = {s.kv_group for s in self.specs.values()}
        # Recurrent layers (hybrid models): per-sequence state, one slot per possible running sequence.
        self.state_specs = recurrent_state_specs(model)
        self.num_state_slots = config.max_num_seqs if self.state_specs else 0
        self.state_caches: dict[int, dict[str, torch.Tensor]] = {}
        self.block_size = config.block_size
        # GPU only, filled by plan_blocks: what the KV-cache budget was taken from (the smoke script prints it)
        self.memory_profile: dict = {}
        # op providers, resolved once for this device and model; then the compiler (docs/compiler.md)
        facts = model_facts(self.model_config, block_size=config.block_size)
        self.op_providers = select_providers(self.device, self.dtype, self.specs, facts, config.op_providers)
        log.info("op providers: %s", describe(self.op_providers))
        self.compiler = None
        if not config.enforce_eager:
            if self.sparse is not None or config.pipeline_parallel_size > 1:
                log.info("compiler off for this run (sparse KV or pipeline parallel): eager")
            else:
                from compiled_llm.compiler import ModelCompiler

                if self.device.type == "cpu":
                    quiet_cpp_extension_import()
                self.compiler = ModelCompiler(model, config, self.device, self.dtype, self.specs, self.hf_config, facts,
                                              stateful=bool(self.state_specs))

    def _build_model(self, model_cls, folder: Path) -> torch.nn.Module:
        """The model on its device in the serving dtype, with its weights; logged, since a large model
        takes minutes here and the log is all a non-terminal run shows."""
        cfg = self.config
        t0 = time.perf_counter()
        no_gpu = "" if torch.cuda.is_available() else " (torch sees no CUDA GPU)"
        log.info("building %s (%d layers) on %s%s in %s", model_cls.__name__,
                 getattr(self.model_config, "num_hidden_layers", 0), self.device, no_gpu,
                 str(self.dtype).replace("torch.", ""))
        torch.manual_seed(cfg.seed)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)  # parameters in the serving dtype; rope tables stay float32
        try:
            with torch.device(self.device):
                model = model_cls(self.model_config).eval()
        finally:
            torch.set_default_dtype(prev)
        if cfg.load_format == "dummy":
            log.info("random weights (--load-format dummy)")
            init_dummy_weights(model, cfg.seed)
        else:
            load_weights(model, folder, model.hf_to_ours)
        params = list(model.parameters())
        log.info("model ready in %.1fs: %.1fM parameters, %s", time.perf_counter() - t0,
                 sum(p.numel() for p in params) / 1e6, gib(sum(p.numel() * p.element_size() for p in params)))
        return model

    # ---- KV cache ------------------------------------------------------------------------
    def group_block_bytes(self) -> dict[int | None, int]:
        """Bytes one block takes across all layers of each KV group."""
        out: dict[int | None, int] = {}
        elt = torch.empty((), dtype=self.dtype).element_size()
        for s in self.specs.values():
            if s.writes_cache:
                per = (1 if s.k_eq_v else 2) * self.block_size * s.num_kv_heads * s.head_dim * elt
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
            raise ValueError(f"the recurrent state of {self.num_state_slots} sequences takes {self.state_bytes()} "
                             f"bytes, more than the cache budget ({budget}); lower max_num_seqs or give the cache "
                             "more memory")
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
        if gpu:
            self._report_memory_plan(counts)
        return counts

    # ---- GPU memory profile ------------------------------------------------------------------
    def gpu_kv_budget(self, max_model_len: int, block_bytes: dict[int | None, int]) -> int:
        """The KV cache's bytes on the GPU (runtime/memory.py): measured, then planned; kept in
        memory_profile. Raises ValueError when one max_model_len sequence would not fit."""
        m = self.measure_memory(max_model_len)
        need = one_sequence_bytes(block_bytes, max_model_len, self.block_size) + self.state_bytes()
        budget = kv_cache_budget(m["total_bytes"], self.config.gpu_memory_utilization, m["in_use_bytes"],
                                 m["activation_peak_bytes"], need, max_model_len)
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
        t0 = time.perf_counter()
        context = max(1, max_model_len - 1)
        new = min(self.config.max_num_batched_tokens, context)
        num_seqs = -(-self.config.max_num_batched_tokens // new)
        kv, states = self._kv_tensors({g: 1 for g in self.kv_groups}), self._state_tensors(num_seqs)
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
        slots = torch.arange(context_len - new_tokens, context_len, device=dev).repeat(num_seqs) % bs
        groups = {g: GroupMetadata(torch.zeros(num_seqs, width, dtype=torch.int32, device=dev), slots)
                  for g in self.kv_groups}
        meta = AttentionMetadata(query_start_loc=[i * new_tokens for i in range(num_seqs + 1)],
                                 seq_lens=[context_len] * num_seqs, block_size=bs, groups=groups)
        return self._add_extras(ForwardContext(meta, kv_caches, self.specs), state_caches, num_seqs,
                                has_state=context_len > new_tokens)

    def _report_memory_plan(self, counts: dict[int | None, int]) -> None:
        """Logs the GPU memory split and keeps the blocks per group with the measured numbers."""
        m = self.memory_profile
        m["kv_blocks"] = dict(counts)
        blocks = {("full" if g is None else f"window {g}"): n for g, n in counts.items()}
        log.info("GPU memory: %g x %s total; in use after loading %s (weights %s), activation peak %s of a "
                 "%d-token step, margin %s; KV cache %s: blocks per group %s", self.config.gpu_memory_utilization,
                 gib(m["total_bytes"]), gib(m["in_use_bytes"]), gib(m["weights_bytes"]),
                 gib(m["activation_peak_bytes"]), self.config.max_num_batched_tokens, gib(m["margin_bytes"]),
                 gib(m["kv_cache_bytes"]), blocks)

    def state_bytes(self) -> int:
        """Bytes of all recurrent-state slots (taken from the KV budget)."""
        return self.num_state_slots * sum(s.slot_bytes(self.dtype) for s in self.state_specs.values())

    def _kv_tensors(self, num_blocks: dict[int | None, int]) -> dict[int, torch.Tensor]:
        """One zeroed cache tensor per layer that writes KV, [2 or 1, blocks, block_size, kv_heads, head_dim]."""
        out = {}
        for i, s in self.specs.items():
            if s.writes_cache:
                shape = (1 if s.k_eq_v else 2, num_blocks[s.kv_group], self.block_size, s.num_kv_heads, s.head_dim)
                out[i] = torch.zeros(shape, dtype=self.dtype, device=self.device)
        return out

    def _state_tensors(self, num_slots: int) -> dict[int, dict[str, torch.Tensor]]:
        return allocate_states(self.state_specs, num_slots, self.dtype, self.device)

    def allocate_kv_cache(self, num_blocks: dict[int | None, int]) -> None:
        t0 = time.perf_counter()
        kv_bytes = sum(n * self.group_block_bytes().get(g, 0) for g, n in num_blocks.items())
        log.info("allocating the KV cache: %s (blocks per group %s), recurrent state %s", gib(kv_bytes),
                 {("full" if g is None else f"window {g}"): n for g, n in num_blocks.items()}, gib(self.state_bytes()))
        self.kv_caches: dict[int, torch.Tensor] = self._kv_tensors(num_blocks)
        self.state_caches = self._state_tensors(self.num_state_slots)
        log.info("KV cache allocated in %.1fs", time.perf_counter() - t0)
        if self.compiler is not None:  # everything compiles before the first request
            self.compiler.warm_up(self.kv_caches, self.block_size,
                                  self._warmup_context if self.state_specs else None)

    def _warmup_context(self, num_seqs: int, tokens_per_seq: int) -> ForwardContext:
        """Warm-up's dummy batch over the real cache, with state slots for the recurrent layers (each starts
        from zeros)."""
        from compiled_llm.compiler.warmup import dummy_context

        ctx = dummy_context(self.specs, self.kv_caches, self.block_size, num_seqs, tokens_per_seq, self.device)
        return self._add_extras(ctx, self.state_caches, self.num_state_slots, has_state=False)

    def _add_extras(self, ctx: ForwardContext, state_caches: dict, num_slots: int, has_state: bool) -> ForwardContext:
        """What a dummy batch needs besides the KV cache: a state slot per sequence for the recurrent layers
        (num_slots reused round robin; has_state: the step continues a prompt) and sparse KV's prefill
        metadata."""
        num_seqs = len(ctx.attn_metadata.seq_lens)
        if self.state_specs:
            ctx.extra[STATE_KEY] = StateMetadata(
                caches=state_caches, slots=[i % num_slots for i in range(num_seqs)],
                has_initial_state=[has_state] * num_seqs, query_start_loc=ctx.attn_metadata.query_start_loc)
        if self.sparse is not None:
            ctx.extra[SPARSE_KEY] = self.sparse.decode_metadata([False] * num_seqs)
        return ctx

    # ---- one step ------------------------------------------------------------------------
    def prepare(self, batch: list[ScheduledSeq]):
        bs = self.block_size
        ids, pos, qsl, seq_lens, logit_rows = [], [], [0], [], []
        groups = self.kv_groups
        slots: dict = {g: [] for g in groups}
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens
            ids.extend(seq.token_ids[start:end])
            pos.extend(range(start, end))
            qsl.append(qsl[-1] + item.num_tokens)
            seq_lens.append(end)
            if end == len(seq):
                logit_rows.append(qsl[-1] - 1)
            for g in groups:
                table = seq.block_tables[g]
                slots[g].extend(table[p // bs] * bs + p % bs for p in range(start, end))
        width = max(len(item.seq.block_tables[g]) for item in batch for g in groups)
        metas = {}
        for g in groups:
            tables = [item.seq.block_tables[g] + [-1] * (width - len(item.seq.block_tables[g])) for item in batch]
            metas[g] = GroupMetadata(torch.tensor(tables, dtype=torch.int32, device=self.device),
                                     torch.tensor(slots[g], dtype=torch.long, device=self.device))
        meta = AttentionMetadata(query_start_loc=qsl, seq_lens=seq_lens, block_size=bs, groups=metas)
        dev = self.device
        positions = torch.tensor(pos, dtype=torch.long)
        if any(item.seq.mm is not None and item.seq.mm.mrope is not None for item in batch):
            positions = mrope_batch_positions(batch, positions)
            if bool((positions == positions[:1]).all()):  # text and decode tokens only: one row says it all,
                positions = positions[0]  # and the step keeps the compiled path
        return (torch.tensor(ids, dtype=torch.long, device=dev), positions.to(dev), meta,
                torch.tensor(logit_rows, dtype=torch.long, device=dev))

    def forward_context(self, batch: list[ScheduledSeq], meta: AttentionMetadata) -> ForwardContext:
        """The context the ops read: KV cache and, for hybrid models, each sequence's state slot
        (a sequence starts from a zero state on its first chunk)."""
        extra = {}
        if self.state_specs:
            extra[STATE_KEY] = StateMetadata(
                caches=self.state_caches, slots=[item.seq.state_slot for item in batch],
                has_initial_state=[item.seq.num_computed_tokens > 0 for item in batch],
                query_start_loc=meta.query_start_loc)
        if self.sparse is not None:
            extra[SPARSE_KEY] = self.sparse.metadata(batch)
        return ForwardContext(meta, self.kv_caches, self.specs, extra)

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Runs the batch; returns float32 logits for each sequence that finished its tokens this step."""
        input_ids, positions, meta, rows = self.prepare(batch)
        if has_media(batch):  # a prefill chunk with media placeholders: eager, embeddings merged in
            return self.execute_media(batch, input_ids, positions, meta, rows)
        return self.execute_prepared(input_ids, positions, self.forward_context(batch, meta), rows)

    def execute_media(self, batch, input_ids, positions, meta, rows) -> torch.Tensor:
        """Runs the media towers for the placeholders in this step, merges their soft tokens into the text
        embeddings and passes the bidirectional spans to the attention op (docs/multimodal.md). Text-only
        steps never come here, so they keep the compiled path."""
        ctx = self.forward_context(batch, meta)
        input_ids, embeds, spans = prepare_media(self.model, batch, input_ids)
        ctx.extra[BIDIR_KEY] = spans
        return self.execute_prepared(input_ids, positions, ctx, rows, inputs_embeds=embeds)

    @torch.inference_mode()
    def execute_prepared(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                         rows: torch.Tensor, intermediate: dict[str, torch.Tensor] | None = None,
                         inputs_embeds: torch.Tensor | None = None):
        """The forward pass on prepared inputs (every rank of a parallel run calls this). Under pipeline
        parallelism a stage after the first gets the previous stage's tensors in `intermediate`, and a
        stage before the last returns its own (a dict) instead of logits. inputs_embeds: media merged in
        (eager)."""
        kwargs = {} if intermediate is None else {"intermediate": intermediate}
        if inputs_embeds is not None:
            kwargs["inputs_embeds"] = inputs_embeds
        compiled = self.compiler is not None and not kwargs and positions.dim() == 1  # M-RoPE steps: eager
        forward = self.compiler if compiled else self.model
        with set_forward_context(ctx):
            hidden = forward(input_ids, positions, **kwargs)
        if isinstance(hidden, dict):
            return hidden
        return self.model.compute_logits(hidden[rows]).float()
