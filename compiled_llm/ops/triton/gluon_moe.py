"""The grouped MoE GEMM's gate/up half (moe.py's _gate_up_kernel) as a Gluon kernel for Hopper: wgmma and TMA with
explicit layouts. moe.moe_launches runs it for the 128-row prefill tiers (MoELaunch.gluon) on sm_90; elsewhere
the Triton kernel runs. The down half (_down_gluon_kernel, MoELaunch.gluon_down) is an experiment, off by default
(COMPILED_LLM_MOE_GLUON_DOWN=1): its design is benchmarks/gluon_moe_down.py's docstring.

Semantics as _gate_up_kernel's: pairs p = t * k + j sorted by expert into blocks of BLOCK_M rows (moe_align:
sorted_ids, padding entries = num_pairs; expert_ids a block; num_padded), act[row] = act_fn(x[p // k] @
gate[e].T) * (x[p // k] @ up[e].T), act_fn the tanh GELU (GEGLU) or SiLU (SwiGLU), padding rows not stored,
blocks of expert -1 (another rank's experts) skipped.

Why Gluon: the gate and up tiles of a K step land in one [2 BLOCK_N, 64] buffer and go through one wgmma of
N = 2 BLOCK_N (the A tile read from shared memory once a step; Triton issues two dots of N = BLOCK_N), with
BLOCK_N = 128 at four stages in 192 KiB, the accumulator split in registers for the epilogue (a column and the one
BLOCK_N to its right sit in the same thread).
  - A CTA owns one row block (BLOCK_M = 128 rows: two warpgroups of 64 rows; 64: one) and BLOCK_N columns of gate
    and up; the column blocks of a row block are grid axis 0 (moe.py's n_fast order), so a block's gathered token
    rows come from L2 after the first column block reads them.
  - A: the block's token rows, gathered by 16-byte cp.async copies from every thread (Hopper's TMA has no row
    gather), zero-filled for padding rows and past K, into an NVMMA-swizzled [BLOCK_M, 64] buffer.
  - W: the descriptor views gate_up_proj as [E * 2I, H]; a K step's gate tile and up tile come by TMA into one
    buffer, one mbarrier a stage. Where BLOCK_N does not divide I (Gemma 4's 704 = 5.5 x 128), the last column
    block's tiles run into the next rows (up's first rows, the next expert's gate, or TMA's zeros past the end):
    computed and not stored.
  - Pipeline (one partition: every warp loads and multiplies): at K step i the CTA waits for its own cp.async
    group of tile i, fences (cp.async writes through the generic proxy, wgmma reads through the async one) and
    meets at a CTA barrier; past it both warpgroups have retired step i - 2's wgmma (one step in flight each), so
    tile i + STAGES - 2 loads into that stage.
  - Epilogue: the activation in fp32 registers, the product in the model's dtype through shared memory (the
    stages' space, free by then), then 16-byte row-masked stores.
FUSED = False (the prototype's comparison, benchmarks/gluon_moe_gate_up.py) issues two wgmma of N = BLOCK_N.

H100, session 65 (benchmarks/NOTES.md, the prototype at Gemma 4's shapes, equal to the engine's output on every
real row): 128 x 128 tiles at four stages 1,004-1,048 us at 8,192 tokens against _gate_up_kernel's 1,076-1,092
(3-8%, two machines), 2-5% faster at 4,096, tied at 1-2K (the expert weights' bytes bind). Gluon has no
interpreter: the CPU checks are the sm_90 builds (runtime/kernel_check.py); the numerics are checked on the GPU
(scripts/check_kernels_gpu.py --only moe).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier, tma,
                                                               warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BLOCK_K = 64
BLOCK_N, STAGES = 128, 4  # the engine's tile: f128x4 of the prototype
# a CTA-wide barrier (bar.sync): gl.thread_barrier in Triton 3.6, gl.barrier from Triton 3.7 on
_cta_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
_GL_DTYPE = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@gluon.jit
def _issue_loads(x_ptrs, rmask, kk, k0, K, w_desc, n0, N, a_buf, w_buf, bar, pred, BLOCK_N: gl.constexpr):
    """K step at column k0: the gathered A rows by cp.async (one commit group a step, also when nothing is
    copied, so that wait_group's count stays one group a step) and the gate / up tiles by TMA onto bar."""
    amask = rmask[:, None] & (kk < K - k0)[None, :] & pred
    async_copy.async_copy_global_to_shared(a_buf, x_ptrs + k0, mask=amask)
    async_copy.commit_group()
    mbarrier.expect(bar, 2 * w_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(w_desc, [n0, k0], bar, w_buf.slice(0, BLOCK_N), pred=pred)
    tma.async_copy_global_to_shared(w_desc, [n0 + N, k0], bar, w_buf.slice(BLOCK_N, BLOCK_N), pred=pred)


@gluon.jit
def gathered_rows(X, SortedIds, pid_m, num_pairs, stride_xt, ld_layout: gl.constexpr, TOP_K: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr):
    """Row block pid_m's token rows of X at the first K slice, [BLOCK_M, BLOCK_K] pointers in ld_layout (padding
    rows point at token 0, masked off by rmask), with the mask and the slice's column offsets kk."""
    rows = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld_layout))
    pair = gl.load(SortedIds + rows)
    rmask = pair < num_pairs
    tok = gl.where(rmask, pair // TOP_K, 0).to(gl.int64)
    kk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, ld_layout))
    return X + tok[:, None] * stride_xt + kk[None, :], rmask, kk


