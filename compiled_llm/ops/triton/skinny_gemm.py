"""Skinny GEMM for decode: y[M, N] = x[M, K] @ W[N, K]^T with few token rows (M = 1..16) and a large weight.

At decode sizes the product is a weight stream: W is read once, x (a few rows) stays in cache, and the time is
N * K * itemsize / bandwidth plus a launch. The kernel is shaped for that:

- the grid is (N blocks, M blocks, K splits); program (n, m, s) reads W[n * block_n : +block_n, its K slice]
  once, in block_k columns per step, and keeps the whole [block_n, BLOCK_M] result in registers;
- the product is computed with W as the left operand ("swap AB"): acc[block_n, BLOCK_M] = W_tile @ x_tile^T,
  so the wide dimension (block_n) is the MMA's M and the token rows, padded to BLOCK_M = 16, its N
  (launch.dot; under the interpreter through _common._dot's float32 copies), or, for tiny M, a
  broadcast multiply of the W tile by each x row and a sum over K (launch.dot False, BLOCK_M = next power of
  two of M);
- split_k > 1 gives each of split_k programs a K slice; they write float32 partials to a workspace
  [split_k, M, N], and a second small kernel sums them in slice order (a fixed order: the result is the
  same run to run) and casts to the output dtype. split_k == 1 stores directly, one launch.

Accumulation is float32; the output has x's dtype. x may have a row stride (its columns contiguous); W is
[N, K] with contiguous rows. `skinny_launch` picks the tile shape from (M, N, K, SM count); the benchmark
(benchmarks/skinny_gemm.py) sweeps the alternatives on the GPU.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from compiled_llm.ops.jit import MONITOR, JitKernel, register_kernel
from compiled_llm.ops.linear import added_wide
from compiled_llm.ops.triton._common import (LAST_COMBINE, _dot, decode_pdl_steps, dot_f32, dot_precision,
                                             ticket_counters)


# M, N and y's row stride are not specialised (N = 1 would be a build of its own): one build per tile shape,
# K alignment (EVEN_K) and PARTIAL
@triton.jit(do_not_specialize=["M", "N", "stride_ym"])
def _skinny_kernel(
    X, W, Y, Part,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr,
    EVEN_K: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, F32: tl.constexpr, PDL: tl.constexpr = 0,
    Tickets=None, SPLIT: tl.constexpr = 1, MERGE: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
):
    # PDL (programmatic dependent launch, launched with launch_pdl; sm_90+ only; decode_mm's o_proj behind the
    # decode's combine takes 2 with PREFETCH, benchmarks/pdl_chain.py the rest): 1 waits for the previous kernel
    # before reading anything and lets the next launch once its weight stream is done; 2 also asks L2 for this
    # program's weight slice before the wait (the weights do not depend on the previous kernel, so their first
    # bytes arrive while it finishes); PREFETCH > 0: only the slice's first PREFETCH column steps
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    s = tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    nmask = n < N
    mmask = m < M
    w_rows = W + n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    x_rows = X + m.to(tl.int64)[None, :] * stride_xm  # [1, BLOCK_M]: x^T tiles are [BLOCK_K, BLOCK_M]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    k_lo = s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    cols = tl.arange(0, BLOCK_M)
    if PDL >= 2:
        p_hi = k_hi
        if PREFETCH > 0:
            p_hi = tl.minimum(k_lo + PREFETCH * BLOCK_K, k_hi)
        _prefetch_l2(W, w_rows, nmask, k_lo, p_hi, BLOCK_K, 128 // W.dtype.element_ty.primitive_bitwidth * 8)
    if PDL >= 1:
        gdc_wait()
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + kk
        kmask = ks < k_hi
        if EVEN_K:  # every block is whole: no column mask on the weight stream
            wv = tl.load(w_rows + ks[None, :], mask=nmask[:, None], other=0.0)
        else:
            wv = tl.load(w_rows + ks[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        if DOT:
            xv = tl.load(x_rows + ks[:, None], mask=kmask[:, None] & mmask[None, :], other=0.0)
            acc += _dot(wv, xv, PREC, F32)  # [BLOCK_N, BLOCK_K] @ [BLOCK_K, BLOCK_M]
        else:
            wf = wv.to(tl.float32)
            for i in tl.static_range(BLOCK_M):  # one row of x at a time: sum_k W[n, k] * x[i, k]
                row = pid_m * BLOCK_M + i
                xi = tl.load(X + row.to(tl.int64) * stride_xm + ks, mask=kmask & (row < M), other=0.0)
                part = tl.sum(wf * xi.to(tl.float32)[None, :], 1)  # [BLOCK_N]
                acc = tl.where(cols[None, :] == i, acc + part[:, None], acc)
    if PDL >= 1:
        gdc_launch_dependents()
    out_mask = nmask[:, None] & mmask[None, :]
    if not PARTIAL:  # one K slice: the result itself
        tl.store(Y + m.to(tl.int64)[None, :] * stride_ym + n[:, None], acc.to(Y.dtype.element_ty), mask=out_mask)
    else:  # slice s's float32 partial, summed by _split_reduce_kernel (or, MERGE, by the tile's last program)
        part_off = m.to(tl.int64)[None, :] * N + n[:, None]
        tl.store(Part + s * M * N + part_off, acc, mask=out_mask)
        if MERGE:
            # the tile's slices take tickets from its counter; the last one sums every slice's partial in slice
            # order (the same order whichever program is last: deterministic) and resets the counter, which is
            # then zero for the next launch (capturable: no memset)
            tile = pid_m * tl.num_programs(0) + pid_n
            tl.debug_barrier()  # every thread's stores precede the (one-thread) release below
            ticket = tl.atomic_add(Tickets + tile, 1, sem="acq_rel", scope="gpu")
            if ticket == SPLIT - 1:
                tl.atomic_xchg(Tickets + tile, 0, sem="relaxed", scope="gpu")
                tot = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
                for i in tl.static_range(SPLIT):
                    tot += tl.load(Part + i * M * N + part_off, mask=out_mask, other=0.0, cache_modifier=".cg")
                tl.store(Y + m.to(tl.int64)[None, :] * stride_ym + n[:, None], tot.to(Y.dtype.element_ty),
                         mask=out_mask)


@triton.jit
def _prefetch_l2(W, w_rows, nmask, k_lo, k_hi, BLOCK_K: tl.constexpr, LINE: tl.constexpr):
    """An L2 prefetch of every 128-byte line of the rows' [k_lo, k_hi) columns (LINE elements a line); lines
    past the matrix prefetch its first one instead (harmless)."""
    j = tl.arange(0, BLOCK_K // LINE) * LINE
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ok = nmask[:, None] & ((k0 + j) < k_hi)[None, :]
        ptrs = tl.where(ok, w_rows + (k0 + j)[None, :], W)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit(do_not_specialize=["M", "N", "split", "stride_ym"])
def _split_reduce_kernel(Part, Y, M, N, split, stride_ym, BLOCK: tl.constexpr):
    # y[m, n] = sum over s = 0..split-1 of part[s, m, n], in that order (deterministic), cast to y's dtype
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    total = M * N
    mask = offs < total
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(split):  # slice order
        acc += tl.load(Part + s * total + offs, mask=mask, other=0.0)
    m = offs // N
    n = offs - m * N
    tl.store(Y + m.to(tl.int64) * stride_ym + n, acc.to(Y.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class SkinnyLaunch:
    """block_n weight rows per program, block_k columns per step, split_k K slices (a float32 workspace and a
    reduce kernel past 1), warps and pipeline stages; dot: tensor-core product with M padded to 16, else a
    multiply-and-sum per x row (tiny M); merge: the slices' partials summed by each tile's last program (a
    ticket counter per tile) instead of a second launch."""
    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = True
    merge: bool = False  # split_k > 1: the last program of each tile sums the partials (no reduce kernel)


_SMS: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132 on an H200); 132 for the CPU (interpreter tests)."""
    if device.type != "cuda":
        return 132
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


