"""Sparse-KV attention in Triton: the `sparse_attention` op's CUDA provider (StreamingLLM, OmniKV;
ops/sparse.py holds the reference and the method's definition, docs/sparse_kv.md).

The sparse layers' kernel: a program owns one query row (a decode token, or under StreamingLLM one
prefill token), one KV head and one split-K chunk of that row's *key list*, and reads only the keys in
it, straight from the paged cache (no [rows, ctx, heads, dim] gather):

- MODE 1, index: the positions in a [rows, budget] int32 list, -1 padded (OmniKV sparse layers read the
  filter layer's pick);
- MODE 2, sinks + window: positions [0, sink) that are not inside the window, scored against the query
  rotated back by StreamingLLM's delta (`QShift`), then (len - window, len - 1] against the query itself.
  The sinks get their own tiles, so a tile is either all sinks or all window.

K=V layers rebuild the keys from the cached values at each key's own position (rope of v * k_norm_weight),
as the dense kernels do; where only the first ROT angles of each half rotate (Gemma 4's global layers: 64 of
256), only those dims are rebuilt, and the weight goes on the query for the rest (PARTIAL, as in the dense
decode kernel). Rebuilding every dim with a cos and a sin per key was 0.2 ms a layer at 16 x 2,048 keys on
the H200, about 4x a dense layer's rate per key (session 15). Rows may map to block-table rows (`TabRow`): a
prefill chunk's tokens share their sequence's table.

OmniKV filter layers (MODE 0, dense) attend with the dense decode kernel (paged_attention.paged_decode),
which also stores every key's log2-domain score per head and each head's log-sum-exp; a small kernel then
sums the heads' probabilities exp2(score - lse) per position, [rows, ctx] float32, which omnikv_select
ranks. The keys are read once (session 8's version read them a second time to re-score them, with every
key dim rebuilt: 4.2x a dense layer at 64K). Nothing in the decode path syncs with the host or changes
shape from step to step, so CUDA graphs can capture it (the split count depends only on the batch size
and the fixed key-list width).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import triton
import triton.language as tl

from compiled_llm.ops.context import layer_cache
from compiled_llm.ops.jit import MONITOR, JitKernel, register_kernel
from compiled_llm.ops.sparse import SPARSE_KEY, _streaming_shift, index_buffer, omnikv_select, staging_buffer
from compiled_llm.ops.triton._common import _dot, _reduce_angle, dot_f32, dot_precision
from compiled_llm.ops.triton.paged_attention import (AttnLaunch, _cached_keys, _scores, attention_launch_policy,
                                                     combine_splits, paged_decode, paged_prefill,
                                                     rotated_block)

DENSE, INDEX, STREAMING = 0, 1, 2
@triton.jit
def _keys_at(v1, v2, w1, w2, inv, pos):
    """K=V: rope(v * k_norm_weight) at each key's own position (pos [BLOCK_N]), both halves."""
    pf = pos.to(tl.float32)[:, None] + tl.zeros_like(inv)[None, :]
    a = pf * inv[None, :]
    a = _reduce_angle(a) + tl.fma(pf, inv[None, :] + tl.zeros_like(pf), -a)
    c = tl.cos(a)
    s = tl.sin(a)
    x1 = v1.to(tl.float32) * w1[None, :]
    x2 = v2.to(tl.float32) * w2[None, :]
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _key_positions(Index, row, length, j0, n, end, n_keys, sink, window, stride_ix,
                   MODE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Positions of the key-list entries j0 + n and which of them are real; is_sink: the tile holds sinks."""
    j = j0 + n
    jm = j < end
    is_sink = j0 < 0  # False (a scalar of the right type)
    if MODE == 1:
        pos = tl.load(Index + row.to(tl.int64) * stride_ix + j, mask=jm, other=-1)
        ok = jm & (pos >= 0) & (pos < length)
    else:
        spad = tl.cdiv(sink, BLOCK_N) * BLOCK_N
        is_sink = j0 < spad
        pos = tl.where(is_sink, j, length - window + (j - spad))
        ok = jm & tl.where(is_sink, (j < sink) & (j < length - window), pos >= 0)
    return tl.where(ok, pos, 0), ok, is_sink


@triton.jit
def _tile_query(is_sink, q1, q2, z1, z2, MODE: tl.constexpr):
    """The query halves a tile's keys are scored against: under StreamingLLM (MODE 2) a sink tile sees the
    query rotated back by delta (z), a window tile the query itself."""
    a1 = q1
    a2 = q2
    if MODE == 2:
        a1 = tl.where(is_sink, z1, q1)
        a2 = tl.where(is_sink, z2, q2)
    return a1, a2


@triton.jit(do_not_specialize=["stride_zs", "stride_zh", "stride_bt", "stride_ix", "n_keys", "sink", "window",
                               "num_splits"])
def _sparse_decode_kernel(
    Q, QShift, K, V, BlockTables, TabRow, Lens, Index, KNorm, InvFreq, Out, MidO, MidLse,
    stride_qs, stride_qh, stride_zs, stride_zh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt, stride_ix,
    stride_os, stride_oh,
    stride_ms, stride_mh, stride_ls, stride_lh,
    scale, softcap, n_keys, sink, window, num_splits,
    MODE: tl.constexpr, ROWMAP: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, K_EQ_V: tl.constexpr,
    DIRECT: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr,
    ROT: tl.constexpr = 16, PARTIAL: tl.constexpr = False, STAGED: tl.constexpr = False,
):
    # STAGED (OmniKV offload, MODE 1): K/V are a staging buffer [rows, n_keys, kv_heads, head_dim] holding
    # the row's key list in order (stage_picks), so entry j sits at (row, j); positions still come from
    # Index, for the rope rebuild.
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(Lens + row)  # keys at positions < length (the query sits at length - 1)
    tab = row
    if ROWMAP:
        tab = tl.load(TabRow + row)
    if MODE == 1:
        total = length * 0 + n_keys
    else:
        total = length * 0 + tl.cdiv(sink, BLOCK_N) * BLOCK_N + window
    chunk = tl.cdiv(tl.cdiv(total, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, total)

    h = tl.arange(0, BLOCK_H)
    hmask = h < GROUP
    head = kvh * GROUP + h
    d = tl.arange(0, BLOCK_D)
    dmask = d < HALF
    qmask = hmask[:, None] & dmask[None, :]
    q_ptr = Q + row.to(tl.int64) * stride_qs + head[:, None] * stride_qh + d[None, :]
    q1 = tl.load(q_ptr, mask=qmask, other=0.0)
    q2 = tl.load(q_ptr + HALF, mask=qmask, other=0.0)
    z1 = q1
    z2 = q2
    if MODE == 2:
        z_ptr = QShift + row.to(tl.int64) * stride_zs + head[:, None] * stride_zh + d[None, :]
        z1 = tl.load(z_ptr, mask=qmask, other=0.0)
        z2 = tl.load(z_ptr + HALF, mask=qmask, other=0.0)
    if PARTIAL:  # plain dims: the key is v * w, so w goes on the queries (zero on the rotated dims); the
        # sinks' query (StreamingLLM) differs from q on the rotated dims only (a zero angle rotates nothing)
        r = tl.arange(0, ROT)
        plain = (d >= ROT) & dmask
        w1 = tl.load(KNorm + d, mask=plain, other=0.0).to(tl.float32)
        w2 = tl.load(KNorm + HALF + d, mask=plain, other=0.0).to(tl.float32)
        q1 = (q1.to(tl.float32) * w1[None, :]).to(q1.dtype)
        q2 = (q2.to(tl.float32) * w2[None, :]).to(q2.dtype)
        qr_ptr = Q + row.to(tl.int64) * stride_qs + head[:, None] * stride_qh + r[None, :]
        q1r = tl.load(qr_ptr, mask=hmask[:, None], other=0.0)
        q2r = tl.load(qr_ptr + HALF, mask=hmask[:, None], other=0.0)
        z1r = q1r
        z2r = q2r
        if MODE == 2:
            zr_ptr = QShift + row.to(tl.int64) * stride_zs + head[:, None] * stride_zh + r[None, :]
            z1r = tl.load(zr_ptr, mask=hmask[:, None], other=0.0)
            z2r = tl.load(zr_ptr + HALF, mask=hmask[:, None], other=0.0)
        w1r = tl.load(KNorm + r).to(tl.float32)
        w2r = tl.load(KNorm + HALF + r).to(tl.float32)
        invr = tl.load(InvFreq + r).to(tl.float32)
    elif K_EQ_V:
        w1 = tl.load(KNorm + d, mask=dmask, other=0.0).to(tl.float32)
        w2 = tl.load(KNorm + HALF + d, mask=dmask, other=0.0).to(tl.float32)
        inv = tl.load(InvFreq + d, mask=dmask, other=0.0).to(tl.float32)

    n = tl.arange(0, BLOCK_N)
    bt_row = BlockTables + tab.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc1 = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    acc2 = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for j0 in range(start, end, BLOCK_N):
        pos, ok, is_sink = _key_positions(Index, row, length, j0, n, end, n_keys, sink, window, stride_ix,
                                          MODE, BLOCK_N)
        if STAGED:
            page = (row + n * 0).to(tl.int64)
            slot = j0 + n
        else:
            page = tl.load(bt_row + pos // PAGE, mask=ok, other=0).to(tl.int64)
            slot = pos % PAGE
        kvmask = ok[:, None] & dmask[None, :]
        v_off = page[:, None] * stride_vb + (slot * stride_vs + kvh * stride_vh)[:, None] + d[None, :]
        v1 = tl.load(V + v_off, mask=kvmask, other=0.0)
        v2 = tl.load(V + v_off + HALF, mask=kvmask, other=0.0)
        if PARTIAL:
            r_off = page[:, None] * stride_vb + (slot * stride_vs + kvh * stride_vh)[:, None] + r[None, :]
            v1r = tl.load(V + r_off, mask=ok[:, None], other=0.0)
            v2r = tl.load(V + r_off + HALF, mask=ok[:, None], other=0.0)
            k1r, k2r = _keys_at(v1r, v2r, w1r, w2r, invr, pos)
            a1r, a2r = _tile_query(is_sink, q1r, q2r, z1r, z2r, MODE)
            qk = _dot(q1, tl.trans(v1), PREC, DOT_F32) + _dot(q2, tl.trans(v2), PREC, DOT_F32)
            qk += _dot(a1r, tl.trans(k1r.to(q1.dtype)), PREC, DOT_F32)
            qk += _dot(a2r, tl.trans(k2r.to(q1.dtype)), PREC, DOT_F32)
        else:
            if K_EQ_V:
                k1, k2 = _keys_at(v1, v2, w1, w2, inv, pos)
                k1 = k1.to(q1.dtype)
                k2 = k2.to(q1.dtype)
            else:
                k1, k2 = _cached_keys(K, page, slot, kvh, d, kvmask, stride_kb, stride_ks, stride_kh, HALF)
            a1, a2 = _tile_query(is_sink, q1, q2, z1, z2, MODE)
            qk = _dot(a1, tl.trans(k1), PREC, DOT_F32) + _dot(a2, tl.trans(k2), PREC, DOT_F32)
        s = _scores(qk, scale, softcap, SOFTCAP)
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pv = p.to(v1.dtype)
        acc1 = acc1 * alpha[:, None] + _dot(pv, v1, PREC, DOT_F32)
        acc2 = acc2 * alpha[:, None] + _dot(pv, v2, PREC, DOT_F32)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o1 = acc1 / l_safe[:, None]
    o2 = acc2 / l_safe[:, None]
    lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))  # log2 domain
    if DIRECT:
        o_ptr = Out + row.to(tl.int64) * stride_os + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptr, o1.to(Out.dtype.element_ty), mask=qmask)
        tl.store(o_ptr + HALF, o2.to(Out.dtype.element_ty), mask=qmask)
    else:
        o_ptr = MidO + row.to(tl.int64) * stride_ms + head[:, None] * stride_mh + split * (2 * HALF) + d[None, :]
        tl.store(o_ptr, o1, mask=qmask)
        tl.store(o_ptr + HALF, o2, mask=qmask)
        tl.store(MidLse + row.to(tl.int64) * stride_ls + head * stride_lh + split, lse, mask=hmask)


@triton.jit(do_not_specialize=["rows", "n_keys", "stride_cp", "stride_cb", "stride_cs", "stride_sp", "stride_sr",
                               "stride_sj", "stride_bt", "stride_ix"])
def _stage_kernel(Cache, Stage, BlockTables, Index, Lens, rows, n_keys,
                  stride_cp, stride_cb, stride_cs, stride_sp, stride_sr, stride_sj, stride_bt, stride_ix,
                  KV: tl.constexpr, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, PAGE: tl.constexpr,
                  BLOCK_J: tl.constexpr):
    """Stage[:, r, j] = the token at position Index[r, j] of row r's paged cache (all its KV heads, WIDTH
    contiguous elements), for the real entries (-1 and positions >= Lens[r] are skipped). A few programs
    each loop over (row, tile of BLOCK_J entries): reading host memory over PCIe, a small grid keeps most
    SMs for the layers computing meanwhile."""
    w = tl.arange(0, BLOCK_W)
    wm = w < WIDTH
    tiles = tl.cdiv(n_keys, BLOCK_J)
    for t in range(tl.program_id(0), rows * tiles, tl.num_programs(0)):
        r = t // tiles
        j = (t % tiles) * BLOCK_J + tl.arange(0, BLOCK_J)
        jm = j < n_keys
        length = tl.load(Lens + r)
        pos = tl.load(Index + r.to(tl.int64) * stride_ix + j, mask=jm, other=-1)
        ok = jm & (pos >= 0) & (pos < length)
        page = tl.load(BlockTables + r.to(tl.int64) * stride_bt + pos // PAGE, mask=ok, other=0).to(tl.int64)
        src = page[:, None] * stride_cb + (pos % PAGE).to(tl.int64)[:, None] * stride_cs + w[None, :]
        dst = r.to(tl.int64) * stride_sr + j.to(tl.int64)[:, None] * stride_sj + w[None, :]
        m = ok[:, None] & wm[None, :]
        for p in tl.static_range(KV):
            x = tl.load(Cache + p * stride_cp + src, mask=m, other=0.0)
            tl.store(Stage + p * stride_sp + dst, x, mask=m)


@triton.jit(do_not_specialize=["n_keys", "stride_cp", "stride_cb", "stride_cs", "stride_sp", "stride_sr",
                               "stride_sj", "stride_bt", "stride_ix"])
def _stage_current_kernel(Cache, Stage, BlockTables, Index, Lens, n_keys,
                          stride_cp, stride_cb, stride_cs, stride_sp, stride_sr, stride_sj, stride_bt, stride_ix,
                          KV: tl.constexpr, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, PAGE: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    """Row r's own token (position Lens[r] - 1, whose KV its layer writes after the picks were staged) into
    the entry of Stage that lists it. Grid: (rows,)."""
    r = tl.program_id(0)
    length = tl.load(Lens + r)
    k = tl.arange(0, BLOCK_K)
    idx = tl.load(Index + r.to(tl.int64) * stride_ix + k, mask=k < n_keys, other=-1)
    j = tl.max(tl.where((idx == length - 1) & (idx >= 0), k, -1), 0)
    pos = tl.maximum(length - 1, 0)
    w = tl.arange(0, BLOCK_W)
    m = (w < WIDTH) & (j >= 0)
    page = tl.load(BlockTables + r.to(tl.int64) * stride_bt + pos // PAGE).to(tl.int64)
    src = page * stride_cb + (pos % PAGE) * stride_cs + w
    dst = r.to(tl.int64) * stride_sr + tl.maximum(j, 0).to(tl.int64) * stride_sj + w
    for p in tl.static_range(KV):
        x = tl.load(Cache + p * stride_cp + src, mask=m, other=0.0)
        tl.store(Stage + p * stride_sp + dst, x, mask=m)


@triton.jit(do_not_specialize=["stride_rs", "stride_rh", "stride_es", "stride_sc"])
def _filter_sum_kernel(Raw, Lse, Lens, Score, width, stride_rs, stride_rh, stride_es, stride_sc,
                       HEADS: tl.constexpr, BLOCK_HH: tl.constexpr, BLOCK: tl.constexpr):
    """Score[row, pos] = sum over the heads of exp2(Raw[row, head, pos] - Lse[row, head]) (each head's
    attention probability), 0 at positions >= the row's length. Grid: (rows, tiles of BLOCK positions)."""
    row = tl.program_id(0)
    pos = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    length = tl.load(Lens + row)
    ok = pos < length
    hh = tl.arange(0, BLOCK_HH)
    hm = hh < HEADS
    lse = tl.load(Lse + row.to(tl.int64) * stride_es + hh, mask=hm, other=0.0)
    m = hm[:, None] & ok[None, :]
    raw = tl.load(Raw + row.to(tl.int64) * stride_rs + hh[:, None] * stride_rh + pos[None, :], mask=m,
                  other=float("-inf"))
    total = tl.sum(tl.where(m, tl.exp2(raw - lse[:, None]), 0.0), 0)
    tl.store(Score + row.to(tl.int64) * stride_sc + pos, total, mask=pos < width)