@gluon.jit
def gated_act(acc_g, acc_u, SILU: gl.constexpr):
    """SwiGLU (SILU) or GEGLU of the two products, in moe.py's _gated_act form: the tanh GELU as
    x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)."""
    if SILU:
        z = acc_g
    else:
        z = 1.5957691216057308 * (acc_g + 0.044715 * acc_g * acc_g * acc_g)
    return acc_g / (1.0 + gl.exp(-z)) * acc_u


@gluon.jit(do_not_specialize=["num_pairs", "E"])  # E: JIT warm-up builds on fewer experts
def _gate_up_gluon_kernel(X, w_desc, SortedIds, ExpertIds, NumPadded, Act, num_pairs, N, K, E, stride_xt, stride_an,
                    TOP_K: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                    STAGES: gl.constexpr, FUSED: gl.constexpr, SILU: gl.constexpr):
    """X [T, K]; w_desc: gate_up_proj as [E * 2N, K] in [BLOCK_N, BLOCK_K] boxes; Act [padded rows, N].
    Program (column block, row block)."""
    gl.static_assert(gl.num_warps() * 16 == BLOCK_M, "a warp a 16-row slice of the wgmma tile")
    gl.static_assert(STAGES >= 3, "the prefetch distance is STAGES - 2")
    gl.static_assert(BLOCK_K == 64, "the row loads: 8 threads x 16 bytes a 128-byte row")
    NW: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = X.dtype.element_ty
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])  # 16-byte chunks, 128 B a row
    a_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)

    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    if pid_m * BLOCK_M >= gl.load(NumPadded):
        return
    e = gl.load(ExpertIds + pid_m)
    if (e < 0) | (e >= E):  # skipped pairs (another rank's experts): the down kernel zeroes their rows
        return

    x_ptrs, rmask, kk = gathered_rows(X, SortedIds, pid_m, num_pairs, stride_xt, ld_layout, TOP_K, BLOCK_M, BLOCK_K)
    n0 = e * 2 * N + pid_n * BLOCK_N  # the gate tile's first row of W [E * 2N, K]; the up tile's is n0 + N

    a_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_sl)
    w_smem = gl.allocate_shared_memory(dtype, [STAGES, 2 * BLOCK_N, BLOCK_K], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    fence_async_shared()  # the initialised barriers are visible to the TMA unit before the first copy

    n_k = gl.cdiv(K, BLOCK_K)
    for s in gl.static_range(STAGES - 2):
        _issue_loads(x_ptrs, rmask, kk, s * BLOCK_K, K, w_desc, n0, N, a_smem.index(s), w_smem.index(s),
                     bars.index(s), s < n_k, BLOCK_N)

    if FUSED:
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                             instr_shape=[16, 2 * BLOCK_N, 16])
        acc = gl.zeros([BLOCK_M, 2 * BLOCK_N], gl.float32, acc_layout)
    else:
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        acc_g = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        acc_u = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)

    for i in range(0, n_k):
        st = i % STAGES
        async_copy.wait_group(STAGES - 3)  # this thread's copies of tile i are in (tiles i + 1 .. may still run)
        fence_async_shared()  # ... and visible to the async proxy that wgmma reads through
        _cta_barrier()  # every thread's part of tile i; both warpgroups past step i - 2's wgmma
        nxt = i + STAGES - 2
        sn = nxt % STAGES
        _issue_loads(x_ptrs, rmask, kk, nxt * BLOCK_K, K, w_desc, n0, N, a_smem.index(sn), w_smem.index(sn),
                     bars.index(sn), nxt < n_k, BLOCK_N)
        mbarrier.wait(bars.index(st), (i // STAGES) & 1)
        a_s = a_smem.index(st)
        w_s = w_smem.index(st)
        if FUSED:
            acc = warpgroup_mma(a_s, w_s.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=[acc])
        else:
            acc_g = warpgroup_mma(a_s, w_s.slice(0, BLOCK_N).permute((1, 0)), acc_g, is_async=True)
            acc_u = warpgroup_mma(a_s, w_s.slice(BLOCK_N, BLOCK_N).permute((1, 0)), acc_u, is_async=True)
            acc_g, acc_u = warpgroup_mma_wait(2, deps=[acc_g, acc_u])
    if FUSED:
        acc = warpgroup_mma_wait(0, deps=[acc])
        # columns c and c + BLOCK_N (gate and up of one output column) are in the same thread: a register split
        acc_g, acc_u = acc.reshape([BLOCK_M, 2, BLOCK_N]).permute((0, 2, 1)).split()
    else:
        acc_g, acc_u = warpgroup_mma_wait(0, deps=[acc_g, acc_u])
    async_copy.wait_group(0)  # the tail's empty groups
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))
    store_act(gated_act(acc_g, acc_u, SILU).to(dtype), SortedIds, Act, pid_m, pid_n, num_pairs, N, stride_an,
              BLOCK_M, BLOCK_N)