TARGET_PROGRAMS_PER_SM = 4  # resident programs per SM that keep enough loads in flight to stream the weight


def skinny_launch(M: int, N: int, K: int, sms: int = 132, itemsize: int = 2) -> SkinnyLaunch:
    """The default launch. Columns per step: 512 bytes of a weight row (256 bf16, 128 fp32). Rows per program:
    64, halved (down to 16) while the N blocks alone give fewer than TARGET_PROGRAMS_PER_SM programs per SM.
    K is split only where those blocks are fewer than half the target (the split costs a second launch and a
    float32 round trip), then up to 8 ways (each slice at least two steps long) until the programs reach the
    target. The tensor-core path (M padded to 16) throughout; more than 16 rows take several M blocks."""
    block_k = max(16, min(512 // itemsize, triton.next_power_of_2(K)))
    target = TARGET_PROGRAMS_PER_SM * sms
    block_n = 64
    while block_n > 16 and triton.cdiv(N, block_n) < target:
        block_n //= 2
    n_blocks = triton.cdiv(N, block_n) * triton.cdiv(M, 16)
    split = 1
    steps = triton.cdiv(K, block_k)
    while split < 8 and 2 * n_blocks < target and n_blocks * split < target and steps // (2 * split) >= 2:
        split *= 2
    split = _effective_split(K, block_k, split)
    return SkinnyLaunch(block_n=block_n, block_k=block_k, split_k=split, num_warps=4, num_stages=3, dot=True)


def _k_per_split(K: int, block_k: int, split_k: int) -> int:
    return triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k


def _effective_split(K: int, block_k: int, split_k: int) -> int:
    """Slices that are not empty once each is rounded up to whole block_k steps (split_k may shrink)."""
    return triton.cdiv(K, _k_per_split(K, block_k, max(1, split_k)))


_WORKSPACE_BLOCK = 1024


def skinny_mm(x: torch.Tensor, w: torch.Tensor, launch: SkinnyLaunch | None = None, pdl: int = 0,
              prefetch: int = 0) -> torch.Tensor:
    """x [M, K] (rows may be strided, columns contiguous) @ w[N, K]^T -> [M, N] in x's dtype, float32 sums.
    launch: override skinny_launch's choice (benchmarks, tests). pdl: _skinny_kernel's PDL (CUDA on sm_90+
    only; benchmarks/pdl_chain.py); prefetch: its PREFETCH (pdl 2)."""
    assert x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1], (x.shape, w.shape)
    assert x.dtype == w.dtype and x.dtype in (torch.float32, torch.bfloat16, torch.float16), (x.dtype, w.dtype)
    if x.stride(1) != 1:
        x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_()
    lp = launch or skinny_launch(M, N, K, num_sms(x.device), x.element_size())
    block_m = 16 if lp.dot else max(1, triton.next_power_of_2(min(M, 16)))
    kps = _k_per_split(K, lp.block_k, lp.split_k)
    split = triton.cdiv(K, kps)
    part = torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1 else y
    grid = (triton.cdiv(N, lp.block_n), triton.cdiv(M, block_m), split)
    merge = lp.merge and split > 1
    extra = {}
    if merge:  # one counter buffer per weight shape: launches of one shape follow each other on one stream
        extra = dict(Tickets=ticket_counters(("skinny", x.device, N, K), grid[0] * grid[1], x.device), SPLIT=split,
                     MERGE=True)
    _skinny_kernel[grid](
        x, w, y, part, M, N, K, kps, x.stride(0), w.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=lp.block_n, BLOCK_K=lp.block_k, PARTIAL=split > 1, EVEN_K=K % lp.block_k == 0,
        DOT=lp.dot, PREC=dot_precision(x.dtype), F32=dot_f32(x.dtype),
        num_warps=lp.num_warps, num_stages=lp.num_stages,
        **({"PDL": pdl, "PREFETCH": prefetch, "launch_pdl": True} if pdl else {}),
        **extra,
    )
    if split > 1 and not merge:
        _split_reduce_kernel[(triton.cdiv(M * N, _WORKSPACE_BLOCK),)](
            part, y, M, N, split, y.stride(0), BLOCK=_WORKSPACE_BLOCK, num_warps=4)
    return y


# The decode projections' launches (ops/linear.py skinny_mm). Narrow (N < K): 64-row tiles of 128 columns, K in
# four slices merged by each tile's last program, four stages. H200 (benchmarks/skinny_gemm.py --try, session 33,
# us at M = 1 / 4 / 8, against session 28's 32-row tiles of 256 columns at three stages): Gemma 4's o_proj 9.46 /
# 9.53 / 9.63 -> 9.15 / 9.26 / 9.28 and global o_proj 14.77 / 15.05 / 15.23 -> 14.32 / 14.34 / 14.56, Qwen3.5's
# out_proj 7.61 / 7.61 / 7.68 -> 7.24 / 7.27 / 7.29, o_proj 7.56 / 7.62 / 7.71 -> 7.26 / 7.31 / 7.31, its shared
# expert's gate_up 4.22 / 4.25 / 4.22 -> 4.17 / 4.20 / 4.18 (cuBLAS: 10.7, 16.0, 9.0, 9.0, 5.1-12.7). Wide (N >= K,
# the shapes ops/linear.py WIDE_MEASURED lists): the 32-row tile unsplit, the best launch at each of them (Gemma 4's
# global qkv 16.27, cuBLAS 18.60; Qwen3.5's merged in_proj 14.90, cuBLAS 16.12; the LM heads)
DECODE_LAUNCH = SkinnyLaunch(block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=4, dot=True, merge=True)
WIDE_LAUNCH = SkinnyLaunch(block_n=32, block_k=256, split_k=1, num_warps=4, num_stages=3, dot=True)
SPLIT_ENV = "COMPILED_LLM_SKINNY_SPLIT"  # the narrow launch's K slices (an A/B of DECODE_LAUNCH's 4)


def decode_launch(n: int, k: int) -> SkinnyLaunch:
    """The op's launch for a weight [n, k]: split and merged where the output is narrow (or an added wide shape asks
    for it: ops/linear.py WIDE_ADD_ENV), else one pass."""
    if n < k or added_wide().get((n, k), False):
        split = int(os.environ.get(SPLIT_ENV, DECODE_LAUNCH.split_k))
        return DECODE_LAUNCH if split == DECODE_LAUNCH.split_k else dataclasses.replace(DECODE_LAUNCH, split_k=split)
    return WIDE_LAUNCH


def decode_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The skinny_mm op's Triton provider: x [M, K] @ w [N, K]^T with decode_launch's launch. The o_proj of the
    decode's combine output (the kernel just before it: _common.LAST_COMBINE) launches with PDL, its first weight
    steps asked of L2 while the combine runs (_common.DECODE_PDL_ENV). Behind other kernels PDL cost Qwen3.5 0.7%
    at batch 8 (its out_proj after the delta rule, its shared expert; session 35), so only there."""
    lp = decode_launch(w.shape[0], w.shape[1])
    MONITOR.note("skinny_mm", (x.dtype, x.shape[1] % lp.block_k == 0, lp.split_k > 1))
    after_combine = LAST_COMBINE[0] is not None and x.data_ptr() == LAST_COMBINE[0]
    LAST_COMBINE[0] = None
    steps = decode_pdl_steps(x.device) if after_combine and lp.split_k > 1 else 0
    return skinny_mm(x, w, lp, pdl=2 if steps else 0, prefetch=steps)


def _decode_keys(facts: dict) -> list:
    # one build of each launch serves every weight whose K is a multiple of the 256-column step (all the released
    # configs'): the narrow one and the wide one (a build whether or not this GPU takes a wide shape: one more
    # parallel build at warm-up)
    return [(facts["dtype"], True, split) for split in (True, False)] if "dtype" in facts and "hidden_size" in facts \
        else []


def _decode_compile(key, device) -> None:
    dtype, even, split = key
    k = 4 * 256 if even else 4 * 256 + 16
    n = 64 if split else 2 * k  # a narrow or a wide weight
    x, w = torch.zeros(2, k, dtype=dtype, device=device), torch.zeros(n, k, dtype=dtype, device=device)
    decode_mm(x, w)
    if split and decode_pdl_steps(x.device):  # the o_proj after a combine (launched with PDL): a build of its own
        LAST_COMBINE[0] = x.data_ptr()
        decode_mm(x, w)


register_kernel(JitKernel("skinny_mm", "skinny_mm", "triton", _decode_keys, _decode_compile))
