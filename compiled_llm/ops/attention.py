"""Paged attention: the one op every attention layer calls.

The op reads and writes the paged KV cache. Per-step data (block tables, slot mappings, sequence lengths)
and the cache tensors reach it through the forward context (ops/context.py) set around each forward;
per-layer constants (head counts, window, K=V mode) come from the layer specs the model declares.
This module holds the reference implementation, which runs on any device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from compiled_llm.ops.context import (absolute_layer, current_forward_context, get_forward_context, layer_cache,
                                      step_memo)
from compiled_llm.ops.registry import Capabilities, OpSpec, Provider, custom_op, register
from compiled_llm.ops.rope import apply_rope, rotated_block


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
    rotated_pairs: int | None = None  # inv_freq's leading nonzero angles (ops/rope.py rotated_pairs); None: all
    # K=V layers whose angles rotate only some dims (Gemma 4's global layers): each cached row holds the value
    # and then the keys of the first rot_keys dims of each half, rotated at the token's position when written
    # ([v | k[:rot_keys] | k[half:half + rot_keys]]), so the decode kernel reads them instead of rebuilding
    # them for every key at every step. 0: keys rebuilt on read. Set by the runtime (runtime/kv_plan.py
    # cached_rot_keys) before the cache is allocated; the cache tensor the ops see is the value part, a view.
    rot_keys: int = 0
    # Sparse KV (set by the runtime on full-attention layers; ops/sparse.py, docs/sparse_kv.md).
    # StreamingLLM: sink_tokens > 0, with sliding_window = its recent window. OmniKV: "filter" | "sparse".
    sink_tokens: int = 0
    omnikv: str | None = None
    offloaded: bool = False  # OmniKV offload: this layer's cache is pinned host memory the device maps

    @property
    def cache_dim(self) -> int:
        """Elements of one cached row of a KV head (head_dim, plus the cached rotated keys)."""
        return self.head_dim + 2 * self.rot_keys

    @property
    def writes_cache(self) -> bool:
        return self.cache_layer == self.layer_idx

    @property
    def kv_group(self) -> int | tuple[int, int] | None:
        """Layers with the same window share block tables (None: full attention; (window, sinks): StreamingLLM)."""
        return (self.sliding_window, self.sink_tokens) if self.sink_tokens else self.sliding_window


def write_kv(cache: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor, slots: torch.Tensor, spec: AttentionSpec,
             positions: torch.Tensor | None = None, all_live: bool | None = None):
    """Scatter this step's keys and values into their slots (K=V layers store the value only, and with
    spec.rot_keys the rotated keys after it: positions, the tokens' positions, are then needed).
    Rows past len(slots) (padding) are ignored, and so are slots < 0 (padded CUDA-graph slots); all_live: the
    caller knows whether every slot is >= 0 (one check a step instead of one a layer)."""
    n = slots.shape[0]
    v = (v if v.shape[0] == n else v[:n]).reshape(n, spec.num_kv_heads, spec.head_dim)
    if k is not None and not spec.k_eq_v:
        k = (k if k.shape[0] == n else k[:n]).reshape(n, spec.num_kv_heads, spec.head_dim)
    else:
        k = None
    pos = positions[:n] if spec.rot_keys else None
    if all_live is None:
        all_live = bool((slots >= 0).all())
    if not all_live:
        keep = slots >= 0
        slots, v = slots[keep], v[keep]
        k = None if k is None else k[keep]
        pos = None if pos is None else pos[keep]
    flat = cache.view(cache.shape[0], -1, spec.num_kv_heads, spec.head_dim)
    if v.dtype != cache.dtype:
        v = v.to(cache.dtype)
    if k is not None and k.dtype != cache.dtype:
        k = k.to(cache.dtype)
    if spec.k_eq_v:
        flat[0].index_copy_(0, slots, v)
        if spec.rot_keys:
            r, d, half = spec.rot_keys, spec.head_dim, spec.head_dim // 2
            keys = keys_from_values(v, pos, spec)
            rows = cache_rows(cache, spec).view(-1, spec.num_kv_heads, spec.cache_dim)
            rows[:, :, d:].index_copy_(0, slots, torch.cat([keys[..., :r], keys[..., half:half + r]], -1))
    else:
        flat[0].index_copy_(0, slots, k)
        flat[1].index_copy_(0, slots, v)


def cache_rows(cache: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """The layer's whole cached rows, [planes, blocks, block_size, kv_heads, cache_dim]: `cache` (what the ops see)
    is their first head_dim elements, a view, when the rows also hold rotated keys (spec.rot_keys)."""
    if cache.shape[-1] == spec.cache_dim:
        return cache
    return cache.as_strided((*cache.shape[:-1], spec.cache_dim), cache.stride(), cache.storage_offset())


def cached_rot_keys(spec: AttentionSpec) -> int:
    """The rot_keys a layer that writes a K=V cache can keep: its rotated dims a half (ops/rope.py rotated_block)
    when they are fewer than the half, else 0 (a fully rotated key cached would be a second plane)."""
    if not (spec.k_eq_v and spec.writes_cache) or spec.rotated_pairs is None:
        return 0
    half = spec.head_dim // 2
    rot = rotated_block(spec.rotated_pairs, half)
    return rot if rot < half else 0


def token_positions(meta, n: int) -> torch.Tensor:
    """The step's first n token positions, which the writers of rows that keep rotated keys rotate them at. Every
    builder of a step's metadata sets them (the runner, the compiler's static buffers, warm-up's and the memory
    profile's dummy steps)."""
    if meta.positions is None or meta.positions.dim() != 1:
        raise ValueError("rows that keep rotated keys (AttentionSpec.rot_keys) are written at the step's token "
                         "positions: AttentionMetadata.positions must hold them, one per token")
    return meta.positions[:n]


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor, spec: AttentionSpec,
              source: AttentionSpec, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values at the given token positions of one sequence."""
    slots = block_table[positions // block_size].long() * block_size + positions % block_size
    flat = cache.view(cache.shape[0], -1, spec.num_kv_heads, spec.head_dim)
    v = flat[-1].index_select(0, slots)
    if not source.k_eq_v:
        return flat[0].index_select(0, slots), v
    return keys_from_values(v, positions, source), v


def keys_from_values(v: torch.Tensor, positions: torch.Tensor, source: AttentionSpec) -> torch.Tensor:
    """K=V layers cache the value only: the keys are its k-norm-scaled, rotated copy at the tokens' positions."""
    k = (v.float() * source.k_norm_weight.float()).to(v.dtype)
    return apply_rope(k, positions, source.inv_freq)