@gluon.jit
def store_act(act, SortedIds, Act, pid_m, pid_n, num_pairs, N, stride_an, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr):
    """The epilogue's store: the [BLOCK_M, BLOCK_N] activations through shared memory into 16-byte row-masked
    stores (padding rows and columns past N not stored)."""
    st_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_N // 8), BLOCK_N // 8], [gl.num_warps(), 1],
                                               [1, 0])
    o_smem = gl.allocate_shared_memory(act.dtype, [BLOCK_M, BLOCK_N],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], act.dtype))
    o_smem.store(act)
    _cta_barrier()
    ro = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, st_layout))
    co = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, st_layout))
    omask = (gl.load(SortedIds + ro) < num_pairs)[:, None] & (co < N)[None, :]
    gl.store(Act + ro.to(gl.int64)[:, None] * stride_an + co[None, :], o_smem.load(st_layout), mask=omask)


@gluon.jit
def _down_load_step(j, n_k, pid, nprog, num_n, total, a_desc, w_desc, ExpertIds, a_smem, w_smem, bars, N, E,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """TMA of the CTA's global K step j (its (j // n_k)-th tile, K step j % n_k) into stage j % STAGES; nothing
    past the CTA's last step. The tile's expert is looked up again here (a scalar load, L1-resident) so that
    the next tile's loads can start before this one's epilogue."""
    tile = pid + (j // n_k) * nprog
    pred = tile < total
    pid_m = tile // num_n
    e = gl.load(ExpertIds + pid_m, mask=pred, other=0)
    e = gl.where((e >= 0) & (e < E), e, 0)  # a skipped block's loads read expert 0 (its result is discarded)
    k0 = (j % n_k) * BLOCK_K
    st = j % STAGES
    bar = bars.index(st)
    mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [pid_m * BLOCK_M, k0], bar, a_smem.index(st), pred=pred)
    tma.async_copy_global_to_shared(w_desc, [e * N + (tile - pid_m * num_n) * BLOCK_N, k0], bar, w_smem.index(st),
                                    pred=pred)


@gluon.jit
def _down_store_tile(acc, o_smem, SortedIds, ExpertIds, TopkWeights, Y, pid_m, pid_n, num_pairs, N, E, stride_yt,
                     acc_layout: gl.constexpr, st_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """A down tile's epilogue: rows scaled by their pick's weight in fp32, bf16 through o_smem, stored
    with 16-byte row-masked stores to the pairs' rows of Y. Another rank's block stores zeros: its activation rows
    were never written (NaN, maybe: not 0 * acc)."""
    e = gl.load(ExpertIds + pid_m)
    ok = (e >= 0) & (e < E)
    rw = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
    pw = gl.load(SortedIds + rw)
    w = gl.load(TopkWeights + pw, mask=pw < num_pairs, other=0.0).to(gl.float32)
    o_smem.store(gl.where(ok, acc * w[:, None], 0.0).to(Y.dtype.element_ty))
    _cta_barrier()
    ro = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, st_layout))
    co = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, st_layout))
    pair = gl.load(SortedIds + ro)
    omask = (pair < num_pairs)[:, None] & (co < N)[None, :]
    gl.store(Y + pair.to(gl.int64)[:, None] * stride_yt + co[None, :], o_smem.load(st_layout), mask=omask)


