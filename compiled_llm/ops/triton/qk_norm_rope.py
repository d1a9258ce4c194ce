"""Triton qk_norm_rope_kv_write and kv_cache_write.

One program per (token, head), q heads first, then KV heads (prefill: per token and group of 8 heads, as
[8, half] tiles): per-head RMSNorm (float32 statistics,
rounded to the input dtype like the reference), rotate-half RoPE on the two halves of the head
(angles reduced before cos/sin so large positions stay accurate), and for KV heads the store of k and
v into the paged cache at the token's slot. Rows past the slot mapping and slots < 0 (CUDA-graph
padding) write nothing.

qk_norm_mrope_kv_write (Qwen3.5): one program per (token, head) too, the whole head in one block: RMSNorm
scaled by weight_offset + w (rounded to the input dtype like the reference), then the first ROT channels
rotated rotate-half with the step's cos/sin table (read, not recomputed: M-RoPE's angles come from the
model), the other channels passed through; k and v stored for KV heads.
"""

from __future__ import annotations

import os
import threading

import torch
import triton
import triton.language as tl

from compiled_llm.ops.attention import ATTENTION, decode_batch, token_positions
from compiled_llm.ops.context import current_forward_context, later_op_runs_with_this, layer_cache
from compiled_llm.ops.jit import MONITOR, JitKernel, register_kernel
from compiled_llm.ops.triton._common import _reduce_angle


@triton.jit
def _norm(x1, x2, w1, w2, eps, D: tl.constexpr, HAS_W: tl.constexpr):
    # one reduction over both halves' squares, as _rstd_rows (its [rows, half] form) explains
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x1 * x1 + x2 * x2, 0) / D + eps)
    x1 = x1 * rstd
    x2 = x2 * rstd
    if HAS_W:
        x1 = x1 * w1
        x2 = x2 * w2
    return x1, x2


@triton.jit
def _rot_keys(v1, v2, KW, Inv, pos, d, HALF: tl.constexpr, dtype):
    """A K=V row's kept keys (AttentionSpec.rot_keys) from its stored value: rope(v * k_norm_weight) on the rows'
    first dims of each half (the value rounded to the cache dtype first, the angle with its product's exact residual,
    which keeps large positions exact). d: the dims of the tiles (masked by the caller's stores)."""
    dm = d < HALF
    x1 = v1.to(dtype).to(tl.float32) * tl.load(KW + d, mask=dm, other=0.0).to(tl.float32)
    x2 = v2.to(dtype).to(tl.float32) * tl.load(KW + HALF + d, mask=dm, other=0.0).to(tl.float32)
    inv = tl.load(Inv + d, mask=dm, other=0.0).to(tl.float32)
    p = tl.zeros_like(x1) + pos
    a = p * inv
    a = _reduce_angle(a) + tl.fma(p, inv + tl.zeros_like(p), -a)
    cs, sn = tl.cos(a), tl.sin(a)
    return (x1 * cs - x2 * sn).to(dtype), (x2 * cs + x1 * sn).to(dtype)