def table_slots(block_tables: torch.Tensor, pos: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache slots of positions pos [B, M] through block_tables [B, max_blocks] ([B, M], slot 0 where the
    block was released) and which positions lie in a live block."""
    blk = torch.gather(block_tables.long(), 1, (pos // block_size).clamp(max=block_tables.shape[1] - 1))
    live = blk >= 0
    return torch.where(live, blk * block_size + pos % block_size, torch.zeros_like(pos)), live


def cache_slots(block_tables: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, block_size: int) -> torch.Tensor:
    """The cache slots of positions pos [B, M] through block_tables [B, max_blocks], flat [B * M]; rows where
    valid is False (or whose block was released) read slot 0 (masked later)."""
    slots, live = table_slots(block_tables, torch.where(valid, pos, torch.zeros_like(pos)), block_size)
    return torch.where(valid & live, slots, torch.zeros_like(slots)).reshape(-1)


def gather_slots(cache: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, spec: AttentionSpec,
                 source: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values at cache_slots' slots for positions pos [B, M]: [B, M, kv_heads, head_dim] each."""
    b, m = pos.shape
    flat = cache.view(cache.shape[0], -1, spec.num_kv_heads, spec.head_dim)
    v = flat[-1].index_select(0, slots)
    k = keys_from_values(v, pos.reshape(-1), source) if source.k_eq_v else flat[0].index_select(0, slots)
    shape = (b, m, spec.num_kv_heads, spec.head_dim)
    return k.view(shape), v.view(shape)


def gather_kv_batched(cache: torch.Tensor, block_tables: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor,
                      spec: AttentionSpec, source: AttentionSpec, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values at positions pos [B, M] through block_tables [B, max_blocks]; rows where valid is
    False read slot 0 (masked later). Returns [B, M, kv_heads, head_dim] each."""
    p = torch.where(valid, pos, torch.zeros_like(pos))
    return gather_slots(cache, cache_slots(block_tables, pos, valid, block_size), p, spec, source)


def ref_kv_cache_write(k: torch.Tensor | None, v: torch.Tensor, layer_idx: int) -> None:
    ctx, spec, cache, group = layer_cache(layer_idx)
    pos = token_positions(ctx.attn_metadata, group.slot_mapping.shape[0]) if spec.rot_keys else None
    # whether every slot is real: the same for a KV group's layers
    live = step_memo(ctx, ("_ref_slots_live", id(group)), lambda: bool((group.slot_mapping >= 0).all()))
    write_kv(cache, k, v, group.slot_mapping, spec, pos, live)


BIDIR_SPANS_KEY = "bidir_spans"  # ForwardContext.extra: per sequence, [(start, end), ...] token positions
SPAN_MASK_PROVIDERS = {"reference", "triton"}  # attention providers that honour those spans


def bidirectional_mask(spans: list[tuple[int, int]], q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """[queries, keys] True where query and key lie in the same span."""
    out = torch.zeros(q_pos.shape[0], k_pos.shape[0], dtype=torch.bool, device=q_pos.device)
    for s, e in spans:
        out |= ((q_pos >= s) & (q_pos < e))[:, None] & ((k_pos >= s) & (k_pos < e))[None, :]
    return out


def decode_batch(ctx) -> bool:
    """Whether the step is one query a sequence with no media spans (those see each other both ways): the batched
    decode paths' steps."""
    meta = ctx.attn_metadata
    return not any(ctx.extra.get(BIDIR_SPANS_KEY) or ()) and \
        list(meta.query_start_loc) == list(range(len(meta.seq_lens) + 1))


def ref_attention(q: torch.Tensor, layer_idx: int) -> torch.Tensor:
    """Plain PyTorch paged attention: each sequence attends over its cached context (written already).
    q may carry padding rows past the last sequence; they come back as zeros."""
    ctx, spec, cache, group = layer_cache(layer_idx)
    if spec.sink_tokens or spec.omnikv is not None:
        from compiled_llm.ops.sparse import sparse_attention

        return sparse_attention(q, layer_idx)
    source = ctx.layers[spec.cache_layer]
    meta = ctx.attn_metadata
    # media tokens (one image, one video frame) that see each other both ways: sliding layers only, as in
    # transformers' Gemma 4 (runtime/model_runner.py execute_media sets them; docs/multimodal.md)
    if decode_batch(ctx):
        return _ref_decode_attention(q, spec, source, cache, group, meta, ctx.extra)
    return _ref_attention_each(q, spec, source, cache, group, meta, ctx.extra.get(BIDIR_SPANS_KEY))


def _ref_attention_each(q: torch.Tensor, spec: AttentionSpec, source: AttentionSpec, cache: torch.Tensor, group,
                        meta, bidir=None) -> torch.Tensor:
    """ref_attention one sequence at a time (any mix of prefill, chunks and decode): each sequence's result
    depends on its own tokens only, not on what else the step holds (a synchronous and an async-scheduled
    engine batch differently). One SDPA over grouped heads a sequence; the einsums where soft-capped."""
    num_tokens = q.shape[0]
    q = q.view(num_tokens, spec.num_heads, spec.head_dim)
    out = torch.zeros_like(q)
    group_size = spec.num_heads // spec.num_kv_heads
    for i, seq_len in enumerate(meta.seq_lens):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        if end == start:
            continue
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        first = 0 if spec.sliding_window is None else max(0, seq_len - (end - start) - spec.sliding_window + 1)
        k_pos = torch.arange(first, seq_len, device=q.device)
        keys, values = gather_kv(cache, group.block_tables[i], k_pos, spec, source, meta.block_size)
        allowed = k_pos[None, :] <= q_pos[:, None]
        if bidir is not None and bidir[i] and spec.sliding_window is not None:
            allowed |= bidirectional_mask(bidir[i], q_pos, k_pos)
        if spec.sliding_window is not None:
            allowed &= k_pos[None, :] > q_pos[:, None] - spec.sliding_window
        if spec.softcap is None:
            out[start:end] = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=allowed,
                scale=spec.scale, enable_gqa=True).transpose(0, 1)
            continue
        keys = keys.repeat_interleave(group_size, dim=1)  # [m, H, D]
        values = values.repeat_interleave(group_size, dim=1)
        scores = torch.einsum("nhd,mhd->hnm", q[start:end], keys) * spec.scale
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[start:end] = torch.einsum("hnm,mhd->nhd", probs, values)
    return out.view(num_tokens, spec.num_heads * spec.head_dim)


def _decode_slots(meta, window: int | None, block_tables: torch.Tensor, dev) -> tuple:
    """A decode batch's key positions k_pos [seqs, longest] (padding past a sequence's end repeats its last key:
    a weight of 0 times an unused slot's contents could still be NaN, 0 * NaN), their cache slots [seqs *
    longest] and the mask [seqs, 1, 1, longest] of real keys (False where a block was released). Tables on the
    CPU: in numpy (the CPU is where this is the attention provider, and the same dozen small ops as tensor ops
    cost ~0.15 ms a KV group a step there), and the mask None where every key is real (sequences of one length
    in their window: SDPA without a mask, ~25% less a layer on 2 cores); elsewhere with tensor ops on the
    tables' device, no copy to or from the host inside the step."""
    n = len(meta.seq_lens)
    if block_tables.device.type != "cpu":
        longest = max(min(s, window) for s in meta.seq_lens) if window is not None else max(meta.seq_lens)
        return _decode_slots_device(meta, window, block_tables[:n], longest)
    seq = np.array(meta.seq_lens, dtype=np.int64)
    lens = np.minimum(seq, window) if window is not None else seq
    longest = int(lens.max())
    j = np.arange(longest)
    k_pos = np.minimum(j, (lens - 1)[:, None])
    if window is not None:
        k_pos += (seq - lens)[:, None]
    bs = meta.block_size
    blk = block_tables.numpy()[np.arange(n)[:, None], k_pos // bs].astype(np.int64)
    slots = blk * bs + k_pos % bs
    mask = None
    if not ((lens == longest).all() and (blk >= 0).all()):
        mask = torch.from_numpy((j < lens[:, None]) & (blk >= 0))[:, None, None, :].to(dev)
    np.maximum(slots, 0, out=slots)
    return torch.from_numpy(k_pos).to(dev), torch.from_numpy(slots.reshape(-1)).to(dev), mask


def _decode_slots_device(meta, window: int | None, tables: torch.Tensor, longest: int) -> tuple:
    """_decode_slots with tensor ops on the tables' device (the lengths from the runner's seq_lens_tensor)."""
    dev, n = tables.device, tables.shape[0]
    seq = (meta.seq_lens_tensor[:n].to(dev).long() if meta.seq_lens_tensor is not None
           else torch.tensor(meta.seq_lens, device=dev))[:, None]
    lens = seq.clamp(max=window) if window is not None else seq
    j = torch.arange(longest, device=dev)
    k_pos = torch.minimum(j, lens - 1) + (seq - lens)
    slots, live = table_slots(tables, k_pos, meta.block_size)
    return k_pos, slots.reshape(-1), ((j < lens) & live)[:, None, None, :]


def _ref_decode_attention(q: torch.Tensor, spec: AttentionSpec, source: AttentionSpec, cache: torch.Tensor,
                          group, meta, extra: dict) -> torch.Tensor:
    """ref_attention for a decode batch (one query per sequence), batched: every sequence's context gathered
    into one padded [seqs, longest, kv_heads, head_dim] view and attended in one product, instead of a Python
    loop over the sequences (which made the reference, the CPU's provider, most of a CPU decode step). The key
    positions, slots and mask are the same for every layer of a KV group: made once per step (kept in
    `extra`)."""
    num_seqs, dev = len(meta.seq_lens), q.device
    key = ("_ref_decode_slots", spec.sliding_window, id(group))  # the same for a KV group's layers
    plan = extra.get(key)
    if plan is None:
        plan = extra[key] = _decode_slots(meta, spec.sliding_window, group.block_tables, dev)
    k_pos, slots, mask = plan
    keys, values = gather_slots(cache, slots, k_pos, spec, source)
    qs = q[:num_seqs].view(num_seqs, spec.num_heads, 1, spec.head_dim)
    if spec.softcap is None:  # one fused kernel (torch's SDPA, grouped heads): a CPU decode step's largest op
        o = F.scaled_dot_product_attention(qs, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask,
                                           scale=spec.scale, enable_gqa=True).reshape(num_seqs, -1)
    else:
        group_size = spec.num_heads // spec.num_kv_heads
        qs = qs.view(num_seqs, spec.num_kv_heads, group_size, spec.head_dim)
        scores = torch.einsum("bkgd,blkd->bkgl", qs, keys) * spec.scale
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.einsum("bkgl,blkd->bkgd", probs, values).reshape(num_seqs, -1)
    if q.shape[0] == num_seqs:
        return o
    out = torch.zeros(q.shape[0], spec.num_heads * spec.head_dim, dtype=q.dtype, device=dev)
    out[:num_seqs] = o
    return out


def reference_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_idx: int) -> torch.Tensor:
    """Write (when this layer owns its cache) then attend, in plain PyTorch."""
    if v is not None and get_forward_context().layers[layer_idx].writes_cache:
        ref_kv_cache_write(k, v, layer_idx)
    return ref_attention(q, layer_idx)


def _triton_attention(caps: Capabilities, shape: dict) -> str | None:
    layer: AttentionSpec = shape["layer"]
    if layer.sink_tokens or layer.omnikv is not None:  # served by the sparse_attention op's kernel
        from compiled_llm.ops.sparse import _triton_sparse

        return _triton_sparse(caps, shape)
    if not 32 <= layer.head_dim <= 512 or layer.head_dim % 2:
        return f"head_dim {layer.head_dim}: the kernels take even head_dim from 32 to 512"
    bs = shape.get("block_size", 16)
    if bs & (bs - 1):
        return f"block size {bs} is not a power of two"
    return caps.triton_ok()


def _cpu_attention(caps: Capabilities, shape: dict) -> str | None:
    if shape["layer"].sink_tokens or shape["layer"].omnikv is not None:
        return "sparse-KV layers are the sparse_attention op's"
    from compiled_llm.ops.cpu_attention import unsupported

    return unsupported(caps, shape)


def _cpu_kv_write(caps: Capabilities, shape: dict) -> str | None:
    from compiled_llm.ops.cpu_attention import write_unsupported

    return write_unsupported(caps, shape)


ATTENTION = register(OpSpec("attention", "paged attention over the cache: prefill, decode, sliding window, soft-cap", [
    Provider("triton", "compiled_llm.ops.triton.providers:attention", _triton_attention, capturable=True),
    Provider("cpu", "compiled_llm.ops.cpu_attention:attention", _cpu_attention),
    Provider("reference", "compiled_llm.ops.attention:ref_attention"),
], per_layer=True, splits_graph=True))

KV_CACHE_WRITE = register(OpSpec("kv_cache_write", "scatter this step's k/v into their cache slots", [
    Provider("triton", "compiled_llm.ops.triton.qk_norm_rope:kv_cache_write", lambda caps, shape: caps.triton_ok()),
    Provider("cpu", "compiled_llm.ops.cpu_attention:kv_cache_write", _cpu_kv_write),
    Provider("reference", "compiled_llm.ops.attention:ref_kv_cache_write", syncs=True),  # write_kv's padding check
]))


@custom_op("compiled_llm::kv_cache_write", mutates_args=())
def kv_cache_write_op(k: torch.Tensor | None, v: torch.Tensor, layer_idx: int) -> torch.Tensor:
    """Writes k/v into the layer's cache (found through the forward context). Returns an empty marker
    that the attention op takes, so the write is ordered before the read and never dropped. Inside a
    compiled piece layer_idx is relative to the piece's first layer (ops/context.py absolute_layer)."""
    layer_idx = absolute_layer(layer_idx)
    KV_CACHE_WRITE.impl(layer_idx)(k, v, layer_idx)
    return v.new_empty(0)


@kv_cache_write_op.register_fake
def _(k, v, layer_idx):
    return v.new_empty(0)


@custom_op("compiled_llm::attention", mutates_args=())
def attention_op(q: torch.Tensor, kv_written: torch.Tensor | None, layer_idx: int) -> torch.Tensor:
    ctx = current_forward_context()
    spec = ctx.layers.get(layer_idx) if ctx is not None else None
    if spec is not None and (spec.sink_tokens or spec.omnikv is not None):  # StreamingLLM, OmniKV (ops/sparse.py)
        from compiled_llm.ops.sparse import SPARSE_ATTENTION

        return SPARSE_ATTENTION.impl(layer_idx)(q, layer_idx)
    if (ctx is not None and any(ctx.extra.get(BIDIR_SPANS_KEY) or ())
            and ATTENTION.provider_name(layer_idx) not in SPAN_MASK_PROVIDERS):
        return ref_attention(q, layer_idx)  # media prefill steps on a provider without the span mask
    return ATTENTION.impl(layer_idx)(q, layer_idx)


@attention_op.register_fake
def _(q, kv_written, layer_idx):
    return torch.empty_like(q)


def attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_idx: int) -> torch.Tensor:
    """q: [tokens, heads * head_dim]; k, v: [tokens, kv_heads * head_dim], or None for layers that read
    another layer's cache (k alone may be None for K=V layers). Writes k/v, then attends."""
    written = None if v is None else torch.ops.compiled_llm.kv_cache_write(k, v, layer_idx)
    return torch.ops.compiled_llm.attention(q, written, layer_idx)