@gluon.jit(do_not_specialize=["num_pairs", "E"])
def _down_gluon_kernel(a_desc, w_desc, SortedIds, ExpertIds, NumPadded, TopkWeights, Y, num_pairs, N, K, E,
                       stride_yt, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                       STAGES: gl.constexpr):
    """a_desc: act [rows, K] in [BLOCK_M, BLOCK_K] boxes; w_desc: down_proj as [E * N, K] in [BLOCK_N, BLOCK_K]
    boxes (N a multiple of BLOCK_N); Y [num_pairs, N]. Persistent: program pid takes tiles pid, pid + programs,
    ... of cdiv(NumPadded, BLOCK_M) row blocks x N / BLOCK_N column blocks."""
    NW: gl.constexpr = gl.num_warps()
    gl.static_assert(NW * 16 == BLOCK_M, "a warp a 16-row slice of the wgmma tile")
    gl.static_assert(STAGES >= 2, "prefetch distance STAGES - 1")
    dtype: gl.constexpr = Y.dtype.element_ty
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    # row-major for the stores: a thread 8 consecutive columns (16 bytes), a warp's lanes along one row's columns
    TPC: gl.constexpr = BLOCK_N // 8 if BLOCK_N // 8 < 32 else 32
    st_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPC, TPC], [NW, 1], [1, 0])
    o_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)

    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    num_n = N // BLOCK_N
    total = gl.cdiv(gl.load(NumPadded), BLOCK_M) * num_n
    my_tiles = gl.cdiv(total - pid, nprog)  # programs never outnumber the tiles' upper bound; may be 0 here
    n_k = gl.cdiv(K, BLOCK_K)

    a_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    w_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    o_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], o_sl)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    fence_async_shared()  # the initialised barriers are visible to the TMA unit before the first copy

    for s in gl.static_range(STAGES - 1):
        _down_load_step(s, n_k, pid, nprog, num_n, total, a_desc, w_desc, ExpertIds, a_smem, w_smem, bars, N, E,
                        BLOCK_M, BLOCK_N, BLOCK_K, STAGES)

    it = 0  # the CTA's global K step: the ring's stage and phase continue across tiles
    for t in range(0, my_tiles):
        tile = pid + t * nprog
        pid_m = tile // num_n
        pid_n = tile - pid_m * num_n
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        for kk in range(0, n_k):
            st = it % STAGES
            mbarrier.wait(bars.index(st), (it // STAGES) & 1)
            acc = warpgroup_mma(a_smem.index(st), w_smem.index(st).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=[acc])
            # this warpgroup has retired step it - 1; the barrier: the other one too, so its stage is free (it also
            # orders the previous epilogue's reads of o_smem before the next one's writes)
            _cta_barrier()
            _down_load_step(it + STAGES - 1, n_k, pid, nprog, num_n, total, a_desc, w_desc, ExpertIds, a_smem,
                            w_smem, bars, N, E, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)
            it += 1
        acc = warpgroup_mma_wait(0, deps=[acc])

        # epilogue (the next tile's first STAGES - 1 loads are in flight meanwhile)
        _down_store_tile(acc, o_smem, SortedIds, ExpertIds, TopkWeights, Y, pid_m, pid_n, num_pairs, N, E,
                         stride_yt, acc_layout, st_layout, BLOCK_M, BLOCK_N)

    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))