# ----------------------------------------------------------------------------------------------------
# host side


def _rope_args(q, k_eq_v, k_norm_weight, inv_freq, head_dim):
    if not k_eq_v:
        return q, q  # unused placeholders
    assert k_norm_weight is not None and inv_freq is not None, "K=V needs k_norm_weight and inv_freq"
    return (k_norm_weight.to(q.device).contiguous(), inv_freq.to(device=q.device, dtype=torch.float32).contiguous())


def sparse_decode(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, lens: torch.Tensor, *, mode: int,
                  scale: float, num_kv_heads: int, head_dim: int, softcap: float | None = None,
                  k_eq_v: bool = False, k_norm_weight: torch.Tensor | None = None,
                  inv_freq: torch.Tensor | None = None, index: torch.Tensor | None = None,
                  q_shift: torch.Tensor | None = None, sink: int = 0, window: int = 0,
                  tab_rows: torch.Tensor | None = None, rotated_pairs: int | None = None,
                  out: torch.Tensor | None = None, num_splits: int | None = None,
                  block_n: int | None = None, policy: AttnLaunch | None = None, staged: bool = False) -> torch.Tensor:
    """One query per row, attending to the keys its mode lists (module doc; INDEX or STREAMING). q: [rows,
    heads(*head_dim)]; lens: [rows] int32, keys at positions < lens (the query's position + 1); tab_rows:
    [rows] int32 block-table row of each query row (default: the row itself); index: [rows, budget] int32
    (MODE 1); q_shift: q as the sinks see it (MODE 2); rotated_pairs (K=V): inv_freq's nonzero angles, for
    the partial rebuild (None: all); policy: the launch (default attention_launch_policy's; num_splits and
    block_n override it); staged (INDEX): `cache` is the rows' staging buffer [kv, rows, budget, kv_heads,
    head_dim] that stage_picks filled, not the paged cache (block_tables unused). Returns [rows, heads,
    head_dim]."""
    rows = lens.shape[0]
    q = q.reshape(rows, -1, head_dim)
    assert q.stride(-1) == 1
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    assert group * num_kv_heads == num_heads and head_dim % 2 == 0
    k_cache, v_cache = cache[0], cache[-1]
    page = 1 if staged else cache.shape[2]
    assert page & (page - 1) == 0, "page size must be a power of two"
    knw, inv = _rope_args(q, k_eq_v, k_norm_weight, inv_freq, head_dim)
    assert mode in (INDEX, STREAMING), "dense rows (OmniKV filter layers) go through filter_decode"
    assert not staged or (mode == INDEX and tab_rows is None and cache.shape[1] >= rows
                          and cache.shape[2] == index.shape[1]), "a staged read lists each row's picks in order"
    if mode == INDEX:
        assert index is not None and index.shape[0] >= rows and index.stride(-1) == 1
        width = index.shape[1]
    else:
        assert q_shift is not None and window >= 1
        q_shift = q_shift.reshape(rows, -1, head_dim)
        width = sink + window
    half = head_dim // 2
    rot = rotated_block(rotated_pairs, half) if k_eq_v else half
    pol = policy or attention_launch_policy(rows, width, head_dim, num_kv_heads=num_kv_heads, k_eq_v=k_eq_v,
                                            rotated_pairs=rotated_pairs)
    splits = max(1, num_splits or pol.num_splits)
    bn = block_n or pol.block_n
    if out is None:
        out = torch.empty(rows, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if rows == 0:
        return out
    direct = splits == 1
    if direct:
        mid_o, mid_lse = out, out
    else:
        mid_o = torch.empty(rows, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(rows, num_heads, splits, dtype=torch.float32, device=q.device)
    qs = q_shift if q_shift is not None else q
    ix = index if index is not None else lens
    tr = tab_rows if tab_rows is not None else lens
    _sparse_decode_kernel[(rows, num_kv_heads, splits)](
        q, qs, k_cache, v_cache, block_tables, tr, lens, ix, knw, inv, out, mid_o, mid_lse,
        q.stride(0), q.stride(1), qs.stride(0), qs.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), ix.stride(0),
        out.stride(0), out.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_lse.stride(0), mid_lse.stride(1),
        float(scale), float(softcap or 1.0), int(index.shape[1] if mode == INDEX else 0), int(sink), int(window),
        splits,
        MODE=mode, ROWMAP=tab_rows is not None,
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HALF=half, BLOCK_D=triton.next_power_of_2(half),
        PAGE=page, BLOCK_N=bn, SOFTCAP=softcap is not None, K_EQ_V=k_eq_v, DIRECT=direct,
        PREC=dot_precision(q.dtype), DOT_F32=dot_f32(q.dtype), ROT=rot, PARTIAL=k_eq_v and rot < half,
        STAGED=staged, num_warps=pol.num_warps, num_stages=pol.num_stages,
    )
    if not direct:
        combine_splits(mid_o, mid_lse, out)
    return out


STAGED_READS = 0  # sparse-layer launches (not graph replays) that read staged picks; tests pin the path
STAGE_PROGRAMS = 32  # stage_picks' grid: enough reads in flight for PCIe, most SMs left to the layers


def _stage_args(cache: torch.Tensor, stage: torch.Tensor, tables: torch.Tensor, index: torch.Tensor):
    kv, _, page, kvh, d = cache.shape
    assert stage.shape[0] == kv and stage.shape[3:] == (kvh, d) and stage.shape[2] == index.shape[1]
    assert cache.stride(3) == d and cache.stride(4) == 1 and stage.stride(3) == d and stage.stride(4) == 1
    assert page & (page - 1) == 0 and index.stride(-1) == 1
    args = (cache.stride(0), cache.stride(1), cache.stride(2), stage.stride(0), stage.stride(1), stage.stride(2),
            tables.stride(0), index.stride(0))
    return args, dict(KV=kv, WIDTH=kvh * d, BLOCK_W=triton.next_power_of_2(kvh * d), PAGE=page)


def stage_picks(cache: torch.Tensor, stage: torch.Tensor, tables: torch.Tensor, index: torch.Tensor,
                lens: torch.Tensor, programs: int | None = None) -> None:
    """OmniKV offload: copy each row's picked tokens (index [rows, budget], positions < lens) from the paged
    cache `cache` [kv, blocks, page, kv_heads, head_dim] (pinned host memory the device maps) into
    stage[:, row] [kv, rows, budget, kv_heads, head_dim], entry j at j; entries that list nothing are left
    as they were (a staged read skips them too)."""
    rows = lens.shape[0]
    if rows == 0:
        return
    args, kw = _stage_args(cache, stage, tables, index)
    block_j = max(1, min(32, 8192 // kw["BLOCK_W"]))  # 8K elements a load: no spills (ptxas, sm_90a)
    tiles = rows * triton.cdiv(index.shape[1], block_j)
    _stage_kernel[(max(1, min(tiles, programs or STAGE_PROGRAMS)),)](
        cache, stage, tables, index, lens, rows, index.shape[1], *args, BLOCK_J=block_j, **kw, num_warps=4)


def stage_current(cache: torch.Tensor, stage: torch.Tensor, tables: torch.Tensor, index: torch.Tensor,
                  lens: torch.Tensor) -> None:
    """Each row's own token (position lens - 1) from `cache` into the staging entry that lists it: the layer
    writes that token's KV after its picks were staged."""
    rows = lens.shape[0]
    if rows == 0:
        return
    args, kw = _stage_args(cache, stage, tables, index)
    _stage_current_kernel[(rows,)](cache, stage, tables, index, lens, index.shape[1], *args,
                                   BLOCK_K=triton.next_power_of_2(index.shape[1]), **kw, num_warps=4)


def filter_decode(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, lens: torch.Tensor, *,
                  scale: float, num_kv_heads: int, head_dim: int, softcap: float | None = None,
                  k_eq_v: bool = False, k_norm_weight: torch.Tensor | None = None,
                  inv_freq: torch.Tensor | None = None, rotated_pairs: int | None = None,
                  out: torch.Tensor | None = None, num_splits: int | None = None,
                  policy: AttnLaunch | None = None, raw_dtype: torch.dtype = torch.float32
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """An OmniKV filter layer's decode rows (row r at position lens[r] - 1 of block-table row r): dense
    attention, and each position's attention probability summed over the heads. Returns (out [rows, heads,
    head_dim], score [rows, block-table width x page] float32, 0 past a row's length). One pass over the
    keys: the dense decode kernel stores the scores and log-sum-exps, _filter_sum_kernel turns them into
    probabilities (reading 4 bytes a head a position, not the keys again). raw_dtype float16 halves what the
    dense kernel stores per key (an A/B of what storing costs, sparse_attention_kernel.py --filter-sweep;
    the engine stores float32)."""
    rows = lens.shape[0]
    page = cache.shape[2]
    width = block_tables.shape[1] * page
    num_heads = q.shape[-1] // head_dim if q.dim() == 2 else q.shape[1]
    raw = torch.empty(rows, num_heads, width, dtype=raw_dtype, device=q.device)
    lse = torch.empty(rows, num_heads, dtype=torch.float32, device=q.device)
    score = torch.empty(rows, width, dtype=torch.float32, device=q.device)
    pol = policy or attention_launch_policy(rows, width, head_dim, num_kv_heads=num_kv_heads, k_eq_v=k_eq_v,
                                            rotated_pairs=rotated_pairs)
    if num_splits is not None:
        pol = dataclasses.replace(pol, num_splits=num_splits)
    out = paged_decode(q, cache, block_tables, lens, scale=scale, softcap=softcap, k_eq_v=k_eq_v,
                       k_norm_weight=k_norm_weight, inv_freq=inv_freq, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, max_seq_len=width, policy=pol, out=out, rotated_pairs=rotated_pairs,
                       raw=raw, lse=lse)
    if rows:
        block = 256
        _filter_sum_kernel[(rows, triton.cdiv(width, block))](
            raw, lse, lens, score, width, raw.stride(0), raw.stride(1), lse.stride(0), score.stride(0),
            HEADS=num_heads, BLOCK_HH=triton.next_power_of_2(num_heads), BLOCK=block, num_warps=4)
    return out, score


# ----------------------------------------------------------------------------------------------------
# the provider


def _meta_tensors(meta, device) -> tuple[torch.Tensor, torch.Tensor]:
    if meta.seq_lens_tensor is None:
        meta.seq_lens_tensor = torch.tensor(meta.seq_lens, dtype=torch.int32, device=device)
    if meta.query_start_loc_tensor is None:
        meta.query_start_loc_tensor = torch.tensor(meta.query_start_loc, dtype=torch.int32, device=device)
    return meta.seq_lens_tensor, meta.query_start_loc_tensor


def _kw(spec, source) -> dict:
    return dict(scale=spec.scale, softcap=spec.softcap, k_eq_v=source.k_eq_v, k_norm_weight=source.k_norm_weight,
                inv_freq=source.inv_freq, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                rotated_pairs=source.rotated_pairs if source.k_eq_v else None)


def _key(spec, source, dtype, mode: int) -> tuple:
    rot = source.rotated_pairs if source.k_eq_v else None  # the partial rebuild (every mode)
    return (dtype, spec.head_dim, spec.num_heads // spec.num_kv_heads, spec.num_kv_heads, spec.softcap is not None,
            source.k_eq_v, mode, rot)


def _mode(spec) -> int:
    return STREAMING if spec.sink_tokens else (DENSE if spec.omnikv == "filter" else INDEX)


def _rows(q, out, spec, source, cache, tables, lens, sm, tab_rows=None, index_rows=None, staged=None):
    """Decode attention for query rows q [rows, H * D] (row r at position lens[r] - 1, in block-table row
    tab_rows[r], default r) into out [rows, H, D]; OmniKV filter layers also write the rows' pick into the
    index buffer (rows index_rows of it, default the first rows). staged: an offloaded sparse layer's
    staging buffer, which a filter layer filled with these rows' picks (_stage_after_filter)."""
    rows = lens.shape[0]
    kw = _kw(spec, source)
    mode = _mode(spec)
    MONITOR.note("sparse_decode", _key(spec, source, q.dtype, mode))
    if mode == STREAMING:
        q_shift = _streaming_shift(q.view(rows, spec.num_heads, spec.head_dim), (lens.long() - 1), spec)
        sparse_decode(q, cache, tables, lens, mode=mode, q_shift=q_shift, sink=spec.sink_tokens,
                      window=spec.sliding_window, tab_rows=tab_rows, out=out, **kw)
    elif mode == INDEX:
        index = sm.index[:rows] if index_rows is None else sm.index[index_rows]
        if staged is not None:
            global STAGED_READS
            STAGED_READS += 1
            MONITOR.note("sparse_decode", _key(spec, source, q.dtype, mode) + ("staged",))
            stage_current(cache, staged, tables, index, lens)
            sparse_decode(q, staged, tables, lens, mode=mode, index=index, out=out, staged=True, **kw)
        else:
            sparse_decode(q, cache, tables, lens, mode=mode, index=index, tab_rows=tab_rows, out=out, **kw)
    else:
        if tab_rows is not None:  # the decode rows of a mixed step (eager): their sequences' block-table rows
            tables = tables.index_select(0, tab_rows.long())
        _, score = filter_decode(q.reshape(rows, -1), cache, tables, lens, out=out, **kw)
        width = score.shape[1]
        pos = torch.arange(width, device=q.device)[None].expand(rows, -1)
        lens64 = lens.long()
        chosen = omnikv_select(score, pos, pos < lens64[:, None], lens64, sm.budget, sm.sink, sm.recent,
                               sm.tp_group_name)
        if index_rows is None:
            sm.index[:rows].copy_(chosen)
        else:
            sm.index[index_rows] = chosen


_SIDE: dict[str, tuple[torch.cuda.Stream, dict[int, torch.cuda.Event]]] = {}


def _side_stream(device: torch.device) -> tuple[torch.cuda.Stream, dict[int, torch.cuda.Event]]:
    """The stream the offloaded picks are staged on, and one event per cache layer (reused every step)."""
    key = str(device)
    if key not in _SIDE:
        _SIDE[key] = (torch.cuda.Stream(device), {})
    return _SIDE[key]


def _stage_after_filter(ctx, layer_idx: int, lens: torch.Tensor, sm) -> None:
    """OmniKV offload, after a filter layer's pick (a step of decode rows): the picked tokens of every
    offloaded cache that the sparse layers up to the next filter layer read are copied from host memory
    to their device staging buffers, on a side stream (CUDA) so that the PCIe reads overlap the layers
    in between; sm.staged_picks tells each sparse layer what to wait for. The runtime allocates the buffers at
    start (sm.staging); a staged read then costs device bandwidth, not PCIe (session 15: 1.66 ms
    against 0.08 for 16 rows x 2,048 picks read from host memory inside the kernel)."""
    targets = []
    for i in sorted(ctx.layers):
        s = ctx.layers[i]
        if i <= layer_idx or s.omnikv is None:
            continue
        if s.omnikv == "filter":
            break
        src = s.cache_layer
        if ctx.layers[src].offloaded and src not in targets and src in ctx.kv_caches:
            targets.append(src)
    if not targets:
        return
    rows = lens.shape[0]
    index = sm.index[:rows]
    cuda = lens.device.type == "cuda"
    if cuda:
        side, events = _side_stream(lens.device)
        side.wait_stream(torch.cuda.current_stream(lens.device))
    with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
        for src in targets:
            sp, cache = ctx.layers[src], ctx.kv_caches[src]
            buf = sm.staging.get(src)
            if buf is None or buf.shape[1] < rows:  # (the runtime allocates them at start; kernel tests here)
                buf = sm.staging[src] = staging_buffer(rows, sm.budget, cache.shape[0], sp.num_kv_heads,
                                                       sp.head_dim, cache.dtype, lens.device)
            stage_picks(cache, buf, ctx.attn_metadata.groups[sp.kv_group].block_tables, index, lens)
            event = None
            if cuda:
                event = events.setdefault(src, torch.cuda.Event())
                event.record(side)
            sm.staged_picks[src] = (buf, event)


def _staged_for(spec, sm, device) -> torch.Tensor | None:
    """A sparse layer's staging buffer if a filter layer staged its picks this step (the current stream
    then waits for the copy), else None (the kernel reads the cache itself)."""
    entry = sm.staged_picks.get(spec.cache_layer) if spec.omnikv == "sparse" else None
    if entry is None:
        return None
    buf, event = entry
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)
    return buf


def gather_blocks(cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks these rows' first lens tokens sit in, copied from `cache` (OmniKV offload: pinned host
    memory the device maps) into a device cache of their own, and the tables renumbered to it (-1 past a
    row's blocks): a prefill chunk then reads its context from device memory, each block brought over
    once, instead of once per query tile over PCIe."""
    page = cache.shape[2]
    need = (lens.long() + page - 1) // page
    held = torch.arange(tables.shape[1], device=tables.device)[None, :] < need[:, None]
    ids, local = torch.unique(tables[held].long(), return_inverse=True)
    renum = torch.full_like(tables, -1)
    renum[held] = local.to(tables.dtype)
    return cache.index_select(1, ids.to(cache.device)), renum


def _prefill_rows(q, out, spec, source, cache, tables, meta, seq_lens, qsl, skip: set[int]) -> None:
    """OmniKV's dense prefill kernel for the rows of a step that are not sparse decode rows (those go through
    the sparse kernel afterwards and are not computed here); an offloaded layer's context is first gathered
    to the device (gather_blocks)."""
    n = len(meta.seq_lens)
    rows = [i for i in range(n) if i not in skip]
    if not rows:
        return
    kw = _kw(spec, source)
    kw.pop("rotated_pairs")
    if len(rows) == n and not source.offloaded:
        paged_prefill(q, cache, tables, qsl, seq_lens, out=out, sliding_window=None, **kw)
        return
    loc = meta.query_start_loc
    tok = torch.tensor([t for i in rows for t in range(loc[i], loc[i + 1])], device=q.device)
    sub_qsl = [0]
    for i in rows:
        sub_qsl.append(sub_qsl[-1] + loc[i + 1] - loc[i])
    idx = torch.tensor(rows, device=q.device)
    sub_tables, sub_lens = tables.index_select(0, idx), seq_lens.index_select(0, idx)
    if source.offloaded:
        cache, sub_tables = gather_blocks(cache, sub_tables, sub_lens)
    part = paged_prefill(q.index_select(0, tok), cache, sub_tables,
                         torch.tensor(sub_qsl, dtype=torch.int32, device=q.device), sub_lens,
                         sliding_window=None, **kw)
    out[tok] = part.view(len(tok), *out.shape[1:])


def attention(q: torch.Tensor, layer_idx: int) -> torch.Tensor:
    """The op's Triton provider (q: [tokens, H * D], padding rows past the last sequence come back as zeros).
    Every row one decode token: one launch over the rows (plus the scoring kernel and the top-k on filter
    layers), static shapes. Otherwise, OmniKV: the dense prefill kernel for the prefill rows' tokens (an
    offloaded layer's context gathered to the device first), the decode rows through the sparse path;
    StreamingLLM: each new token is a query row of its own."""
    ctx, spec, cache, group = layer_cache(layer_idx)
    source = ctx.layers[spec.cache_layer]
    meta = ctx.attn_metadata
    sm = ctx.extra.get(SPARSE_KEY)
    if spec.omnikv is not None and sm is None:
        raise RuntimeError("OmniKV layers need the runtime's sparse metadata in the forward context")
    seq_lens, qsl = _meta_tensors(meta, q.device)
    n = len(meta.seq_lens)
    if spec.omnikv is not None and sm.index is None:
        sm.index = index_buffer(max(n, seq_lens.shape[0]), sm.budget, q.device)
    h, d = spec.num_heads, spec.head_dim
    out = torch.zeros(q.shape[0], h, d, dtype=q.dtype, device=q.device)
    tables = group.block_tables
    if meta.query_start_loc[-1] == n and (spec.omnikv is None or sm.all_decode):
        rows = seq_lens.shape[0]
        staged = _staged_for(spec, sm, q.device) if spec.omnikv is not None else None
        _rows(q[:rows], out[:rows], spec, source, cache, tables, seq_lens, sm, staged=staged)
        if spec.omnikv == "filter":
            _stage_after_filter(ctx, layer_idx, seq_lens, sm)
    elif spec.omnikv is not None:
        MONITOR.note("paged_prefill", (q.dtype, d, h // spec.num_kv_heads, False, spec.softcap is not None,
                                       source.k_eq_v))
        dec = [i for i in range(n) if sm.decode[i] and meta.query_start_loc[i + 1] - meta.query_start_loc[i] == 1]
        _prefill_rows(q, out, spec, source, cache, tables, meta, seq_lens, qsl, skip=set(dec))
        if dec:
            tok = torch.tensor([meta.query_start_loc[i] for i in dec], device=q.device)
            idx = torch.tensor(dec, device=q.device)
            part = torch.empty(len(dec), h, d, dtype=q.dtype, device=q.device)
            _rows(q[tok], part, spec, source, cache, tables, seq_lens[idx], sm, tab_rows=idx.int(), index_rows=idx)
            out[tok] = part
    else:  # StreamingLLM prefill (chunks, mixed batches): every new token is a row with its own sinks and window
        seq_of, lens = [], []
        for i, L in enumerate(meta.seq_lens):
            m = meta.query_start_loc[i + 1] - meta.query_start_loc[i]
            seq_of.extend([i] * m)
            lens.extend(range(L - m + 1, L + 1))
        t = len(lens)
        _rows(q[:t], out[:t], spec, source, cache, tables, torch.tensor(lens, dtype=torch.int32, device=q.device),
              sm, tab_rows=torch.tensor(seq_of, dtype=torch.int32, device=q.device))
    return out.view(q.shape[0], h * d)


# ---- JIT warm-up ---------------------------------------------------------------------------------


def _keys(facts: dict) -> list:
    dtype, keys = facts["dtype"], set()
    layers = facts.get("layers", {})
    every = facts.get("all_layers", layers)
    for spec in layers.values():
        if spec.sink_tokens or spec.omnikv is not None:
            source = every[spec.cache_layer]
            key = ("sparse_decode",) + _key(spec, source, dtype, _mode(spec))
            keys.add(key)
            if spec.omnikv == "sparse" and source.offloaded:  # decode steps read staged picks (offload)
                keys.add(key + ("staged",))
    return sorted(keys, key=repr)


SPLIT_BUILDS = [1 << i for i in range(7)]  # the launch policy's split counts, 1 to 64


def _compile(key, device) -> None:
    """Each mode's direct and split-K builds (and the combine kernel), on a throwaway cache; filter layers:
    the dense decode kernel with its raw scores, and the head-sum kernel."""
    _, dtype, head_dim, group, kv_heads, softcap, k_eq_v, mode, rot = key[:9]
    staged = key[9:] == ("staged",)
    page, width, rows = 16, 64, 2
    cache = torch.zeros(1 if k_eq_v else 2, width, page, kv_heads, head_dim, dtype=dtype, device=device)
    tables = torch.zeros(rows, width, dtype=torch.int32, device=device)
    lens = torch.full((rows,), page * width, dtype=torch.int32, device=device)
    q = torch.zeros(rows, kv_heads * group * head_dim, dtype=dtype, device=device)
    kw = dict(scale=1.0, softcap=30.0 if softcap else None, k_eq_v=k_eq_v, num_kv_heads=kv_heads, head_dim=head_dim,
              k_norm_weight=torch.ones(head_dim, dtype=dtype, device=device) if k_eq_v else None,
              inv_freq=torch.zeros(head_dim // 2, device=device) if k_eq_v else None, rotated_pairs=rot)
    if mode == DENSE:
        for splits in SPLIT_BUILDS:  # direct, and the combine's build at each power-of-two split count
            filter_decode(q, cache, tables, lens, num_splits=splits, **kw)
        return
    extra = {}
    if mode == INDEX:
        extra["index"] = torch.zeros(rows, 64, dtype=torch.int32, device=device)
    if staged:  # the staging copies and the kernel's staged read (OmniKV offload)
        stage = torch.zeros(cache.shape[0], rows, 64, kv_heads, head_dim, dtype=dtype, device=device)
        stage_picks(cache, stage, tables, extra["index"], lens)
        stage_current(cache, stage, tables, extra["index"], lens)
        for splits in SPLIT_BUILDS:
            sparse_decode(q, stage, tables, lens, mode=mode, num_splits=splits, staged=True, **extra, **kw)
        return
    elif mode == STREAMING:
        extra.update(q_shift=q, sink=4, window=60)
    for tab_rows in (None, lens * 0):  # decode rows; rows mapped to block-table rows (prefill steps)
        for splits in SPLIT_BUILDS:
            sparse_decode(q, cache, tables, lens, mode=mode, num_splits=splits, tab_rows=tab_rows, **extra, **kw)


register_kernel(JitKernel("sparse_decode", "sparse_attention", "triton", _keys, _compile))
