"""Prototype (not wired into the engine): a Gluon (Hopper wgmma + TMA) kernel for the head_dim-512 K=V global
attention prefill of Gemma 4 26B-A4B (16 query heads, 2 KV heads, causal, bf16), one sequence, no cached prefix.
H100, session 64 (benchmarks/NOTES.md): the plain 64-key one-stage tile 2,583 us at 8,192 tokens against the engine's
Triton kernel's 3,937 (-34%), 53.6 against 115.5 at 1,024; the K=V and 32-key tiles slower than it.

Design. A CTA owns BLOCK_M = 64 rows = 8 query tokens x the 8 query heads of one KV head (row = token * 8 + head,
as _prefill_kernel packs them) and the WHOLE 512-wide output: 8 warps = two warpgroups, every wgmma accumulator
in NVMMADistributedLayout(warps_per_cta=[4, 2]), so warpgroup w holds columns [w * N / 2, (w + 1) * N / 2) of
each accumulator:
  - scores S [64, BLOCK_N] (instr n = BLOCK_N / 2): each warpgroup half of the keys over all 512 dims: the
    QK^T is computed once (the split_d Triton kernel computes it twice);
  - output as two [64, 256] fp32 accumulators (dims 0..255 and 256..511; instr n = 128): 128 registers a thread.
Q [64, 512] is loaded once into shared memory (two [64, 256] NVMMA tiles, 64 KB). Key and value tiles
[BLOCK_N, 512] come by TMA (two [BLOCK_N, 256] boxes each) into STAGES buffers each, one mbarrier a buffer: tile
j + STAGES's keys load once Q K^T of tile j is done, its values once P V is (STAGES = 1: the next keys load under
the softmax and P V, the next values under Q K^T). P goes through shared memory (bf16 [64, BLOCK_N]) as the A
operand of P V. Online softmax in exp2 (scale * log2 e folded in); the causal mask is applied to every key tile
(it masks keys only in the last one: 8 query tokens fit one key tile). Query tiles are launched longest first.
The output goes out through shared memory (Q's tiles, free by then) in coalesced 16-byte stores.

K=V mode (ROT > 0; variants kv*): Gemma 4's global keys are rope(v * w) with only the first ROT = 64 angles of
each half rotating, so key dims outside [0, ROT) and [256, 256 + ROT) are v * w: Q K^T = Q_rot K_rot^T +
(Q * w)_rest V_rest^T. The kernel then reads the keys' 128 rotated dims (a [T, 2, 128] buffer) besides the values:
1.25 KB a key instead of 2 KB (the L2 -> SM traffic that 64-row tiles make large: every CTA streams its keys).

    python3 benchmarks/gluon_d512_prefill.py [--tokens 1024,4096,8192] [--variants 64x1,32x2,kv64x1,kv32x2]
        # GPU: every variant checked against an fp32 torch reference, then timed (CUDA-graph replays) beside
        # paged_prefill (the engine's d512 K=V path, benchmarks/prefill_kernels.py's set-up)
    python3 benchmarks/gluon_d512_prefill.py --build-only [--block-n 64 --stages 1 --rot 0]
        # CPU: build for sm_90a (GPUTarget('cuda', 90, 32)), print shared memory, ptxas registers and spills
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

LOG2E = 1.4426950408889634
# a CTA-wide barrier (bar.sync): gl.thread_barrier in Triton 3.6, gl.barrier from Triton 3.7 on
_cta_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
GROUP, HEAD_D, BLOCK_M = 8, 512, 64
ATOL, RTOL = 1.5e-2, 1e-2  # the check: |gluon - fp32 reference| <= ATOL + RTOL |reference| everywhere


@gluon.jit
def _load2(desc, smem, bar, row, col, step, stage, pred):
    """A key or value tile: two boxes, at columns col and col + step, into smem.index(2 * stage + 0 / 1)."""
    mbarrier.expect(bar, 2 * desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(desc, [row, col], bar, smem.index(2 * stage), pred=pred)
    tma.async_copy_global_to_shared(desc, [row, col + step], bar, smem.index(2 * stage + 1), pred=pred)


@gluon.jit
def _tile(j, n_kv, col, kcol, m_i, l_i, acc0, acc1, qpos, qk_scale, q_smem, k_smem, v_smem, p_smem, bars_k, bars_v,
          k_desc, v_desc, s_layout: gl.constexpr, o_layout: gl.constexpr, BLOCK_M: gl.constexpr,
          BLOCK_N: gl.constexpr, HALF: gl.constexpr, STAGES: gl.constexpr, ROT: gl.constexpr):
    """Key tile j (keys j * BLOCK_N ...) from stage j % STAGES: S = Q K^T, online softmax, acc += P V; then the
    loads of tile j + STAGES into the freed stage (keys after Q K^T, values after P V).
    ROT > 0 (K=V): k_smem holds only the keys' rotated dims [0, ROT) of each half; the rest of Q K^T is Q (whose
    other dims the caller scaled by the key norm's weight) against the values' same dims."""
    PIECES: gl.constexpr = (HALF // ROT).bit_length() - 1 if ROT > 0 else 0
    st = j % STAGES
    if STAGES == 1:  # an index the compiler cannot fold to 0 (j < 2^30): with a constant one LLVM hoists every
        st = j >> 30  # wgmma's shared-memory descriptors out of the loop, to registers (K=V: 255 and spills)
    phase = (j // STAGES) & 1
    kstart = j * BLOCK_N
    more = j + STAGES < n_kv
    ks0 = k_smem.index(2 * st)
    ks1 = k_smem.index(2 * st + 1)
    vs0 = v_smem.index(2 * st)
    vs1 = v_smem.index(2 * st + 1)
    mbarrier.wait(bars_k.index(st), phase)
    s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    if ROT == 0:
        s = warpgroup_mma(q_smem.index(0), ks0.permute((1, 0)), s, use_acc=False, is_async=True)
        s = warpgroup_mma(q_smem.index(1), ks1.permute((1, 0)), s, is_async=True)
    else:
        s = warpgroup_mma(q_smem.index(0).slice(0, ROT, dim=1), ks0.permute((1, 0)), s, use_acc=False,
                          is_async=True)
        s = warpgroup_mma(q_smem.index(1).slice(0, ROT, dim=1), ks1.permute((1, 0)), s, is_async=True)
        mbarrier.wait(bars_v.index(st), phase)
        # dims [ROT, HALF) as the power-of-two slices [ROT, 2 ROT), [2 ROT, 4 ROT), ... (shared memory views must
        # be powers of two wide)
        for i in gl.static_range(PIECES):
            s = warpgroup_mma(q_smem.index(0).slice(ROT << i, ROT << i, dim=1),
                              vs0.slice(ROT << i, ROT << i, dim=1).permute((1, 0)), s, is_async=True)
            s = warpgroup_mma(q_smem.index(1).slice(ROT << i, ROT << i, dim=1),
                              vs1.slice(ROT << i, ROT << i, dim=1).permute((1, 0)), s, is_async=True)
    s = warpgroup_mma_wait(0, deps=[s])
    _cta_barrier()  # both warpgroups are done with the key tile: load tile j + STAGES's under the softmax and P V
    _load2(k_desc, k_smem, bars_k.index(st), kstart + STAGES * BLOCK_N, kcol, k_desc.block_type.shape[1], st, more)

    kpos = kstart + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    s = gl.where(kpos[None, :] <= qpos[:, None], s * qk_scale, float("-inf"))  # causal (bites on the last tile only)
    m_new = gl.maximum(m_i, gl.max(s, 1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    p_smem.store(p.to(gl.bfloat16))
    fence_async_shared()
    _cta_barrier()  # every warp's part of P is in shared memory before either warpgroup's wgmma reads it

    alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
    acc0 = acc0 * alpha_o[:, None]
    acc1 = acc1 * alpha_o[:, None]
    if ROT == 0:
        mbarrier.wait(bars_v.index(st), phase)
    acc0 = warpgroup_mma(p_smem, vs0, acc0, is_async=True)
    acc1 = warpgroup_mma(p_smem, vs1, acc1, is_async=True)
    acc0, acc1 = warpgroup_mma_wait(0, deps=[acc0, acc1])
    _cta_barrier()  # both warpgroups are done with the value tile (and P): load tile j + STAGES's
    _load2(v_desc, v_smem, bars_v.index(st), kstart + STAGES * BLOCK_N, col, HALF, st, more)
    return m_new, l_i, acc0, acc1


@gluon.jit
def _attn_d512_kernel(Q, k_desc, v_desc, Out, W, T, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh,
                      GROUP: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      STAGES: gl.constexpr, ROT: gl.constexpr):
    """k_desc: keys [T, kv_heads * HEAD_D] in [BLOCK_N, HEAD_D / 2] boxes, or (ROT > 0, K=V) only their rotated
    dims, [T, kv_heads * 2 * ROT] in [BLOCK_N, ROT] boxes (dims [0, ROT) and [HALF, HALF + ROT) of each head);
    W (ROT > 0): the key norm's weight [HEAD_D] fp32, folded into Q's unrotated dims. v_desc: values
    [T, kv_heads * HEAD_D] in [BLOCK_N, HEAD_D / 2] boxes."""
    HALF: gl.constexpr = HEAD_D // 2
    BLOCK_T: gl.constexpr = BLOCK_M // GROUP
    gl.static_assert(BLOCK_N % BLOCK_T == 0, "a query tile's keys end inside one key tile")
    gl.static_assert(gl.num_warps() == 8, "two warpgroups")
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BLOCK_N // 2, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, HALF // 2, 16])
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])
    st_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])  # not ld_layout: nothing of Q's
    # addresses or masks is shared with the output's (else they would stay live, in registers, across the loop)
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF], gl.bfloat16)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.bfloat16)
    KW: gl.constexpr = k_desc.block_type.shape[1]  # HALF, or ROT (K=V)

    kvh = gl.program_id(1)
    tile = gl.num_programs(0) - 1 - gl.program_id(0)  # longest rows of the causal triangle first
    t0 = tile * BLOCK_T
    col = kvh * HEAD_D
    kcol = kvh * 2 * KW

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, HALF], q_sl)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * STAGES, BLOCK_N, KW], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * STAGES, BLOCK_N, HALF], v_desc.layout)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_N], p_sl)
    bars_k = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    bars_v = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars_k.index(i), count=1)
        mbarrier.init(bars_v.index(i), count=1)
    fence_async_shared()  # the initialised barriers are visible to the TMA unit before the first copy

    last = gl.minimum(t0 + BLOCK_T, T)  # keys [0, last) are seen by some row of this tile
    n_kv = gl.cdiv(last, BLOCK_N)
    for i in gl.static_range(STAGES):
        _load2(k_desc, k_smem, bars_k.index(i), i * BLOCK_N, kcol, KW, i, i < n_kv)
        _load2(v_desc, v_smem, bars_v.index(i), i * BLOCK_N, col, HALF, i, i < n_kv)

    # Q: rows token * GROUP + g of head kvh * GROUP + g, through registers into shared memory (once)
    r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld_layout))
    d = gl.arange(0, HALF, layout=gl.SliceLayout(0, ld_layout))
    tok = t0 + r // GROUP
    q_off = tok.to(gl.int64) * stride_qt + (kvh * GROUP + r % GROUP) * stride_qh
    q_ptr = Q + q_off[:, None] + d[None, :]
    qmask = (tok < T)[:, None] & (d < HALF)[None, :]
    q0 = gl.load(q_ptr, mask=qmask, other=0.0)
    q1 = gl.load(q_ptr + HALF, mask=qmask, other=0.0)
    if ROT > 0:  # q . k = q_rot . k_rot + (q * w)_other . v_other: the keys' other dims are v * w (zero angles)
        w0 = gl.where(d >= ROT, gl.load(W + d), 1.0)
        w1 = gl.where(d >= ROT, gl.load(W + HALF + d), 1.0)
        q0 = (q0.to(gl.float32) * w0[None, :]).to(gl.bfloat16)
        q1 = (q1.to(gl.float32) * w1[None, :]).to(gl.bfloat16)
    q_smem.index(0).store(q0)
    q_smem.index(1).store(q1)
    fence_async_shared()
    _cta_barrier()

    rs = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    qpos = t0 + rs // GROUP
    m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc0 = gl.zeros([BLOCK_M, HALF], gl.float32, o_layout)
    acc1 = gl.zeros([BLOCK_M, HALF], gl.float32, o_layout)
    # one loop, the causal mask applied on every tile (only the last one masks anything): two loops (interior tiles
    # unmasked, then the masked one, as constexpr variants of _tile) built to 255 registers and ~370 B of spills
    for j in range(0, n_kv):
        m_i, l_i, acc0, acc1 = _tile(j, n_kv, col, kcol, m_i, l_i, acc0, acc1, qpos, qk_scale, q_smem, k_smem,
                                     v_smem, p_smem, bars_k, bars_v, k_desc, v_desc, s_layout, o_layout, BLOCK_M,
                                     BLOCK_N, HALF, STAGES, ROT)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars_k.index(i))
        mbarrier.invalidate(bars_v.index(i))

    # the output through shared memory (Q's tiles, free now): 8-wide coalesced stores, few live pointers
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    inv = 1.0 / gl.where(l_o > 0.0, l_o, 1.0)
    q_smem.index(0).store((acc0 * inv[:, None]).to(gl.bfloat16))
    q_smem.index(1).store((acc1 * inv[:, None]).to(gl.bfloat16))
    _cta_barrier()
    ro = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, st_layout))
    do = gl.arange(0, HALF, layout=gl.SliceLayout(0, st_layout))
    tok_o = t0 + ro // GROUP
    o_ptr = Out + (tok_o.to(gl.int64) * stride_ot + (kvh * GROUP + ro % GROUP) * stride_oh)[:, None] + do[None, :]
    omask = (tok_o < T)[:, None] & (do < HALF)[None, :]
    gl.store(o_ptr, q_smem.index(0).load(st_layout), mask=omask)
    gl.store(o_ptr + HALF, q_smem.index(1).load(st_layout), mask=omask)


def launch_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor,
                block_n: int = 64, stages: int = 1, w: torch.Tensor | None = None):
    """(grid, args, kwargs) of the kernel for q [T, 16, 512] and dense k, v [T, 2, 512] (bf16); or, K=V
    (w, the key norm's weight, given): k holds only the keys' rotated dims, [T, 2, 2 * ROT] (each half's first
    ROT), the other dims of the keys being v * w."""
    T, hq, d = q.shape
    kvh = v.shape[1]
    assert d == HEAD_D and hq == GROUP * kvh and q.stride(-1) == 1 and out.stride(-1) == 1
    rot = k.shape[2] // 2 if w is not None else 0
    assert rot == 0 or (k.shape[2] == 2 * rot and 16 <= rot < d // 2 and rot & (rot - 1) == 0 and w.numel() == d)
    vbox = [block_n, d // 2]
    kbox = [block_n, rot] if rot else vbox
    kd = TensorDescriptor.from_tensor(k.reshape(T, -1), kbox, gl.NVMMASharedLayout.get_default_for(kbox, gl.bfloat16))
    vd = TensorDescriptor.from_tensor(v.reshape(T, -1), vbox, gl.NVMMASharedLayout.get_default_for(vbox, gl.bfloat16))
    w = w.float().contiguous() if w is not None else q  # unused without ROT
    grid = (triton.cdiv(T, BLOCK_M // GROUP), kvh)
    args = (q, kd, vd, out, w, T, float(scale) * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1))
    kwargs = dict(GROUP=GROUP, HEAD_D=HEAD_D, BLOCK_M=BLOCK_M, BLOCK_N=block_n, STAGES=stages, ROT=rot, num_warps=8,
                  num_stages=1)
    return grid, args, kwargs


def gluon_prefill_d512(q, k, v, scale, out=None, block_n: int = 64, stages: int = 1, w=None):
    """Causal attention of one sequence: q [T, 16, 512], k, v [T, 2, 512] bf16 -> [T, 16, 512]. K=V (w given):
    k is [T, 2, 2 * ROT], the rotated dims of the keys (see launch_args)."""
    out = torch.empty_like(q) if out is None else out
    grid, args, kwargs = launch_args(q, k, v, scale, out, block_n, stages, w)
    _attn_d512_kernel[grid](*args, **kwargs)
    return out


# ---------------------------------------------------------------------------------------------------------------
# --build-only: compile for sm_90 on a machine without a GPU (as compiled_llm/runtime/kernel_check.py does)

def build_sm90(block_n: int = 64, stages: int = 1, rot: int = 0, T: int = 256):
    """The kernel built for sm_90a on this machine (compiled_llm.runtime.kernel_check's build, no GPU needed)."""
    from compiled_llm.runtime.kernel_check import Launch, build_sm90 as build

    q = torch.zeros(T, 16, HEAD_D, dtype=torch.bfloat16)
    v = torch.zeros(T, 2, HEAD_D, dtype=torch.bfloat16)
    k = torch.zeros(T, 2, 2 * rot, dtype=torch.bfloat16) if rot else v.clone()
    w = torch.ones(HEAD_D) if rot else None
    _, args, kwargs = launch_args(q, k, v, HEAD_D ** -0.5, torch.empty_like(q), block_n, stages, w)
    return build(Launch(_attn_d512_kernel, args, kwargs))


def build_only(block_n: int, stages: int, rot: int) -> int:
    if block_n is None:  # every variant of the GPU run
        return max(build_only(bn, st, 64 if kv else 0) for bn, st, kv in VARIANTS.values())
    from compiled_llm.runtime.kernel_check import SMEM_LIMIT, ptxas_usage

    k = build_sm90(block_n, stages, rot)
    ptx = k.asm["ptx"]
    regs, spilled = ptxas_usage(ptx)
    print(f"triton {triton.__version__} torch {torch.__version__}: BLOCK_N={block_n} STAGES={stages} ROT={rot} "
          f"built for sm_90a")
    print(f"  shared memory {k.metadata.shared} B ({k.metadata.shared / 1024:.1f} KiB of 227), "
          f"registers {regs}, spill stores {spilled} B, "
          f"wgmma {ptx.count('wgmma.mma_async')}, TMA copies {ptx.count('cp.async.bulk.tensor')}")
    return 0 if k.metadata.shared <= SMEM_LIMIT and spilled == 0 else 1


# ---------------------------------------------------------------------------------------------------------------
# GPU: check and timing

def reference(q, k, v, scale):
    T, hq, d = q.shape
    g = hq // k.shape[1]
    qf = q.float().transpose(0, 1)
    kf = k.float().repeat_interleave(g, dim=1).transpose(0, 1)
    vf = v.float().repeat_interleave(g, dim=1).transpose(0, 1)
    o = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=scale)
    return o.transpose(0, 1)


def kernel_us(fn, name: str, calls: int = 5) -> float:
    """Mean device time a call of the kernels whose name contains `name` (torch.profiler), -1 if none seen."""
    from grouped_mm_moe import kernel_times_us

    return sum(us for k, us in kernel_times_us(fn, calls).items() if name in k) or -1.0


def keqv_keys(v: torch.Tensor, w: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """A K=V layer's keys: rope(v * w) (pairs d, d + 256; position = row), bf16, as _rebuild_k_kernel makes them."""
    T, _, d = v.shape
    x = v.float() * w.float()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    a = torch.arange(T, device=v.device, dtype=torch.float64)[:, None, None] * inv_freq.double()
    c, s = a.cos().float(), a.sin().float()
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).to(v.dtype)


VARIANTS = {  # name: (BLOCK_N, STAGES, K=V with the rotated dims only)
    "64x1": (64, 1, False), "32x2": (32, 2, False), "kv64x1": (64, 1, True), "kv32x2": (32, 2, True),
    "kv32x3": (32, 3, True),
}


def gpu_main(tokens: list[int], variants: list[str], check_only: bool) -> int:
    from prefill_kernels import SHAPES, attention_case  # noqa: E402
    from graph_timing import kernel_timer  # noqa: E402
    from compiled_llm.ops.rope import rope_inv_freq
    from compiled_llm.ops.triton import paged_attention as PA

    dev, dt = torch.device("cuda"), torch.bfloat16
    time_fn = kernel_timer(False, calls=5)
    rows = []
    ok = True
    inv_freq = rope_inv_freq(HEAD_D, 1e6, "proportional", partial_rotary_factor=0.25).to(dev)
    rot = int((inv_freq != 0).sum())  # 64: the angles past it are zero
    for T in tokens:
        g = torch.Generator(device=dev).manual_seed(T)
        q = torch.randn(T, 16, HEAD_D, device=dev, generator=g).to(dt)
        v = torch.randn(T, 2, HEAD_D, device=dev, generator=g).to(dt)
        w = (1.0 + 0.2 * torch.randn(HEAD_D, device=dev, generator=g)).to(dt)
        k = keqv_keys(v, w, inv_freq)
        k_rot = torch.cat([k[..., :rot], k[..., HEAD_D // 2: HEAD_D // 2 + rot]], -1).contiguous()
        scale = HEAD_D ** -0.5
        n_ref = min(T, 2048)  # the last n_ref queries against all keys (fp32 scores: 16 x n_ref x T)
        qs = q[-n_ref:].float().transpose(0, 1)
        kf = k.float().repeat_interleave(GROUP, dim=1).transpose(0, 1)
        vf = v.float().repeat_interleave(GROUP, dim=1).transpose(0, 1)
        sc = (qs @ kf.transpose(1, 2)) * scale
        pos = torch.arange(T, device=dev)
        sc = sc.masked_fill(pos[None, :] > pos[-n_ref:, None], float("-inf"))
        ref = (torch.softmax(sc, -1) @ vf).transpose(0, 1)
        del sc, kf, vf, qs
        if T <= 1024:  # the whole of it through SDPA too (checks the check)
            assert float((reference(q, k, v, scale)[-n_ref:] - ref).abs().max()) < 1e-4
        flops = 4.0 * T * T / 2 * HEAD_D * 16
        row = dict(T=T)
        for name in variants:
            bn, stages, kv = VARIANTS[name]
            kk, ww = (k_rot, w) if kv else (k, None)
            try:
                out = gluon_prefill_d512(q, kk, v, scale, block_n=bn, stages=stages, w=ww)
                torch.cuda.synchronize()
                diff = (out[-n_ref:].float() - ref).abs()
                err = float(diff.max())
                # bf16: the output's own rounding is up to 2^-9 |o| (early rows average few values, |o| ~ 3)
                good = bool((diff <= ATOL + RTOL * ref.abs()).all()) and bool(torch.isfinite(out).all())
            except Exception as exc:  # a build or launch failure is reported, the other variants still run
                print(f"T={T} {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                ok, row[name] = False, None
                continue
            ok &= good
            print(f"T={T} {name}: max |gluon - fp32 reference| = {err:.3e} over the last {n_ref} queries "
                  f"({'ok' if good else f'FAIL: over {ATOL} + {RTOL} |ref|'})", flush=True)
            if not check_only and good:
                row[name] = time_fn(lambda: gluon_prefill_d512(q, kk, v, scale, out=out, block_n=bn, stages=stages,
                                                               w=ww))
        if check_only:
            continue
        args, opts, _ = attention_case(SHAPES["full"], SHAPES["full"]["glob"], [T], dev, dt, seed=2)
        pol = PA.attention_launch_policy(1, 0, HEAD_D, prefill=True)
        row["paged_prefill"] = time_fn(lambda: PA.paged_prefill(*args, policy=pol, **opts))
        row["_prefill_kernel"] = kernel_us(lambda: PA.paged_prefill(*args, policy=pol, **opts), "_prefill_kernel")
        row["flops"] = flops
        rows.append(row)
    if rows:
        cols = variants + ["paged_prefill", "_prefill_kernel"]
        print(f"\n{torch.cuda.get_device_name()}; us a call (TFLOP/s of useful work, 4 * T*T/2 * 512 * 16 flops)")
        print(f"{'T':>6} " + " ".join(f"{c:>20}" for c in cols))
        for row in rows:
            cells = []
            for c in cols:
                us = row.get(c)
                cells.append(f"{us:>9.1f} ({row['flops'] / us / 1e6:>6.1f})" if us and us > 0 else f"{'-':>20}")
            print(f"{row['T']:>6} " + " ".join(f"{x:>20}" for x in cells))
        print("gluon variants: BLOCK_N x STAGES, kv = K=V (keys' rotated dims only). paged_prefill: CUDA-graph")
        print("replays of the whole call, its _rebuild_k_kernel (rotates the keys, copies the values into the dense")
        print("TMA buffers) included; _prefill_kernel: that kernel alone (torch.profiler, mean of 5 calls)")
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-only", action="store_true", help="compile for sm_90 on the CPU, print usage")
    ap.add_argument("--tokens", default="1024,4096,8192")
    ap.add_argument("--variants", default="64x1,32x2,kv64x1,kv32x2", help=f"of {','.join(VARIANTS)}")
    ap.add_argument("--block-n", type=int, default=None, help="--build-only: keys a tile (default: every variant)")
    ap.add_argument("--stages", type=int, default=1, help="--build-only: key / value buffers")
    ap.add_argument("--rot", type=int, default=0, help="--build-only: K=V, the keys' rotated dims a half (64)")
    ap.add_argument("--check-only", action="store_true", help="GPU: correctness only, no timing")
    a = ap.parse_args()
    if a.build_only:
        return build_only(a.block_n, a.stages, a.rot)
    return gpu_main([int(t) for t in a.tokens.split(",")], a.variants.split(","), a.check_only)


if __name__ == "__main__":
    sys.exit(main())