@triton.jit
def _qk_norm_rope_kernel(Q, K, V, Pos, Inv, QW, KW, Slots, QOut, KC, VC,
                         n_slots, eps,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_ot, stride_oh, stride_cs, stride_ch,
                         H: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
                         HAS_K: tl.constexpr, HAS_V: tl.constexpr, NORM_V: tl.constexpr, ROT: tl.constexpr = 0):
    # ROT > 0 (K=V rows that keep rotated keys, AttentionSpec.rot_keys): after the value, its keys' first ROT dims
    # of each half, [k1 | k2] (_rot_keys; KW is then the layer's k-norm weight)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    dm = d < HALF
    pos = tl.load(Pos + t).to(tl.float32)
    ang = _reduce_angle(pos * tl.load(Inv + d, mask=dm, other=0.0))
    cos = tl.cos(ang)
    sin = tl.sin(ang)
    if h < H:
        w1 = tl.load(QW + d, mask=dm, other=0.0).to(tl.float32)
        w2 = tl.load(QW + HALF + d, mask=dm, other=0.0).to(tl.float32)
        p = Q + t * stride_qt + h * stride_qh + d
        x1, x2 = _norm(tl.load(p, mask=dm, other=0.0), tl.load(p + HALF, mask=dm, other=0.0), w1, w2, eps,
                       2 * HALF, True)
        x1 = x1.to(QOut.dtype.element_ty).to(tl.float32)
        x2 = x2.to(QOut.dtype.element_ty).to(tl.float32)
        o = QOut + t * stride_ot + h * stride_oh + d
        tl.store(o, (x1 * cos - x2 * sin).to(QOut.dtype.element_ty), mask=dm)
        tl.store(o + HALF, (x2 * cos + x1 * sin).to(QOut.dtype.element_ty), mask=dm)
    elif HAS_V:
        kvh = h - H
        slot = tl.load(Slots + t, mask=t < n_slots, other=-1)
        if slot >= 0:
            c = slot * stride_cs + kvh * stride_ch + d
            if HAS_K:
                w1 = tl.load(KW + d, mask=dm, other=0.0).to(tl.float32)
                w2 = tl.load(KW + HALF + d, mask=dm, other=0.0).to(tl.float32)
                p = K + t * stride_kt + kvh * stride_kh + d
                x1, x2 = _norm(tl.load(p, mask=dm, other=0.0), tl.load(p + HALF, mask=dm, other=0.0), w1, w2,
                               eps, 2 * HALF, True)
                x1 = x1.to(KC.dtype.element_ty).to(tl.float32)
                x2 = x2.to(KC.dtype.element_ty).to(tl.float32)
                tl.store(KC + c, (x1 * cos - x2 * sin).to(KC.dtype.element_ty), mask=dm)
                tl.store(KC + c + HALF, (x2 * cos + x1 * sin).to(KC.dtype.element_ty), mask=dm)
            p = V + t * stride_vt + kvh * stride_vh + d
            v1 = tl.load(p, mask=dm, other=0.0)
            v2 = tl.load(p + HALF, mask=dm, other=0.0)
            if NORM_V:
                v1, v2 = _norm(v1, v2, v1, v2, eps, 2 * HALF, False)
            tl.store(VC + c, v1.to(VC.dtype.element_ty), mask=dm)
            tl.store(VC + c + HALF, v2.to(VC.dtype.element_ty), mask=dm)
            if ROT > 0:
                k1, k2 = _rot_keys(v1, v2, KW, Inv, pos, d, HALF, VC.dtype.element_ty)
                tl.store(VC + c + 2 * HALF, k1, mask=d < ROT)
                tl.store(VC + c + 2 * HALF + ROT, k2, mask=d < ROT)


@triton.jit
def _rstd_rows(x1, x2, eps, D: tl.constexpr):
    """Each row's RMS factor of float32 [rows, half] tiles x1, x2 (the row's two halves): one reduction over both
    halves' squares, not a sum of two (each a cross-warp round with its barriers). The decode kernel's QK prologue:
    26 -> 17 `bar.sync` before its first KV copy (Triton 3.6, sm_90, sliding layers); session 54, its write-back form
    at 1 x 1.1K / 8 x 1.1K / 4 x 8.5K: H200 10.23 / 26.75 / 16.70 -> 9.93 / 26.39 / 16.33 us, H100 10.45 / 32.70 /
    19.99 -> 10.31 / 32.52 / 19.79."""
    return 1.0 / tl.sqrt(tl.sum(x1 * x1 + x2 * x2, 1) / D + eps)


@triton.jit
def _norm_rows(x1, x2, w1, w2, eps, D: tl.constexpr, HAS_W: tl.constexpr):
    # _norm for [heads, half] tiles: one RMSNorm per row
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    rstd = _rstd_rows(x1, x2, eps, D)
    x1 = x1 * rstd[:, None]
    x2 = x2 * rstd[:, None]
    if HAS_W:
        x1 = x1 * w1[None, :]
        x2 = x2 * w2[None, :]
    return x1, x2


