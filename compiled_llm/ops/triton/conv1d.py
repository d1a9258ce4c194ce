"""Causal depthwise conv1d + SiLU over a batch of sequences with per-sequence input windows (Qwen3.5's
Gated DeltaNet layers), in two launches and no host sync:

1. `_conv_kernel`: every (token tile, channel tile) program computes out[t] = silu(sum_j w[:, j] * ext[t + j])
   where ext is the sequence's saved window (K-1 inputs; zeros on its first chunk) followed by its tokens.
   The sequence of each token comes from a searchsorted over the offsets, so decode and prefill share it.
2. `_state_kernel`: one program per (sequence, channel tile) writes the new window, the last K-1 entries of
   ext, over the old one (after launch 1 has read it).

Rows past the last sequence (CUDA-graph padding) come out zero, as in the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compiled_llm.ops.state import get_state_metadata


@triton.jit
def _conv_kernel(X, W, Cache, Out, SeqOf, Qsl, Slots, Init,
                 n_tokens, n_seqs, dim,
                 stride_xt, stride_ot, stride_cs, stride_cd,
                 K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < dim
    seq = tl.load(SeqOf + t, mask=t < n_tokens, other=n_seqs)
    live = seq < n_seqs
    seq_c = tl.where(live, seq, 0)
    start = tl.load(Qsl + seq_c, mask=live, other=0)
    slot = tl.load(Slots + seq_c, mask=live, other=0).to(tl.int64)
    init = tl.load(Init + seq_c, mask=live, other=0) != 0
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


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, cache: torch.Tensor, query_start_loc: torch.Tensor,
                         slots: torch.Tensor, has_initial_state: torch.Tensor) -> torch.Tensor:
    """x [tokens, dim]; weight [dim, K]; cache [num_slots, dim, K-1] (updated in place); query_start_loc
    [num_seqs + 1], slots and has_initial_state [num_seqs], int32 on x's device. Returns [tokens, dim]."""
    n, dim = x.shape
    k = weight.shape[1]
    out = torch.zeros_like(x)
    num_seqs = slots.numel()
    if n == 0 or num_seqs == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight.contiguous()
    assert cache.shape[1:] == (dim, k - 1) and cache.stride(2) == 1, (cache.shape, dim, k)
    seq_of = torch.searchsorted(query_start_loc[1:], torch.arange(n, device=x.device, dtype=torch.int32), right=True)
    seq_of = seq_of.to(torch.int32)
    block_t, block_d = 16, 128
    _conv_kernel[(triton.cdiv(n, block_t), triton.cdiv(dim, block_d))](
        x, weight, cache, out, seq_of, query_start_loc, slots, has_initial_state,
        n, num_seqs, dim, x.stride(0), out.stride(0), cache.stride(0), cache.stride(1),
        K=k, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4)
    _state_kernel[(num_seqs, triton.cdiv(dim, block_d))](
        x, cache, query_start_loc, slots, has_initial_state, dim,
        x.stride(0), cache.stride(0), cache.stride(1),
        K=k, BLOCK_W=max(2, triton.next_power_of_2(k - 1)), BLOCK_D=block_d, num_warps=4)
    return out


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, layer_idx: int) -> torch.Tensor:
    """The op's Triton provider: state and batch layout from the forward context."""
    meta = get_state_metadata()
    qsl, slots, init = meta.device_tensors(x.device)
    return causal_conv1d_varlen(x, weight, meta.caches[layer_idx]["conv"], qsl, slots, init)
