"""Sparse-KV attention for long contexts: StreamingLLM and OmniKV (docs/sparse_kv.md).

The runtime (runtime/sparse_kv.py) marks the full-attention layers a method applies to on their
AttentionSpec, and puts a SparseMetadata into the forward context each step; the attention op routes
those layers to the `sparse_attention` op declared here: this module's PyTorch paths are its reference
provider, ops/triton/sparse_attention.py its Triton one (CUDA, capturable).

StreamingLLM (spec.sink_tokens = S > 0, spec.sliding_window = W): a query at position p sees the first S
positions (attention sinks) and the W positions (p - W, p]. The method numbers positions within its cache:
the sinks keep 0..S-1 and the window follows right after them. Keys are cached rotated with their
original positions and RoPE scores depend only on the distance, so window keys already have the right
distance to the query; only sink keys are off, by delta = max(0, p - W + 1 - S) (the tokens dropped
between them). The sink scores therefore use the query rotated back by delta: exact, one extra rope on q,
no key rewritten (K=V layers rebuild keys with their original positions as usual).

OmniKV (spec.omnikv = "filter" | "sparse"): decode rows only; prefill and prefill chunks stay dense.
A filter layer attends densely and then picks, from its own head-summed attention probabilities, the
`budget` positions the next layers attend to: always the first `sink` and the last `recent`, the rest
by score. The pick goes into a fixed-size index buffer ([rows, budget] int32, -1 padded, ascending);
the sparse layers up to the next filter layer attend only to those positions of their own cache. The
full cache is kept, so a token not picked this step can be picked the next.

Two paths compute the same thing: a per-sequence loop (any batch: prefill chunks, mixed batches) and,
when every row is one decode token, a vectorised path with static shapes and no host syncs (one gather
over [rows, keys], one top-k). Filter layers score block by block in both (`filter_decode`): a chunk of
positions' keys, then values, at a time, never [rows, ctx, kv_heads, head_dim].
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from compiled_llm.ops.attention import gather_kv_batched, keys_from_values
from compiled_llm.ops.context import layer_cache
from compiled_llm.ops.registry import Capabilities, OpSpec, Provider, register
from compiled_llm.ops.rope import apply_rope

SPARSE_KEY = "sparse_kv"  # ForwardContext.extra key

VECTORIZED = True  # tests switch this off to compare with the per-sequence path
# OmniKV filter layers (decode): the keys, then the values, of this many bytes' worth of positions (all rows
# together) are gathered at a time, never the whole context as [rows, ctx, kv_heads, head_dim]
FILTER_CHUNK_BYTES = 64 << 20


@dataclass
class SparseMetadata:
    """Per step, from the runtime. `decode[i]`: sequence i computes one generated token this step."""

    decode: list[bool]
    index: torch.Tensor | None = None  # OmniKV: [>= num_seqs, budget] int32; None: this process's index_buffer
    budget: int = 0  # OmniKV: positions a sparse layer attends to (sinks and recent included)
    sink: int = 0
    recent: int = 0
    tp_group_name: str | None = None  # OmniKV scores are summed over the heads of this TP group
    # OmniKV offload: cache layer -> its device staging buffer (staging_buffer; the runtime's, allocated at
    # start; the only tensors the metadata carries, and only under the offload, which tensor parallelism
    # refuses), and, filled during the forward by the Triton provider, cache layer -> (buffer, what the sparse
    # layer waits for before reading it) once a filter layer of this step staged the picks
    staging: dict = field(default_factory=dict)
    staged_picks: dict = field(default_factory=dict)

    @property
    def all_decode(self) -> bool:
        return bool(self.decode) and all(self.decode)

    @property
    def whole_graph_ok(self) -> bool:
        """A whole-forward CUDA graph was captured with every row a decode row (compiler/model.py asks)."""
        return self.all_decode


_INDEX: dict[tuple[str, int], torch.Tensor] = {}


def index_buffer(rows: int, budget: int, device: torch.device | str) -> torch.Tensor:
    """OmniKV's token choice, [rows, budget] int32: one buffer per process, device and budget, allocated
    once (the runtime sizes it for max_num_seqs at start, so CUDA Graphs see one fixed address). The
    metadata carries no tensor, so a tensor-parallel driver can hand it to every rank as plain data."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (str(device), budget)
    buf = _INDEX.get(key)
    if buf is None or buf.shape[0] < rows:
        buf = _INDEX[key] = torch.full((rows, budget), -1, dtype=torch.int32, device=device)
    return buf