def fits(x: torch.Tensor, gate_up_proj: torch.Tensor, block_m: int) -> str | None:
    """None where the kernel can run these operands; else why not (for the caller's warning). Any intermediate
    size: a column block past I reads the next rows of W (or TMA's zeros past its end) and stores nothing."""
    if x.dtype not in _GL_DTYPE or gate_up_proj.dtype != x.dtype:
        return f"dtype {x.dtype} (bf16 or fp16 only)"
    if block_m not in (64, 128):
        return f"{block_m}-row blocks (64 or 128)"
    hidden = x.shape[1]
    if not gate_up_proj.is_contiguous() or x.stride(1) != 1 or x.stride(0) % 8 or hidden % 8:
        return "operands not contiguous in 16-byte rows"
    if gate_up_proj.data_ptr() % 16 or x.data_ptr() % 16:
        return "operands not 16-byte aligned"
    return None


def gate_up(x: torch.Tensor, gate_up_proj: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
            num_padded: torch.Tensor, act: torch.Tensor, top_k: int, block_m: int, *, silu: bool = False,
            num_experts: int | None = None, block_n: int = BLOCK_N, stages: int = STAGES, fused: bool = True,
            w_desc: TensorDescriptor | None = None) -> torch.Tensor:
    """act[row] for every real row of moe_align's blocks (x [T, H]; gate_up_proj [E, 2I, H], contiguous; act
    [len(sorted_ids), I]). num_experts: the experts a block may name (default E; JIT warm-up's stand-in weights
    hold fewer). w_desc: a descriptor made already (launch_args)."""
    grid, args, kwargs = launch_args(x, gate_up_proj, sorted_ids, expert_ids, num_padded, act, top_k, block_m,
                                     silu=silu, num_experts=num_experts, block_n=block_n, stages=stages, fused=fused,
                                     w_desc=w_desc)
    _gate_up_gluon_kernel[grid](*args, **kwargs)
    return act


def weight_descriptor(gate_up_proj: torch.Tensor, block_n: int = BLOCK_N) -> TensorDescriptor:
    """gate_up_proj [E, 2I, H] as [E * 2I, H] in [block_n, 64] boxes (made once a launch set-up)."""
    E, two_i, H = gate_up_proj.shape
    box = [block_n, BLOCK_K]
    return TensorDescriptor.from_tensor(gate_up_proj.view(E * two_i, H), box,
                                        gl.NVMMASharedLayout.get_default_for(box, _GL_DTYPE[gate_up_proj.dtype]))


