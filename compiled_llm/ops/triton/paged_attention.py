"""Paged attention kernels for the layers FlashInfer does not serve (head_dim 512, K=V global layers).

Cache per layer: [2 (K, V) or 1 (K=V), num_blocks, block_size, num_kv_heads, head_dim]. Block tables
[num_seqs, max_blocks] int32, -1 where a block was released (only ever outside the window, never read).
Query at position p sees keys j with p - W < j <= p (W = sliding window, or everything when None).
K=V layers cache only v (normalised, unrotated); keys are rebuilt in-kernel as rope(v * k_norm_weight).

Both kernels work on head_dim split into two halves (the rotate-half pairs), so the K=V rebuild needs no
shuffles and head_dim 512 is processed as two 256-wide chunks. One program owns one KV head and all
the query heads of its GQA group, so every K/V tile is read once per group (prefill with split_d: two, one
per output half, each computing the full scores, so that a head_dim-512 tile keeps a 256-wide accumulator). On
Hopper the head_dim-512 K=V prefill runs gluon_prefill.py's kernel instead, over the dense buffers the key rebuild
fills here: it holds the whole 512-wide output and computes the scores once.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents
from triton.tools.tensor_descriptor import TensorDescriptor

from compiled_llm.ops.rope import rotated_block  # noqa: F401  (the decode kernel's ROT; sparse_attention imports it here)
from compiled_llm.ops.triton import _common, gluon_prefill
from compiled_llm.ops.triton.qk_norm_rope import _norm, _norm_rope_rows, _rot_keys, _rstd_rows
from compiled_llm.ops.triton._common import (LAST_COMBINE, _dot, _reduce_angle, _tanh, decode_pdl_steps, dot_f32,
                                             dot_precision)

log = logging.getLogger("compiled_llm")

# Per-step integers (split counts, batch sizes, block-table width) are marked do_not_specialize so that a
# new value never triggers a fresh build mid-serving (Triton would otherwise specialise on ==1 / %16).


# ----------------------------------------------------------------------------------------------------
# launch policy


@dataclass(frozen=True)
class AttnLaunch:
    num_splits: int = 1  # decode: split-K chunks per (sequence, KV head)
    block_n: int = 32  # keys per tile (independent of the page size)
    block_m: int = 64  # prefill: rows per program = query tokens x query heads of one GQA group
    num_warps: int = 4
    num_stages: int = 2
    # prefill: two programs per (query tile, KV head), one per half of the output's head_dim; both compute the
    # full scores (twice the QK^T work) but each keeps one [block_m, head_dim/2] accumulator, so larger tiles
    # fit. Not for K=V layers whose keys are rebuilt in the loop (that needs both halves of v): ignored there.
    split_d: bool = False
    # prefill: the key tiles that every row of the query tile sees whole (inside the causal edge and the window,
    # none past the last key) run without the position masks; only the edge tiles build and apply them
    interior: bool = True
    # prefill, K=V layers with the dense rebuilt keys (no window): the key and value tiles through TMA
    # descriptors over dense [sequences x positions, kv_heads x head_dim] buffers (the values copied there by
    # the key rebuild), not per-thread loads through the registers and the block table; sm_90+ (or the
    # interpreter), else ignored
    tma: bool = False
    # prefill, head_dim-512 K=V layers with the dense rebuilt keys: the Gluon kernel (gluon_prefill.py; 64-row CTAs
    # holding the whole 512-wide output, the scores computed once); Hopper (sm_90) only, without a window or a
    # soft-cap, else PREFILL_D512_TMA (with a warning on a GPU)
    gluon: bool = False


# a d=512 prefill whose keys are rebuilt in the loop cannot split the output (the rebuild needs all of v)
UNSPLIT_D512 = AttnLaunch(block_m=64, block_n=32, num_warps=8, num_stages=2)
# the d=512 K=V prefill on the dense rebuilt keys: 64-key tiles, one stage (the most shared memory allows with the
# loads staged through the registers); through TMA, 32-key tiles at two stages (H100, session 63, prefill_kernels
# --attn-tma, us: 1 x 8,192 3,944 / 4,043 against 4,126 / 4,119, 8 x 1,024 661 / 665 against 722 / 721, 1 x 4,096
# 1,092 against 1,159; the 32-key tile without TMA 4,418 at 8,192; end to end 8192x4x512 +0.35%, TTFT 8K -2%)
PREFILL_D512 = AttnLaunch(block_m=128, block_n=64, num_warps=8, num_stages=1, split_d=True)
PREFILL_D512_TMA = AttnLaunch(block_m=128, block_n=32, num_warps=8, num_stages=2, split_d=True, tma=True)
# the Gluon kernel: 64 rows, 64-key tiles, one stage (H100, session 64, one sequence, the kernel alone: 2,583 us at
# 8,192 tokens against PREFILL_D512_TMA's 3,937, 53.6 against 115.5 at 1,024)
PREFILL_D512_GLUON = AttnLaunch(block_m=64, block_n=64, num_warps=8, num_stages=1, gluon=True)


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


PREFILL_INTERIOR_ENV = "COMPILED_LLM_PREFILL_INTERIOR"  # 0: every prefill key tile masked (an A/B)
PREFILL_TMA_ENV = "COMPILED_LLM_PREFILL_TMA"  # 0: the d512 K=V prefill's tiles loaded through the registers (A/B)
PREFILL_GLUON_ENV = "COMPILED_LLM_PREFILL_GLUON"  # 0: the d512 K=V prefill on the Triton tile, not Gluon's (A/B)
ROT_TILE_ENV = "COMPILED_LLM_DECODE_ROT_TILE"  # 32: kept-keys decode on the rebuild's 32-key tiles (an A/B)
SPLIT_ROUND_ENV = "COMPILED_LLM_DECODE_SPLIT_ROUND"  # ceil: d<512 decode splits rounded up to a power of 2 (A/B)
KEY_TILE_ENV = "COMPILED_LLM_DECODE_KEY_TILE"  # 32 / 64: every d256 K!=V decode on that key tile (an A/B)


def attention_launch_policy(num_seqs: int, max_seq_len: int, head_dim: int, *, num_kv_heads: int = 1,
                            sliding_window: int | None = None, k_eq_v: bool = False, prefill: bool = False,
                            num_sms: int = 132, rotated_pairs: int | None = None, rot_keys: bool = False) -> AttnLaunch:
    """Tile sizes and split count. Pass a fixed max_seq_len (e.g. the block-table width x page size) to
    keep the choice stable across CUDA-graph replays. rot_keys: a K=V layer whose rows keep the rotated keys
    (AttentionSpec.rot_keys): decode reads them, no rebuild."""
    # Register/smem figures from ptxas (triton 3.8, sm_90a, bf16) are noted per choice.
    if prefill:
        # H200 sweep (benchmarks/NOTES.md, 2026-11-29): 64-row tiles halve the d=512 prefill (6.2 vs 12.1 ms
        # at 8192 tokens); 128x64 tiles are 15% faster than 64x32 at d=256. Session 17 (prefill_kernels.py):
        # at d=512 one program per output half with 128 x 64 tiles and one stage, 4.58 vs 6.20 ms at 8,192
        # tokens and 0.74 vs 0.91 ms at 8 x 1,024 (the only split tile that fits shared memory with 64 keys)
        interior = os.environ.get(PREFILL_INTERIOR_ENV, "1") != "0"
        if head_dim >= 512:  # K from the dense rebuilt buffer
            if os.environ.get(PREFILL_GLUON_ENV, "1") != "0":
                return PREFILL_D512_GLUON
            tma = os.environ.get(PREFILL_TMA_ENV, "1") != "0"
            return dataclasses.replace(PREFILL_D512_TMA if tma else PREFILL_D512, interior=interior)
        if head_dim >= 256:
            return AttnLaunch(block_m=128, block_n=64, num_warps=8, num_stages=2, interior=interior)
        return AttnLaunch(block_m=64, block_n=64, num_warps=4, num_stages=2, interior=interior)
    # K=V with a quarter of the angles rotating (Gemma 4's global layers): keys rebuilt for those dims only
    partial = k_eq_v and rotated_block(rotated_pairs, head_dim // 2) < head_dim // 2
    if head_dim >= 512:
        # K=V: the in-loop key rebuild keeps fp32 cos/sin tables live: 16-key tiles (248 regs, no spill;
        # 32-key tiles spill). K!=V, 32-key tiles: 196 regs. Partial rebuild: 32-key tiles, 2 stages (H200
        # sweep, session 13: 26.0 / 55.3 / 56.5 us at 8 x 1.1K / 8 x 4.4K / 4 x 8.5K against 28.2 / 75.5 /
        # 73.8 with 16-key tiles and 3 stages)
        block_n = 16 if k_eq_v and not partial else 32
    elif head_dim >= 256:
        # K!=V: ~100-120 regs at 32-key tiles. The sliding layers (their QK work inside the kernel) take 64-key
        # tiles: H100 sweep, session 51 (decode_attention.py --qk-sweep), us, 32 against 64: 1 x 1.1K 10.78 / 10.45,
        # 4 x 8.5K 19.70 / 19.59, 8 x 1.1K 32.24 / 32.31; end to end (session 52, alternating, two rounds) batch 1
        # +0.35%, 8192x4x512 +0.0%. A window-less d256 layer (Qwen3.5's full attention) was not measured: 32 there
        tile = os.environ.get(KEY_TILE_ENV, "auto")
        block_n = 16 if k_eq_v else int(tile) if tile != "auto" else 64 if sliding_window is not None else 32
    else:
        block_n = 32
    # H200 sweep: 2 stages 18% faster for d=256 decode
    warps, stages = 4, (2 if head_dim < 512 or partial else 3)
    ctx = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window)
    base = max(1, num_seqs * num_kv_heads)
    # H200 sweep at 26B-A4B shapes, 1 and 8 sequences (benchmarks/NOTES.md, 2026-12-01): short splits win
    # at small batches (d=512 K=V: 32 splits of ~35 keys took 23 us against 59 us for 4 splits of 256); the
    # heavier d=512 programs want about one wave, d=256 ones about two
    waves, min_keys = (1, 32) if head_dim >= 512 else (2, 64)
    # d<512: at most two waves, not up to four: since each program also norms and rotates its queries (the decode's
    # QK work), the sliding layers' kernel ran faster on half the splits (H100, session 51: 32.2 against 33.0 us at
    # 8 x 1.1K with 4, 19.7 against 20.7 at 4 x 8.5K with 8; one sequence is bound by min_keys)
    floor = head_dim < 512 and os.environ.get(SPLIT_ROUND_ENV, "floor") != "ceil"
    want = (_pow2_floor if floor else triton.next_power_of_2)(triton.cdiv(waves * num_sms, base))
    by_len = _pow2_floor(triton.cdiv(ctx, min_keys))
    splits = max(1, min(want, by_len, 64))
    if rot_keys and k_eq_v and head_dim >= 512 and os.environ.get(ROT_TILE_ENV, "64") != "32":
        # the kept keys free the rebuild's registers (sm_90: 148, no spill): 64-key tiles at 4 warps, 2 stages.
        # H200 (session 24, decode_attention.py --layers global, rot keys cached): 37.85 / 40.05 us against
        # 41.45 / 42.98 for the 32-key tiles at 8 x 4.4K / 4 x 8.5K, 12.32 against 12.49 at 1 x 1.1K, 3% slower
        # at 8 x 1.1K; one sequence keeps at most 32 splits
        return AttnLaunch(num_splits=min(splits, 32) if base <= 2 else splits, block_n=64, num_warps=4,
                          num_stages=2)
    if partial and head_dim >= 512 and base <= 2:
        # one sequence of Gemma 4's global layers (H200 sweep, session 23, decode_attention.py at 1 x 1.1K with
        # the engine's table bound): 32 splits of 64-key tiles at 8 warps, 16.64 us against 19.15 for 64 splits of
        # 32-key tiles at 4 (at 8 sequences equal, 26.27 / 26.46: the tiles above stay). ptxas sm_90: 238
        # registers, no spill (the 4-warp tile: 255 and a 56-byte spill)
        return AttnLaunch(num_splits=min(splits, 32), block_n=64, num_warps=8, num_stages=stages)
    return AttnLaunch(num_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages)


# ----------------------------------------------------------------------------------------------------
# device helpers


@triton.jit
def _rope_base(inv, BLOCK_N: tl.constexpr):
    # cos/sin of n * inv_freq for the key offsets n in one tile (tile-invariant, computed once per program)
    b = tl.arange(0, BLOCK_N).to(tl.float32)[:, None] * inv[None, :]
    b = _reduce_angle(b)
    return tl.cos(b), tl.sin(b)


@triton.jit
def _rebuild_keys(v1, v2, w1, w2, inv, cos_b, sin_b, kstart, like):
    """Keys of the tile at positions kstart + n from the K=V cache: rope(v * k_norm_weight), both halves, in
    the dtype of `like` (the query's, for the dot). cos/sin((kstart + n) f) via the angle-sum formula: only
    head_dim/2 transcendentals per tile."""
    ks = tl.zeros_like(inv) + kstart
    a = ks * inv
    a_err = tl.fma(ks, inv, -a)  # exact residual of the product, keeps large positions accurate
    a = _reduce_angle(a) + a_err
    ca = tl.cos(a)[None, :]
    sa = tl.sin(a)[None, :]
    c = ca * cos_b - sa * sin_b
    s = sa * cos_b + ca * sin_b
    x1 = v1.to(tl.float32) * w1[None, :]
    x2 = v2.to(tl.float32) * w2[None, :]
    return (x1 * c - x2 * s).to(like.dtype), (x2 * c + x1 * s).to(like.dtype)


@triton.jit
def _cached_keys(K, page, slot, kvh, d, kvmask, stride_kb, stride_ks, stride_kh, HALF: tl.constexpr):
    """Both halves of a tile's keys from the paged cache (K!=V layers): rows at (page, slot), head kvh."""
    k_off = page[:, None] * stride_kb + (slot * stride_ks + kvh * stride_kh)[:, None] + d[None, :]
    return tl.load(K + k_off, mask=kvmask, other=0.0), tl.load(K + k_off + HALF, mask=kvmask, other=0.0)


@triton.jit
def _scores(qk, scale, softcap, SOFTCAP: tl.constexpr):
    # log2-domain scores (exp2 in the softmax)
    if SOFTCAP:
        return _tanh(qk * (scale / softcap)) * (softcap * 1.4426950408889634)
    else:
        return qk * (scale * 1.4426950408889634)


# ----------------------------------------------------------------------------------------------------
# decode: one query token per sequence, split-K over the context


@triton.jit
def _write_new_kv(KNew, VNew, KNorm, K, V, Slots, seq, kvh, d, dmask, cos, sin, eps, norm_v, stride_kn, stride_knh,
                  stride_vn, stride_vnh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                  HALF: tl.constexpr, PAGE: tl.constexpr):
    """The decode's QK form (see _decode_kernel): the new token's key and value made from its rows as
    _qk_norm_rope_kernel makes them, stored at its slot (< 0: padding, nothing stored)."""
    slot = tl.load(Slots + seq)
    if slot >= 0:
        kp = KNew + seq * stride_kn + kvh * stride_knh + d
        w1 = tl.load(KNorm + d, mask=dmask, other=0.0).to(tl.float32)
        w2 = tl.load(KNorm + HALF + d, mask=dmask, other=0.0).to(tl.float32)
        k1, k2 = _norm(tl.load(kp, mask=dmask, other=0.0), tl.load(kp + HALF, mask=dmask, other=0.0), w1, w2, eps,
                       2 * HALF, True)
        k1 = k1.to(K.dtype.element_ty).to(tl.float32)
        k2 = k2.to(K.dtype.element_ty).to(tl.float32)
        vp = VNew + seq * stride_vn + kvh * stride_vnh + d
        v1 = tl.load(vp, mask=dmask, other=0.0).to(tl.float32)
        v2 = tl.load(vp + HALF, mask=dmask, other=0.0).to(tl.float32)
        if norm_v != 0:
            v1, v2 = _norm(v1, v2, v1, v2, eps, 2 * HALF, False)
        kc = K + (slot // PAGE) * stride_kb + (slot % PAGE) * stride_ks + kvh * stride_kh + d
        vc = V + (slot // PAGE) * stride_vb + (slot % PAGE) * stride_vs + kvh * stride_vh + d
        tl.store(kc, (k1 * cos - k2 * sin).to(K.dtype.element_ty), mask=dmask)
        tl.store(kc + HALF, (k2 * cos + k1 * sin).to(K.dtype.element_ty), mask=dmask)
        tl.store(vc, v1.to(V.dtype.element_ty), mask=dmask)
        tl.store(vc + HALF, v2.to(V.dtype.element_ty), mask=dmask)


@triton.jit
def _write_new_row(VNew, KNorm, InvFreq, V, Slots, Pos, seq, kvh, d, dmask, eps, stride_vn, stride_vnh, stride_vb,
                   stride_vs, stride_vh, HALF: tl.constexpr, PAGE: tl.constexpr, ROT: tl.constexpr):
    """The decode's QK form on a K=V layer whose rows keep rotated keys: the new token's row made from its value
    as _qk_norm_rope_kernel makes it (the value RMS-normed without weight, then its kept keys), stored at its slot
    (< 0: padding, nothing stored)."""
    slot = tl.load(Slots + seq)
    if slot >= 0:
        vp = VNew + seq * stride_vn + kvh * stride_vnh + d
        v1, v2 = _norm(tl.load(vp, mask=dmask, other=0.0), tl.load(vp + HALF, mask=dmask, other=0.0), 0.0, 0.0, eps,
                       2 * HALF, False)
        row = V + (slot // PAGE) * stride_vb + (slot % PAGE) * stride_vs + kvh * stride_vh + d
        tl.store(row, v1.to(V.dtype.element_ty), mask=dmask)
        tl.store(row + HALF, v2.to(V.dtype.element_ty), mask=dmask)
        k1, k2 = _rot_keys(v1, v2, KNorm, InvFreq, tl.load(Pos + seq).to(tl.float32), d, HALF, V.dtype.element_ty)
        tl.store(row + 2 * HALF, k1, mask=d < ROT)
        tl.store(row + 2 * HALF + ROT, k2, mask=d < ROT)


@triton.jit
def split_range(SeqLens, seq, split, window, num_splits, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr):
    """A decode split's key range [start, end) of sequence `seq`: a whole number of BLOCK_N tiles of the keys it
    sees (the window's, SLIDING), split `split` of num_splits."""
    seq_len = tl.load(SeqLens + seq)
    first = seq_len * 0
    if SLIDING:
        first = tl.maximum(seq_len - window, 0)
    chunk = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    start = first + split * chunk
    return start, tl.minimum(start + chunk, seq_len)


@triton.jit(do_not_specialize=["stride_bt", "num_splits", "norm_v"])
def _decode_kernel(
    Q, K, V, BlockTables, SeqLens, KNorm, InvFreq, Out, MidO, MidLse, Raw,
    stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_os, stride_oh,
    stride_ms, stride_mh, stride_ls, stride_lh, stride_rs, stride_rh,
    scale, softcap, window, num_splits,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, ROT: tl.constexpr, PARTIAL: tl.constexpr,
    SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, K_EQ_V: tl.constexpr, DIRECT: tl.constexpr, PREC: tl.constexpr,
    RAW: tl.constexpr = False, F32: tl.constexpr = False, ROT_CACHED: tl.constexpr = False,
    KNew=None, VNew=None, Pos=None, QW=None, Slots=None, stride_kn=0, stride_knh=0, stride_vn=0, stride_vnh=0,
    eps=0.0, norm_v=0, QK: tl.constexpr = False, QOut=None, stride_xs=0, stride_xh=0, GP: tl.constexpr = 1,
):
    # QK (DecodeQK): Q holds the step's query rows before their norm and RoPE, KNew / VNew its key and value rows
    # before theirs, KNorm / InvFreq the layer's k-norm weight and frequencies, QW the q-norm weight. Each program
    # normalises and rotates its group's query heads itself; the program whose split ends at the sequence's last
    # key first makes that key and value (k RMS-normed and rotated, v RMS-normed without weight when norm_v) and
    # stores them at the token's slot (Slots; < 0: padding, no store), then reads its keys as always: no earlier
    # launch writes the cache. The op qk_norm_rope_kv_write was, at decode, a launch of its own before this one
    # (ops/triton/qk_norm_rope.py defers it here). The new key at the end of the loop from registers instead took
    # 32 more registers (137, sm_90), a CTA fewer an SM at batch 8. With ROT_CACHED (K=V, no KNew) the new row is
    # the normed value and its kept keys (_write_new_row), and the rotated dims' queries are normed and rotated
    # from their raw rows.
    # QOut (with QK; the default, COMPILED_LLM_DECODE_QK=2): the write-back form. Each program normalises and
    # rotates only its group's GROUP real query heads ([GP, head_dim] tiles, not the BLOCK_H rows the dots pad them
    # to), stores them in QOut (the op's output; the programs of one group store the same values), and after the
    # barrier the plain kernel runs on QOut: the prologue's work is GROUP rows instead of BLOCK_H. Without QOut
    # (=1) the BLOCK_H rows are normalised in registers (a global layer's kernel ~4 us slower on the H100).
    # ROT_CACHED (with PARTIAL: AttentionSpec.rot_keys): each cached row keeps, after the value's 2 HALF
    # elements, the rotated keys of the first ROT dims of each half, [k1 | k2]: read, not rebuilt.
    # RAW (OmniKV filter layers, ops/triton/sparse_attention.py): also store every key's log2-domain score per
    # head, Raw[seq, head, pos], and the log-sum-exp (MidLse; the combine writes the total), so the tokens can
    # be ranked by their attention probability without reading the keys a second time.
    # PARTIAL (K=V layers whose angles past ROT are zero, e.g. Gemma 4's global layers: 64 of 256): only the
    # first ROT dims of each half are rotated. Those keys are rebuilt in the loop; on the others the key is
    # v * k_norm_weight, so the weight goes on the query once (q * w, zero on the rotated dims) and the dot
    # reads v as loaded. The full rebuild was about half of the layer's decode time on the H200 (session 13).
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    start, end = split_range(SeqLens, seq, split, window, num_splits, BLOCK_N, SLIDING)

    h = tl.arange(0, BLOCK_H)
    hmask = h < GROUP
    head = kvh * GROUP + h
    d = tl.arange(0, BLOCK_D)
    dmask = d < HALF
    qmask = hmask[:, None] & dmask[None, :]
    q_ptr = Q + seq * stride_qs + head[:, None] * stride_qh + d[None, :]
    WRITE_Q: tl.constexpr = QK and QOut is not None
    if QK:  # as _qk_norm_rope_kernel: the norm's output rounded to the input dtype, then rotated
        ang = _reduce_angle(tl.load(Pos + seq).to(tl.float32) * tl.load(InvFreq + d, mask=dmask, other=0.0))
        cos = tl.cos(ang)
        sin = tl.sin(ang)
        w1 = tl.load(QW + d, mask=dmask, other=0.0).to(tl.float32)
        w2 = tl.load(QW + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    if WRITE_Q:  # the write-back form (see QOut): the group's real heads to QOut, then the plain kernel reads them
        g = tl.arange(0, GP)
        gmask = (g < GROUP)[:, None] & dmask[None, :]
        gq = Q + seq * stride_qs + (kvh * GROUP + g)[:, None] * stride_qh + d[None, :]
        a1, a2 = _norm_rope_rows(tl.load(gq, mask=gmask, other=0.0), tl.load(gq + HALF, mask=gmask, other=0.0), w1,
                                 w2, cos[None, :], sin[None, :], eps, HALF)
        go = QOut + seq * stride_xs + (kvh * GROUP + g)[:, None] * stride_xh + d[None, :]
        tl.store(go, a1, mask=gmask)
        tl.store(go + HALF, a2, mask=gmask)
    else:
        q1 = tl.load(q_ptr, mask=qmask, other=0.0)
        q2 = tl.load(q_ptr + HALF, mask=qmask, other=0.0)
    if QK and not WRITE_Q:
        if PARTIAL:  # the rows' norm factors, for the rotated dims' queries below (those _norm_rows applies)
            rq = _rstd_rows(q1.to(tl.float32), q2.to(tl.float32), eps, 2 * HALF)
        q1, q2 = _norm_rope_rows(q1, q2, w1, w2, cos[None, :], sin[None, :], eps, HALF)
    if QK:
        if (start < end) & (end == tl.load(SeqLens + seq)):  # this split reads the new token's key: write it first
            if ROT_CACHED:
                _write_new_row(VNew, KNorm, InvFreq, V, Slots, Pos, seq, kvh, d, dmask, eps, stride_vn, stride_vnh,
                               stride_vb, stride_vs, stride_vh, HALF, PAGE, ROT)
            else:
                _write_new_kv(KNew, VNew, KNorm, K, V, Slots, seq, kvh, d, dmask, cos, sin, eps, norm_v, stride_kn,
                              stride_knh, stride_vn, stride_vnh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                              stride_vh, HALF, PAGE)
        tl.debug_barrier()  # the CTA's stores (the row; the write-back form's queries) precede its loads of them
    if WRITE_Q:
        q_ptr = QOut + seq * stride_xs + head[:, None] * stride_xh + d[None, :]
        q1 = tl.load(q_ptr, mask=qmask, other=0.0)
        q2 = tl.load(q_ptr + HALF, mask=qmask, other=0.0)

    if PARTIAL:
        r = tl.arange(0, ROT)
        plain = (d >= ROT) & dmask
        w1 = tl.load(KNorm + d, mask=plain, other=0.0).to(tl.float32)
        w2 = tl.load(KNorm + HALF + d, mask=plain, other=0.0).to(tl.float32)
        q1 = (q1.to(tl.float32) * w1[None, :]).to(q1.dtype)  # zero on the rotated dims
        q2 = (q2.to(tl.float32) * w2[None, :]).to(q2.dtype)
        if WRITE_Q:
            qr_ptr = QOut + seq * stride_xs + head[:, None] * stride_xh + r[None, :]
        else:
            qr_ptr = Q + seq * stride_qs + head[:, None] * stride_qh + r[None, :]
        q1r = tl.load(qr_ptr, mask=hmask[:, None], other=0.0)
        q2r = tl.load(qr_ptr + HALF, mask=hmask[:, None], other=0.0)
        if QK and not WRITE_Q:  # Q is before its norm and RoPE: those dims normed and rotated as above
            wq1 = tl.load(QW + r).to(tl.float32)
            wq2 = tl.load(QW + HALF + r).to(tl.float32)
            x1r = (q1r.to(tl.float32) * rq[:, None] * wq1[None, :]).to(q1r.dtype).to(tl.float32)
            x2r = (q2r.to(tl.float32) * rq[:, None] * wq2[None, :]).to(q1r.dtype).to(tl.float32)
            angr = _reduce_angle(tl.load(Pos + seq).to(tl.float32) * tl.load(InvFreq + r))
            cr = tl.cos(angr)[None, :]
            sr = tl.sin(angr)[None, :]
            q1r = (x1r * cr - x2r * sr).to(q1r.dtype)
            q2r = (x2r * cr + x1r * sr).to(q1r.dtype)
        if not ROT_CACHED:
            w1r = tl.load(KNorm + r).to(tl.float32)
            w2r = tl.load(KNorm + HALF + r).to(tl.float32)
            invr = tl.load(InvFreq + r).to(tl.float32)
            cos_b, sin_b = _rope_base(invr, BLOCK_N)
    elif K_EQ_V:
        w1 = tl.load(KNorm + d, mask=dmask, other=0.0).to(tl.float32)
        w2 = tl.load(KNorm + HALF + d, mask=dmask, other=0.0).to(tl.float32)
        inv = tl.load(InvFreq + d, mask=dmask, other=0.0).to(tl.float32)
        cos_b, sin_b = _rope_base(inv, BLOCK_N)

    n = tl.arange(0, BLOCK_N)
    bt_row = BlockTables + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc1 = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    acc2 = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for kstart in range(start, end, BLOCK_N):
        pos = kstart + n
        pmask = pos < end
        page = tl.load(bt_row + pos // PAGE, mask=pmask, other=0).to(tl.int64)
        slot = pos % PAGE
        kvmask = pmask[:, None] & dmask[None, :]
        v_off = page[:, None] * stride_vb + (slot * stride_vs + kvh * stride_vh)[:, None] + d[None, :]
        v1 = tl.load(V + v_off, mask=kvmask, other=0.0)
        v2 = tl.load(V + v_off + HALF, mask=kvmask, other=0.0)
        if PARTIAL:
            r_off = page[:, None] * stride_vb + (slot * stride_vs + kvh * stride_vh)[:, None] + r[None, :]
            if ROT_CACHED:
                k1r = tl.load(V + r_off + 2 * HALF, mask=pmask[:, None], other=0.0)
                k2r = tl.load(V + r_off + 2 * HALF + ROT, mask=pmask[:, None], other=0.0)
            else:
                v1r = tl.load(V + r_off, mask=pmask[:, None], other=0.0)
                v2r = tl.load(V + r_off + HALF, mask=pmask[:, None], other=0.0)
                k1r, k2r = _rebuild_keys(v1r, v2r, w1r, w2r, invr, cos_b, sin_b, kstart, q1)
            qk = _dot(q1, tl.trans(v1), PREC, F32) + _dot(q2, tl.trans(v2), PREC, F32)
            qk += _dot(q1r, tl.trans(k1r), PREC, F32)
            qk += _dot(q2r, tl.trans(k2r), PREC, F32)
        else:
            if K_EQ_V:
                k1, k2 = _rebuild_keys(v1, v2, w1, w2, inv, cos_b, sin_b, kstart, q1)
            else:
                k1, k2 = _cached_keys(K, page, slot, kvh, d, kvmask, stride_kb, stride_ks, stride_kh, HALF)
            qk = _dot(q1, tl.trans(k1), PREC, F32) + _dot(q2, tl.trans(k2), PREC, F32)
        s = _scores(qk, scale, softcap, SOFTCAP)
        if RAW:
            tl.store(Raw + seq.to(tl.int64) * stride_rs + head[:, None] * stride_rh + pos[None, :], s,
                     mask=hmask[:, None] & pmask[None, :])
        s = tl.where(pmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pv = p.to(v1.dtype)
        acc1 = acc1 * alpha[:, None] + _dot(pv, v1, PREC, F32)
        acc2 = acc2 * alpha[:, None] + _dot(pv, v2, PREC, F32)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o1 = acc1 / l_safe[:, None]
    o2 = acc2 / l_safe[:, None]
    lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
    if DIRECT:
        o_ptr = Out + seq * stride_os + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptr, o1.to(Out.dtype.element_ty), mask=qmask)
        tl.store(o_ptr + HALF, o2.to(Out.dtype.element_ty), mask=qmask)
        if RAW:  # MidLse is the caller's [seqs, heads] log-sum-exp here
            tl.store(MidLse + seq * stride_ls + head * stride_lh, lse, mask=hmask)
    else:
        o_ptr = MidO + seq * stride_ms + head[:, None] * stride_mh + split * (2 * HALF) + d[None, :]
        tl.store(o_ptr, o1, mask=qmask)
        tl.store(o_ptr + HALF, o2, mask=qmask)
        tl.store(MidLse + seq * stride_ls + head * stride_lh + split, lse, mask=hmask)


@triton.jit(do_not_specialize=["num_splits"])
def _combine_kernel(
    MidO, MidLse, Out, Lse, num_splits,
    stride_ms, stride_mh, stride_ls, stride_lh, stride_os, stride_oh, stride_es,
    HEAD_DIM: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_S: tl.constexpr, WRITE_LSE: tl.constexpr = False,
    GDC: tl.constexpr = False,
):
    # program (seq, head, dims chunk): every split's partial output of BLOCK_DC dims in one load, weighted by the
    # splits' log-sum-exps. (A loop over the splits, one row a step, cost ~3.6 us a launch at 16 splits on the
    # H200, each step waiting on its load: session 34's --ladder; now ~one load's latency.)
    if GDC:  # the next kernel (launched with PDL: _common.DECODE_PDL_ENV) may start now; it waits for this one
        gdc_launch_dependents()
    seq = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    smask = sp < num_splits
    lse = tl.load(MidLse + seq * stride_ls + head * stride_lh + sp, mask=smask, other=float("-inf"))
    mx = tl.max(lse, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp2(lse - mx)
    denom = tl.sum(w, 0)
    empty = denom == 0.0
    denom = tl.where(empty, 1.0, denom)
    dv = tl.program_id(2) * BLOCK_DC + tl.arange(0, BLOCK_DC)
    dmask = dv < HEAD_DIM
    o = tl.load(MidO + seq * stride_ms + head * stride_mh + sp[:, None] * HEAD_DIM + dv[None, :],
                mask=smask[:, None] & dmask[None, :], other=0.0)
    acc = tl.sum(w[:, None] * o, 0)
    tl.store(Out + seq * stride_os + head * stride_oh + dv, (acc / denom).to(Out.dtype.element_ty), mask=dmask)
    if WRITE_LSE:  # the sequence's log2-domain log-sum-exp over every split
        if tl.program_id(2) == 0:
            tl.store(Lse + seq * stride_es + head, tl.where(empty, float("-inf"), mx + tl.log2(denom)))


def combine_splits(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None = None):
    """A split decode's partial results merged into out [rows, heads, head_dim]: mid_o [rows, heads, splits,
    head_dim] float32 and mid_lse [rows, heads, splits] their log2-domain log-sum-exps; lse [rows, heads] (optional)
    receives the total's."""
    rows, heads, splits, head_dim = mid_o.shape
    assert mid_o.stride(2) == head_dim and mid_o.stride(3) == 1 and mid_lse.stride(2) == 1
    block_s = triton.next_power_of_2(splits)
    block_dc = max(16, min(128, triton.next_power_of_2(head_dim), 4096 // block_s))  # <= 4K float32 a program
    le = lse if lse is not None else out
    _combine_kernel[(rows, heads, triton.cdiv(head_dim, block_dc))](
        mid_o, mid_lse, out, le, splits,
        mid_o.stride(0), mid_o.stride(1), mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1),
        le.stride(0), HEAD_DIM=head_dim, BLOCK_DC=block_dc, BLOCK_S=block_s, WRITE_LSE=lse is not None,
        **({"GDC": True} if decode_pdl_steps(out.device) else {}), num_warps=4,
    )
    LAST_COMBINE[0] = out.data_ptr()
    return out


def _kv_views(cache: torch.Tensor, num_kv_heads: int, head_dim: int):
    assert cache.dim() == 5 and cache.shape[3] == num_kv_heads and cache.shape[4] == head_dim, cache.shape
    k, v = cache[0], cache[-1]
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    return k, v


def _rope_args(q, k_eq_v, k_norm_weight, inv_freq, head_dim):
    if not k_eq_v:
        return q, q  # unused placeholders
    assert k_norm_weight is not None and inv_freq is not None, "K=V needs k_norm_weight and inv_freq"
    assert k_norm_weight.numel() == head_dim and inv_freq.numel() == head_dim // 2
    return (k_norm_weight.to(q.device).contiguous(),
            inv_freq.to(device=q.device, dtype=torch.float32).contiguous())


@dataclass
class DecodeQK:
    """The step's QK-norm + RoPE + KV write, done inside the decode kernel (ops/triton/qk_norm_rope.py defers it
    here at decode): q (paged_decode's q) and k, v [tokens, kv_heads, head_dim] before their norms, positions
    [tokens], inv_freq [head_dim / 2] float32, the norms' weights (v's norm has none: norm_v) and the slots. K=V
    layers whose rows keep rotated keys: k None, k_weight the layer's k-norm weight (the kept keys')."""
    k: torch.Tensor | None
    v: torch.Tensor
    positions: torch.Tensor
    inv_freq: torch.Tensor
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    slots: torch.Tensor
    eps: float
    norm_v: bool
    q_out: torch.Tensor | None = None  # the write-back form (the decode kernel's QOut): the op's output


def paged_decode(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, *,
                 scale: float, sliding_window: int | None = None, softcap: float | None = None,
                 k_eq_v: bool = False, k_norm_weight: torch.Tensor | None = None,
                 inv_freq: torch.Tensor | None = None, num_kv_heads: int, head_dim: int,
                 max_seq_len: int | None = None, policy: AttnLaunch | None = None,
                 out: torch.Tensor | None = None, rotated_pairs: int | None = None,
                 raw: torch.Tensor | None = None, lse: torch.Tensor | None = None, rot_keys: int = 0,
                 qk: DecodeQK | None = None) -> torch.Tensor:
    """One query token per sequence (at position seq_len - 1). q: [num_seqs, num_heads(*head_dim)];
    seq_lens: [num_seqs] int32 on the device. Returns [num_seqs, num_heads, head_dim]. rotated_pairs (K=V):
    inv_freq's leading nonzero angles, the rest zero (None: all rotate). rot_keys (K=V, AttentionSpec.rot_keys):
    the cache is the value part of rows that keep the rotated keys after it (read instead of rebuilt). raw and lse (together; OmniKV's
    filter layers): raw [num_seqs, num_heads, >= the block-table width x page] float32 (or float16, rounded on
    the store) receives every key's
    log2-domain score at [seq, head, pos] (positions past seq_len untouched), lse [num_seqs, num_heads]
    float32 each head's log2-domain log-sum-exp, so softmax(scores)[pos] = exp2(raw - lse). qk (DecodeQK): q is
    before its norm and RoPE, and the kernel also writes the step's keys and values (K!=V layers) or rows (K=V
    layers with rot_keys)."""
    assert (raw is None) == (lse is None), "raw scores and log-sum-exps come together"
    num_seqs = seq_lens.shape[0]
    q = q.view(num_seqs, -1, head_dim)
    assert q.stride(-1) == 1
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    assert group * num_kv_heads == num_heads and head_dim % 2 == 0
    k_cache, v_cache = _kv_views(cache, num_kv_heads, head_dim)
    page = cache.shape[2]
    assert page & (page - 1) == 0, "page size must be a power of two"
    knw, inv = _rope_args(q, k_eq_v, k_norm_weight, inv_freq, head_dim)
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * page  # host-side bound, no device sync
    pol = policy or attention_launch_policy(num_seqs, max_seq_len, head_dim, num_kv_heads=num_kv_heads,
                                            sliding_window=sliding_window, k_eq_v=k_eq_v)
    if out is None:
        out = torch.empty(num_seqs, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    splits = max(1, pol.num_splits)
    direct = splits == 1
    if direct:
        mid_o, mid_lse = out, (lse if lse is not None else out)
    else:
        mid_o = torch.empty(num_seqs, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=q.device)
    if raw is not None:
        assert raw.shape[:2] == (num_seqs, num_heads) and raw.stride(-1) == 1
        assert raw.dtype in (torch.float32, torch.float16), "raw scores are stored as float32 (or float16)"
        assert raw.shape[2] >= max_seq_len and lse.shape == (num_seqs, num_heads) and lse.dtype == torch.float32
    rw = raw if raw is not None else out
    half = head_dim // 2
    rot = rotated_block(rotated_pairs, half) if k_eq_v else half
    if rot_keys:
        assert k_eq_v and rot_keys == rot < half, (rot_keys, rot, half)
    extra = {}
    if qk is not None:  # q, k and v before their norms and RoPE (DecodeQK)
        # K=V: rows that keep their rotated keys, made from the normed value (no k)
        assert (qk.k is None and qk.norm_v and rot_keys) if k_eq_v else qk.k is not None
        kn = qk.k if qk.k is not None else qk.v
        assert raw is None and kn.stride(-1) == 1 and qk.v.stride(-1) == 1
        knw, inv = qk.k_weight, qk.inv_freq
        assert inv.dtype == torch.float32 and inv.numel() == half and knw.numel() == head_dim
        extra = dict(KNew=kn, VNew=qk.v, Pos=qk.positions, QW=qk.q_weight, Slots=qk.slots,
                     stride_kn=kn.stride(0), stride_knh=kn.stride(1), stride_vn=qk.v.stride(0),
                     stride_vnh=qk.v.stride(1), eps=float(qk.eps), norm_v=int(qk.norm_v), QK=True)
        if qk.q_out is not None:
            qo = qk.q_out.view(qk.q_out.shape[0], num_heads, head_dim)
            assert qo.stride(-1) == 1 and qo.dtype == q.dtype
            extra.update(QOut=qo, stride_xs=qo.stride(0), stride_xh=qo.stride(1),
                         GP=triton.next_power_of_2(group))
    _decode_kernel[(num_seqs, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, knw, inv, out, mid_o, mid_lse, rw,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_lse.stride(0), mid_lse.stride(1), rw.stride(0), rw.stride(1),
        float(scale), float(softcap or 1.0), int(sliding_window or 0), splits,
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HALF=half,
        BLOCK_D=triton.next_power_of_2(half), PAGE=page, BLOCK_N=pol.block_n, ROT=rot, PARTIAL=k_eq_v and rot < half,
        SLIDING=sliding_window is not None, SOFTCAP=softcap is not None, K_EQ_V=k_eq_v, DIRECT=direct,
        PREC=dot_precision(q.dtype), RAW=raw is not None, F32=dot_f32(q.dtype), ROT_CACHED=rot_keys > 0,
        num_warps=pol.num_warps, num_stages=pol.num_stages, **extra,
    )
    if not direct:
        combine_splits(mid_o, mid_lse, out, lse)
    return out


# ----------------------------------------------------------------------------------------------------
# prefill: variable-length chunked prefill over the paged context


@triton.jit
def _tile_keys(K, seq, kvh, d, kvmask, pos, page, slot, v1, v2, rope, kstart, like, stride_kb, stride_ks, stride_kh,
               HALF: tl.constexpr, K_EQ_V: tl.constexpr, K_DENSE: tl.constexpr):
    """Both halves of a prefill key tile loaded through the registers: from the dense rebuilt buffer (K_DENSE),
    rebuilt from the values (K=V), or from the paged cache."""
    if K_DENSE:
        k_off = seq.to(tl.int64) * stride_kb + (pos * stride_ks + kvh * stride_kh)[:, None] + d[None, :]
        k1 = tl.load(K + k_off, mask=kvmask, other=0.0)
        k2 = tl.load(K + k_off + HALF, mask=kvmask, other=0.0)
    elif K_EQ_V:
        w1, w2, inv, cos_b, sin_b = rope
        k1, k2 = _rebuild_keys(v1, v2, w1, w2, inv, cos_b, sin_b, kstart, like)
    else:
        k1, k2 = _cached_keys(K, page, slot, kvh, d, kvmask, stride_kb, stride_ks, stride_kh, HALF)
    return k1, k2


@triton.jit
def _prefill_tile(kstart, n, last, qpos, window, m_i, l_i, acc1, acc2, q1, q2, kv, rope, span, scale, softcap,
                  kd, vd, drow, MASK: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
                  SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, K_EQ_V: tl.constexpr, K_DENSE: tl.constexpr,
                  BIDIR: tl.constexpr, PREC: tl.constexpr, F32: tl.constexpr, SPLIT_D: tl.constexpr,
                  TMA: tl.constexpr):
    """One key tile of the prefill's online softmax: keys kstart + n. MASK: the positions past `last`, after a
    row's own or outside its window are masked (and not loaded); without it every key of the tile is seen by
    every row (the caller's interior tiles). TMA: keys and values from the descriptors kd / vd over the dense
    buffers, rows drow + kstart + n (rows past the sequence's last key hold zeros there: no load mask).
    """
    K, V, seq, kvh, d, dmask, bt_row, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, vpart = kv
    pos = kstart + n
    if MASK:
        pmask = pos < last
    if TMA:
        row = drow + kstart
        col = kvh * (2 * HALF)
        if SPLIT_D:
            v1 = vd.load([row, col + vpart])  # this program's half
            v2 = v1
        else:
            v1 = vd.load([row, col])
            v2 = vd.load([row, col + HALF])
        k1 = kd.load([row, col])
        k2 = kd.load([row, col + HALF])
    else:
        if MASK:
            kvmask = pmask[:, None] & dmask[None, :]
            page = tl.load(bt_row + pos // PAGE, mask=pmask, other=0).to(tl.int64)
        else:
            kvmask = (pos >= 0)[:, None] & dmask[None, :]  # folds to d < HALF (all true where BLOCK_D == HALF)
            page = tl.load(bt_row + pos // PAGE).to(tl.int64)
        slot = pos % PAGE
        v_off = page[:, None] * stride_vb + (slot * stride_vs + kvh * stride_vh)[:, None] + d[None, :]
        if SPLIT_D:
            v1 = tl.load(V + v_off + vpart, mask=kvmask, other=0.0)  # this program's half
            v2 = v1
        else:
            v1 = tl.load(V + v_off, mask=kvmask, other=0.0)
            v2 = tl.load(V + v_off + HALF, mask=kvmask, other=0.0)
        k1, k2 = _tile_keys(K, seq, kvh, d, kvmask, pos, page, slot, v1, v2, rope, kstart, q1, stride_kb,
                            stride_ks, stride_kh, HALF, K_EQ_V, K_DENSE)
    qk = _dot(q1, tl.trans(k1), PREC, F32) + _dot(q2, tl.trans(k2), PREC, F32)
    s = _scores(qk, scale, softcap, SOFTCAP)
    if MASK:
        allowed = pmask[None, :] & (pos[None, :] <= qpos[:, None])
        if BIDIR:
            span_lo, span_hi = span
            in_span = (pos[None, :] >= span_lo[:, None]) & (pos[None, :] < span_hi[:, None])
            allowed = allowed | (pmask[None, :] & in_span)
        if SLIDING:
            allowed = allowed & (pos[None, :] > qpos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    pv = p.to(v1.dtype)
    acc1 = acc1 * alpha[:, None] + _dot(pv, v1, PREC, F32)
    if not SPLIT_D:
        acc2 = acc2 * alpha[:, None] + _dot(pv, v2, PREC, F32)
    return m_new, l_i, acc1, acc2


@triton.jit(do_not_specialize=["stride_bt", "num_seqs"])
def _prefill_kernel(
    Q, K, V, BlockTables, SeqLens, QueryStart, KNorm, InvFreq, Out, SpanLo, SpanHi,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    scale, softcap, window, num_seqs,
    GROUP: tl.constexpr, GP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HALF: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, K_EQ_V: tl.constexpr, K_DENSE: tl.constexpr,
    BIDIR: tl.constexpr, PREC: tl.constexpr, F32: tl.constexpr = False, SPLIT_D: tl.constexpr = False,
    INTERIOR: tl.constexpr = False, Kd=None, Vd=None, dense_rows=0, TMA: tl.constexpr = False,
):
    # K_DENSE: keys come pre-rebuilt from a dense [num_seqs, positions, kv_heads, head_dim] buffer (K)
    # BIDIR: each new token also sees the keys of its span [SpanLo, SpanHi) (media tokens, both ways)
    # SPLIT_D: axis 1 is kv_heads x 2; program (pid, j) owns KV head j // 2 and output half j % 2. The scores
    # (and so m_i, l_i) are the same in both programs; each reads and accumulates only its half of V.
    # TMA (K_DENSE): Kd / Vd describe the dense keys and values as [num_seqs * dense_rows, kv_heads * head_dim]
    # in [BLOCK_N, HALF] boxes; sequence s's key j is row s * dense_rows + j
    tl.static_assert(not SPLIT_D or K_DENSE or not K_EQ_V, "SPLIT_D: the in-loop key rebuild needs all of v")
    pid = tl.program_id(0)
    if SPLIT_D:
        kvh = tl.program_id(1) // 2
        part = tl.program_id(1) % 2
    else:
        kvh = tl.program_id(1)
    # Sequence of this query tile: sequence s owns tiles [qsl[s] // BLOCK_Q + s, qsl[s+1] // BLOCK_Q + s + 1).
    lo = pid * 0
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(QueryStart + mid) // BLOCK_Q + mid <= pid:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_begin = tl.load(QueryStart + seq)
    q_len = tl.load(QueryStart + seq + 1) - q_begin
    q_off = (pid - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    if q_off >= q_len:
        return
    seq_len = tl.load(SeqLens + seq)
    ctx0 = seq_len - q_len  # position of the first new token

    r = tl.arange(0, BLOCK_M)
    tok = q_off + r // GP
    g = r % GP
    rmask = (tok < q_len) & (g < GROUP)
    head = kvh * GROUP + g
    qpos = ctx0 + tok
    d = tl.arange(0, BLOCK_D)
    dmask = d < HALF
    qmask = rmask[:, None] & dmask[None, :]
    q_ptr = Q + (q_begin + tok).to(tl.int64)[:, None] * stride_qt + (head * stride_qh)[:, None] + d[None, :]
    q1 = tl.load(q_ptr, mask=qmask, other=0.0)
    q2 = tl.load(q_ptr + HALF, mask=qmask, other=0.0)

    if K_EQ_V and not K_DENSE:
        w1 = tl.load(KNorm + d, mask=dmask, other=0.0).to(tl.float32)
        w2 = tl.load(KNorm + HALF + d, mask=dmask, other=0.0).to(tl.float32)
        inv = tl.load(InvFreq + d, mask=dmask, other=0.0).to(tl.float32)
        cos_b, sin_b = _rope_base(inv, BLOCK_N)

    # keys this tile can see: [first, last)
    last = tl.minimum(ctx0 + q_off + BLOCK_Q, seq_len)
    if BIDIR:
        span_lo = tl.load(SpanLo + q_begin + tok, mask=rmask, other=0)
        span_hi = tl.load(SpanHi + q_begin + tok, mask=rmask, other=0)
        last = tl.minimum(tl.maximum(last, tl.max(span_hi, 0)), seq_len)
    first = last * 0
    if SLIDING:
        first = tl.maximum(ctx0 + q_off - window + 1, 0)

    n = tl.arange(0, BLOCK_N)
    bt_row = BlockTables + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc1 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # SPLIT_D: this program's half only
    if SPLIT_D:
        acc2 = tl.zeros([1, 1], tl.float32)  # unused
        vpart = part * HALF
    else:
        acc2 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        vpart = 0
    if K_EQ_V and not K_DENSE:
        rope = (w1, w2, inv, cos_b, sin_b)
    else:
        rope = (0.0, 0.0, 0.0, 0.0, 0.0)  # unused
    if BIDIR:
        span = (span_lo, span_hi)
    else:
        span = (0, 0)  # unused
    kv = (K, V, seq, kvh, d, dmask, bt_row, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, vpart)
    drow = seq * dense_rows
    # INTERIOR: three runs of the same tiles: [first, a_end) and [b_end, last) masked, [a_end, b_end) without
    # the position masks (every row sees every key there: past the window's edge for the tile's last query,
    # at or before the first query's position, before `last`). Spans (BIDIR) widen `last`: all tiles masked.
    a_end = first
    b_end = first
    if INTERIOR and not BIDIR:
        if SLIDING:  # the window's edge: masked tiles up to the first tile every row sees whole
            full_lo = tl.maximum(first, ctx0 + q_off + BLOCK_Q - window)
            a_end = tl.minimum(first + tl.cdiv(full_lo - first, BLOCK_N) * BLOCK_N, last)
            for kstart in range(first, a_end, BLOCK_N):
                m_i, l_i, acc1, acc2 = _prefill_tile(
                    kstart, n, last, qpos, window, m_i, l_i, acc1, acc2, q1, q2, kv, rope, span, scale, softcap,
                    Kd, Vd, drow, True, HALF, BLOCK_D, PAGE, SLIDING, SOFTCAP, K_EQ_V, K_DENSE, BIDIR, PREC, F32,
                    SPLIT_D, TMA)
        full_hi = tl.minimum(ctx0 + q_off + 1, last)
        b_end = a_end + tl.maximum(full_hi - a_end, 0) // BLOCK_N * BLOCK_N
        for kstart in range(a_end, b_end, BLOCK_N):
            m_i, l_i, acc1, acc2 = _prefill_tile(
                kstart, n, last, qpos, window, m_i, l_i, acc1, acc2, q1, q2, kv, rope, span, scale, softcap,
                Kd, Vd, drow, False, HALF, BLOCK_D, PAGE, SLIDING, SOFTCAP, K_EQ_V, K_DENSE, BIDIR, PREC, F32,
                SPLIT_D, TMA)
    for kstart in range(b_end, last, BLOCK_N):
        m_i, l_i, acc1, acc2 = _prefill_tile(
            kstart, n, last, qpos, window, m_i, l_i, acc1, acc2, q1, q2, kv, rope, span, scale, softcap,
            Kd, Vd, drow, True, HALF, BLOCK_D, PAGE, SLIDING, SOFTCAP, K_EQ_V, K_DENSE, BIDIR, PREC, F32,
            SPLIT_D, TMA)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o_ptr = Out + (q_begin + tok).to(tl.int64)[:, None] * stride_ot + (head * stride_oh)[:, None] + d[None, :]
    if SPLIT_D:
        tl.store(o_ptr + part * HALF, (acc1 / l_safe[:, None]).to(Out.dtype.element_ty), mask=qmask)
    else:
        tl.store(o_ptr, (acc1 / l_safe[:, None]).to(Out.dtype.element_ty), mask=qmask)
        tl.store(o_ptr + HALF, (acc2 / l_safe[:, None]).to(Out.dtype.element_ty), mask=qmask)


@triton.jit(do_not_specialize=["stride_bt"])
def _rebuild_k_kernel(
    V, BlockTables, SeqLens, QueryStart, KNorm, InvFreq, KD, VD,
    stride_vb, stride_vs, stride_vh, stride_bt, stride_ds, stride_dp, stride_dh,
    window, rows,
    HALF: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr,
    COPY_V: tl.constexpr = False, TAIL: tl.constexpr = 1,
):
    """K=V layers, prefill: write rope(v * k_norm_weight) for every position some query of the step can see
    into a dense [num_seqs, positions, kv_heads, head_dim] buffer: once per key, not once per query tile.
    COPY_V (no window): v itself too, into VD (same layout), and zeros in both at the positions past seq_len up to
    a multiple of TAIL (below `rows`): the prefill's TMA tiles read those rows unmasked."""
    seq = tl.program_id(0)
    kvh = tl.program_id(2)
    seq_len = tl.load(SeqLens + seq)
    first = seq_len * 0
    if SLIDING:
        q_len = tl.load(QueryStart + seq + 1) - tl.load(QueryStart + seq)
        first = tl.maximum(seq_len - q_len - window + 1, 0)
    end = seq_len
    if COPY_V:
        end = tl.minimum(tl.cdiv(seq_len, TAIL) * TAIL, rows)
    pos0 = first + tl.program_id(1) * BLOCK_N
    if pos0 >= end:
        return
    pos = pos0 + tl.arange(0, BLOCK_N)
    pmask = pos < seq_len
    d = tl.arange(0, BLOCK_D)
    dmask = d < HALF
    mask = pmask[:, None] & dmask[None, :]
    page = tl.load(BlockTables + seq.to(tl.int64) * stride_bt + pos // PAGE, mask=pmask, other=0).to(tl.int64)
    v_off = page[:, None] * stride_vb + ((pos % PAGE) * stride_vs + kvh * stride_vh)[:, None] + d[None, :]
    x1 = tl.load(V + v_off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(V + v_off + HALF, mask=mask, other=0.0).to(tl.float32)
    if COPY_V:  # masked rows load as zeros: the tail rows are written as zeros
        mask = (pos < end)[:, None] & dmask[None, :]
        vd = VD + seq.to(tl.int64) * stride_ds + (pos * stride_dp + kvh * stride_dh)[:, None] + d[None, :]
        tl.store(vd, x1.to(VD.dtype.element_ty), mask=mask)
        tl.store(vd + HALF, x2.to(VD.dtype.element_ty), mask=mask)
    x1 = x1 * tl.load(KNorm + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    x2 = x2 * tl.load(KNorm + HALF + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    inv = tl.load(InvFreq + d, mask=dmask, other=0.0)
    pf = pos.to(tl.float32)[:, None] + tl.zeros_like(inv)[None, :]
    a = pf * inv[None, :]
    a = _reduce_angle(a) + tl.fma(pf, inv[None, :] + tl.zeros_like(pf), -a)
    c = tl.cos(a)
    s = tl.sin(a)
    out = KD + seq.to(tl.int64) * stride_ds + (pos * stride_dp + kvh * stride_dh)[:, None] + d[None, :]
    tl.store(out, (x1 * c - x2 * s).to(KD.dtype.element_ty), mask=mask)
    tl.store(out + HALF, (x2 * c + x1 * s).to(KD.dtype.element_ty), mask=mask)


# dense rebuilt-key buffers above this size fall back to rebuilding keys inside the attention loop
DENSE_K_LIMIT_BYTES = 1 << 30
_TMA_WARNED: set = set()
_GLUON_WARNED: set = set()


def _dense_buffer(num_seqs: int, rows: int, num_kv_heads: int, head_dim: int, like: torch.Tensor) -> torch.Tensor:
    """A dense [num_seqs, rows, kv_heads, head_dim] buffer the key rebuild fills (a test poisons it with NaN)."""
    return torch.empty(num_seqs, rows, num_kv_heads, head_dim, dtype=like.dtype, device=like.device)


def _tma_fits(q, v_cache, sliding_window, half, block_d, block_n, nbytes) -> bool:
    """AttnLaunch.tma can run: a device with TMA (sm_90+, or the interpreter), no window (the rebuild writes every
    row from position 0), power-of-two halves and key tiles of at most 64 (the zeroed tail rows), the values in the
    query's dtype, and both dense buffers within DENSE_K_LIMIT_BYTES; a GPU that has TMA and misses one is told."""
    if not _common.has_tma(q.device):
        return False
    fits = (sliding_window is None and half == block_d and 16 <= block_n <= 64 and v_cache.dtype == q.dtype
            and nbytes <= DENSE_K_LIMIT_BYTES)
    key = (sliding_window, half, block_n, v_cache.dtype, q.dtype, nbytes > DENSE_K_LIMIT_BYTES)
    if not fits and q.is_cuda and key not in _TMA_WARNED:
        _TMA_WARNED.add(key)
        log.warning("prefill attention (head_dim %d, window %s): key and value tiles load without TMA (%d-key tiles, "
                    "%s values for %s queries, %.2f GB of dense keys and values)", 2 * half, sliding_window,
                    block_n, v_cache.dtype, q.dtype, nbytes / 1e9)
    return fits


def _gluon_fits(q, v_cache, sliding_window, softcap, group, head_dim, nbytes) -> bool:
    """AttnLaunch.gluon can run (dense rebuilt keys given): a Hopper GPU (wgmma), head_dim 512, no window, no soft-cap,
    bf16 queries and values, both dense buffers within DENSE_K_LIMIT_BYTES. An sm_90+ device that misses one is
    told which (the layer then runs the Triton tile, ~1.5x slower at 8K tokens on an H100)."""
    if not _common.sm90(q.device):
        return False
    why = [reason for reason, miss in [
        ("not a Hopper GPU (sm_90)", not _common.hopper(q.device)),
        (f"head_dim {head_dim}, group {group}", not gluon_prefill.fits(group, head_dim)),
        (f"a {sliding_window}-token window", sliding_window is not None), (f"soft-cap {softcap}", softcap is not None),
        (f"{q.dtype} queries, {v_cache.dtype} values", q.dtype != torch.bfloat16 or v_cache.dtype != q.dtype),
        (f"{nbytes / 1e9:.2f} GB of dense keys and values", nbytes > DENSE_K_LIMIT_BYTES)] if miss]
    if why and tuple(why) not in _GLUON_WARNED:
        _GLUON_WARNED.add(tuple(why))
        log.warning("prefill attention (head_dim %d, K=V): the Triton tile runs, not the Gluon kernel: %s", head_dim,
                    "; ".join(why))
    return not why


def paged_prefill(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                  seq_lens: torch.Tensor, *, scale: float, sliding_window: int | None = None,
                  softcap: float | None = None, k_eq_v: bool = False, k_norm_weight: torch.Tensor | None = None,
                  inv_freq: torch.Tensor | None = None, num_kv_heads: int, head_dim: int,
                  max_seq_len: int | None = None, policy: AttnLaunch | None = None,
                  out: torch.Tensor | None = None, spans: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Variable-length chunked prefill: sequence i's new tokens are q[qsl[i]:qsl[i+1]] at positions
    seq_len - q_len .. seq_len - 1 (their K/V already written to the cache); they attend to the cached
    context and causally to each other. query_start_loc [num_seqs + 1] and seq_lens [num_seqs] are int32
    device tensors. max_seq_len: optional host bound on seq_lens (sizes the K=V key buffer; defaults to the
    block-table width). spans: (lo, hi) int32 [num_tokens], the positions [lo, hi) of the span each new token
    sees both ways (lo = hi = 0 outside spans; a span never reaches past its sequence's seq_len).
    Returns [num_tokens, num_heads, head_dim]."""
    num_tokens = q.shape[0]
    num_seqs = seq_lens.shape[0]
    q = q.view(num_tokens, -1, head_dim)
    assert q.stride(-1) == 1
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    assert group * num_kv_heads == num_heads and head_dim % 2 == 0
    k_cache, v_cache = _kv_views(cache, num_kv_heads, head_dim)
    page = cache.shape[2]
    assert page & (page - 1) == 0, "page size must be a power of two"
    knw, inv = _rope_args(q, k_eq_v, k_norm_weight, inv_freq, head_dim)
    pol = policy or attention_launch_policy(num_seqs, 0, head_dim, prefill=True)
    if out is None:
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * page
    dense_bytes = num_seqs * max_seq_len * num_kv_heads * head_dim * q.element_size()
    dense = k_eq_v and dense_bytes <= DENSE_K_LIMIT_BYTES
    gluon = dense and pol.gluon and _gluon_fits(q, v_cache, sliding_window, softcap, group, head_dim, 2 * dense_bytes)
    if pol.gluon and not gluon:  # the Triton tile's best (the warning above says why, on a GPU)
        pol = dataclasses.replace(PREFILL_D512_TMA, interior=pol.interior)
    gp = triton.next_power_of_2(group)
    block_m = max(pol.block_m, gp, 16)
    block_q = block_m // gp
    half = head_dim // 2
    block_d = triton.next_power_of_2(half)
    tma = dense and pol.tma and _tma_fits(q, v_cache, sliding_window, half, block_d, pol.block_n, 2 * dense_bytes)
    if pol.tma and not tma and policy is None:  # the policy's TMA tile without TMA: the registers' best tile
        pol = dataclasses.replace(PREFILL_D512, interior=pol.interior)
    k_src, ks = k_cache, (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    tma_args = {}
    tma = tma or gluon  # the Gluon kernel reads the dense values too, by TMA
    if dense:
        # rows are positions; for sliding windows only the visible ones are written (and read)
        k_src = _dense_buffer(num_seqs, max_seq_len, num_kv_heads, head_dim, q)
        v_src = _dense_buffer(num_seqs, max_seq_len, num_kv_heads, head_dim, q) if tma else k_src
        ks = (k_src.stride(0), k_src.stride(1), k_src.stride(2))
        rows = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window + num_tokens)
        _rebuild_k_kernel[(num_seqs, triton.cdiv(rows, 16), num_kv_heads)](
            v_cache, block_tables, seq_lens, query_start_loc, knw, inv, k_src, v_src,
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), *ks,
            int(sliding_window or 0), max_seq_len,
            HALF=half, BLOCK_D=block_d, PAGE=page, BLOCK_N=16, SLIDING=sliding_window is not None, COPY_V=tma,
            TAIL=pol.block_n, num_warps=8,
        )
        if gluon:
            return gluon_prefill.prefill_d512(
                q, k_src.view(num_seqs * max_seq_len, -1), v_src.view(num_seqs * max_seq_len, -1), query_start_loc,
                seq_lens, max_seq_len, scale, out, num_kv_heads=num_kv_heads, block_n=pol.block_n,
                stages=pol.num_stages)
        if tma:
            box = [pol.block_n, half]
            tma_args = dict(Kd=TensorDescriptor.from_tensor(k_src.view(num_seqs * max_seq_len, -1), box),
                            Vd=TensorDescriptor.from_tensor(v_src.view(num_seqs * max_seq_len, -1), box),
                            dense_rows=max_seq_len, TMA=True)
    split_d = pol.split_d and not (k_eq_v and not dense)  # the in-loop rebuild needs both halves of v
    if pol.split_d and not split_d and policy is None:  # the policy's split tile, unsplit, would not fit
        pol = UNSPLIT_D512
        block_m = max(pol.block_m, gp, 16)
        block_q = block_m // gp
    block_n = pol.block_n
    if k_eq_v and not dense:
        block_n = min(block_n, 16)  # in-loop rebuild keeps fp32 cos/sin tables live
    grid = (triton.cdiv(num_tokens, block_q) + num_seqs, num_kv_heads * (2 if split_d else 1))
    span_lo, span_hi = spans if spans is not None else (seq_lens, seq_lens)  # unused without BIDIR
    _prefill_kernel[grid](
        q, k_src, v_cache, block_tables, seq_lens, query_start_loc, knw, inv, out, span_lo, span_hi,
        q.stride(0), q.stride(1),
        *ks,
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        float(scale), float(softcap or 1.0), int(sliding_window or 0), num_seqs,
        GROUP=group, GP=gp, BLOCK_Q=block_q, BLOCK_M=block_m, HALF=half, BLOCK_D=block_d,
        PAGE=page, BLOCK_N=block_n,
        SLIDING=sliding_window is not None, SOFTCAP=softcap is not None, K_EQ_V=k_eq_v, K_DENSE=dense,
        BIDIR=spans is not None, PREC=dot_precision(q.dtype), F32=dot_f32(q.dtype), SPLIT_D=split_d,
        INTERIOR=pol.interior, **tma_args,
        num_warps=pol.num_warps, num_stages=pol.num_stages,
    )
    return out