@triton.jit
def _norm_rope_rows(x1, x2, w1, w2, cos, sin, eps, HALF: tl.constexpr):
    """Query rows [rows, HALF] x 2: RMS-normed with weight, rounded to the input dtype, then rotated by cos / sin
    (broadcast to the rows); in the input dtype."""
    dt = x1.dtype
    n1, n2 = _norm_rows(x1, x2, w1, w2, eps, 2 * HALF, True)
    n1 = n1.to(dt).to(tl.float32)
    n2 = n2.to(dt).to(tl.float32)
    return (n1 * cos - n2 * sin).to(dt), (n2 * cos + n1 * sin).to(dt)


@triton.jit(do_not_specialize=["NH"])
def _qk_norm_rope_heads_kernel(Q, K, V, Pos, Inv, QW, KW, Slots, QOut, KC, VC,
                               n_slots, eps, NH,
                               stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                               stride_ot, stride_oh, stride_cs, stride_ch,
                               H: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, HPP: tl.constexpr,
                               HAS_K: tl.constexpr, HAS_V: tl.constexpr, NORM_V: tl.constexpr, ROT: tl.constexpr = 0):
    # prefill: program (t, j) takes token t's heads [j * HPP, (j + 1) * HPP) of the NH query and KV heads as one
    # [HPP, half] tile each (the token's angles computed once for them); one program per (token, head) made
    # 196K one-warp programs at 8K tokens, bound by block scheduling rather than bytes (H200: 138 us a layer)
    t = tl.program_id(0).to(tl.int64)
    hh = tl.program_id(1) * HPP + tl.arange(0, HPP)
    d = tl.arange(0, BLOCK)
    dm = d < HALF
    pos = tl.load(Pos + t).to(tl.float32)
    ang = _reduce_angle(pos * tl.load(Inv + d, mask=dm, other=0.0))
    cos = tl.cos(ang)[None, :]
    sin = tl.sin(ang)[None, :]
    mq = (hh < H)[:, None] & dm[None, :]
    w1 = tl.load(QW + d, mask=dm, other=0.0).to(tl.float32)
    w2 = tl.load(QW + HALF + d, mask=dm, other=0.0).to(tl.float32)
    p = Q + t * stride_qt + hh[:, None] * stride_qh + d[None, :]
    y1, y2 = _norm_rope_rows(tl.load(p, mask=mq, other=0.0), tl.load(p + HALF, mask=mq, other=0.0), w1, w2, cos, sin,
                             eps, HALF)
    o = QOut + t * stride_ot + hh[:, None] * stride_oh + d[None, :]
    tl.store(o, y1.to(QOut.dtype.element_ty), mask=mq)
    tl.store(o + HALF, y2.to(QOut.dtype.element_ty), mask=mq)
    if HAS_V:
        slot = tl.load(Slots + t, mask=t < n_slots, other=-1)
        kvh = tl.where(hh >= H, hh - H, 0)
        mkv = ((hh >= H) & (hh < NH) & (slot >= 0))[:, None] & dm[None, :]
        c = slot * stride_cs + kvh[:, None] * stride_ch + d[None, :]
        if HAS_K:
            w1 = tl.load(KW + d, mask=dm, other=0.0).to(tl.float32)
            w2 = tl.load(KW + HALF + d, mask=dm, other=0.0).to(tl.float32)
            p = K + t * stride_kt + kvh[:, None] * stride_kh + d[None, :]
            x1, x2 = _norm_rows(tl.load(p, mask=mkv, other=0.0), tl.load(p + HALF, mask=mkv, other=0.0), w1, w2,
                                eps, 2 * HALF, True)
            x1 = x1.to(KC.dtype.element_ty).to(tl.float32)
            x2 = x2.to(KC.dtype.element_ty).to(tl.float32)
            tl.store(KC + c, (x1 * cos - x2 * sin).to(KC.dtype.element_ty), mask=mkv)
            tl.store(KC + c + HALF, (x2 * cos + x1 * sin).to(KC.dtype.element_ty), mask=mkv)
        p = V + t * stride_vt + kvh[:, None] * stride_vh + d[None, :]
        v1 = tl.load(p, mask=mkv, other=0.0)
        v2 = tl.load(p + HALF, mask=mkv, other=0.0)
        if NORM_V:
            v1, v2 = _norm_rows(v1, v2, v1, v2, eps, 2 * HALF, False)
        tl.store(VC + c, v1.to(VC.dtype.element_ty), mask=mkv)
        tl.store(VC + c + HALF, v2.to(VC.dtype.element_ty), mask=mkv)
        if ROT > 0:  # (as _qk_norm_rope_kernel)
            k1, k2 = _rot_keys(v1, v2, KW, Inv, pos, d[None, :], HALF, VC.dtype.element_ty)
            mr = mkv & (d < ROT)[None, :]
            tl.store(VC + c + 2 * HALF, k1, mask=mr)
            tl.store(VC + c + 2 * HALF + ROT, k2, mask=mr)


