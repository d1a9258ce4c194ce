"""Builds the model, owns the KV-cache tensors, and turns a scheduled batch into one forward pass."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from compiled_llm.config import EngineConfig
from compiled_llm.models.loader import init_dummy_weights, load_weights, resolve_dtype
from compiled_llm.models.registry import resolve_model_class
from compiled_llm.ops.attention import AttentionMetadata, ForwardContext, GroupMetadata, set_forward_context
from compiled_llm.ops.state import STATE_KEY, StateMetadata, allocate_states
from compiled_llm.runtime.scheduler import ScheduledSeq

log = logging.getLogger("compiled_llm")

DEFAULT_CPU_KV_BYTES = 1 << 30


def read_hf_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.exists():
        raise ValueError(f"no config.json in {folder} (is it a Hugging Face checkpoint folder?)")
    return json.loads(path.read_text())


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        folder = Path(config.resolved_model())
        if not folder.is_dir():
            raise ValueError(f"model folder {folder} does not exist")
        self.hf_config = read_hf_config(folder)
        model_cls = resolve_model_class(self.hf_config)
        self.model_config = model_cls.config_from_hf(self.hf_config)
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.model_config.torch_dtype)
        torch.manual_seed(config.seed)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)  # parameters in the serving dtype; rope tables stay float32
        try:
            with torch.device(self.device):
                model = model_cls(self.model_config).eval()
        finally:
            torch.set_default_dtype(prev)
        if config.load_format == "dummy":
            init_dummy_weights(model, config.seed)
        elif config.load_format == "auto":
            load_weights(model, folder, model.hf_to_ours)
        else:
            raise ValueError(f"unknown load_format {config.load_format!r}; use auto or dummy")
        self.model = model
        self.specs = model.attention_specs()
        # Recurrent layers (hybrid models): per-sequence state, one slot per possible running sequence.
        self.state_specs = model.state_specs() if hasattr(model, "state_specs") else {}
        self.num_state_slots = config.max_num_seqs if self.state_specs else 0
        self.state_caches: dict[int, dict[str, torch.Tensor]] = {}
        self.block_size = config.block_size

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
        window plus one step's tokens needs (twice, to keep prefix hits), the full group the rest."""
        bytes_per = self.group_block_bytes()
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return {g: cfg.num_kv_blocks for g in bytes_per}
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * cfg.gpu_memory_utilization)
        else:
            budget = cfg.kv_cache_memory_bytes or DEFAULT_CPU_KV_BYTES
        budget -= self.state_bytes()
        bs = self.block_size
        sliding = {g: b for g, b in bytes_per.items() if g is not None}
        full_bytes = bytes_per.get(None, 0)
        counts: dict[int | None, int] = {}
        even = budget // sum(bytes_per.values())
        for g, b in sliding.items():
            per_seq = -(-(g + bs) // bs) + 1
            need = cfg.max_num_seqs * per_seq + -(-cfg.max_num_batched_tokens // bs)
            counts[g] = min(even, 2 * need) if full_bytes else budget // b
        if full_bytes:
            rest = budget - sum(counts[g] * sliding[g] for g in sliding)
            counts[None] = rest // full_bytes
        return counts

    def state_bytes(self) -> int:
        """Bytes of all recurrent-state slots (taken from the KV budget)."""
        return self.num_state_slots * sum(s.slot_bytes(self.dtype) for s in self.state_specs.values())

    def allocate_kv_cache(self, num_blocks: dict[int | None, int]) -> None:
        self.kv_caches: dict[int, torch.Tensor] = {}
        for i, s in self.specs.items():
            if s.writes_cache:
                shape = (1 if s.k_eq_v else 2, num_blocks[s.kv_group], self.block_size, s.num_kv_heads, s.head_dim)
                self.kv_caches[i] = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.state_caches = allocate_states(self.state_specs, self.num_state_slots, self.dtype, self.device)

    # ---- one step ------------------------------------------------------------------------
    def prepare(self, batch: list[ScheduledSeq]):
        bs = self.block_size
        ids, pos, qsl, seq_lens, logit_rows = [], [], [0], [], []
        groups = {s.kv_group for s in self.specs.values()}
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
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(pos, dtype=torch.long, device=dev),
                meta, torch.tensor(logit_rows, dtype=torch.long, device=dev))

    def forward_context(self, batch: list[ScheduledSeq], meta: AttentionMetadata) -> ForwardContext:
        """The context the ops read: KV cache and, for hybrid models, each sequence's state slot
        (a sequence starts from a zero state on its first chunk)."""
        extra = {}
        if self.state_specs:
            extra[STATE_KEY] = StateMetadata(
                caches=self.state_caches, slots=[item.seq.state_slot for item in batch],
                has_initial_state=[item.seq.num_computed_tokens > 0 for item in batch],
                query_start_loc=meta.query_start_loc)
        return ForwardContext(meta, self.kv_caches, self.specs, extra)

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Runs the batch; returns float32 logits for each sequence that finished its tokens this step."""
        input_ids, positions, meta, rows = self.prepare(batch)
        with set_forward_context(self.forward_context(batch, meta)):
            hidden = self.model(input_ids, positions)
        return self.model.compute_logits(hidden[rows]).float()
