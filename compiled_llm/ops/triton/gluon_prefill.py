"""The head_dim-512 K=V prefill attention (Gemma 4's global layers) as a Gluon kernel: Hopper's warpgroup MMA
(wgmma) and TMA, written with explicit layouts. paged_attention.paged_prefill launches it on sm_90 over the dense
key and value buffers its key rebuild fills; elsewhere the Triton tile runs.

Why not Triton: a 512-wide fp32 accumulator for 64 rows does not fit Triton's layouts, so the Triton kernel splits
the output into two programs that both compute the scores (twice the QK^T work). Here a CTA owns BLOCK_M = 64 rows
(BLOCK_M / GP query tokens x the GQA group's GP query heads, row = token * GP + head) and the whole output: 8 warps
= two warpgroups, every wgmma accumulator in NVMMADistributedLayout(warps_per_cta=[4, 2]), so warpgroup w holds
columns [w * N / 2, (w + 1) * N / 2) of each accumulator:
  - scores S [64, BLOCK_N]: each warpgroup half of the keys over all 512 dims (computed once);
  - the output as two [64, 256] fp32 accumulators (dims 0..255, 256..511): 128 registers a thread.
Q [64, 512] goes once into shared memory (two [64, 256] tiles). Key and value tiles [BLOCK_N, 512] come by TMA
(two [BLOCK_N, 256] boxes each) into STAGES buffers, one mbarrier each: tile j + STAGES's keys load once Q K^T of
tile j is done, its values once P V is (STAGES = 1: the next keys load under the softmax and P V, the next values
under the next Q K^T). P goes through shared memory as P V's A operand. Online softmax in exp2 (scale * log2 e
folded in); the causal mask on every key tile. Query tiles run longest first. The output leaves through shared
memory (Q's tiles, free by then) in 16-byte stores.

Several sequences (varlen, with a cached prefix): sequence s owns query tiles [qsl[s] // BLOCK_T + s,
qsl[s + 1] // BLOCK_T + s + 1) (as _prefill_kernel); its key j is row s * dense_rows + j of the dense buffers,
whose rows past seq_len up to a multiple of BLOCK_N hold zeros (the rebuild's COPY_V tail): a key tile is read
whole, unmasked, its keys past the query's position masked in the scores.

H100, session 65 (benchmarks/NOTES.md; prefill_kernels.py --attn-tma, the whole paged_prefill call): 2,568 us at
8,192 tokens against the Triton tile's 3,922 (-35%), 432 against 674 at 8 x 1,024, 59.6 against 119.4 at 1,024;
TTFT 8K -5.1%. Gluon has no interpreter: the CPU checks are the sm_90 builds (runtime/kernel_check.py), the numerics
are checked on the GPU (scripts/check_kernels_gpu.py --only prefill, against an fp32 reference).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOG2E = 1.4426950408889634
HEAD_D, BLOCK_M = 512, 64
# a CTA-wide barrier (bar.sync): gl.thread_barrier in Triton 3.6, gl.barrier from Triton 3.7 on
_cta_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier


@gluon.jit
def _load2(desc, smem, bar, row, col, step, stage, pred):
    """A key or value tile: two boxes, at columns col and col + step, into smem.index(2 * stage + 0 / 1)."""
    mbarrier.expect(bar, 2 * desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(desc, [row, col], bar, smem.index(2 * stage), pred=pred)
    tma.async_copy_global_to_shared(desc, [row, col + step], bar, smem.index(2 * stage + 1), pred=pred)


@gluon.jit
def _tile(j, n_kv, row0, col, m_i, l_i, acc0, acc1, qpos, qk_scale, q_smem, k_smem, v_smem, p_smem, bars_k, bars_v,
          k_desc, v_desc, s_layout: gl.constexpr, o_layout: gl.constexpr, BLOCK_M: gl.constexpr,
          BLOCK_N: gl.constexpr, HALF: gl.constexpr, STAGES: gl.constexpr):
    """Key tile j (keys j * BLOCK_N ..., dense rows row0 + those) from stage j % STAGES: S = Q K^T, online softmax,
    acc += P V; then the loads of tile j + STAGES into the freed stage (keys after Q K^T, values after P V)."""
    st = j % STAGES
    if STAGES == 1:  # an index the compiler cannot fold to 0 (j < 2^30): with a constant one LLVM hoists every
        st = j >> 30  # wgmma's shared-memory descriptors out of the loop, into registers
    phase = (j // STAGES) & 1
    kstart = j * BLOCK_N
    more = j + STAGES < n_kv
    ks0 = k_smem.index(2 * st)
    ks1 = k_smem.index(2 * st + 1)
    vs0 = v_smem.index(2 * st)
    vs1 = v_smem.index(2 * st + 1)
    mbarrier.wait(bars_k.index(st), phase)
    s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    s = warpgroup_mma(q_smem.index(0), ks0.permute((1, 0)), s, use_acc=False, is_async=True)
    s = warpgroup_mma(q_smem.index(1), ks1.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma_wait(0, deps=[s])
    _cta_barrier()  # both warpgroups are done with the key tile: load tile j + STAGES's under the softmax and P V
    _load2(k_desc, k_smem, bars_k.index(st), row0 + kstart + STAGES * BLOCK_N, col, HALF, st, more)

    kpos = kstart + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    s = gl.where(kpos[None, :] <= qpos[:, None], s * qk_scale, float("-inf"))  # causal
    m_new = gl.maximum(m_i, gl.max(s, 1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    p_smem.store(p.to(p_smem.dtype))
    fence_async_shared()
    _cta_barrier()  # every warp's part of P is in shared memory before either warpgroup's wgmma reads it

    alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
    acc0 = acc0 * alpha_o[:, None]
    acc1 = acc1 * alpha_o[:, None]
    mbarrier.wait(bars_v.index(st), phase)
    acc0 = warpgroup_mma(p_smem, vs0, acc0, is_async=True)
    acc1 = warpgroup_mma(p_smem, vs1, acc1, is_async=True)
    acc0, acc1 = warpgroup_mma_wait(0, deps=[acc0, acc1])
    _cta_barrier()  # both warpgroups are done with the value tile (and P): load tile j + STAGES's
    _load2(v_desc, v_smem, bars_v.index(st), row0 + kstart + STAGES * BLOCK_N, col, HALF, st, more)
    return m_new, l_i, acc0, acc1


@gluon.jit(do_not_specialize=["num_seqs", "dense_rows"])
def _prefill_d512_kernel(Q, k_desc, v_desc, Out, SeqLens, QueryStart, qk_scale, num_seqs, dense_rows,
                         stride_qt, stride_qh, stride_ot, stride_oh,
                         GROUP: gl.constexpr, GP: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
                         BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Q [tokens, heads, HEAD_D] (the new tokens of every sequence, sequence s's at qsl[s] .. qsl[s + 1]), Out
    likewise; k_desc / v_desc: the dense keys and values [num_seqs * dense_rows, kv_heads * HEAD_D] in
    [BLOCK_N, HEAD_D / 2] boxes. Program (i, kvh): query tile i (counted from the last) of KV head kvh."""
    HALF: gl.constexpr = HEAD_D // 2
    BLOCK_T: gl.constexpr = BLOCK_M // GP
    gl.static_assert(gl.num_warps() == 8, "two warpgroups")
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BLOCK_N // 2, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, HALF // 2, 16])
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])
    st_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])  # not ld_layout: nothing of Q's
    # addresses or masks is shared with the output's (else they would stay live, in registers, across the loop)
    dtype: gl.constexpr = Q.dtype.element_ty
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF], dtype)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)

    kvh = gl.program_id(1)
    pid = gl.num_programs(0) - 1 - gl.program_id(0)  # the last query tiles (the longest rows) first
    lo = pid * 0  # the sequence of this query tile: the last s with qsl[s] // BLOCK_T + s <= pid
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if gl.load(QueryStart + mid) // BLOCK_T + mid <= pid:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_begin = gl.load(QueryStart + seq)
    q_len = gl.load(QueryStart + seq + 1) - q_begin
    t0 = (pid - (q_begin // BLOCK_T + seq)) * BLOCK_T  # the tile's first token, within the sequence's new ones
    if t0 >= q_len:
        return
    seq_len = gl.load(SeqLens + seq)
    pos0 = seq_len - q_len + t0  # the tile's first query position
    row0 = seq * dense_rows
    col = kvh * HEAD_D

    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HALF], q_sl)
    k_smem = gl.allocate_shared_memory(dtype, [2 * STAGES, BLOCK_N, HALF], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2 * STAGES, BLOCK_N, HALF], v_desc.layout)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], p_sl)
    bars_k = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    bars_v = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars_k.index(i), count=1)
        mbarrier.init(bars_v.index(i), count=1)
    fence_async_shared()  # the initialised barriers are visible to the TMA unit before the first copy

    last = gl.minimum(pos0 + BLOCK_T, seq_len)  # keys [0, last) are seen by some row of this tile
    n_kv = gl.cdiv(last, BLOCK_N)
    for i in gl.static_range(STAGES):
        _load2(k_desc, k_smem, bars_k.index(i), row0 + i * BLOCK_N, col, HALF, i, i < n_kv)
        _load2(v_desc, v_smem, bars_v.index(i), row0 + i * BLOCK_N, col, HALF, i, i < n_kv)

    # Q: row token * GP + g is head kvh * GROUP + g's query of token t0 + token (g < GROUP), through the
    # registers into shared memory (once)
    r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld_layout))
    d = gl.arange(0, HALF, layout=gl.SliceLayout(0, ld_layout))
    tok = t0 + r // GP
    q_off = (q_begin + tok).to(gl.int64) * stride_qt + (kvh * GROUP + r % GP) * stride_qh
    qmask = ((tok < q_len) & (r % GP < GROUP))[:, None] & (d < HALF)[None, :]
    q_ptr = Q + q_off[:, None] + d[None, :]
    q_smem.index(0).store(gl.load(q_ptr, mask=qmask, other=0.0))
    q_smem.index(1).store(gl.load(q_ptr + HALF, mask=qmask, other=0.0))
    fence_async_shared()
    _cta_barrier()

    rs = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    qpos = pos0 + rs // GP
    m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc0 = gl.zeros([BLOCK_M, HALF], gl.float32, o_layout)
    acc1 = gl.zeros([BLOCK_M, HALF], gl.float32, o_layout)
    # one loop with the causal mask on every tile (it bites on the last one or two): a separate unmasked loop
    # (constexpr variants of _tile) built to 255 registers and spills
    for j in range(0, n_kv):
        m_i, l_i, acc0, acc1 = _tile(j, n_kv, row0, col, m_i, l_i, acc0, acc1, qpos, qk_scale, q_smem, k_smem,
                                     v_smem, p_smem, bars_k, bars_v, k_desc, v_desc, s_layout, o_layout,
                                     BLOCK_M, BLOCK_N, HALF, STAGES)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars_k.index(i))
        mbarrier.invalidate(bars_v.index(i))

    # the output through shared memory (Q's tiles, free now): 8-wide coalesced stores, few live pointers
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    inv = 1.0 / gl.where(l_o > 0.0, l_o, 1.0)
    q_smem.index(0).store((acc0 * inv[:, None]).to(dtype))
    q_smem.index(1).store((acc1 * inv[:, None]).to(dtype))
    _cta_barrier()
    ro = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, st_layout))
    do = gl.arange(0, HALF, layout=gl.SliceLayout(0, st_layout))
    tok_o = t0 + ro // GP
    o_off = (q_begin + tok_o).to(gl.int64) * stride_ot + (kvh * GROUP + ro % GP) * stride_oh
    omask = ((tok_o < q_len) & (ro % GP < GROUP))[:, None] & (do < HALF)[None, :]
    o_ptr = Out + o_off[:, None] + do[None, :]
    gl.store(o_ptr, q_smem.index(0).load(st_layout), mask=omask)
    gl.store(o_ptr + HALF, q_smem.index(1).load(st_layout), mask=omask)