@triton.jit
def _norm_rotate(src, w_ptr, d, dm, partner, rot, sign, cos, sin, eps, offset, D: tl.constexpr):
    """One head: RMSNorm scaled by offset + w, rounded to the input dtype, then rotate-half on the rotated
    channels (partner/sign: each channel's rotate-half partner and the sign it enters with)."""
    x = tl.load(src + d, mask=dm, other=0.0)
    xf = x.to(tl.float32)
    xp = tl.load(src + partner, mask=dm, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / D + eps)
    w = tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32) + offset
    wp = tl.load(w_ptr + partner, mask=dm, other=0.0).to(tl.float32) + offset
    xn = (xf * rstd * w).to(x.dtype).to(tl.float32)  # the norm's output in the model's dtype, as the reference
    pn = (xp * rstd * wp).to(x.dtype).to(tl.float32)
    return tl.where(rot, xn * cos + sign * pn * sin, xn)


@triton.jit(do_not_specialize=["n_slots", "H"])  # one build for every batch and head count (warm-up's is tiny)
def _qk_norm_mrope_kernel(Q, K, V, Cos, Sin, QW, KW, Slots, QOut, KC, VC,
                          n_slots, eps, offset, H,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_ct, stride_st, stride_ot, stride_oh, stride_cs, stride_ch,
                          D: tl.constexpr, ROT: tl.constexpr, BLOCK: tl.constexpr, HAS_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    dm = d < D
    half: tl.constexpr = ROT // 2
    rot = d < ROT
    partner = tl.where(d < half, d + half, tl.where(rot, d - half, d))
    sign = tl.where(d < half, -1.0, 1.0)
    cos = tl.load(Cos + t * stride_ct + d, mask=rot, other=1.0).to(tl.float32)
    sin = tl.load(Sin + t * stride_st + d, mask=rot, other=0.0).to(tl.float32)
    if h < H:
        y = _norm_rotate(Q + t * stride_qt + h * stride_qh, QW, d, dm, partner, rot, sign, cos, sin, eps, offset, D)
        tl.store(QOut + t * stride_ot + h * stride_oh + d, y.to(QOut.dtype.element_ty), mask=dm)
    else:
        kvh = h - H
        slot = tl.load(Slots + t, mask=t < n_slots, other=-1)
        if slot >= 0:
            c = slot * stride_cs + kvh * stride_ch + d
            if HAS_K:
                y = _norm_rotate(K + t * stride_kt + kvh * stride_kh, KW, d, dm, partner, rot, sign, cos, sin, eps,
                                 offset, D)
                tl.store(KC + c, y.to(KC.dtype.element_ty), mask=dm)
            vv = tl.load(V + t * stride_vt + kvh * stride_vh + d, mask=dm, other=0.0)
            tl.store(VC + c, vv.to(VC.dtype.element_ty), mask=dm)


def qk_norm_mrope_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, weight_offset: float,
                           layer_idx: int) -> torch.Tensor:
    n, num_heads, head_dim = q.shape
    rot = cos.shape[-1]
    assert rot % 2 == 0 and rot <= head_dim and q.stride(-1) == 1 and k.stride(-1) == 1
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _, spec, cache, group = layer_cache(layer_idx)
    kc, vc = _planes(cache, spec)
    slots = group.slot_mapping
    kv_heads = k.shape[1]
    v = v.reshape(v.shape[0], kv_heads, head_dim)
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    has_k = not spec.k_eq_v
    MONITOR.note("qk_norm_mrope_kv_write", (q.dtype, head_dim, rot, has_k))
    if n:
        _qk_norm_mrope_kernel[(n, num_heads + kv_heads)](
            q, k, v, cos, sin, q_weight, k_weight, slots, q_out, kc, vc,
            slots.shape[0], float(eps), float(weight_offset), num_heads,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos.stride(0), sin.stride(0), q_out.stride(0), q_out.stride(1), kc.stride(0), kc.stride(1),
            D=head_dim, ROT=rot, BLOCK=triton.next_power_of_2(head_dim), HAS_K=has_k,
            num_warps=1 if head_dim <= 256 else 4)
    return q_out