def launch_args(x, gate_up_proj, sorted_ids, expert_ids, num_padded, act, top_k: int, block_m: int, *,
                silu: bool = False, num_experts: int | None = None, block_n: int = BLOCK_N, stages: int = STAGES,
                fused: bool = True, w_desc: TensorDescriptor | None = None):
    """(grid, args, kwargs) of _gate_up_gluon_kernel."""
    E, two_i, H = gate_up_proj.shape
    inter = two_i // 2
    assert act.stride(1) == 1 and fits(x, gate_up_proj, block_m) is None
    wd = w_desc if w_desc is not None else weight_descriptor(gate_up_proj, block_n)
    grid = (triton.cdiv(inter, block_n), expert_ids.numel())
    args = (x, wd, sorted_ids, expert_ids, num_padded, act, top_k * x.shape[0], inter, H,
            E if num_experts is None else num_experts, x.stride(0), act.stride(0))
    kwargs = dict(TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K, STAGES=stages, FUSED=fused,
                  SILU=silu, num_warps=block_m // 16, num_stages=1)
    return grid, args, kwargs


# ---------------------------------------------------------------------------------------------------------------
# the down half (MoELaunch.gluon_down): an experiment, off by default until a GPU has checked and timed it

DOWN_STAGES = {128: 4, 256: 3}  # BLOCK_N: stages (128 x 256 at 3: 144 KiB of stages + the 64-KiB epilogue buffer)


def down_fits(act: torch.Tensor, down_proj: torch.Tensor, block_m: int, block_n: int) -> str | None:
    """None where _down_gluon_kernel can run these operands; else why not."""
    if act.dtype not in _GL_DTYPE or down_proj.dtype != act.dtype:
        return f"dtype {act.dtype} (bf16 or fp16 only)"
    if block_m not in (64, 128) or block_n not in DOWN_STAGES:
        return f"{block_m} x {block_n} tiles ({{64, 128}} x {{{', '.join(map(str, DOWN_STAGES))}}})"
    E, H, inter = down_proj.shape
    if H % block_n:
        return f"hidden size {H} not a multiple of {block_n}-column tiles"
    if not down_proj.is_contiguous() or act.stride(1) != 1 or inter % 8 or act.stride(0) % 8:
        return "operands not contiguous in 16-byte rows"
    if down_proj.data_ptr() % 16 or act.data_ptr() % 16:
        return "operands not 16-byte aligned"
    return None


def down_launch_args(act, down_proj, sorted_ids, expert_ids, num_padded, topk_weights, y, block_m: int, block_n: int,
                     programs: int, *, stages: int | None = None, num_experts: int | None = None):
    """(grid, args, kwargs) of _down_gluon_kernel, which writes y[pair] = topk_weight[pair] * act[row of pair] @
    down_proj[e].T for every real pair (zeros for a block of another rank's experts; moe.py
    _down_persistent_kernel's semantics): act [len(sorted_ids), I] (a row block's rows contiguous); down_proj
    [E, H, I]; moe_align's outputs at block_m; topk_weights [T, k] (any float dtype, read as fp32); y [T k, H];
    programs: the most CTAs (one an SM), never more than the alignment's tiles."""
    E, H, inter = down_proj.shape
    assert y.stride(1) == 1 and down_fits(act, down_proj, block_m, block_n) is None
    dt = _GL_DTYPE[act.dtype]
    a_box, w_box = [block_m, BLOCK_K], [block_n, BLOCK_K]
    ad = TensorDescriptor.from_tensor(act, a_box, gl.NVMMASharedLayout.get_default_for(a_box, dt))
    wd = TensorDescriptor.from_tensor(down_proj.view(E * H, inter), w_box,
                                      gl.NVMMASharedLayout.get_default_for(w_box, dt))
    tiles = expert_ids.numel() * (H // block_n)  # the alignment's upper bound; the kernel reads the real count
    grid = (max(1, min(programs, tiles)),)
    args = (ad, wd, sorted_ids, expert_ids, num_padded, topk_weights.contiguous(), y, y.shape[0], H, inter,
            E if num_experts is None else num_experts, y.stride(0))
    kwargs = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
                  STAGES=DOWN_STAGES[block_n] if stages is None else stages, num_warps=block_m // 16, num_stages=1)
    return grid, args, kwargs
