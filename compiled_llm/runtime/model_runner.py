"""Builds the model, owns the KV-cache tensors, and turns a scheduled batch into one forward pass."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch

from compiled_llm.config import EngineConfig
from compiled_llm.distributed.parallel_state import get_parallel_state
from compiled_llm.models.interfaces import recurrent_state_specs
from compiled_llm.models.loader import build_model, resolve_dtype
from compiled_llm.models.registry import resolve_model_class
from compiled_llm.multimodal.runner import BIDIR_KEY, has_media, mrope_batch_positions, prepare_media
from compiled_llm.ops import collective
from compiled_llm.ops.context import AttentionMetadata, ForwardContext, GroupMetadata, set_forward_context
from compiled_llm.ops.registry import describe, model_facts, select_providers
from compiled_llm.ops.sparse import SPARSE_KEY
from compiled_llm.ops.state import STATE_KEY, StateLayout, StateMetadata, allocate_states, copy_state_slots
from compiled_llm.ops.upload import new_step_inputs, to_device_packed
from compiled_llm.runtime.host_memory import MappedHost
from compiled_llm.runtime.kv_plan import KVCachePlanner, mark_rot_keys
from compiled_llm.runtime import prompt_logprobs
from compiled_llm.runtime.memory import gib
from compiled_llm.runtime.sampler import PendingTokens, fill_pending
from compiled_llm.runtime.scheduler import ScheduledSeq
from compiled_llm.runtime.sparse_kv import SparseKV, SparseKVConfig

log = logging.getLogger("compiled_llm")

def read_hf_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.exists():
        raise ValueError(f"no config.json in {folder} (is it a Hugging Face checkpoint folder?)")
    return json.loads(path.read_text())


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


# chunks of at least this many tokens make a step's per-token host columns in numpy (prepare_inputs)
VECTOR_CHUNK_TOKENS = 64


def decode_in_order(batch: list[ScheduledSeq]) -> bool:
    """Whether every row of the step is one token that ends its sequence (a decode row, which samples). Then its
    logits are the hidden states' rows as they are, and, where row i's token is also the previous step's sampled
    row i (a decode batch that did not change, async scheduling), its input ids are the sampled tokens as they are:
    no gather or scatter launch at either end of the step (three of the ~ten small launches around a decode
    step's graph)."""
    return all(item.num_tokens == 1 and item.seq.num_computed_tokens + 1 == len(item.seq) for item in batch)


class ModelRunner(KVCachePlanner):
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
        self.model = model = build_model(model_cls, self.model_config, folder, self.device, self.dtype,
                                         config.load_format, config.seed)
        self.specs = model.attention_specs()
        self.sparse = SparseKV.build(config, self.specs, self.device)  # marks the specs; None without a method
        rot = mark_rot_keys(self.specs, config.kv_rotated_keys)  # K=V rows that keep rotated keys (kv_plan.py)
        if rot:
            log.info("K=V layers %s keep their keys' %d rotated dims a half beside each cached value", rot,
                     self.specs[rot[0]].rot_keys)
        if self.sparse is not None and self.sparse.offloaded:
            log.info("OmniKV offload: %s of device buffers for the sparse layers' staged picks",
                     gib(self.sparse.allocate_staging(self.dtype)))
        self.mapped_host = MappedHost()  # OmniKV's offloaded KV (runtime/host_memory.py)
        # the KV groups the block tables cover (under pipeline parallelism: every stage's, set by the driver)
        self.kv_groups = {s.kv_group for s in self.specs.values()}
        # Recurrent layers (hybrid models): per-sequence state, one slot per possible running sequence.
        self.state_specs = recurrent_state_specs(model)
        # Prefix caching keeps state snapshots in extra slots after those (block_manager.py).
        self.num_snapshot_slots = 0
        if self.state_specs and config.enable_prefix_caching:
            snaps = config.prefix_state_snapshots
            if snaps is not None and snaps < 0:
                raise ValueError(f"prefix_state_snapshots must be 0 or more, not {snaps}")
            self.num_snapshot_slots = config.max_num_seqs if snaps is None else snaps
        self.num_state_slots = config.max_num_seqs + self.num_snapshot_slots if self.state_specs else 0
        self.state_caches: dict[int, dict[str, torch.Tensor]] = {}
        self.block_size = config.block_size
        # GPU only, filled by plan_blocks: what the KV-cache budget was taken from (the smoke script prints it)
        self.memory_profile: dict = {}
        # op providers, resolved once for this device and model; then the compiler (docs/compiler.md)
        ps = get_parallel_state()
        facts = model_facts(self.model_config, block_size=config.block_size,
                            max_num_batched_tokens=config.max_num_batched_tokens, tp_size=ps.tp_size,
                            states=self.state_specs)  # the recurrent kernels' JIT keys (ops/triton/delta_rule.py)
        self.op_providers = select_providers(self.device, self.dtype, self.specs, facts, config.op_providers)
        log.info("op providers: %s", describe(self.op_providers))
        if ps.tp_size > 1 and not config.enforce_eager:  # collective: every rank of the stage's TP group is here
            collective.prepare(ps.tp_group_name, ps.tp_size, self.model_config.hidden_size, self.dtype, self.device)
        self.compiler = None
        if not config.enforce_eager:
            from compiled_llm.compiler import ModelCompiler

            if self.device.type == "cpu":
                quiet_cpp_extension_import()
            # sparse KV reads per-step host metadata: no whole-graph decode capture (compiler whole_graph_decode_ok)
            self.compiler = ModelCompiler(model, config, self.device, self.dtype, self.specs, self.hf_config, facts,
                                          stateful=bool(self.state_specs), sparse=self.sparse is not None,
                                          stage_inputs=self._stage_inputs())

    def _stage_inputs(self):
        """On a pipeline stage after the first: num_tokens -> zeros shaped like what the previous stage sends
        (the compiler warms up with them); None elsewhere."""
        if get_parallel_state().is_first_stage:
            return None
        model, dtype, device = self.model, self.dtype, self.device
        return lambda n: {name: torch.zeros(shape, dtype=dt, device=device)
                          for name, (shape, dt) in model.intermediate_shapes(n, dtype).items()}

    # ---- KV cache (sizing: runtime/kv_plan.py) ---------------------------------------------
    def _kv_tensors(self, num_blocks: dict[int | None, int], offload: bool = True) -> dict[int, torch.Tensor]:
        """One zeroed cache tensor per layer that writes KV, [2 or 1, blocks, block_size, kv_heads, head_dim];
        an offloaded layer's (OmniKV) in pinned host memory, seen by the device through its mapping (not for
        the start-up's profile step: offload=False). A layer whose rows also keep rotated keys (rot_keys)
        allocates [..., cache_dim] and hands the ops its first head_dim elements, a view."""
        out = {}
        for i, s in self.specs.items():
            if s.writes_cache:
                shape = (1 if s.k_eq_v else 2, num_blocks[s.kv_group], self.block_size, s.num_kv_heads, s.cache_dim)
                if s.offloaded and offload:
                    out[i] = self.mapped_host.empty(shape, self.dtype, self.device)
                else:
                    out[i] = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if s.rot_keys:
                    out[i] = out[i][..., :s.head_dim]
        return out

    def _state_tensors(self, num_slots: int) -> dict[int, dict[str, torch.Tensor]]:
        return allocate_states(self.state_specs, num_slots, self.dtype, self.device)

    def abandon_compile(self) -> None:
        if self.compiler is not None:
            self.compiler.abandon()

    def release(self) -> None:
        """At shutdown: the captured CUDA graphs (and the collectives in them) go before the process group is
        left, and the KV cache with them, so that another engine in this process finds the memory free."""
        if self.compiler is not None:
            self.compiler.release_graphs()
        collective.release()
        self.kv_caches = {}
        self.mapped_host.release()
        if self.sparse is not None:
            self.sparse.staging.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def allocate_kv_cache(self, num_blocks: dict[int | None, int]) -> None:
        t0 = time.perf_counter()
        kv_bytes = sum(n * self.group_block_bytes().get(g, 0) for g, n in num_blocks.items())
        log.info("allocating the KV cache: %s (blocks per group %s), recurrent state %s", gib(kv_bytes),
                 {("full" if g is None else f"window {g}"): n for g, n in num_blocks.items()}, gib(self.state_bytes()))
        self.kv_caches: dict[int, torch.Tensor] = self._kv_tensors(num_blocks)
        if self.mapped_host.bytes:
            self.sparse.offloaded_bytes = self.mapped_host.bytes
            log.info("OmniKV offload: %s of KV (layers %s) in pinned host memory, %s on the device (all on the "
                     "device: %s)", gib(self.mapped_host.bytes), self.sparse.offloaded, gib(kv_bytes),
                     gib(kv_bytes + self.mapped_host.bytes))
        self.state_caches = self._state_tensors(self.num_state_slots)
        log.info("KV cache allocated in %.1fs", time.perf_counter() - t0)
        if self.compiler is not None:  # everything compiles before the first request
            self.compiler.warm_up(self.kv_caches, self.block_size,
                                  self._warmup_context if (self.state_specs or self.sparse is not None) else None)

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
            layout = StateLayout.build([i % num_slots for i in range(num_seqs)], [has_state] * num_seqs,
                                       ctx.attn_metadata.query_start_loc, self.device)
            ctx.extra[STATE_KEY] = StateMetadata(caches=state_caches, layout=layout)
        if self.sparse is not None:  # one token a sequence: decode rows (what a whole-graph capture must see)
            one = ctx.attn_metadata.query_start_loc[-1] == num_seqs
            ctx.extra[SPARSE_KEY] = self.sparse.decode_metadata([one] * num_seqs)
        return ctx

    # ---- one step ------------------------------------------------------------------------
    def prepare(self, batch: list[ScheduledSeq], pending: PendingTokens | None = None):
        """The step's device inputs. pending (async scheduling): the previous step's sampled tokens, still on
        the device; a sequence whose last token is a placeholder for one of them gets it copied in there."""
        rows_of = None if pending is None else pending.rows
        input_ids, positions, meta, rows, fill, prompt = self.prepare_inputs(batch, rows_of, self.device)
        decode = new_step_inputs() and decode_in_order(batch)
        if fill is not None:
            if decode and all(rows_of.get(item.seq.seq_id) == i for i, item in enumerate(batch)):
                input_ids = pending.tokens[:len(batch)].to(input_ids.dtype)  # row i's token: the previous row i
            else:
                fill_pending(input_ids, fill, pending.tokens)
        if decode and prompt is None:
            rows = None  # every row samples, in order: the hidden states as they are (no gather)
        return input_ids, positions, meta, rows, prompt

    def prepare_inputs(self, batch: list[ScheduledSeq], pending_rows: dict[int, int] | None, dev: torch.device):
        """(input ids, positions, metadata, logit rows, fill, prompt) on dev. The multi-process driver prepares
        them on the CPU for the wire (every rank then moves them to its own device). fill (async scheduling):
        None, or (rows of input_ids, rows of the previous step's sampled tokens) that each rank copies on its
        device; pending_rows: seq_id -> row of the sequences whose last token is a placeholder. prompt: None, or
        the PromptRows of the logit rows after the sampled ones (runtime/prompt_logprobs.py)."""
        bs = self.block_size
        ids, pos, qsl, seq_lens, logit_rows = [], [], [0], [], []
        fill_at, fill_from = [], []
        groups = self.kv_groups
        slots: dict = {g: [] for g in groups}
        # a step with a long chunk (a prompt) makes its per-token columns in numpy: 8,192 tokens' positions and
        # two groups' slots took ~2.4 ms in Python, ahead of the step's first kernel; a decode batch's in Python
        vec = any(item.num_tokens >= VECTOR_CHUNK_TOKENS for item in batch) and new_step_inputs()
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens
            qsl.append(qsl[-1] + item.num_tokens)
            if pending_rows and end == len(seq) and seq.seq_id in pending_rows:
                fill_at.append(qsl[-1] - 1)
                fill_from.append(pending_rows[seq.seq_id])
            seq_lens.append(end)
            if end == len(seq):
                logit_rows.append(qsl[-1] - 1)
            if vec:
                ids.append(np.asarray(seq.token_ids[start:end], dtype=np.int64))
                at = np.arange(start, end)
                pos.append(at)
                first = start // bs
                for g in groups:
                    blocks = np.asarray(seq.block_tables[g][first:(end - 1) // bs + 1], dtype=np.int64)
                    slots[g].append(blocks[at // bs - first] * bs + at % bs)
                continue
            ids.extend(seq.token_ids[start:end])
            pos.extend(range(start, end))
            for g in groups:
                table = seq.block_tables[g]
                slots[g].extend(table[p // bs] * bs + p % bs for p in range(start, end))
        if vec:
            ids, pos = np.concatenate(ids), np.concatenate(pos)
            slots = {g: np.concatenate(v) for g, v in slots.items()}
        step_spans = prompt_logprobs.spans(batch)
        for i, lo, n in step_spans:  # after the sampled rows (runtime/prompt_logprobs.py)
            first = qsl[i] + lo - batch[i].seq.num_computed_tokens
            logit_rows.extend(range(first, first + n))
        width = max(len(item.seq.block_tables[g]) for item in batch for g in groups)
        tables = {}
        for g in groups:  # through numpy: torch.tensor of the nested lists took 5 ms at 16 x 64K tokens a group
            tables[g] = np.full((len(batch), width), -1, dtype=np.int32)
            for i, item in enumerate(batch):
                t = item.seq.block_tables[g]
                tables[g][i, :len(t)] = np.fromiter(t, np.int32, len(t))
        positions = torch.as_tensor(pos, dtype=torch.long)
        if any(item.seq.mm is not None and item.seq.mm.mrope is not None for item in batch):
            positions = mrope_batch_positions(batch, positions)
            if bool((positions == positions[:1]).all()):  # text and decode tokens only: one row says it all,
                positions = positions[0]  # and the step keeps the compiled path
        # every host array of the step in one copy (on CUDA; to_device_packed), the sequence lengths and offsets
        # included: made here without a stream sync (the attention kernels would make them with one); on the
        # CPU too, where they cost nothing and the reference decode attention reads them
        items = [(ids, torch.long), (positions, torch.long), (seq_lens, torch.int32), (qsl, torch.int32),
                 (logit_rows, torch.long)]
        for g in groups:
            items += [(tables[g], torch.int32), (slots[g], torch.long)]
        if fill_at:
            items += [(fill_at, torch.long), (fill_from, torch.long)]
        if step_spans:
            items.append((prompt_logprobs.targets(batch, step_spans), torch.long))
        input_ids, positions, lens_t, qsl_t, rows_t, *rest = to_device_packed(items, dev)
        prompt = prompt_logprobs.PromptRows(rest.pop(), prompt_logprobs.top_k(batch, step_spans)) if step_spans \
            else None
        metas = {g: GroupMetadata(rest[2 * i], rest[2 * i + 1]) for i, g in enumerate(groups)}
        meta = AttentionMetadata(query_start_loc=qsl, seq_lens=seq_lens, block_size=bs, groups=metas,
                                 positions=positions)
        meta.seq_lens_tensor, meta.query_start_loc_tensor = lens_t, qsl_t
        fill = tuple(rest[2 * len(groups):]) if fill_at else None
        return input_ids, positions, meta, rows_t, fill, prompt

    def forward_context(self, batch: list[ScheduledSeq], meta: AttentionMetadata) -> ForwardContext:
        """The context the ops read: KV cache and, for hybrid models, each sequence's state slot
        (a sequence starts from a zero state on its first chunk). The state ops' batch layout is built and
        uploaded here, once per step (pinned, non-blocking): the ops read its device tensors, never the host."""
        extra = {}
        if self.state_specs:
            layout = StateLayout.build([item.seq.state_slot for item in batch],
                                       [item.seq.num_computed_tokens > 0 for item in batch], meta.query_start_loc,
                                       self.device)
            extra[STATE_KEY] = StateMetadata(
                caches=self.state_caches, layout=layout,
                copies_before=[(i.load_state, i.seq.state_slot) for i in batch if i.load_state is not None],
                copies_after=[(i.seq.state_slot, i.save_state) for i in batch if i.save_state is not None])
        if self.sparse is not None:
            extra[SPARSE_KEY] = self.sparse.metadata(batch)
        return ForwardContext(meta, self.kv_caches, self.specs, extra)

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq], pending: PendingTokens | None = None) -> torch.Tensor:
        """Runs the batch; returns float32 logits for each sequence that finished its tokens this step.
        pending: the previous step's tokens still on the device (async scheduling)."""
        input_ids, positions, meta, rows, prompt = self.prepare(batch, pending)
        if has_media(batch):  # a prefill chunk with media placeholders: eager, embeddings merged in
            return self.execute_media(batch, input_ids, positions, meta, rows, prompt)
        return self.execute_prepared(input_ids, positions, self.forward_context(batch, meta), rows, prompt=prompt)

    def execute_media(self, batch, input_ids, positions, meta, rows, prompt=None) -> torch.Tensor:
        """Runs the media towers for the placeholders in this step, merges their soft tokens into the text
        embeddings and passes the bidirectional spans to the attention op (docs/multimodal.md). Text-only
        steps never come here, so they keep the compiled path."""
        ctx = self.forward_context(batch, meta)
        input_ids, embeds, spans = prepare_media(self.model, batch, input_ids)
        ctx.extra[BIDIR_KEY] = spans
        return self.execute_prepared(input_ids, positions, ctx, rows, inputs_embeds=embeds, prompt=prompt)

    @torch.inference_mode()
    def execute_prepared(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                         rows: torch.Tensor | None, intermediate: dict[str, torch.Tensor] | None = None,
                         inputs_embeds: torch.Tensor | None = None, prompt: prompt_logprobs.PromptRows | None = None):
        """The forward pass on prepared inputs (every rank of a parallel run calls this). Under pipeline
        parallelism a stage after the first gets the previous stage's tensors in `intermediate`, and a
        stage before the last returns its own (a dict) instead of logits. rows: the hidden rows whose logits are
        returned (None: every row, in order). inputs_embeds: media merged in (eager). prompt: the last rows are
        prompt rows, reduced to their logprobs (runtime/prompt_logprobs.py)."""
        kwargs = {} if intermediate is None else {"intermediate": intermediate}
        if inputs_embeds is not None:
            kwargs["inputs_embeds"] = inputs_embeds
        # media steps (inputs_embeds) and M-RoPE steps run eager; a pipeline stage's tensors go to the compiled forward
        compiled = self.compiler is not None and inputs_embeds is None and positions.dim() == 1
        forward = self.compiler if compiled else self.model
        state = ctx.extra.get(STATE_KEY)
        if state is not None:  # hybrid prefix caching: a cached snapshot into a sequence's slot
            copy_state_slots(state.caches, state.copies_before)
        with set_forward_context(ctx):
            hidden = forward(input_ids, positions, **kwargs)
        if state is not None:  # a sequence's state at a block boundary into a snapshot slot
            copy_state_slots(state.caches, state.copies_after)
        if isinstance(hidden, dict):
            return hidden
        if prompt is None:
            return self.model.compute_logits(hidden if rows is None else hidden[rows]).float()
        m = rows.shape[0] - prompt.targets.shape[0]
        sampled = self.model.compute_logits(hidden[rows[:m]]).float() if m else \
            hidden.new_empty(0, self.model_config.vocab_size, dtype=torch.float32)
        return prompt_logprobs.pack(sampled, prompt_logprobs.summarize(self.model.compute_logits, hidden[rows[m:]],
                                                                       prompt))