def _planes(cache: torch.Tensor, spec):
    """The K and V planes of a layer cache, flattened to [slots, kv_heads, head_dim]."""
    flat = cache.view(cache.shape[0], -1, spec.num_kv_heads, spec.head_dim)
    return flat[0], flat[-1]


PREFILL_HEADS_MIN_TOKENS = 256  # from here a program takes 8 of a token's heads (_qk_norm_rope_heads_kernel)


def heads_per_program(num_tokens: int) -> int:
    """Heads of one token a QK-norm + RoPE program takes: 1 for decode-sized batches (latency: the most
    programs), 8 from PREFILL_HEADS_MIN_TOKENS tokens."""
    return 1 if num_tokens < PREFILL_HEADS_MIN_TOKENS else 8


# At a decode step the op's work on a layer that owns its cache goes into the decode attention kernel: the op
# leaves its output unwritten and its inputs in the forward context (DEFERRED_QK: layer -> (that output, the
# kernel's paged_attention.DecodeQK, q)), and the Triton attention provider hands them to paged_decode, which
# normalises and rotates q per program and k / v in the program that reads the new key, and writes the cache.
# K!=V layers, and K=V layers whose rows keep their rotated keys (Gemma 4's global layers: the row is the normed
# value and those keys). One launch less a layer; the output's only reader is the attention op (checked there by
# address).
# The kernel's form (COMPILED_LLM_DECODE_QK): 2, the default, the write-back form (each program normalises and
# rotates only its group's real query heads, writes them to the op's output, then runs the plain kernel on it);
# 1 the in-register form (the BLOCK_H rows the dots pad a group to, normalised in registers); 0 the op's own
# launch at decode too. H100, session 48, alternating processes: 2 against 1 at batch 1 +0.9 / +1.2%, 1024x8x256
# +0.2%, 8192x4x512 +0.4%; a global layer's decode kernel 14.4 -> 10.2-10.8 us, the sliding ones unchanged.
DECODE_QK_ENV = "COMPILED_LLM_DECODE_QK"
DEFERRED_QK = "deferred_qk"
_BUILDING = threading.local()  # .on: warm-up builds the op's own kernels (a scratch decode step would defer them)


def _form() -> str:
    """COMPILED_LLM_DECODE_QK, the default 2 when unset (see above)."""
    return os.environ.get(DECODE_QK_ENV, "2")


def writes_back() -> bool:
    """The decode kernel's write-back form (paged_attention._decode_kernel QOut): the default (2), not
    COMPILED_LLM_DECODE_QK=1 (the in-register form)."""
    return _form() == "2"


