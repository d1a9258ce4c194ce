"""Causal depthwise conv1d + SiLU over a batch of sequences with per-sequence input windows (Qwen3.5's
Gated DeltaNet layers), in two launches and no host sync:

1. `_conv_kernel`: every (token tile, channel tile) program computes out[t] = silu(sum_j w[:, j] * ext[t + j])
   where ext is the sequence's saved window (K-1 inputs; zeros on its first chunk) followed by its tokens.
   The sequence of each token comes from the step's layout (ops/state.py: seq_of, built on the host once per
   step); at decode, token t is sequence t's, and the kernel needs no map.
2. `_state_kernel`: one program per (sequence, channel tile) writes the new window, the last K-1 entries of
   ext, over the old one (after launch 1 has read it).
A decode step is launch 1 alone: each program moves its own windows, and for 2 to 4 taps it reads each window
entry and token once, for both the conv and the move (_conv_taps, _conv_silu_taps, _conv_store_moved: the
helpers the delta rule's fused decode launch calls too, so both compute the same values).

Rows past the last sequence (CUDA-graph padding) come out zero, as in the reference; sequences without tokens
(whole-graph decode padding) leave their slot alone. Only device tensors are read: a CUDA graph replays both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compiled_llm.ops.jit import JitKernel, register_kernel
from compiled_llm.ops.state import WARM_LAYOUTS, StateLayout, get_state_metadata


@triton.jit
def _conv_taps(X, CS, t64, sx_t, slot, scs_n, scs_c, ch, mask, keep, KW: tl.constexpr):
    """A decode token's channels `ch` as stored, for a kernel of 2 to 4 taps: its window's saved inputs w0, w1,
    w2 (those past K - 1 and, without an initial state (keep false), all of them zeros) and the token's inputs
    x. Read once, for both the conv (_conv_silu_taps) and the window's move (_conv_store_moved): the decode
    branch of `_conv_kernel` ([tokens, channels] tiles: t64 and slot columns, ch a row) and the delta rule's
    fused decode launch (scalars and a channel vector) both take them. Vectors, not a [channels, taps] tile: a
    reduction over such a tile would hand its layout to the delta rule's state tile, which the outputs multiply
    (a 64 KB conversion through shared memory)."""
    tl.static_assert((KW >= 2) & (KW <= 4), "the fused decode conv takes 2 to 4 taps")
    base = CS + slot * scs_n + ch * scs_c
    w0 = tl.load(base, mask=mask & keep, other=0.0)
    if KW > 2:
        w1 = tl.load(base + 1, mask=mask & keep, other=0.0)
    else:
        w1 = tl.zeros_like(w0)
    if KW > 3:
        w2 = tl.load(base + 2, mask=mask & keep, other=0.0)
    else:
        w2 = tl.zeros_like(w0)
    x = tl.load(X + t64 * sx_t + ch, mask=mask, other=0.0)
    return w0, w1, w2, x


@triton.jit
def _conv_silu_taps(w0, w1, w2, x, CW, ch, cmask, KW: tl.constexpr):
    """silu(causal conv) from _conv_taps' inputs (weight CW [channels, KW]; cmask: the channels that exist),
    rounded to the token's dtype and returned in float32: the same products and sums in the same order as the
    general loop of `_conv_kernel`, so the same values."""
    acc = tl.zeros(x.shape, tl.float32)
    acc += w0.to(tl.float32) * tl.load(CW + ch * KW, mask=cmask, other=0.0).to(tl.float32)
    if KW > 2:
        acc += w1.to(tl.float32) * tl.load(CW + ch * KW + 1, mask=cmask, other=0.0).to(tl.float32)
    if KW > 3:
        acc += w2.to(tl.float32) * tl.load(CW + ch * KW + 2, mask=cmask, other=0.0).to(tl.float32)
    acc += x.to(tl.float32) * tl.load(CW + ch * KW + (KW - 1), mask=cmask, other=0.0).to(tl.float32)
    y = acc / (1.0 + tl.exp(-acc))
    return y.to(x.dtype).to(tl.float32)


@triton.jit
def _conv_store_moved(CS, slot, scs_n, scs_c, ch, mask, w1, w2, x, KW: tl.constexpr):
    """The windows of channels `ch` moved by the token, from the values _conv_taps read (no second read):
    window[i] = (old window ++ token)[i + 1]."""
    base = CS + slot * scs_n + ch * scs_c
    if KW > 2:
        tl.store(base, w1, mask=mask)
    if KW > 3:
        tl.store(base + 1, w2, mask=mask)
    tl.store(base + (KW - 2), x.to(CS.dtype.element_ty), mask=mask)


@triton.jit
def _conv_shift(X, CS, t64, sx_t, slot, scs_n, scs_c, ch, mask, keep, KW: tl.constexpr):
    """The windows of channels `ch` move by the decode token: window[i] = (old window ++ token)[i + 1]; without
    an initial state (keep false) the old window counts as zeros. t64 and slot are columns and ch a row (the
    decode branch's [tokens, channels] tile) for kernel sizes outside _conv_taps' 2 to 4, which reads each input
    once instead."""
    base = CS + slot * scs_n + ch * scs_c
    for i in tl.static_range(KW - 1):
        if i + 1 < KW - 1:
            xv = tl.load(base + (i + 1), mask=mask & keep, other=0.0)
        else:
            xv = tl.load(X + t64 * sx_t + ch, mask=mask, other=0.0)
        tl.store(base + i, xv.to(CS.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_tokens", "n_mapped", "n_seqs"])  # per-step counts: one build for all
def _conv_kernel(X, W, Cache, Out, SeqOf, Qsl, Slots, Init,
                 n_tokens, n_mapped, n_seqs, dim,
                 stride_xt, stride_ot, stride_cs, stride_cd,
                 K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, DECODE: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < dim
    if DECODE:  # token t, if any, is sequence t's only token
        seq = t
    else:  # n_mapped: the tokens the map covers (the rows after them are padding)
        seq = tl.load(SeqOf + t, mask=t < n_mapped, other=n_seqs)
    in_batch = seq < n_seqs
    seq_c = tl.where(in_batch, seq, 0)
    start = tl.load(Qsl + seq_c, mask=in_batch, other=0)
    end = tl.load(Qsl + seq_c + 1, mask=in_batch, other=0)
    live = in_batch & (t >= start) & (t < end)
    slot = tl.load(Slots + seq_c, mask=live, other=0).to(tl.int64)
    init = tl.load(Init + seq_c, mask=live, other=0) != 0
    TAPS: tl.constexpr = DECODE and (K >= 2) and (K <= 4)  # each input read once, for the conv and the move
    if TAPS:  # token t is sequence t's, its K - 1 earlier inputs all in the window
        t64, slot2, ch = t.to(tl.int64)[:, None], slot[:, None], d[None, :]
        m = live[:, None] & dmask[None, :]
        w0, w1, w2, xv = _conv_taps(X, Cache, t64, stride_xt, slot2, stride_cs, stride_cd, ch, m, init[:, None], K)
        y = _conv_silu_taps(w0, w1, w2, xv, W, ch, dmask[None, :], K)
    else:
        acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
        for j in tl.static_range(K):
            src = t - (K - 1) + j  # the input this tap reads; before `start` it is in the saved window
            in_x = live & (src >= start)
            xv = tl.load(X + src.to(tl.int64)[:, None] * stride_xt + d[None, :],
                         mask=in_x[:, None] & dmask[None, :], other=0.0).to(tl.float32)
            widx = (K - 1) - (start - src)  # position in the window [0, K-1)
            in_s = live & init & (src < start) & (widx >= 0)
            sv = tl.load(Cache + slot[:, None] * stride_cs + d[None, :] * stride_cd + widx[:, None],
                         mask=in_s[:, None] & dmask[None, :], other=0.0).to(tl.float32)
            wv = tl.load(W + d * K + j, mask=dmask, other=0.0).to(tl.float32)
            acc += (xv + sv) * wv[None, :]
        y = acc / (1.0 + tl.exp(-acc))
    y = tl.where(live[:, None], y, 0.0)
    tl.store(Out + t.to(tl.int64)[:, None] * stride_ot + d[None, :], y.to(Out.dtype.element_ty),
             mask=(t < n_tokens)[:, None] & dmask[None, :])
    # a decode step's window moves by its one token here (no state launch); each (sequence, channel) is this
    # program's alone, read above before written
    if TAPS:
        _conv_store_moved(Cache, slot2, stride_cs, stride_cd, ch, m, w1, w2, xv, K)
    elif DECODE:  # other kernel sizes: read again
        _conv_shift(X, Cache, t.to(tl.int64)[:, None], stride_xt, slot[:, None], stride_cs, stride_cd, d[None, :],
                    live[:, None] & dmask[None, :], init[:, None], K)


@triton.jit
def _state_kernel(X, Cache, Qsl, Slots, Init, dim,
                  stride_xt, stride_cs, stride_cd,
                  K: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr):
    s = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < dim
    start = tl.load(Qsl + s)
    n = tl.load(Qsl + s + 1) - start
    slot = tl.load(Slots + s).to(tl.int64)
    init = tl.load(Init + s) != 0
    i = tl.arange(0, BLOCK_W)  # new window entry i is ext[n + i]; ext = old window ++ tokens
    wmask = i < K - 1
    e = n + i
    from_x = wmask & (e >= K - 1)
    xv = tl.load(X + (start + e - (K - 1)).to(tl.int64)[:, None] * stride_xt + d[None, :],
                 mask=from_x[:, None] & dmask[None, :], other=0.0)
    from_s = wmask & (e < K - 1) & init
    base = Cache + slot * stride_cs + d[None, :] * stride_cd
    sv = tl.load(base + e[:, None], mask=from_s[:, None] & dmask[None, :], other=0.0)
    new = tl.where(from_x[:, None], xv.to(Cache.dtype.element_ty), sv)
    if n > 0:
        tl.store(base + i[:, None], new, mask=wmask[:, None] & dmask[None, :])


STATE_BLOCK_D = 128  # the window kernel's channel tile (a prefill's one launch a layer)


def conv_tiles(decode: bool) -> tuple[int, int, int]:
    """(block_t, block_d, num_warps) of the conv kernel: one choice for decode and one for prefill, whatever the
    batch (each is one build, warmed at start-up). Decode: 8 x 32 tiles (H200, Qwen3.5 35B-A3B's 8,192 channels,
    benchmarks/state_kernels.py, session 20: 3.46 us against 6.83 for 16 x 128 at 8 sequences, 2.44 against
    3.29 at 1, 7.11 against 13.77 at 32: the kernel is latency-bound, and more, smaller programs hide it), at 4
    warps since the decode branch reads each input once (session 30, one machine, us at 1 / 8 / 32 / 64
    sequences: the branch before at its best, 2 warps, 2.29 / 3.50 / 7.17 / 12.61; now at 2 warps 2.49 / 3.74 /
    7.18 / 11.98, at 4 warps 2.19 / 3.29 / 6.92 / 11.26, the best of the 24 tiles at each size).
    Prefill keeps 16 x 128 (not swept)."""
    return (8, 32, 4) if decode else (16, 128, 4)


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, cache: torch.Tensor,
                         layout: StateLayout, tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [tokens, dim] (rows past the layout's tokens: padding; any row stride, e.g. the [q; k; v] columns of
    a wider projection's output, read in place); weight [dim, K]; cache [num_slots, dim, K-1]
    (updated in place); layout: the step's sequences, its tensors on x's device; tiles: (block_t, block_d,
    num_warps) of the conv kernel, overriding conv_tiles (benchmarks/state_kernels.py sweeps them).
    Returns [tokens, dim]."""
    n, dim = x.shape
    k = weight.shape[1]
    num_seqs = layout.num_seqs
    if n == 0 or num_seqs == 0:
        return torch.zeros_like(x)
    out = torch.empty(n, dim, dtype=x.dtype, device=x.device)  # the conv kernel writes every row (padding: 0)
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight.contiguous()
    assert cache.shape[1:] == (dim, k - 1) and cache.stride(2) == 1, (cache.shape, dim, k)
    t = layout.tensors
    qsl, slots, init = t["query_start_loc"], t["slots"], t["has_initial_state"]
    seq_of = qsl if layout.decode else t["seq_of"]  # not read at decode
    block_t, block_d, warps = tiles or conv_tiles(layout.decode)
    _conv_kernel[(triton.cdiv(n, block_t), triton.cdiv(dim, block_d))](
        x, weight, cache, out, seq_of, qsl, slots, init,
        n, seq_of.numel(), num_seqs, dim, x.stride(0), out.stride(0), cache.stride(0), cache.stride(1),
        K=k, BLOCK_T=block_t, BLOCK_D=block_d, DECODE=layout.decode, num_warps=warps)
    if not layout.decode:  # a decode step's conv kernel moved the windows itself
        _state_kernel[(num_seqs, triton.cdiv(dim, STATE_BLOCK_D))](  # its own channel tile, whatever the conv's
            x, cache, qsl, slots, init, dim,
            x.stride(0), cache.stride(0), cache.stride(1),
            K=k, BLOCK_W=max(2, triton.next_power_of_2(k - 1)), BLOCK_D=STATE_BLOCK_D, num_warps=4)
    return out


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, layer_idx: int) -> torch.Tensor:
    """The op's Triton provider: state and batch layout from the forward context."""
    meta = get_state_metadata()
    return causal_conv1d_varlen(x, weight, meta.caches[layer_idx]["conv"], meta.layout)


# ---- JIT warm-up ---------------------------------------------------------------------------------

def _keys(facts: dict) -> list:
    """(dtype, channels, window) of each distinct recurrent layer's conv state (`facts["states"]`)."""
    return sorted({(facts["dtype"], spec.shapes["conv"][0], spec.shapes["conv"][1] + 1)
                   for spec in (facts.get("states") or {}).values() if "conv" in spec.shapes}, key=repr)


def _compile(key, device) -> None:
    dtype, dim, k = key
    weight = torch.zeros(dim, k, dtype=dtype, device=device)
    cache = torch.zeros(2, dim, k - 1, dtype=dtype, device=device)
    for slots, init, qsl in WARM_LAYOUTS:
        layout = StateLayout.build(slots, init, qsl, device)
        causal_conv1d_varlen(torch.zeros(qsl[-1], dim, dtype=dtype, device=device), weight, cache, layout)


register_kernel(JitKernel("causal_conv1d", "causal_conv1d", "triton", _keys, _compile))