def fits(group: int, head_dim: int) -> bool:
    """The kernel's shape limits: head_dim 512, a GQA group of at most BLOCK_M heads."""
    return head_dim == HEAD_D and 1 <= group <= BLOCK_M


def prefill_d512(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start_loc: torch.Tensor,
                 seq_lens: torch.Tensor, dense_rows: int, scale: float, out: torch.Tensor, *, num_kv_heads: int,
                 block_n: int = 64, stages: int = 1) -> torch.Tensor:
    """Causal prefill attention over dense keys and values: q, out [tokens, heads, 512] (bf16 or fp16); k, v
    [num_seqs * dense_rows, num_kv_heads * 512], sequence s's key j at row s * dense_rows + j, its rows from seq_len
    up to a multiple of block_n zero (or past the tensor's end). query_start_loc [num_seqs + 1], seq_lens [num_seqs]
    int32; sequence s's new tokens are positions seq_len - q_len ... seq_len - 1."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    assert fits(group, head_dim) and q.stride(-1) == 1 and out.stride(-1) == 1 and k.dtype == v.dtype == q.dtype
    gp = triton.next_power_of_2(group)
    box = [block_n, head_dim // 2]
    layout = gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16)
    kd = TensorDescriptor.from_tensor(k, box, layout)
    vd = TensorDescriptor.from_tensor(v, box, layout)
    num_seqs = seq_lens.shape[0]
    grid = (triton.cdiv(num_tokens, BLOCK_M // gp) + num_seqs, num_kv_heads)
    _prefill_d512_kernel[grid](
        q, kd, vd, out, seq_lens, query_start_loc, float(scale) * LOG2E, num_seqs, dense_rows,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        GROUP=group, GP=gp, HEAD_D=head_dim, BLOCK_M=BLOCK_M, BLOCK_N=block_n, STAGES=stages, num_warps=8,
        num_stages=1,
    )
    return out