def _defers(q: torch.Tensor, k, v, norm_v: bool, layer_idx: int) -> bool:
    """Whether this call's work goes into the layer's decode attention kernel (see DEFERRED_QK)."""
    if v is None or _form() == "0" or getattr(_BUILDING, "on", False):
        return False
    if not later_op_runs_with_this(q.device):
        return False
    ctx = current_forward_context()
    if ctx is None or not decode_batch(ctx):
        return False
    spec = ctx.layers.get(layer_idx)
    if spec is None or spec.sink_tokens or spec.omnikv is not None or spec.cache_layer != layer_idx:
        return False
    # K!=V layers, and K=V layers whose rows keep their rotated keys (normed values: Gemma 4's global layers)
    kinds = (k is not None and not spec.k_eq_v) or (spec.k_eq_v and spec.rot_keys > 0 and norm_v)
    return kinds and ATTENTION.provider_name(layer_idx) == "triton"


def _defer(q, k, v, positions, inv, q_weight, k_weight, eps, norm_v, layer_idx) -> torch.Tensor:
    from compiled_llm.ops.triton.paged_attention import DecodeQK  # (paged_attention imports this module)

    q_out = torch.empty_like(q)
    _, spec, _, group = layer_cache(layer_idx)
    slots = group.slot_mapping
    if spec.k_eq_v:  # the kept keys: from the value and the layer's k-norm weight
        k, k_weight = None, spec.k_norm_weight
    back = q_out if writes_back() else None
    current_forward_context().extra[DEFERRED_QK][layer_idx] = (
        q_out, DecodeQK(k, v, positions, inv, q_weight, k_weight, slots, eps, norm_v, back), q)
    return q_out


def qk_norm_rope_kv_write(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, positions: torch.Tensor,
                          inv_freq: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor | None, eps: float,
                          norm_v: bool, layer_idx: int) -> torch.Tensor:
    ctx = current_forward_context()
    if ctx is not None:
        ctx.extra.setdefault(DEFERRED_QK, {}).pop(layer_idx, None)  # an earlier run's (a capture's eager first run)
    inv = inv_freq if inv_freq.dtype == torch.float32 else inv_freq.float()
    if _defers(q, k, v, norm_v, layer_idx):
        return _defer(q, k, v, positions, inv, q_weight, k_weight, eps, norm_v, layer_idx)
    n, num_heads, head_dim = q.shape
    half = head_dim // 2
    q_out = torch.empty_like(q)
    has_v = v is not None
    kv_heads = 0
    kc = vc = q_out
    slots = positions
    n_slots, s_cs, s_ch, rot = 0, 0, 0, 0
    if has_v:
        _, spec, cache, group = layer_cache(layer_idx)
        kc, vc = _planes(cache, spec)
        slots, n_slots = group.slot_mapping, group.slot_mapping.shape[0]
        s_cs, s_ch = kc.stride(0), kc.stride(1)
        kv_heads = v.shape[1]
        if spec.k_eq_v:
            k = None
        rot = spec.rot_keys  # rows that keep rotated keys: made from the value with the layer's k-norm weight
        if rot:
            k_weight = spec.k_norm_weight
    has_k = k is not None
    kk = k if has_k else q
    vv = v if has_v else q
    block = triton.next_power_of_2(half)
    hpp = heads_per_program(n)
    # (each kernel its own key: a warm-up forward of a few tokens notes the one-head kernel's only)
    MONITOR.note("qk_norm_rope_kv_write", (q.dtype, head_dim, has_k, has_v, norm_v, num_heads, hpp, rot))
    if n:
        heads = num_heads + kv_heads
        args = (q, kk, vv, positions, inv, q_weight, k_weight if k_weight is not None else q_weight, slots, q_out,
                kc, vc, n_slots, float(eps))
        strides = (q.stride(0), q.stride(1), kk.stride(0), kk.stride(1), vv.stride(0), vv.stride(1),
                   q_out.stride(0), q_out.stride(1), s_cs, s_ch)
        flags = dict(H=num_heads, HALF=half, BLOCK=block, HAS_K=has_k, HAS_V=has_v, NORM_V=norm_v, ROT=rot)
        if hpp == 1:
            _qk_norm_rope_kernel[(n, heads)](*args, *strides, **flags, num_warps=1 if block <= 128 else 4)
        else:
            _qk_norm_rope_heads_kernel[(n, triton.cdiv(heads, hpp))](*args, heads, *strides, **flags, HPP=hpp,
                                                                       num_warps=4)
    return q_out


