"""Routed experts: the fused routers (Gemma 4's norm + scale + proj + softmax + top-k + renorm + per-expert
scale; Qwen3.5's proj + softmax + top-k + renorm, the same kernels without the norm and the scales) and a gated-MLP grouped GEMM over tokens sorted by expert: GELU-tanh (GEGLU, Gemma 4) or SiLU (SwiGLU,
Qwen3.5 MoE), chosen at compile time.

Expert weights are the checkpoint's packed layout: gate_up_proj [E, 2I, H] (rows 0..I-1 gate, I..2I-1 up),
down_proj [E, H, I]. y_t = sum_k w_tk * down_e(gelu_tanh(gate_e(x_t)) * up_e(x_t)).
Everything here avoids host syncs, so it can be captured in a CUDA graph. Token-count arguments are
do_not_specialize, so the only builds are one per launch-policy tier.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from compiled_llm.ops.triton._common import _gelu_tanh, dot_precision

# ----------------------------------------------------------------------------------------------------
# alignment


def moe_max_padded(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of the padded length: every expert (bucket) that has a pair may add block_m - 1 padding rows."""
    n = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(n, block_m) * block_m


@triton.jit(do_not_specialize=["n", "size"])
def _align_kernel(
    Ids, Cursor, SortedIds, ExpertIds, NumPadded,
    n, E, size,
    BLOCK_M: tl.constexpr, BINS: tl.constexpr, CHUNK: tl.constexpr, CB: tl.constexpr,
):
    # One program: bucket counts, padded segment ends (cumsum), then each pair's slot by an atomic cursor per
    # bucket. A pair's row in its expert's segment does not change its result (the grouped GEMMs treat rows
    # independently), so the atomics' order is harmless. Bucket E holds another rank's experts' pairs.
    c = tl.arange(0, CHUNK)
    bins = tl.arange(0, BINS)
    counts = tl.zeros([BINS], tl.int32)
    for i0 in range(0, n, CHUNK):
        m = c < n - i0
        e = tl.load(Ids + i0 + c, mask=m, other=0)
        e = tl.where((e >= 0) & (e < E), e, E)
        e = tl.where(m, e, BINS - 1)  # masked lanes count into the last bin, which no pair uses
        counts += tl.histogram(e.to(tl.int32), BINS)
    counts = tl.where(bins <= E, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(Cursor + bins, ends - padded)
    tl.store(NumPadded + bins - (BINS - 1), ends, mask=bins == BINS - 1)  # the total
    # padding rows hold n; blocks past the end and the other ranks' blocks have expert -1
    for j0 in range(0, size, CHUNK):
        tl.store(SortedIds + j0 + c, tl.full([CHUNK], 0, tl.int32) + n, mask=c < size - j0)
    cb = tl.arange(0, CB)
    for b0 in range(0, size // BLOCK_M, CB):
        start = (b0 + cb) * BLOCK_M
        eid = tl.sum((ends[None, :] <= start[:, None]).to(tl.int32), 1)
        tl.store(ExpertIds + b0 + cb, tl.where(eid < E, eid, -1), mask=b0 + cb < size // BLOCK_M)
    tl.debug_barrier()
    for i0 in range(0, n, CHUNK):
        m = c < n - i0
        e = tl.load(Ids + i0 + c, mask=m, other=0)
        e = tl.where((e >= 0) & (e < E), e, E)
        slot = tl.atomic_add(Cursor + e, 1, mask=m)
        tl.store(SortedIds + slot, (i0 + c).to(tl.int32), mask=m)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Sort (token, slot) pairs by expert and pad each expert's segment to a multiple of block_m. Pairs whose
    expert lies outside [0, num_experts) (another rank's, under expert parallelism) go to a last segment
    whose blocks have expert -1: the kernels write zeros for them. One kernel launch (a decode step's MoE
    layer used to spend a dozen small torch kernels here).

    Returns (sorted_ids [P] int32: flat pair index t * k + j, padding rows hold T * k; within an expert's
             segment the pairs' order is unspecified;
             expert_ids [P / block_m] int32: expert of each block, -1 for skipped pairs and past the end;
             num_padded [1] int32: the used length). P = moe_max_padded(T * k, E + 1, block_m) is known on the host.
    """
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    dev = flat.device
    size = moe_max_padded(n, num_experts + 1, block_m)
    bins = triton.next_power_of_2(num_experts + 2)
    cursor = torch.empty(bins, dtype=torch.int32, device=dev)
    sorted_ids = torch.empty(size, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(size // block_m, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    _align_kernel[(1,)](flat, cursor, sorted_ids, expert_ids, num_padded, n, num_experts, size,
                        BLOCK_M=block_m, BINS=bins, CHUNK=1024, CB=max(16, min(64, 8192 // bins)), num_warps=4)
    return sorted_ids, expert_ids, num_padded


# ----------------------------------------------------------------------------------------------------
# launch policy


@dataclass(frozen=True)
class MoELaunch:
    block_m: int
    # gate/up kernel (block_n columns of gate and the same of up)
    a_block_n: int
    a_block_k: int
    a_warps: int
    a_stages: int
    # down kernel
    b_block_n: int
    b_block_k: int
    b_warps: int
    b_stages: int


def moe_launch_policy(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int) -> MoELaunch:
    """Decode-sized batches are weight-bandwidth bound: small block_m, narrow N tiles for more programs.
    Prefill-sized batches are compute bound: large tiles."""
    pairs_per_expert = num_tokens * top_k / max(1, num_experts)
    if pairs_per_expert <= 2:  # decode (T <= ~32 for E=128, k=8)
        return MoELaunch(16, 32, 128, 4, 4, 64, 128, 4, 4)
    if pairs_per_expert <= 16:
        return MoELaunch(16, 64, 128, 4, 4, 128, 128, 4, 3)
    if pairs_per_expert <= 96:
        return MoELaunch(32, 64, 64, 4, 4, 128, 64, 4, 4)
    if pairs_per_expert <= 256:
        return MoELaunch(64, 64, 64, 4, 3, 128, 64, 8, 3)
    return MoELaunch(128, 64, 64, 8, 3, 128, 64, 8, 3)


# ----------------------------------------------------------------------------------------------------
# grouped GEMMs


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(
    X, W, SortedIds, ExpertIds, NumPadded, Act,
    num_pairs, N, K,
    stride_xt, stride_we, stride_wn, stride_an,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SILU: tl.constexpr, PREC: tl.constexpr,
):
    # act[row] = act_fn(x @ gate[e].T) * (x @ up[e].T) for a block of rows sorted by expert
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(NumPadded):
        return
    e = tl.load(ExpertIds + pid_m).to(tl.int64)
    if e < 0:  # skipped pairs: the down kernel zeroes their rows
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SortedIds + rows)
    rmask = pair < num_pairs
    tok = (pair // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    kk = tl.arange(0, BLOCK_K)
    a_ptr = X + tok[:, None] * stride_xt + kk[None, :]
    g_ptr = W + e * stride_we + cols[None, :] * stride_wn + kk[:, None]  # [BLOCK_K, BLOCK_N]
    u_ptr = g_ptr + N * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = kk < K - k0
        a = tl.load(a_ptr, mask=rmask[:, None] & kmask[None, :], other=0.0)
        bmask = kmask[:, None] & cmask[None, :]
        acc_g += tl.dot(a, tl.load(g_ptr, mask=bmask, other=0.0), input_precision=PREC)
        acc_u += tl.dot(a, tl.load(u_ptr, mask=bmask, other=0.0), input_precision=PREC)
        a_ptr += BLOCK_K
        g_ptr += BLOCK_K
        u_ptr += BLOCK_K
    if SILU:
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    else:
        act = _gelu_tanh(acc_g) * acc_u
    out_ptr = Act + rows.to(tl.int64)[:, None] * stride_an + cols[None, :]
    tl.store(out_ptr, act.to(Act.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    Act, W, SortedIds, ExpertIds, NumPadded, TopkWeights, Y,
    num_pairs, N, K,
    stride_an, stride_we, stride_wn, stride_yt,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
):
    # y[pair] = w_pair * act[row] @ down[e].T, scattered to the pair's row of [T * k, H]
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(NumPadded):
        return
    e = tl.load(ExpertIds + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SortedIds + rows)
    rmask = pair < num_pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    y_ptr = Y + pair.to(tl.int64)[:, None] * stride_yt + cols[None, :]
    if e < 0:  # pairs of another rank's experts contribute zero
        tl.store(y_ptr, tl.zeros([BLOCK_M, BLOCK_N], Y.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])
        return
    kk = tl.arange(0, BLOCK_K)
    a_ptr = Act + rows.to(tl.int64)[:, None] * stride_an + kk[None, :]
    b_ptr = W + e * stride_we + cols[None, :] * stride_wn + kk[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = kk < K - k0
        a = tl.load(a_ptr, mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptr, mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc += tl.dot(a, b, input_precision=PREC)
        a_ptr += BLOCK_K
        b_ptr += BLOCK_K
    w = tl.load(TopkWeights + pair, mask=rmask, other=0.0).to(tl.float32)
    acc = acc * w[:, None]
    tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


ACTIVATIONS = ("gelu_tanh", "silu")


def fused_moe(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, activation: str = "gelu_tanh", policy: MoELaunch | None = None) -> torch.Tensor:
    """x [T, H]; gate_up_proj [E, 2I, H]; down_proj [E, H, I]; topk_weights [T, k]; topk_ids [T, k].
    activation: gelu_tanh (GEGLU) or silu (SwiGLU). Returns [T, H] in x.dtype."""
    assert activation in ACTIVATIONS, activation
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = gate_up_proj.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    assert gate_up_proj.shape[2] == hidden and down_proj.shape == (num_experts, hidden, inter)
    assert x.stride(1) == 1 and gate_up_proj.stride(2) == 1 and down_proj.stride(2) == 1
    if num_tokens == 0:
        return torch.zeros_like(x)
    pol = policy or moe_launch_policy(num_tokens, top_k, num_experts, hidden, inter)
    num_pairs = num_tokens * top_k
    sorted_ids, expert_ids, num_padded = moe_align(topk_ids, num_experts, pol.block_m)
    num_blocks = expert_ids.numel()
    act = torch.empty(sorted_ids.numel(), inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, pol.a_block_n))](
        x, gate_up_proj, sorted_ids, expert_ids, num_padded, act,
        num_pairs, inter, hidden,
        x.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1), act.stride(0),
        TOP_K=top_k, BLOCK_M=pol.block_m, BLOCK_N=pol.a_block_n, BLOCK_K=pol.a_block_k,
        SILU=activation == "silu", PREC=dot_precision(x.dtype), num_warps=pol.a_warps, num_stages=pol.a_stages,
    )
    weights = topk_weights.to(torch.float32).contiguous()
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _down_kernel[(num_blocks, triton.cdiv(hidden, pol.b_block_n))](
        act, down_proj, sorted_ids, expert_ids, num_padded, weights, y,
        num_pairs, hidden, inter,
        act.stride(0), down_proj.stride(0), down_proj.stride(1), y.stride(0),
        BLOCK_M=pol.block_m, BLOCK_N=pol.b_block_n, BLOCK_K=pol.b_block_k, PREC=dot_precision(x.dtype),
        num_warps=pol.b_warps, num_stages=pol.b_stages,
    )
    if top_k == 1:
        return y
    return y.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)


def fused_geglu_moe(x, gate_up_proj, down_proj, topk_weights, topk_ids, *, policy: MoELaunch | None = None):
    return fused_moe(x, gate_up_proj, down_proj, topk_weights, topk_ids, activation="gelu_tanh", policy=policy)


def fused_swiglu_moe(x, gate_up_proj, down_proj, topk_weights, topk_ids, *, policy: MoELaunch | None = None):
    return fused_moe(x, gate_up_proj, down_proj, topk_weights, topk_ids, activation="silu", policy=policy)


# ----------------------------------------------------------------------------------------------------
# router


@triton.jit(do_not_specialize=["T", "slice_h"])
def _router_logits_kernel(
    X, Scale, W, Partial,
    T, H, E, eps, root, slice_h,
    stride_xt, stride_we,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, PREC: tl.constexpr,
    NORM: tl.constexpr,
):
    # program (t block, e block, h slice): partial[s, t, e] = sum over the slice of (x * rstd * scale * H^-0.5)[t] * W[e]
    # (NORM false: of x[t] * W[e], the plain projection)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    s = tl.program_id(2)
    tmask = t < T
    emask = e < E
    hh = tl.arange(0, BLOCK_H)
    x_row = X + t.to(tl.int64)[:, None] * stride_xt
    if NORM:
        ss = tl.zeros([BLOCK_T], tl.float32)  # the RMS needs the whole row; a decode batch's rows are few and cached
        for h0 in range(0, H, BLOCK_H):
            hmask = hh < H - h0
            xv = tl.load(x_row + h0 + hh[None, :], mask=tmask[:, None] & hmask[None, :], other=0.0).to(tl.float32)
            ss += tl.sum(xv * xv, 1)
        rstd = tl.rsqrt(ss / H + eps)
    acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    lo = s * slice_h
    for h0 in range(lo, lo + slice_h, BLOCK_H):
        hmask = hh < H - h0
        if NORM:
            xv = tl.load(x_row + h0 + hh[None, :], mask=tmask[:, None] & hmask[None, :], other=0.0).to(tl.float32)
            sc = tl.load(Scale + h0 + hh, mask=hmask, other=0.0).to(tl.float32) * root
            hv = (xv * rstd[:, None] * sc[None, :]).to(X.dtype.element_ty)  # the normed input in the model's dtype
        else:
            hv = tl.load(x_row + h0 + hh[None, :], mask=tmask[:, None] & hmask[None, :], other=0.0)
        wv = tl.load(W + e[None, :] * stride_we + h0 + hh[:, None], mask=hmask[:, None] & emask[None, :], other=0.0)
        acc += tl.dot(hv, wv.to(X.dtype.element_ty), input_precision=PREC)
    out = Partial + (s * T + t.to(tl.int64))[:, None] * E + e[None, :]
    tl.store(out, acc, mask=tmask[:, None] & emask[None, :])


@triton.jit(do_not_specialize=["T", "splits"])
def _router_topk_kernel(
    Partial, ExpertScale, OutW, OutIds,
    T, E, splits,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    EXPERT_SCALE: tl.constexpr, LOGITS: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    e = tl.arange(0, BLOCK_E)
    emask = e < E
    acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    for s in range(0, splits):  # the slices' partial logits, summed in a fixed order
        acc += tl.load(Partial + (s * T + t.to(tl.int64))[:, None] * E + e[None, :],
                       mask=tmask[:, None] & emask[None, :], other=0.0)
    if LOGITS != tl.float32:  # the logits rounded to the model's dtype, as its projection gives them
        acc = acc.to(LOGITS).to(tl.float32)
    # softmax over experts (fp32)
    logits = tl.where(emask[None, :], acc, float("-inf"))
    mx = tl.max(logits, 1)
    p = tl.exp(logits - mx[:, None])
    p = p / tl.sum(p, 1)[:, None]
    # top-k by repeated argmax (lowest index wins ties)
    kk = tl.arange(0, BLOCK_K)
    sel_w = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    sel_i = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(p, 1)
        idx = tl.min(tl.where(p == best[:, None], e[None, :], BLOCK_E), 1)
        sel_w = tl.where(kk[None, :] == i, best[:, None], sel_w)
        sel_i = tl.where(kk[None, :] == i, idx[:, None], sel_i)
        p = tl.where(e[None, :] == idx[:, None], -1.0, p)
    kmask = kk < TOP_K
    sel_w = sel_w / tl.sum(sel_w, 1)[:, None]
    omask = tmask[:, None] & kmask[None, :]
    if EXPERT_SCALE:
        sel_w = sel_w * tl.load(ExpertScale + sel_i, mask=omask, other=0.0).to(tl.float32)
    o_off = t.to(tl.int64)[:, None] * TOP_K + kk[None, :]
    tl.store(OutW + o_off, sel_w, mask=omask)
    tl.store(OutIds + o_off, sel_i, mask=omask)


ROUTER_PROGRAMS = 256  # enough programs to keep an H200's 132 SMs reading the router weight at decode sizes


def router_launch(num_tokens: int, hidden: int, num_experts: int) -> tuple[int, int, int, int]:
    """(block_t, block_e, splits, slice_h). A decode batch (a few rows) has too little work for one program
    per row block: the logits are split over expert blocks and hidden slices, so the [E, H] weight is read by
    many programs at once; the slices' partial sums are added in the top-k kernel."""
    block_h = 64
    block_t = 16 if num_tokens <= 1024 else 32
    block_e = 16 if num_tokens <= 64 else min(64, max(16, triton.next_power_of_2(num_experts)))
    rows = triton.cdiv(num_tokens, block_t) * triton.cdiv(num_experts, block_e)
    splits = max(1, min(triton.cdiv(hidden, 2 * block_h), ROUTER_PROGRAMS // rows))
    slice_h = triton.cdiv(triton.cdiv(hidden, splits), block_h) * block_h
    return block_t, block_e, triton.cdiv(hidden, slice_h), slice_h


_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def fused_router_topk(x: torch.Tensor, scale: torch.Tensor | None, proj_weight: torch.Tensor,
                      per_expert_scale: torch.Tensor | None, top_k: int, eps: float):
    """Gemma 4 router. x [T, H]; scale [H]; proj_weight [E, H]; per_expert_scale [E].
    Returns (weights [T, k] fp32, ids [T, k] int32), experts in descending probability.
    scale None: Qwen3.5's softmax router (no norm, no scales; the logits rounded to x's dtype first, as
    its projection gives them)."""
    norm = scale is not None
    num_tokens, hidden = x.shape
    num_experts = proj_weight.shape[0]
    assert x.stride(1) == 1 and proj_weight.stride(1) == 1 and top_k <= num_experts
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=x.device)
    if num_tokens == 0:
        return weights, ids
    block_t, block_e, splits, slice_h = router_launch(num_tokens, hidden, num_experts)
    partial = torch.empty(splits, num_tokens, num_experts, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(num_experts, block_e), splits)
    _router_logits_kernel[grid](
        x, scale.contiguous() if norm else x, proj_weight, partial,
        num_tokens, hidden, num_experts, float(eps), float(hidden ** -0.5), slice_h,
        x.stride(0), proj_weight.stride(0),
        BLOCK_T=block_t, BLOCK_H=64, BLOCK_E=block_e, PREC=dot_precision(x.dtype), NORM=norm, num_warps=4,
        num_stages=2,
    )
    has_scale = per_expert_scale is not None
    _router_topk_kernel[(triton.cdiv(num_tokens, block_t),)](
        partial, per_expert_scale.contiguous() if has_scale else partial, weights, ids, num_tokens, num_experts,
        splits, TOP_K=top_k, BLOCK_T=block_t, BLOCK_E=max(16, triton.next_power_of_2(num_experts)),
        BLOCK_K=triton.next_power_of_2(top_k), EXPERT_SCALE=has_scale,
        LOGITS=tl.float32 if norm else _TL_DTYPE[x.dtype], num_warps=4,
    )
    return weights, ids


def launch_variants(num_experts: int, top_k: int, hidden: int, inter: int, max_tokens: int) -> list[int]:
    """One token count per distinct kernel build the router and grouped GEMMs need for batches of 1 to
    max_tokens tokens (their launch constexprs change with the batch): what JIT warm-up runs, so that no
    batch size compiles a kernel while serving."""
    seen, out = set(), []
    for tokens in range(1, max(1, max_tokens) + 1):
        bt, be, _, _ = router_launch(tokens, hidden, num_experts)
        pol = moe_launch_policy(tokens, top_k, num_experts, hidden, inter)
        key = (bt, be, pol)
        if key not in seen:
            seen.add(key)
            out.append(tokens)
    return out
