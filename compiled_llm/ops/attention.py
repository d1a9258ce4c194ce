"""Paged attention: the one op every attention layer calls.

The op reads and writes the paged KV cache. Per-step data (block tables, slot mappings, sequence lengths)
and the cache tensors reach it through the forward context that the runtime sets around each forward;
per-layer constants (head counts, window, K=V mode) come from the layer specs the model declares.
This module holds the reference implementation, which runs on any device.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from compiled_llm.ops.rope import apply_rope


@dataclass
class AttentionSpec:
    """What one attention layer needs from the cache. Declared by the model at construction."""

    layer_idx: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None  # None: full attention
    cache_layer: int  # layer whose cache this layer reads (itself unless it shares KV)
    scale: float = 1.0
    softcap: float | None = None
    # K=V layers keep one tensor (the normalised, unrotated value); keys are rebuilt on read as
    # rope(v * k_norm_weight). These hold what that needs (on the source layer's spec).
    k_eq_v: bool = False
    k_norm_weight: torch.Tensor | None = None
    inv_freq: torch.Tensor | None = None

    @property
    def writes_cache(self) -> bool:
        return self.cache_layer == self.layer_idx

    @property
    def kv_group(self) -> int | None:
        """Layers with the same window share block tables (None: full attention)."""
        return self.sliding_window


@dataclass
class GroupMetadata:
    """Block tables and slot mapping of one KV-cache group (full layers, or sliding layers of one window)."""

    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, -1 where a block was released
    slot_mapping: torch.Tensor  # [num_tokens] int64: block * block_size + offset of each new token


@dataclass
class AttentionMetadata:
    query_start_loc: list[int]  # num_seqs + 1 offsets into the token dimension
    seq_lens: list[int]  # context length of each sequence after this step's tokens
    block_size: int
    groups: dict[int | None, GroupMetadata]
    seq_lens_tensor: torch.Tensor | None = None
    query_start_loc_tensor: torch.Tensor | None = None


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    kv_caches: dict[int, torch.Tensor]  # cache layer -> [2 or 1, num_blocks, block_size, kv_heads, head_dim]
    layers: dict[int, AttentionSpec]
    extra: dict = field(default_factory=dict)


_CONTEXT: ForwardContext | None = None


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext):
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, ctx
    try:
        yield ctx
    finally:
        _CONTEXT = prev


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("attention called outside a forward context (the runtime sets one per step)")
    return _CONTEXT


def write_kv(cache: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor, slots: torch.Tensor, spec: AttentionSpec):
    """Scatter this step's keys and values into their slots (K=V layers store the value only)."""
    flat = cache.view(cache.shape[0], -1, spec.num_kv_heads, spec.head_dim)
    if spec.k_eq_v:
        flat[0].index_copy_(0, slots, v.to(cache.dtype))
    else:
        flat[0].index_copy_(0, slots, k.to(cache.dtype))
        flat[1].index_copy_(0, slots, v.to(cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor, spec: AttentionSpec,
              source: AttentionSpec, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values at the given token positions of one sequence."""
    slots = block_table[positions // block_size].long() * block_size + positions % block_size
    flat = cache.view(cache.shape[0], -1, spec.num_kv_heads, spec.head_dim)
    v = flat[-1].index_select(0, slots)
    if not source.k_eq_v:
        return flat[0].index_select(0, slots), v
    k = (v.float() * source.k_norm_weight.float()).to(v.dtype)
    return apply_rope(k, positions, source.inv_freq), v


def reference_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_idx: int) -> torch.Tensor:
    """Plain PyTorch paged attention: write new K/V, then attend each sequence over its cached context."""
    ctx = get_forward_context()
    spec = ctx.layers[layer_idx]
    source = ctx.layers[spec.cache_layer]
    meta = ctx.attn_metadata
    group = meta.groups[spec.kv_group]
    cache = ctx.kv_caches[spec.cache_layer]
    num_tokens = q.shape[0]
    q = q.view(num_tokens, spec.num_heads, spec.head_dim)
    if spec.writes_cache:
        kk = None if k is None else k.view(num_tokens, spec.num_kv_heads, spec.head_dim)
        write_kv(cache, kk, v.view(num_tokens, spec.num_kv_heads, spec.head_dim), group.slot_mapping, spec)
    out = torch.empty_like(q)
    group_size = spec.num_heads // spec.num_kv_heads
    for i, seq_len in enumerate(meta.seq_lens):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        if end == start:
            continue
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        first = 0 if spec.sliding_window is None else max(0, seq_len - (end - start) - spec.sliding_window + 1)
        k_pos = torch.arange(first, seq_len, device=q.device)
        keys, values = gather_kv(cache, group.block_tables[i], k_pos, spec, source, meta.block_size)
        keys = keys.repeat_interleave(group_size, dim=1)  # [m, H, D]
        values = values.repeat_interleave(group_size, dim=1)
        scores = torch.einsum("nhd,mhd->hnm", q[start:end], keys) * spec.scale
        if spec.softcap is not None:
            scores = torch.tanh(scores / spec.softcap) * spec.softcap
        allowed = k_pos[None, :] <= q_pos[:, None]
        if spec.sliding_window is not None:
            allowed &= k_pos[None, :] > q_pos[:, None] - spec.sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[start:end] = torch.einsum("hnm,mhd->nhd", probs, values)
    return out.view(num_tokens, spec.num_heads * spec.head_dim)


@torch.library.custom_op("compiled_llm::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_idx: int) -> torch.Tensor:
    return reference_attention(q, k, v, layer_idx)


@attention_op.register_fake
def _(q, k, v, layer_idx):
    return torch.empty_like(q)


def attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_idx: int) -> torch.Tensor:
    """q: [tokens, heads * head_dim]; k, v: [tokens, kv_heads * head_dim] or None for KV-sharing layers."""
    return torch.ops.compiled_llm.attention(q, k, v, layer_idx)