@triton.jit
def _kv_write_kernel(K, V, Slots, KC, VC, Pos, KNorm, InvFreq, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cs, stride_ch, D: tl.constexpr, BLOCK: tl.constexpr, HAS_K: tl.constexpr,
                     ROT: tl.constexpr = 0):
    # ROT > 0 (K=V layers that keep rotated keys, AttentionSpec.rot_keys): after the value, the row also gets
    # rope(v * k_norm_weight) of the first ROT dims of each half at the token's position, [k1 | k2], computed as
    # the decode kernel rebuilt them (float32 from the stored value, rounded once)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    slot = tl.load(Slots + t)
    if slot >= 0:
        d = tl.arange(0, BLOCK)
        dm = d < D
        c = slot * stride_cs + h * stride_ch + d
        if HAS_K:
            tl.store(KC + c, tl.load(K + t * stride_kt + h * stride_kh + d, mask=dm).to(KC.dtype.element_ty), mask=dm)
        tl.store(VC + c, tl.load(V + t * stride_vt + h * stride_vh + d, mask=dm).to(VC.dtype.element_ty), mask=dm)
        if ROT > 0:
            r = tl.arange(0, ROT)
            v_row = V + t * stride_vt + h * stride_vh
            k1, k2 = _rot_keys(tl.load(v_row + r), tl.load(v_row + D // 2 + r), KNorm, InvFreq,
                               tl.load(Pos + t).to(tl.float32), r, D // 2, VC.dtype.element_ty)
            base = slot * stride_cs + h * stride_ch + D
            tl.store(VC + base + r, k1)
            tl.store(VC + base + ROT + r, k2)


def kv_cache_write(k: torch.Tensor | None, v: torch.Tensor, layer_idx: int) -> None:
    ctx, spec, cache, group = layer_cache(layer_idx)
    kc, vc = _planes(cache, spec)
    slots = group.slot_mapping
    n = slots.shape[0]
    v = v.view(v.shape[0], spec.num_kv_heads, spec.head_dim)
    has_k = k is not None and not spec.k_eq_v
    k = k.view(k.shape[0], spec.num_kv_heads, spec.head_dim) if has_k else v
    block = triton.next_power_of_2(spec.head_dim)
    rot = spec.rot_keys
    pos = knorm = inv = slots
    if rot:
        pos = token_positions(ctx.attn_metadata, n)
        knorm, inv = spec.k_norm_weight, spec.inv_freq if spec.inv_freq.dtype == torch.float32 else spec.inv_freq.float()
    MONITOR.note("kv_cache_write", (v.dtype, spec.head_dim, has_k, rot))
    if n:
        _kv_write_kernel[(n, spec.num_kv_heads)](
            k, v, slots, kc, vc, pos, knorm, inv, k.stride(0), k.stride(1), v.stride(0), v.stride(1), kc.stride(0),
            kc.stride(1), D=spec.head_dim, BLOCK=block, HAS_K=has_k, ROT=rot)


def _qk_keys(facts: dict) -> list:
    dtype = facts["dtype"]
    layers = facts.get("layers", {})
    keys = set()
    for spec in layers.values():  # (the query head count is a constexpr of both kernels)
        for hpp in (heads_per_program(1), heads_per_program(PREFILL_HEADS_MIN_TOKENS)):  # decode's, prefill's
            if spec.writes_cache:
                keys.add((dtype, spec.head_dim, not spec.k_eq_v, True, True, spec.num_heads, hpp, spec.rot_keys))
            else:
                keys.add((dtype, spec.head_dim, False, False, False, spec.num_heads, hpp, 0))
    return sorted(keys, key=repr)


def _qk_compile(key, device) -> None:
    dtype, head_dim, has_k, has_v, norm_v, num_heads, hpp, rot = key
    _BUILDING.on = True  # this kernel, not the decode kernel's deferred form (paged_attention's warm-up builds that)
    try:
        if has_v:  # the KV path reads a forward context: launch on a throwaway one-layer cache
            from compiled_llm.ops.triton.providers import scratch_context

            with scratch_context(head_dim, dtype, device, k_eq_v=not has_k, rot_keys=rot):
                _qk_launch(key, device, 0)
        else:
            _qk_launch(key, device, None)
    finally:
        _BUILDING.on = False


def _qk_launch(key, device, layer):
    dtype, head_dim, has_k, has_v, norm_v, num_heads, hpp, _ = key
    inv = torch.zeros(head_dim // 2, dtype=torch.float32, device=device)
    w = torch.ones(head_dim, dtype=dtype, device=device)
    n = 2 if hpp == 1 else PREFILL_HEADS_MIN_TOKENS  # the decode kernel, or prefill's kernel of several heads
    assert heads_per_program(n) == hpp
    q = torch.zeros(n, num_heads, head_dim, dtype=dtype, device=device)
    kv = torch.zeros(n, 1, head_dim, dtype=dtype, device=device)
    pos = torch.zeros(n, dtype=torch.long, device=device)
    qk_norm_rope_kv_write(q, kv if has_k else None, kv if has_v else None, pos, inv, w, w, 1e-6, norm_v,
                          layer if layer is not None else -1)


register_kernel(JitKernel("qk_norm_rope_kv_write", "qk_norm_rope_kv_write", "triton", _qk_keys, _qk_compile))


def _mrope_keys(facts: dict) -> list:
    rot = facts.get("rotary_dim")
    if not rot:  # models without M-RoPE tables
        return []
    return sorted({(facts["dtype"], s.head_dim, rot, not s.k_eq_v) for s in facts.get("layers", {}).values()
                   if s.writes_cache}, key=repr)


def _mrope_compile(key, device) -> None:
    from compiled_llm.ops.triton.providers import scratch_context

    dtype, head_dim, rot, has_k = key
    with scratch_context(head_dim, dtype, device, k_eq_v=not has_k):
        q = torch.zeros(2, 2, head_dim, dtype=dtype, device=device)
        kv = torch.zeros(2, 1, head_dim, dtype=dtype, device=device)
        table = torch.zeros(2, rot, dtype=dtype, device=device)
        w = torch.zeros(head_dim, dtype=dtype, device=device)
        qk_norm_mrope_kv_write(q, kv, kv, table, table, w, w, 1e-6, 1.0, 0)


register_kernel(JitKernel("qk_norm_mrope_kv_write", "qk_norm_mrope_kv_write", "triton", _mrope_keys, _mrope_compile))


def _kv_keys(facts: dict) -> list:
    return sorted({(facts["dtype"], s.head_dim, not s.k_eq_v, s.rot_keys) for s in facts.get("layers", {}).values()
                   if s.writes_cache}, key=repr)


def _kv_compile(key, device) -> None:
    from compiled_llm.ops.triton.providers import scratch_context

    dtype, head_dim, has_k, rot = key
    with scratch_context(head_dim, dtype, device, k_eq_v=not has_k, rot_keys=rot):
        kv = torch.zeros(2, head_dim, dtype=dtype, device=device)
        kv_cache_write(kv if has_k else None, kv, 0)


register_kernel(JitKernel("kv_cache_write", "kv_cache_write", "triton", _kv_keys, _kv_compile))