def staging_buffer(rows: int, budget: int, kv: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                   device: torch.device | str) -> torch.Tensor:
    """OmniKV offload: where a filter layer copies the picked tokens of an offloaded cache layer to the device
    for its sparse layers, [kv (1 for K=V, else 2), rows, budget, kv_heads, head_dim]. The runtime allocates
    one per offloaded cache layer at start, for max_num_seqs rows (a fixed address for CUDA Graphs, counted
    in its memory plan), and hands them over in SparseMetadata.staging."""
    return torch.zeros(kv, max(rows, 1), budget, kv_heads, head_dim, dtype=dtype, device=device)


# ---- shared pieces ------------------------------------------------------------------------------


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, spec,
            q_shift: torch.Tensor | None = None, shift_cols: torch.Tensor | None = None, guard_empty: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, n, H, D]; keys/values [B, m, kvH, D]; allowed [B, n, m]. Columns where shift_cols [B, m] is set
    score against q_shift instead of q (StreamingLLM sinks). Returns out [B, n, H, D] and the float32
    probabilities [B, H, n, m]; with guard_empty, rows with nothing allowed (padding) give zeros.
    In place where it can: a long prefill chunk's scores are the largest tensors of the step."""
    bsz, n, h, d = q.shape
    kvh = keys.shape[2]
    g = h // kvh
    scores = torch.einsum("bnkgd,bmkd->bkgnm", q.view(bsz, n, kvh, g, d), keys)
    if q_shift is not None:
        shifted = torch.einsum("bnkgd,bmkd->bkgnm", q_shift.view(bsz, n, kvh, g, d), keys)
        scores = torch.where(shift_cols[:, None, None, None, :], shifted, scores)
    scores = scores.reshape(bsz, h, n, -1).mul_(spec.scale)
    if spec.softcap is not None:
        scores = scores.div_(spec.softcap).tanh_().mul_(spec.softcap)
    scores.masked_fill_(~allowed[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    del scores
    if guard_empty:
        probs = probs.nan_to_num_(0.0)
    out = torch.einsum("bkgnm,bmkd->bnkgd", probs.to(q.dtype).view(bsz, kvh, g, n, -1), values)
    return out.reshape(bsz, n, h, d), probs


def omnikv_select(score: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, seq_lens: torch.Tensor, budget: int,
                  sink: int, recent: int, tp_group_name: str | None = None) -> torch.Tensor:
    """The positions a filter layer keeps: score [B, M] (attention probabilities summed over heads) at
    positions pos [B, M]. Always the first `sink` and the last `recent` positions, then the best scores,
    `budget` in all. Returns [B, budget] int32, ascending, -1 padded."""
    if tp_group_name is not None:  # every rank must pick the same tokens: sum the heads of all ranks
        score = torch.ops._c10d_functional.wait_tensor(
            torch.ops._c10d_functional.all_reduce(score.contiguous(), "sum", tp_group_name))
    forced = valid & ((pos < sink) | (pos >= seq_lens[:, None] - recent))
    score = score.masked_fill(forced, float("inf")).masked_fill(~valid, float("-inf"))
    k = min(budget, score.shape[1])
    top = torch.topk(score, k, dim=-1)
    chosen = pos.gather(1, top.indices)
    big = torch.iinfo(torch.int64).max
    chosen = torch.where(top.values == float("-inf"), torch.full_like(chosen, big), chosen)
    chosen = torch.sort(chosen, dim=-1).values
    chosen = torch.where(chosen == big, torch.full_like(chosen, -1), chosen)
    if k < budget:
        chosen = torch.cat([chosen, chosen.new_full((chosen.shape[0], budget - k), -1)], dim=1)
    return chosen.to(torch.int32)


def _gather_chunk(cache, tables, pos, valid, spec, source, block_size, values: bool) -> torch.Tensor:
    """Keys (or values) at positions pos [B, M] through tables [B, blocks]: [B, M, kv_heads, head_dim]."""
    p = torch.where(valid, pos, torch.zeros_like(pos))
    blk = torch.gather(tables.long(), 1, (p // block_size).clamp(max=tables.shape[1] - 1))
    ok = valid & (blk >= 0)
    slots = torch.where(ok, blk * block_size + p % block_size, torch.zeros_like(p)).reshape(-1)
    flat = cache.view(cache.shape[0], -1, spec.num_kv_heads, spec.head_dim)
    shape = (*pos.shape, spec.num_kv_heads, spec.head_dim)
    if values or not source.k_eq_v:
        return flat[-1 if values else 0].index_select(0, slots).view(shape)
    return keys_from_values(flat[0].index_select(0, slots), p.reshape(-1), source).view(shape)


def filter_decode(qd: torch.Tensor, cache, tables, lens, spec, source, block_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """An OmniKV filter layer's decode rows: qd [B, H, D], one query per row at position lens - 1, attends
    densely over its context, block by block: the keys of a chunk of positions are gathered and scored
    (scores [B, H, ctx] float32 are the largest tensor, ctx = the block-table width), then the values of
    each chunk weighted by the probabilities. Returns out [B, H, D], the probabilities summed over the
    heads [B, ctx], the positions [B, ctx] and which are real."""
    b, h, d = qd.shape
    kvh = spec.num_kv_heads
    dev = qd.device
    width = tables.shape[1] * block_size
    per_pos = max(1, b * kvh * d * 4)
    chunk = max(block_size, FILTER_CHUNK_BYTES // per_pos // block_size * block_size)
    pos = torch.arange(width, device=dev)[None].expand(b, -1)
    valid = pos < lens[:, None]
    qg = qd.reshape(b, kvh, h // kvh, d)
    scores = torch.empty(b, h, width, dtype=torch.float32, device=dev)
    for c0 in range(0, width, chunk):
        sl = slice(c0, c0 + chunk)
        keys = _gather_chunk(cache, tables, pos[:, sl], valid[:, sl], spec, source, block_size, values=False)
        s = torch.einsum("bkgd,bmkd->bkgm", qg, keys).reshape(b, h, -1).mul_(spec.scale)
        if spec.softcap is not None:
            s = s.div_(spec.softcap).tanh_().mul_(spec.softcap)
        scores[:, :, sl] = s
    scores.masked_fill_(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # rows with nothing (padding): zeros
    del scores
    out = torch.zeros(b, kvh, h // kvh, d, dtype=torch.float32, device=dev)
    for c0 in range(0, width, chunk):
        sl = slice(c0, c0 + chunk)
        values = _gather_chunk(cache, tables, pos[:, sl], valid[:, sl], spec, source, block_size, values=True)
        p = probs[:, :, sl].to(qd.dtype).reshape(b, kvh, h // kvh, -1)
        out += torch.einsum("bkgm,bmkd->bkgd", p, values).float()
    return out.reshape(b, h, d).to(qd.dtype), probs.sum(1), pos, valid


def _streaming_shift(q: torch.Tensor, q_pos: torch.Tensor, spec) -> torch.Tensor:
    """q rotated back by each query's delta = max(0, p - W + 1 - S): the query as the sinks see it."""
    delta = (q_pos - spec.sliding_window + 1 - spec.sink_tokens).clamp(min=0)
    flat = q.reshape(-1, spec.num_heads, spec.head_dim)
    return apply_rope(flat, -delta.reshape(-1), spec.inv_freq).view_as(q)


# ---- the op -------------------------------------------------------------------------------------


def is_sparse_layer(spec) -> bool:
    """A layer a sparse method applies to (its attention goes through the sparse_attention op)."""
    return bool(spec.sink_tokens) or spec.omnikv is not None


def _triton_sparse(caps: Capabilities, shape: dict) -> str | None:
    layer = shape["layer"]
    if not 32 <= layer.head_dim <= 512 or layer.head_dim % 2:
        return f"head_dim {layer.head_dim}: the kernel takes even head_dim from 32 to 512"
    bs = shape.get("block_size", 16)
    if bs & (bs - 1):
        return f"block size {bs} is not a power of two"
    return caps.triton_ok()


# Called by the attention op for the layers a sparse method applies to (ops/attention.py routes them).
# The Triton provider reads only the kept or picked keys from the paged cache and is CUDA-graph safe.
SPARSE_ATTENTION = register(OpSpec("sparse_attention", "StreamingLLM / OmniKV attention over the kept or picked keys", [
    Provider("triton", "compiled_llm.ops.triton.sparse_attention:attention", _triton_sparse, capturable=True),
    Provider("reference", "compiled_llm.ops.sparse:sparse_attention"),
], per_layer=True, applies=is_sparse_layer))


def sparse_attention(q: torch.Tensor, layer_idx: int) -> torch.Tensor:
    """Attention for a layer a sparse method applies to (called by ref_attention). q: [tokens, H * D]."""
    ctx, spec, cache, group = layer_cache(layer_idx)
    sm: SparseMetadata | None = ctx.extra.get(SPARSE_KEY)
    if spec.omnikv is not None and sm is None:
        raise RuntimeError("OmniKV layers need the runtime's sparse metadata in the forward context")
    meta = ctx.attn_metadata
    if spec.omnikv is not None and sm.index is None:
        sm.index = index_buffer(len(meta.seq_lens), sm.budget, q.device)
    qsl = meta.query_start_loc
    one_token = all(qsl[i + 1] - qsl[i] == 1 for i in range(len(meta.seq_lens)))
    if VECTORIZED and one_token and meta.seq_lens and (spec.omnikv is None or sm.all_decode):
        return _decode_vectorized(q, ctx, spec, cache, group, sm)
    return _per_sequence(q, ctx, spec, cache, group, sm)


def _per_sequence(q, ctx, spec, cache, group, sm) -> torch.Tensor:
    source = ctx.layers[spec.cache_layer]
    meta = ctx.attn_metadata
    num_tokens = q.shape[0]
    q = q.view(num_tokens, spec.num_heads, spec.head_dim)
    out = torch.zeros_like(q)
    dev = q.device
    picks = []  # (row, positions, head-summed probabilities) of OmniKV decode rows at a filter layer
    for i, seq_len in enumerate(meta.seq_lens):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        n = end - start
        if n == 0:
            continue
        q_pos = torch.arange(seq_len - n, seq_len, device=dev)
        q_shift = shift_cols = None
        decode = sm is not None and sm.decode[i]
        if spec.omnikv == "filter" and decode and n == 1:
            lens = torch.tensor([seq_len], device=dev)
            o, score, _, _ = filter_decode(q[start:end], cache, group.block_tables[i:i + 1], lens, spec, source,
                                           meta.block_size)
            out[start:end] = o
            picks.append((i, torch.arange(seq_len, device=dev), score[0, :seq_len]))
            continue
        if spec.sink_tokens:
            s, w = spec.sink_tokens, spec.sliding_window
            lo = max(0, seq_len - n - w + 1)
            k_pos = torch.cat([torch.arange(0, min(s, lo), device=dev), torch.arange(lo, seq_len, device=dev)])
            allowed = (k_pos[None, :] <= q_pos[:, None]) & (
                (k_pos[None, :] > q_pos[:, None] - w) | (k_pos[None, :] < s))
            if seq_len - w > s:  # some query's window starts past the sinks: they see the shifted query
                q_shift = _streaming_shift(q[start:end], q_pos, spec)[None]
                shift_cols = (k_pos < s)[None]
        elif spec.omnikv == "sparse" and decode:
            row = sm.index[i].long()
            k_pos = row[row >= 0]
            allowed = torch.ones(1, k_pos.shape[0], dtype=torch.bool, device=dev)
        else:
            k_pos = torch.arange(0, seq_len, device=dev)
            allowed = k_pos[None, :] <= q_pos[:, None]
        valid = torch.ones(1, k_pos.shape[0], dtype=torch.bool, device=dev)
        keys, values = gather_kv_batched(cache, group.block_tables[i:i + 1], k_pos[None], valid, spec, source, meta.block_size)
        o, probs = _attend(q[None, start:end], keys, values, allowed[None], spec, q_shift, shift_cols)
        out[start:end] = o[0]
    if picks:
        _write_picks(picks, sm, meta, dev)
    return out.view(num_tokens, spec.num_heads * spec.head_dim)


def _write_picks(picks, sm: SparseMetadata, meta, dev) -> None:
    """One batched selection for the decode rows of a filter layer (one all-reduce under TP)."""
    width = max(p[1].shape[0] for p in picks)
    rows = len(picks)
    pos = torch.zeros(rows, width, dtype=torch.long, device=dev)
    valid = torch.zeros(rows, width, dtype=torch.bool, device=dev)
    score = torch.zeros(rows, width, dtype=torch.float32, device=dev)
    for r, (_, k_pos, s) in enumerate(picks):
        m = k_pos.shape[0]
        pos[r, :m], valid[r, :m], score[r, :m] = k_pos, True, s
    lens = torch.tensor([meta.seq_lens[i] for i, _, _ in picks], device=dev)
    chosen = omnikv_select(score, pos, valid, lens, sm.budget, sm.sink, sm.recent, sm.tp_group_name)
    for r, (i, _, _) in enumerate(picks):
        sm.index[i].copy_(chosen[r])


def _decode_vectorized(q, ctx, spec, cache, group, sm) -> torch.Tensor:
    """Every row one decode token: static shapes, no host syncs (CUDA-graph safe given a fixed block-table
    width and meta.seq_lens_tensor)."""
    source = ctx.layers[spec.cache_layer]
    meta = ctx.attn_metadata
    n = len(meta.seq_lens)
    h, d = spec.num_heads, spec.head_dim
    dev = q.device
    lens = meta.seq_lens_tensor
    lens = torch.tensor(meta.seq_lens, device=dev) if lens is None else lens[:n].to(dev).long()
    tables = group.block_tables[:n]
    qd = q[:n].view(n, 1, h, d)
    q_shift = shift_cols = None
    if spec.sink_tokens:
        s, w = spec.sink_tokens, spec.sliding_window
        sinks = torch.arange(s, device=dev)[None].expand(n, s)
        window = lens[:, None] - w + torch.arange(w, device=dev)[None]
        pos = torch.cat([sinks, window], dim=1)
        valid = torch.cat([sinks < (lens[:, None] - w), window >= 0], dim=1)  # sinks inside the window: once
        q_shift = _streaming_shift(qd, (lens - 1)[:, None], spec)
        shift_cols = torch.cat([torch.ones(n, s, dtype=torch.bool, device=dev),
                                torch.zeros(n, w, dtype=torch.bool, device=dev)], dim=1)
    elif spec.omnikv == "sparse":
        pos = sm.index[:n].long()
        valid = pos >= 0
    else:  # the filter layer: dense, block by block, and the pick
        o, score, pos, valid = filter_decode(qd[:, 0], cache, tables, lens, spec, source, meta.block_size)
        chosen = omnikv_select(score, pos, valid, lens, sm.budget, sm.sink, sm.recent, sm.tp_group_name)
        sm.index[:n].copy_(chosen)
        out = torch.zeros(q.shape[0], h * d, dtype=q.dtype, device=dev)
        out[:n] = o.reshape(n, h * d)
        return out
    keys, values = gather_kv_batched(cache, tables, pos, valid, spec, source, meta.block_size)
    o, _ = _attend(qd, keys, values, valid[:, None, :], spec, q_shift, shift_cols, guard_empty=True)
    out = torch.zeros(q.shape[0], h * d, dtype=q.dtype, device=dev)
    out[:n] = o.reshape(n, h * d)
    return out
