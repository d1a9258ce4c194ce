"""Routed experts: the fused routers (Gemma 4's norm + scale + proj + softmax + top-k + renorm + per-expert
scale; Qwen3.5's proj + softmax + top-k + renorm, the same kernels without the norm and the scales) and a gated-MLP grouped GEMM over tokens sorted by expert: GELU-tanh (GEGLU, Gemma 4) or SiLU (SwiGLU,
Qwen3.5 MoE), chosen at compile time.

Expert weights are the checkpoint's packed layout: gate_up_proj [E, 2I, H] (rows 0..I-1 gate, I..2I-1 up),
down_proj [E, H, I]. y_t = sum_k w_tk * down_e(gelu_tanh(gate_e(x_t)) * up_e(x_t)).
The router is one launch at decode sizes (_router_fused_kernel: split-H partial logits, the last program
of a token block, found by a self-resetting ticket counter, reduces them in a fixed order and picks the
experts) and two launches past ROUTER_FUSED_MAX_TOKENS tokens (logits, then top-k).
Everything here avoids host syncs, so it can be captured in a CUDA graph. Token-count arguments are
do_not_specialize, so the only builds are one per launch-policy tier.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from compiled_llm.ops.triton import _common, gluon_moe
from compiled_llm.ops.triton._common import _dot, _gelu_tanh, dot_f32, dot_precision, ticket_counters
from compiled_llm.ops.triton.skinny_gemm import num_sms

log = logging.getLogger("compiled_llm")

# ----------------------------------------------------------------------------------------------------
# alignment


def moe_max_padded(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of the padded length: every expert (bucket) that has a pair may add block_m - 1 padding rows."""
    n = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(n, block_m) * block_m


@triton.jit
def _block_experts(ExpertIds, ends, E, size, BLOCK_M: tl.constexpr, CB: tl.constexpr):
    # each block's expert: how many buckets' padded segments end at or before its first row (ends: the
    # buckets' cumulative padded ends); -1 for the other ranks' bucket E and past the end
    cb = tl.arange(0, CB)
    for b0 in range(0, size // BLOCK_M, CB):
        start = (b0 + cb) * BLOCK_M
        eid = tl.sum((ends[None, :] <= start[:, None]).to(tl.int32), 1)
        tl.store(ExpertIds + b0 + cb, tl.where(eid < E, eid, -1), mask=b0 + cb < size // BLOCK_M)


@triton.jit
def _align_body(Ids, Cursor, SortedIds, ExpertIds, NumPadded, n, E, size,
                BLOCK_M: tl.constexpr, BINS: tl.constexpr, CHUNK: tl.constexpr, CB: tl.constexpr):
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
    _block_experts(ExpertIds, ends, E, size, BLOCK_M, CB)
    tl.debug_barrier()
    for i0 in range(0, n, CHUNK):
        m = c < n - i0
        e = tl.load(Ids + i0 + c, mask=m, other=0)
        e = tl.where((e >= 0) & (e < E), e, E)
        slot = tl.atomic_add(Cursor + e, 1, mask=m)
        tl.store(SortedIds + slot, (i0 + c).to(tl.int32), mask=m)


@triton.jit(do_not_specialize=["n", "size"])
def _align_kernel(
    Ids, Cursor, SortedIds, ExpertIds, NumPadded,
    n, E, size,
    BLOCK_M: tl.constexpr, BINS: tl.constexpr, CHUNK: tl.constexpr, CB: tl.constexpr,
):
    _align_body(Ids, Cursor, SortedIds, ExpertIds, NumPadded, n, E, size, BLOCK_M, BINS, CHUNK, CB)


@triton.jit
def _self_route(TopkIds, pid_m, T, E, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, K_PAD: tl.constexpr,
                BINS: tl.constexpr):
    # A decode batch of at most BLOCK_M tokens, grouped without an alignment launch: program pid_m takes the
    # pid_m-th expert (ascending) that any token picked, and its rows are the tokens themselves (a token picks
    # an expert at most once, so one block holds all of an expert's pairs). The gate/up kernel's programs read
    # the T x k ids (a few hundred bytes) and rank the experts by a histogram over BINS >= E bins and a prefix
    # sum, in registers (padding and another rank's experts are counted into bin 0, then taken off it).
    # Returns (expert, or -1 past the last picked one; pair [BLOCK_M] = t * k + slot; row mask).
    t = tl.arange(0, BLOCK_M)
    j = tl.arange(0, K_PAD)
    m2 = (t[:, None] < T) & (j[None, :] < TOP_K)
    ids = tl.load(TopkIds + t[:, None] * TOP_K + j[None, :], mask=m2, other=-1).to(tl.int32)
    valid = m2 & (ids >= 0) & (ids < E)
    counts = tl.histogram(tl.reshape(tl.where(valid, ids, 0), [BLOCK_M * K_PAD]), BINS)
    bins = tl.arange(0, BINS)
    counts = tl.where(bins == 0, counts - tl.sum(tl.sum((~valid).to(tl.int32), 1), 0), counts)
    present = ((counts > 0) & (bins < E)).to(tl.int32)
    mine = (present > 0) & (tl.cumsum(present, 0) == pid_m + 1)
    e = tl.where(tl.sum(mine.to(tl.int32), 0) > 0, tl.sum(tl.where(mine, bins, 0), 0), -1)
    hit = valid & (ids == e)
    rmask = tl.max(hit.to(tl.int32), 1) > 0
    pair = t * TOP_K + tl.sum(tl.where(hit, j[None, :], 0), 1)
    return e, pair, rmask


@triton.jit
def _zero_skipped_pairs(TopkIds, Y, T, E, stride_yt, cols, cmask, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    # the self-routed grid's spare block: the pairs of another rank's experts (ids outside [0, E)) output zero
    t = tl.arange(0, BLOCK_M)
    for j in tl.static_range(TOP_K):
        idj = tl.load(TopkIds + t * TOP_K + j, mask=t < T, other=0)
        skip = (t < T) & ((idj < 0) | (idj >= E))
        z_ptr = Y + (t * TOP_K + j).to(tl.int64)[:, None] * stride_yt + cols[None, :]
        tl.store(z_ptr, tl.zeros([BLOCK_M, BLOCK_N], Y.dtype.element_ty), mask=skip[:, None] & cmask[None, :])


# Which alignment a pair count takes. H200, 26B-A4B (session 12): the one program took 12.8 / 35 / 66 / 120 /
# 451 us at 128 / 512 / 1K / 2K / 8K tokens (top-8), torch's sort 88-146 us (a dozen launches); session 27's
# TTFT profile: the one program 55 us a layer at 1K tokens, 104 at 2K. From ALIGN_PARALLEL_MIN_PAIRS pairs the
# three-launch parallel alignment takes them; COMPILED_LLM_MOE_ALIGN=program|parallel|sorted forces one, =legacy
# gives back session 26's choice (A/B).
ALIGN_PARALLEL_MIN_PAIRS = 2048
ALIGN_SORT_MIN_PAIRS = 20480  # the fused decode router aligns in its own program below this (and one token block)
ALIGN_ENV = "COMPILED_LLM_MOE_ALIGN"


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Sort (token, slot) pairs by expert and pad each expert's segment to a multiple of block_m. Pairs whose
    expert lies outside [0, num_experts) (another rank's, under expert parallelism) go to a last segment
    whose blocks have expert -1: the kernels write zeros for them. Decode and small prefills: one kernel launch
    (a decode step's MoE layer used to spend a dozen small torch kernels here); from ALIGN_PARALLEL_MIN_PAIRS
    pairs on, three launches parallel over the pairs (`moe_align_parallel`): one program walking 65K pairs took
    0.45-0.48 ms a layer of an 8K-token prefill on the H200 (session 12), torch's sort 0.10-0.15 ms.

    Returns (sorted_ids [P] int32: flat pair index t * k + j, padding rows hold T * k; within an expert's
             segment the pairs' order is unspecified;
             expert_ids [P / block_m] int32: expert of each block, -1 for skipped pairs and past the end;
             num_padded [1] int32: the used length). P = moe_max_padded(T * k, E + 1, block_m) is known on the host.
    """
    kind = os.environ.get(ALIGN_ENV) or align_kind(topk_ids.numel())
    if kind == "legacy":  # session 26's choice: the one program, torch's sort from ALIGN_SORT_MIN_PAIRS pairs
        kind = "sorted" if topk_ids.numel() >= ALIGN_SORT_MIN_PAIRS else "program"
    if kind == "sorted":
        return moe_align_sorted(topk_ids, num_experts, block_m)
    if kind == "parallel":
        return moe_align_parallel(topk_ids, num_experts, block_m)
    return moe_align_program(topk_ids, num_experts, block_m)


def align_kind(num_pairs: int) -> str:
    """moe_align's choice for a pair count (a key of the warm-up's launch variants): program or parallel."""
    return "parallel" if num_pairs >= ALIGN_PARALLEL_MIN_PAIRS else "program"


def moe_align_sorted(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """moe_align through torch's device ops (a stable sort by expert, counts, offsets; no host sync): a dozen
    launches, each parallel over the pairs. Same outputs; within a segment the pairs keep their order."""
    flat = topk_ids.reshape(-1)
    n, dev = flat.numel(), flat.device
    size = moe_max_padded(n, num_experts + 1, block_m)
    # bucket E: other ranks'. int32 keys: the radix sort makes half the passes of int64 keys (it was 8 launches,
    # ~100 us a layer of an 8K-token prefill on the H200)
    bucket = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts).to(torch.int32)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev).scatter_add_(0, bucket.long(),
                                                                                     torch.ones_like(bucket, dtype=torch.long))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    ranked, order = torch.sort(bucket, stable=True)  # pairs grouped by bucket
    first = torch.cumsum(counts, 0) - counts  # where each bucket begins in `order`
    pos = (ends - padded)[ranked] + torch.arange(n, device=dev) - first[ranked]
    sorted_ids = torch.full((size,), n, dtype=torch.int32, device=dev)
    sorted_ids[pos] = order.to(torch.int32)
    starts = torch.arange(0, size, block_m, device=dev)
    owner = torch.searchsorted(ends, starts, right=True)  # the bucket whose segment holds each block
    expert_ids = torch.where(owner < num_experts, owner, -1).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)


@triton.jit
def _chunk_buckets(Ids, g, n, E, CHUNK: tl.constexpr):
    # the buckets of chunk g's pairs: the expert, E for another rank's, E + 1 past the last pair (no pair's)
    i = g * CHUNK + tl.arange(0, CHUNK)
    m = i < n
    e = tl.load(Ids + i, mask=m, other=0)
    e = tl.where((e >= 0) & (e < E), e, E)
    return tl.where(m, e, E + 1).to(tl.int32)


@triton.jit(do_not_specialize=["n", "size"])
def _align_count_kernel(Ids, Counts, SortedIds, n, E, size, fill,
                        BINS: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr):
    # Parallel alignment, 1 of 3 (moe_align_parallel): program g counts its CHUNK pairs' buckets into row g of
    # Counts [G, BINS] (masked lanes into bin E + 1, which no pair uses) and fills its share of SortedIds
    # with the padding value n.
    g = tl.program_id(0)
    e = _chunk_buckets(Ids, g, n, E, CHUNK)
    tl.store(Counts + g * BINS + tl.arange(0, BINS), tl.histogram(e, BINS))
    f = tl.arange(0, FILL)
    for j0 in range(g * fill, tl.minimum(g * fill + fill, size), FILL):
        tl.store(SortedIds + j0 + f, tl.full([FILL], 0, tl.int32) + n, mask=j0 + f < tl.minimum(g * fill + fill, size))


@triton.jit(do_not_specialize=["G", "size"])
def _align_scan_kernel(Counts, Base, ExpertIds, NumPadded, G, E, size,
                       BLOCK_M: tl.constexpr, BINS: tl.constexpr, GT: tl.constexpr, CB: tl.constexpr):
    # 2 of 3, one program: the buckets' padded segments (as _align_body), and for each (program g, bucket b)
    # Base[g, b] = where g's first pair of bucket b goes minus how many of g's pairs sort before bucket b
    # (g's pairs sorted by bucket then take rows Base[g, b] + their rank in that sorted chunk). The programs'
    # rows are read GT at a time, so no build depends on the pair count.
    r = tl.arange(0, GT)
    bins = tl.arange(0, BINS)
    total = tl.zeros([BINS], tl.int32)
    for g0 in range(0, G, GT):
        ok = (g0 + r[:, None] < G) & (bins[None, :] <= E)
        total += tl.sum(tl.load(Counts + (g0 + r[:, None]) * BINS + bins[None, :], mask=ok, other=0), 0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    carry = ends - padded  # where the next program's first pair of each bucket goes
    for g0 in range(0, G, GT):
        ok = (g0 + r[:, None] < G) & (bins[None, :] <= E)
        counts = tl.load(Counts + (g0 + r[:, None]) * BINS + bins[None, :], mask=ok, other=0)
        before_g = carry[None, :] + tl.cumsum(counts, 0) - counts  # the earlier programs' pairs of the bucket
        before_b = tl.cumsum(counts, 1) - counts  # the program's own pairs of earlier buckets
        tl.store(Base + (g0 + r[:, None]) * BINS + bins[None, :], before_g - before_b, mask=ok)
        carry += tl.sum(counts, 0)
    tl.store(NumPadded + bins - (BINS - 1), ends, mask=bins == BINS - 1)  # the total
    _block_experts(ExpertIds, ends, E, size, BLOCK_M, CB)


@triton.jit(do_not_specialize=["n"])
def _align_scatter_kernel(Ids, Base, SortedIds, n, E, BINS: tl.constexpr, CHUNK: tl.constexpr):
    # 3 of 3: program g sorts its pairs by (bucket, index) and writes each to Base[g, bucket] + its rank
    g = tl.program_id(0)
    c = tl.arange(0, CHUNK)
    key = tl.sort(_chunk_buckets(Ids, g, n, E, CHUNK) * CHUNK + c)
    b = key // CHUNK
    slot = tl.load(Base + g * BINS + b, mask=b <= E, other=0) + c
    tl.store(SortedIds + slot, g * CHUNK + key % CHUNK, mask=b <= E)


ALIGN_PARALLEL_CHUNK = 1024  # pairs a program of the parallel alignment takes


def moe_align_parallel(topk_ids: torch.Tensor, num_experts: int, block_m: int, chunk: int = ALIGN_PARALLEL_CHUNK):
    """moe_align in three launches, each but the middle one parallel over chunks of the pairs (count, then one
    program for the segments and each chunk's offsets, then each chunk sorts its pairs and writes them): no
    atomics, so within an expert's segment the pairs are in ascending order, as moe_align_sorted's. chunk: a
    power of two (the interpreter's tests take small ones: its sort of 1,024 keys takes seconds)."""
    flat = topk_ids.reshape(-1)
    n, dev = flat.numel(), flat.device
    grid = triton.cdiv(n, chunk)
    size = moe_max_padded(n, num_experts + 1, block_m)
    bins = triton.next_power_of_2(num_experts + 2)
    counts = torch.empty(grid, bins, dtype=torch.int32, device=dev)
    base = torch.empty(grid, bins, dtype=torch.int32, device=dev)
    sorted_ids = torch.empty(size, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(size // block_m, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    fill = triton.cdiv(size, grid)
    _align_count_kernel[(grid,)](flat, counts, sorted_ids, n, num_experts, size, fill, BINS=bins, CHUNK=chunk,
                                 FILL=1024, num_warps=4)
    _align_scan_kernel[(1,)](counts, base, expert_ids, num_padded, grid, num_experts, size, BLOCK_M=block_m,
                             BINS=bins, GT=8, CB=max(16, min(64, 8192 // bins)), num_warps=8)
    _align_scatter_kernel[(grid,)](flat, base, sorted_ids, n, num_experts, BINS=bins, CHUNK=chunk, num_warps=4)
    return sorted_ids, expert_ids, num_padded


def _align_buffers(n: int, num_experts: int, block_m: int, device):
    """(cursor, sorted_ids, expert_ids, num_padded, size, launch constexprs) of a one-program alignment."""
    size = moe_max_padded(n, num_experts + 1, block_m)
    bins = triton.next_power_of_2(num_experts + 2)
    bufs = (torch.empty(bins, dtype=torch.int32, device=device), torch.empty(size, dtype=torch.int32, device=device),
            torch.empty(size // block_m, dtype=torch.int32, device=device), torch.empty(1, dtype=torch.int32, device=device))
    return bufs, size, dict(BLOCK_M=block_m, BINS=bins, CHUNK=1024, CB=max(16, min(64, 8192 // bins)))


def moe_align_program(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """moe_align in one Triton program (decode sizes: one launch)."""
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    (cursor, sorted_ids, expert_ids, num_padded), size, meta = _align_buffers(n, num_experts, block_m, flat.device)
    _align_kernel[(1,)](flat, cursor, sorted_ids, expert_ids, num_padded, n, num_experts, size, **meta, num_warps=4)
    return sorted_ids, expert_ids, num_padded


_UNSORTED: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def unsorted_blocks(num_pairs: int, block_m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The alignment of pairs left in their own order, one block of block_m rows each: (sorted_ids [P]: pair b
    at row b * block_m, padding rows hold num_pairs; num_padded [1] = P), P = num_pairs * block_m. Constant for
    a pair count, so kept per device: a decode step launches nothing for it (the warm-up's first call makes
    it, before any CUDA-graph capture; one made during a capture is not kept, its memory being the graph's)."""
    key = (num_pairs, block_m, torch.device(device))
    hit = _UNSORTED.get(key)
    if hit is not None:
        return hit
    size = num_pairs * block_m
    sorted_ids = torch.full((size,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[::block_m] = torch.arange(num_pairs, dtype=torch.int32, device=device)
    out = sorted_ids, torch.full((1,), size, dtype=torch.int32, device=device)
    if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        _UNSORTED[key] = out
    return out


# ----------------------------------------------------------------------------------------------------
# launch policy


@dataclass(frozen=True)
class MoELaunch:
    """unsorted: the pairs are not sorted by expert; each (token, slot) pair is its own block of block_m rows,
    with the top-k ids as the blocks' experts (one token: its k experts are distinct, so grouping saves no
    weight reads, and the alignment launch is saved)."""
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
    unsorted: bool = False
    self_routed: bool = False  # up to block_m tokens: the grouped kernels rank the picked experts themselves
    # the column blocks of one row block launch one after another (grid axis 0), so a block's token rows are
    # read from memory once and the other column blocks find them in L2. Row-block-first order (False) reads
    # every row block again for each column block: at prefill sizes the rows (8,192 tokens x 8 picks x 2,816
    # x 2 bytes = 369 MB for Gemma 4's gate/up) are far past the L2, 11 passes of them against 1 GB of weights.
    n_fast: bool = False
    # the weight tiles (and the down kernel's activation rows, which are contiguous per block) through Hopper's
    # tensor-memory accelerator (host-made TMA descriptors) instead of per-thread loads; sm_90+ only (the
    # interpreter too), and only where each column block stays inside one expert (tma_usable)
    tma: bool = False
    # prefill tiers with TMA: the down kernel persistent, this many programs an SM, each walking the (row block,
    # column block) tiles in n_fast order in one loop that Triton flattens and pipelines across tiles (the next
    # tile's first loads overlap this one's epilogue); 0: a program a tile. H200, session 36 (the 8,192-token
    # prompt's 30 MoE layers in latency.py's profile): down 17.96 -> 15.37 ms; the gate/up kernel persistent the
    # same way took 29.05 -> 54.34 ms (its gathered token rows load through the registers, not TMA) and was removed
    persistent: int = 0
    # the aligned TMA gate/up kernel: a block whose second half is all padding (an expert's last block holding at
    # most block_m / 2 pairs, about half of those blocks) runs on half-height tiles, so half its tensor work is not
    # spent on padding rows (at 8,192 tokens Gemma 4's 128-row blocks are ~11% padding; under the H200's power cap
    # the prefill is bound by energy, so work removed counts). An experiment (COMPILED_LLM_MOE_HALF_TAIL=1), off
    # by default, not measured on a GPU yet
    half_tail: bool = False
    # the aligned TMA gate/up GEMM on gluon_moe.py's kernel (one wgmma over gate and up, 128 x 128 tiles at four
    # stages) where it runs (a Hopper GPU: gluon_fits); the Triton kernel elsewhere. H100, session 65's prototype:
    # 3-8% faster at 8,192 tokens, 2-5% at 4,096, tied at 2,048 (the 128-row tiers)
    gluon: bool = False
    # the down GEMM of the same tiers on gluon_moe.py's persistent kernel (b_block_n-wide tiles, the stage ring
    # running across a CTA's tiles); an experiment (COMPILED_LLM_MOE_GLUON_DOWN=1), off by default: no GPU has run it
    gluon_down: bool = False


UNSORTED_ENV = "COMPILED_LLM_MOE_UNSORTED"  # 0: one token is aligned like any batch (an A/B of the saving)
UNSORTED_ONE_TOKEN = os.environ.get(UNSORTED_ENV, "1") != "0"
# 0: decode batches take the alignment launch (an A/B of the saving)
SELF_ROUTE_ENV = "COMPILED_LLM_MOE_SELF_ROUTE"
SELF_ROUTE = os.environ.get(SELF_ROUTE_ENV, "1") != "0"
N_FAST_ENV = "COMPILED_LLM_MOE_N_FAST"  # 0: prefill-sized batches launch row blocks first (an A/B of MoELaunch.n_fast)
N_FAST = os.environ.get(N_FAST_ENV, "1") != "0"
# 0: prefill-sized batches load the weight tiles without TMA (an A/B of MoELaunch.tma); all: decode-sized batches
# through TMA too (H200, session 26: no faster; Qwen3.5 1024x8x256 1,117.1 -> 1,109.7 tok/s, Gemma 4 8192x4x512
# 626.9 -> 626.7: off by default)
TMA_ENV = "COMPILED_LLM_MOE_TMA"
TMA = os.environ.get(TMA_ENV, "1") != "0"
TMA_DECODE = os.environ.get(TMA_ENV, "1") == "all"
# N: every prefill tier's MoELaunch.persistent (programs an SM; 0: none); unset: the policy's (the top tier only)
PERSISTENT_ENV = "COMPILED_LLM_MOE_PERSISTENT"
PERSISTENT = int(os.environ[PERSISTENT_ENV]) if os.environ.get(PERSISTENT_ENV) else None
HALF_TAIL_ENV = "COMPILED_LLM_MOE_HALF_TAIL"  # 1: the prefill tiers' MoELaunch.half_tail
HALF_TAIL = os.environ.get(HALF_TAIL_ENV, "0") == "1"
# 0: the 128-row prefill tiers' gate/up GEMM on the Triton kernel (an A/B; read at each prefill-sized launch, so
# latency.py --alternate-env can flip it between runs)
GLUON_ENV = "COMPILED_LLM_MOE_GLUON"
GLUON_DOWN_ENV = "COMPILED_LLM_MOE_GLUON_DOWN"  # 1: the 128-row tiers' MoELaunch.gluon_down (read as GLUON_ENV)


def moe_launch_policy(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int) -> MoELaunch:
    """Decode-sized batches are weight-bandwidth bound: small block_m, narrow N tiles for more programs.
    Prefill-sized batches are compute bound: large tiles. One token: the decode tier's tiles, unsorted (its
    alignment was a 4-5 us launch a layer of a 26B-A4B batch-1 decode step on the H200, session 12)."""
    if num_tokens == 1 and UNSORTED_ONE_TOKEN:
        return MoELaunch(16, 32, 128, 4, 4, 64, 128, 4, 4, unsorted=True, tma=TMA_DECODE)
    pairs_per_expert = num_tokens * top_k / max(1, num_experts)
    if pairs_per_expert <= 2:  # decode (T <= ~32 for E=128, k=8)
        # up to 16 tokens without an alignment launch: the gate/up kernel ranks the picked experts (E bins) and
        # records each block for the down kernel. H200, batch 8, one machine (session 19): Gemma 4 26B-A4B
        # 1,004.8 -> 1,026.4 tok/s, Qwen3.5 35B-A3B (256 experts) 1,012.0 -> 1,038.4. (Session 18's first form,
        # where the down kernel ranked 2E bins again, lost 3% on Qwen3.5.)
        # the down kernel's stages: 2 where its K (the expert's intermediate size) is 512 or less, four 128-column
        # steps a program. H200, Qwen3.5 35B-A3B (I 512) at 56 experts (session 23, moe_stream --launch, two
        # calls): down 31.98 -> 31.07 and 31.96 -> 31.02 us; Gemma 4 (I 704) keeps 4
        return MoELaunch(16, 32, 128, 4, 4, 64, 128, 4, 2 if inter <= 512 else 4,
                         self_routed=SELF_ROUTE and num_tokens <= 16, tma=TMA_DECODE)
    if pairs_per_expert <= 16:
        return MoELaunch(16, 64, 128, 4, 4, 128, 128, 4, 3, tma=TMA_DECODE)
    # H200 sweep (benchmarks/prefill_kernels.py, session 17): 64-row blocks at 1,024 tokens (Gemma 4 671 -> 559 us,
    # Qwen3.5 549 -> 534), 256-column down tiles at 8,192 (2,362 -> 2,285 us; 1,579 -> 1,457)
    # every prefill tier: the launch order, the experiments' switches (the persistent down kernel is the top tier's
    # default, below)
    prefill = dict(n_fast=N_FAST, half_tail=HALF_TAIL, persistent=PERSISTENT or 0)
    gluon = dict(gluon=TMA and os.environ.get(GLUON_ENV, "1") != "0",
                 gluon_down=TMA and os.environ.get(GLUON_DOWN_ENV, "0") == "1")
    if pairs_per_expert <= 96:
        return MoELaunch(64, 64, 64, 4, 4, 128, 64, 4, 3, tma=TMA, **prefill)
    if pairs_per_expert <= 256:
        if TMA:
            # with TMA, 128-row blocks at 8 warps (H200, prefill_kernels --moe-tma): at 256 pairs an expert (session
            # 25) Gemma 4 at 4,096 tokens 1,190 -> 1,078 us, Qwen3.5 at 8,192 1,304 -> 1,252; the tier's lower end
            # (session 26, Gemma 4) at 2,048 tokens (128 pairs) 728 -> 716 us, at 3,072 (192) 967 -> 926
            return MoELaunch(128, 64, 64, 8, 3, 128, 64, 8, 3, tma=True, **gluon, **prefill)
        return MoELaunch(64, 64, 64, 4, 3, 128, 64, 8, 3, tma=TMA, **prefill)
    # the down kernel persistent here (MoELaunch.persistent), not below: H200, session 36, latency.py's 8,192-token
    # prompt, its 30 down launches 17.96 -> 15.37 ms and 17.84 -> 16.21 (two machines); at 1,024 tokens (64-row
    # blocks) 4.64 -> 6.49 ms; prefill_kernels.py's whole MoE at 1,024 / 2,048 / 4,096 / 8,192 tokens 473 -> 544,
    # 619 -> 680, 1,083 -> 1,131, 1,879 -> 1,866 us
    return MoELaunch(128, 64, 64, 8, 3, 256, 64, 8, 3, tma=TMA, **gluon,
                     **dict(prefill, persistent=1 if PERSISTENT is None else PERSISTENT))


# ----------------------------------------------------------------------------------------------------
# grouped GEMMs


@triton.jit
def _block_ids(N_FAST: tl.constexpr):
    """(row block, column block) of this program: MoELaunch.n_fast puts the column blocks on grid axis 0."""
    if N_FAST:
        return tl.program_id(1), tl.program_id(0)
    return tl.program_id(0), tl.program_id(1)


@triton.jit
def _gated_act(acc_g, acc_u, SILU: tl.constexpr):
    # the gate/up kernels' epilogue: SwiGLU (SILU) or GEGLU (tanh-approximated GELU) of the two products
    if SILU:
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    else:
        act = _gelu_tanh(acc_g) * acc_u
    return act


@triton.jit
def _gate_up_tma_rows(X, Wd, Act, rows, pair, e, pid_n, num_pairs, N, K, stride_xt, stride_an,
                      TOP_K: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SILU: tl.constexpr, PREC: tl.constexpr):
    # _gate_up_kernel's TMA body for BM rows of a block (all of it, or its first half) and their pairs
    rmask = pair < num_pairs
    tok = (pair // TOP_K).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    a_ptr = X + tok[:, None] * stride_xt + kk[None, :]
    acc_g = tl.zeros([BM, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BM, BLOCK_N], tl.float32)
    n0 = (e * 2 * N + pid_n * BLOCK_N).to(tl.int32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptr, mask=rmask[:, None] & (kk < K - k0)[None, :], other=0.0)
        acc_g += tl.dot(a, Wd.load([n0, k0]).T, input_precision=PREC)
        acc_u += tl.dot(a, Wd.load([n0 + N, k0]).T, input_precision=PREC)
        a_ptr += BLOCK_K
    act = _gated_act(acc_g, acc_u, SILU)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(Act + rows.to(tl.int64)[:, None] * stride_an + cols[None, :], act.to(Act.dtype.element_ty),
             mask=rmask[:, None] & (cols < N)[None, :])


@triton.jit(do_not_specialize=["num_pairs", "E"])  # E: JIT warm-up builds on fewer experts
def _gate_up_kernel(
    X, W, SortedIds, ExpertIds, NumPadded, Act,
    num_pairs, N, K, E,
    stride_xt, stride_we, stride_wn, stride_an,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SILU: tl.constexpr, PREC: tl.constexpr, TopkIds=None, SELF_ROUTE: tl.constexpr = False,
    K_PAD: tl.constexpr = 8, BINS: tl.constexpr = 256, N_FAST: tl.constexpr = False,
    Wd=None, TMA: tl.constexpr = False, HALF_TAIL: tl.constexpr = False,
):
    # act[row] = act_fn(x @ gate[e].T) * (x @ up[e].T) for a block of rows sorted by expert
    # TMA: Wd describes W as [E * 2N, K] in [BLOCK_N, BLOCK_K] tiles (N a multiple of BLOCK_N: a tile never
    # crosses from gate to up or into the next expert; K's tail reads as zeros). HALF_TAIL (MoELaunch.half_tail,
    # aligned TMA blocks only): a block whose second half is all padding computes its first half only
    pid_m, pid_n = _block_ids(N_FAST)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if SELF_ROUTE:  # rank the picked experts; the first column block records its block for the down kernel
        e32, pair, rmask = _self_route(TopkIds, pid_m, num_pairs // TOP_K, E, TOP_K, BLOCK_M, K_PAD, BINS)
        if pid_n == 0:
            tl.store(ExpertIds + pid_m, e32)
            tl.store(SortedIds + rows, tl.where(rmask, pair, num_pairs))
        if e32 < 0:
            return
        e = e32.to(tl.int64)
    else:
        if pid_m * BLOCK_M >= tl.load(NumPadded):
            return
        e = tl.load(ExpertIds + pid_m).to(tl.int64)
        if (e < 0) | (e >= E):  # skipped pairs (another rank's experts): the down kernel zeroes their rows
            return
        if TMA and HALF_TAIL:
            half = pid_m * BLOCK_M + tl.arange(0, BLOCK_M // 2)
            if tl.min(tl.load(SortedIds + half + BLOCK_M // 2)) >= num_pairs:  # the second half all padding
                _gate_up_tma_rows(X, Wd, Act, half, tl.load(SortedIds + half), e, pid_n, num_pairs, N, K,
                                  stride_xt, stride_an, TOP_K, BLOCK_M // 2, BLOCK_N, BLOCK_K, SILU, PREC)
                return
        pair = tl.load(SortedIds + rows)
        rmask = pair < num_pairs
    if TMA:
        _gate_up_tma_rows(X, Wd, Act, rows, pair, e, pid_n, num_pairs, N, K, stride_xt, stride_an, TOP_K, BLOCK_M,
                          BLOCK_N, BLOCK_K, SILU, PREC)
        return
    tok = (pair // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    kk = tl.arange(0, BLOCK_K)
    a_ptr = X + tok[:, None] * stride_xt + kk[None, :]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    g_ptr = W + e * stride_we + cols[None, :] * stride_wn + kk[:, None]  # [BLOCK_K, BLOCK_N]
    u_ptr = g_ptr + N * stride_wn
    for k0 in range(0, K, BLOCK_K):
        kmask = kk < K - k0
        a = tl.load(a_ptr, mask=rmask[:, None] & kmask[None, :], other=0.0)
        bmask = kmask[:, None] & cmask[None, :]
        acc_g += tl.dot(a, tl.load(g_ptr, mask=bmask, other=0.0), input_precision=PREC)
        acc_u += tl.dot(a, tl.load(u_ptr, mask=bmask, other=0.0), input_precision=PREC)
        a_ptr += BLOCK_K
        g_ptr += BLOCK_K
        u_ptr += BLOCK_K
    act = _gated_act(acc_g, acc_u, SILU)
    out_ptr = Act + rows.to(tl.int64)[:, None] * stride_an + cols[None, :]
    tl.store(out_ptr, act.to(Act.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@triton.jit(do_not_specialize=["num_pairs", "E"])  # E: JIT warm-up builds on fewer experts
def _down_kernel(
    Act, W, SortedIds, ExpertIds, NumPadded, TopkWeights, Y,
    num_pairs, N, K, E,
    stride_an, stride_we, stride_wn, stride_yt,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
    TopkIds=None, SELF_ROUTE: tl.constexpr = False, TOP_K: tl.constexpr = 1, N_FAST: tl.constexpr = False,
    Ad=None, Wd=None, TMA: tl.constexpr = False,
):
    # y[pair] = w_pair * act[row] @ down[e].T, scattered to the pair's row of [T * k, H]
    # TMA: Ad describes act [rows, K] in [BLOCK_M, BLOCK_K] tiles (a block's rows are contiguous; its padding
    # rows hold whatever the gate/up kernel left there, which reaches only their own output rows, never stored),
    # Wd the weight as [E * N, K] in [BLOCK_N, BLOCK_K] tiles (N a multiple of BLOCK_N)
    pid_m, pid_n = _block_ids(N_FAST)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    if SELF_ROUTE:  # the blocks the gate/up kernel recorded (it ran first on this stream)
        if pid_m == tl.num_programs(1 if N_FAST else 0) - 1:
            _zero_skipped_pairs(TopkIds, Y, num_pairs // TOP_K, E, stride_yt, cols, cmask, TOP_K, BLOCK_M, BLOCK_N)
            return
        e = tl.load(ExpertIds + pid_m).to(tl.int64)
        if e < 0:
            return
        pair = tl.load(SortedIds + rows)
        rmask = pair < num_pairs
        y_ptr = Y + pair.to(tl.int64)[:, None] * stride_yt + cols[None, :]
    else:
        if pid_m * BLOCK_M >= tl.load(NumPadded):
            return
        e = tl.load(ExpertIds + pid_m).to(tl.int64)
        pair = tl.load(SortedIds + rows)
        rmask = pair < num_pairs
        y_ptr = Y + pair.to(tl.int64)[:, None] * stride_yt + cols[None, :]
        if (e < 0) | (e >= E):  # pairs of another rank's experts contribute zero
            tl.store(y_ptr, tl.zeros([BLOCK_M, BLOCK_N], Y.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])
            return
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if TMA:
        m0 = pid_m * BLOCK_M
        n0 = (e * N + pid_n * BLOCK_N).to(tl.int32)
        for k0 in range(0, K, BLOCK_K):
            acc += tl.dot(Ad.load([m0, k0]), Wd.load([n0, k0]).T, input_precision=PREC)
    else:
        a_ptr = Act + rows.to(tl.int64)[:, None] * stride_an + kk[None, :]
        b_ptr = W + e * stride_we + cols[None, :] * stride_wn + kk[:, None]
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


@triton.jit(do_not_specialize=["num_pairs", "E"])
def _down_persistent_kernel(
    SortedIds, ExpertIds, NumPadded, TopkWeights, Y, Ad, Wd,
    num_pairs, N, K, E, stride_yt,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
    FLATTEN: tl.constexpr = True,
):
    # _down_kernel's aligned TMA path (MoELaunch.persistent): a program walks tiles pid, pid + programs, ... of the
    # padded row blocks (the alignment's length) x column blocks, column blocks of a row block in turn; the loop
    # nest has no branch (another rank's experts: their pairs' rows stored as zeros), so Triton can flatten it
    num_n = tl.cdiv(N, BLOCK_N)
    tiles = tl.cdiv(tl.load(NumPadded), BLOCK_M) * num_n
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=FLATTEN):
        pid_m = tile // num_n
        pid_n = tile - pid_m * num_n
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        e = tl.load(ExpertIds + pid_m).to(tl.int64)
        ok = (e >= 0) & (e < E)
        e = tl.where(ok, e, 0)
        pair = tl.load(SortedIds + rows)
        rmask = pair < num_pairs
        m0 = pid_m * BLOCK_M
        n0 = (e * N + pid_n * BLOCK_N).to(tl.int32)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc += tl.dot(Ad.load([m0, k0]), Wd.load([n0, k0]).T, input_precision=PREC)
        w = tl.load(TopkWeights + pair, mask=rmask, other=0.0).to(tl.float32)
        # (a skipped block's activation rows were never written: whatever they hold, its pairs store zeros)
        acc = tl.where(ok, acc * w[:, None], 0.0)
        tl.store(Y + pair.to(tl.int64)[:, None] * stride_yt + cols[None, :], acc.to(Y.dtype.element_ty),
                 mask=rmask[:, None] & (cols < N)[None, :])


ACTIVATIONS = ("gelu_tanh", "silu")
_TMA_WARNED: set = set()
_GLUON_WARNED: set = set()


def gluon_fits(x: torch.Tensor, weights: torch.Tensor, pol: MoELaunch, half: str = "gate/up") -> bool:
    """MoELaunch.gluon (half "gate/up": x the tokens, weights gate_up_proj) or .gluon_down (half "down": x the
    activations, weights down_proj) can run here: a Hopper GPU (wgmma; Gluon has no interpreter) and operands
    gluon_moe.fits / down_fits takes. An sm_90+ device that misses one is told which, once (that GEMM then runs on
    the Triton kernel; the gate/up one is 3-8% slower at 8K tokens on an H100)."""
    if not _common.sm90(x.device):
        return False
    if not _common.hopper(x.device):
        why = "not a Hopper GPU (sm_90)"
    elif half == "gate/up":
        why = gluon_moe.fits(x, weights, pol.block_m)
    else:
        why = gluon_moe.down_fits(x, weights, pol.block_m, pol.b_block_n)
    if why and weights.stride(0) != 0 and (half, why) not in _GLUON_WARNED:
        _GLUON_WARNED.add((half, why))
        log.warning("grouped MoE %s GEMM (experts %s): the Triton kernel runs, not the Gluon one: %s", half,
                    tuple(weights.shape), why)
    return why is None


def tma_usable(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, pol: MoELaunch) -> bool:
    """MoELaunch.tma can run here: a device with TMA (compute capability 9.0+; the Triton interpreter emulates
    it), whole weight tensors (their 2D views are the descriptors' tensors), and column tiles that divide the
    expert's rows (a tile must not cross into the next expert, or from gate to up)."""
    if not _common.has_tma(x.device):
        return False
    inter, hidden = down_proj.shape[2], down_proj.shape[1]
    fits = (gate_up_proj.is_contiguous() and down_proj.is_contiguous() and inter % pol.a_block_n == 0
            and hidden % pol.b_block_n == 0 and gate_up_proj.data_ptr() % 16 == 0 and down_proj.data_ptr() % 16 == 0
            and inter * down_proj.element_size() % 16 == 0 and hidden * gate_up_proj.element_size() % 16 == 0)
    key = (tuple(gate_up_proj.shape), tuple(down_proj.shape), pol.a_block_n, pol.b_block_n)
    # a GPU that has TMA, weights that do not fit it (zero-stride stand-ins, JIT warm-up's, are not served weights)
    if not fits and x.is_cuda and gate_up_proj.stride(0) != 0 and key not in _TMA_WARNED:
        _TMA_WARNED.add(key)
        log.warning("grouped MoE GEMMs (experts %s / %s): the weight tiles load without TMA (non-contiguous weights, "
                    "or %d-wide gate/up and %d-wide down tiles that do not divide the expert's rows); about 10%% "
                    "slower at prefill sizes on the H200", tuple(gate_up_proj.shape), tuple(down_proj.shape),
                    pol.a_block_n, pol.b_block_n)
    return fits


def fused_moe(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, activation: str = "gelu_tanh", policy: MoELaunch | None = None,
              sum_slots: bool = True, alignment: tuple | None = None) -> torch.Tensor:
    """x [T, H]; gate_up_proj [E, 2I, H]; down_proj [E, H, I]; topk_weights [T, k]; topk_ids [T, k].
    activation: gelu_tanh (GEGLU) or silu (SwiGLU). Returns [T, H] in x.dtype; sum_slots=False: each pick's
    weighted output, [T, k, H], for the caller to sum (`topk_sum`; benchmarks time the two apart).
    alignment: moe_align's outputs for these ids at the policy's block_m, made already (the router's last program
    can make them: fused_router_topk align_block_m)."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        assert activation in ACTIVATIONS, activation
        return torch.zeros_like(x) if sum_slots else x.new_zeros(0, top_k, hidden)
    gate_up, down = moe_launches(x, gate_up_proj, down_proj, topk_weights, topk_ids, activation=activation,
                                 policy=policy, alignment=alignment)
    gate_up()
    y = down()
    if not sum_slots:
        return y.view(num_tokens, top_k, hidden)
    if top_k == 1:
        return y
    # (the sum inside the down kernel, by the last program of each column block, was measured slower on the
    # H200: session 23, benchmarks/results/moe_topk_sum_in_down_kernel_rejected_*.diff)
    return topk_sum(y.view(num_tokens, top_k, hidden))


def moe_launches(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, *, activation: str = "gelu_tanh", policy: MoELaunch | None = None,
                 alignment: tuple | None = None) -> tuple[Callable[[], None], Callable[[], torch.Tensor]]:
    """fused_moe's two grouped GEMMs as two calls on buffers made once (at least one token): `gate_up()` writes
    the activations (and, self-routed, each block's expert and rows), then `down()` returns each pick's weighted
    output [T k, H]. Each call launches one kernel, so a benchmark can time them apart (benchmarks/moe_stream.py
    --parts; the down kernel reads what the last gate/up call recorded)."""
    assert activation in ACTIVATIONS, activation
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = gate_up_proj.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    assert gate_up_proj.shape[2] == hidden and down_proj.shape == (num_experts, hidden, inter)
    assert x.stride(1) == 1 and gate_up_proj.stride(2) == 1 and down_proj.stride(2) == 1 and num_tokens > 0
    pol = policy or moe_launch_policy(num_tokens, top_k, num_experts, hidden, inter)
    num_pairs = num_tokens * top_k
    route: dict = {}
    up_route: dict = {}
    if pol.self_routed and num_tokens <= pol.block_m:
        # no alignment: a block per picked expert (at most min(E, pairs)) and a spare one, which zeroes the
        # pairs of another rank's experts
        num_blocks = min(num_experts, num_pairs) + 1
        rows = num_blocks * pol.block_m
        # each block's expert and pairs, written by the gate/up kernel and read by the down kernel
        expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=x.device)
        sorted_ids = torch.empty(rows, dtype=torch.int32, device=x.device)
        num_padded = expert_ids  # unused
        route = dict(TopkIds=topk_ids.contiguous(), SELF_ROUTE=True)
        up_route = dict(K_PAD=triton.next_power_of_2(top_k), BINS=triton.next_power_of_2(num_experts))
    else:
        if pol.unsorted:
            sorted_ids, num_padded = unsorted_blocks(num_pairs, pol.block_m, x.device)
            expert_ids = topk_ids.reshape(-1)
        elif alignment is not None:
            sorted_ids, expert_ids, num_padded = alignment
        else:
            sorted_ids, expert_ids, num_padded = moe_align(topk_ids, num_experts, pol.block_m)
        num_blocks, rows = expert_ids.numel(), sorted_ids.numel()
    act = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    weights = topk_weights.contiguous()  # any float dtype: the down kernel reads it as float32 (no cast launch)
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)

    n_fast = pol.n_fast and num_blocks < 65536  # (grid axis 1 holds at most 65,535)
    up_tma, down_tma, gluon_down = {}, {}, None
    if pol.tma and tma_usable(x, gate_up_proj, down_proj, pol):
        gu2, dn2 = gate_up_proj.view(-1, hidden), down_proj.view(-1, inter)
        up_tma = dict(Wd=TensorDescriptor.from_tensor(gu2, [pol.a_block_n, pol.a_block_k]), TMA=True)
        if pol.half_tail and not route and not pol.unsorted:
            up_tma["HALF_TAIL"] = True
        elif pol.gluon and not route and not pol.unsorted and num_blocks < 65536 and gluon_fits(x, gate_up_proj, pol):
            up_tma = dict(w_desc=gluon_moe.weight_descriptor(gate_up_proj))
        down_tma = dict(Ad=TensorDescriptor.from_tensor(act, [pol.block_m, pol.b_block_k]),
                        Wd=TensorDescriptor.from_tensor(dn2, [pol.b_block_n, pol.b_block_k]), TMA=True)
        if pol.gluon_down and not route and not pol.unsorted and gluon_fits(act, down_proj, pol, "down"):
            gluon_down = gluon_moe.down_launch_args(act, down_proj, sorted_ids, expert_ids, num_padded, weights, y,
                                                    pol.block_m, pol.b_block_n, num_sms(x.device),
                                                    num_experts=num_experts)

    def grid(n_blocks: int) -> tuple[int, int]:
        return (n_blocks, num_blocks) if n_fast else (num_blocks, n_blocks)

    def gate_up() -> None:
        if "w_desc" in up_tma:
            gluon_moe.gate_up(x, gate_up_proj, sorted_ids, expert_ids, num_padded, act, top_k, pol.block_m,
                              silu=activation == "silu", num_experts=num_experts, w_desc=up_tma["w_desc"])
            return
        _gate_up_kernel[grid(triton.cdiv(inter, pol.a_block_n))](
            x, gate_up_proj, sorted_ids, expert_ids, num_padded, act,
            num_pairs, inter, hidden, num_experts,
            x.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1), act.stride(0),
            TOP_K=top_k, BLOCK_M=pol.block_m, BLOCK_N=pol.a_block_n, BLOCK_K=pol.a_block_k,
            SILU=activation == "silu", PREC=dot_precision(x.dtype), num_warps=pol.a_warps,
            num_stages=pol.a_stages, N_FAST=n_fast, **route, **up_route, **up_tma,
        )

    def down() -> torch.Tensor:
        if gluon_down is not None:
            grid_d, args, kwargs = gluon_down
            gluon_moe._down_gluon_kernel[grid_d](*args, **kwargs)
            return y
        if pol.persistent and down_tma and not route and not pol.unsorted:
            programs = num_sms(x.device) * pol.persistent
            _down_persistent_kernel[(min(programs, num_blocks * triton.cdiv(hidden, pol.b_block_n)),)](
                sorted_ids, expert_ids, num_padded, weights, y, down_tma["Ad"], down_tma["Wd"],
                num_pairs, hidden, inter, num_experts, y.stride(0), BLOCK_M=pol.block_m, BLOCK_N=pol.b_block_n,
                BLOCK_K=pol.b_block_k, PREC=dot_precision(x.dtype), num_warps=pol.b_warps, num_stages=pol.b_stages)
            return y
        _down_kernel[grid(triton.cdiv(hidden, pol.b_block_n))](
            act, down_proj, sorted_ids, expert_ids, num_padded, weights, y,
            num_pairs, hidden, inter, num_experts,
            act.stride(0), down_proj.stride(0), down_proj.stride(1), y.stride(0),
            BLOCK_M=pol.block_m, BLOCK_N=pol.b_block_n, BLOCK_K=pol.b_block_k, PREC=dot_precision(x.dtype),
            num_warps=pol.b_warps, num_stages=pol.b_stages, N_FAST=n_fast, **route,
            **({"TOP_K": top_k} if route else {}), **down_tma,
        )
        return y

    return gate_up, down


@triton.jit(do_not_specialize=["T"])
def _topk_sum_kernel(Y, Out, T, H, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    # out[t] = sum_j y[t, j] in float32, stored in the output's dtype: one kernel where a torch sum and a cast
    # were two (each a launch per MoE layer of a decode step)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = h < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(Y + (t * TOP_K + j) * H + h, mask=m, other=0.0).to(tl.float32)
    tl.store(Out + t * H + h, acc.to(Out.dtype.element_ty), mask=m)


def topk_sum_tiles(hidden: int) -> tuple[int, int]:
    """(block_h, num_warps) of the top-k sum: one build for every batch size. H200 sweep (state_kernels.py,
    session 21): 256-column tiles, 4 warps: 1.73 -> 1.42 us at 8 tokens and H = 2048, 1.81 -> 1.46 at 2816, and
    within 0.05 us of the best tile at 1 to 32 tokens (1,024-column tiles left most SMs idle)."""
    return min(256, triton.next_power_of_2(hidden)), 4


def topk_sum(y: torch.Tensor, tiles: tuple[int, int] | None = None) -> torch.Tensor:
    """[T, k, H] -> [T, H]: the weighted expert outputs of each token added in float32. tiles: (block_h,
    num_warps), overriding topk_sum_tiles (benchmarks/state_kernels.py sweeps them)."""
    num_tokens, top_k, hidden = y.shape
    y = y.contiguous()
    out = torch.empty(num_tokens, hidden, dtype=y.dtype, device=y.device)
    if num_tokens:
        block_h, warps = tiles or topk_sum_tiles(hidden)
        _topk_sum_kernel[(num_tokens, triton.cdiv(hidden, block_h))](y, out, num_tokens, hidden, TOP_K=top_k,
                                                                     BLOCK_H=block_h, num_warps=warps)
    return out


def fused_geglu_moe(x, gate_up_proj, down_proj, topk_weights, topk_ids, *, policy: MoELaunch | None = None,
                    sum_slots: bool = True, alignment: tuple | None = None):
    return fused_moe(x, gate_up_proj, down_proj, topk_weights, topk_ids, activation="gelu_tanh", policy=policy,
                     sum_slots=sum_slots, alignment=alignment)


def fused_swiglu_moe(x, gate_up_proj, down_proj, topk_weights, topk_ids, *, policy: MoELaunch | None = None,
                     sum_slots: bool = True, alignment: tuple | None = None):
    return fused_moe(x, gate_up_proj, down_proj, topk_weights, topk_ids, activation="silu", policy=policy,
                     sum_slots=sum_slots, alignment=alignment)


# ----------------------------------------------------------------------------------------------------
# router


@triton.jit
def _store_picks(sel_w, sel_i, t, tmask, kk, ExpertScale, OutW, OutIds, TOP_K: tl.constexpr,
                 EXPERT_SCALE: tl.constexpr):
    # both router paths end here: renormalise the top-k probabilities, apply the per-expert scale, store the
    # weights (float32, or the model's dtype where the model casts them: no cast kernel after) and the ids (in
    # the output's dtype: int64 for the op)
    kmask = kk < TOP_K
    sel_w = tl.where(kmask[None, :], sel_w, 0.0)
    sel_w = sel_w / tl.sum(sel_w, 1)[:, None]
    omask = tmask[:, None] & kmask[None, :]
    if EXPERT_SCALE:
        sel_w = sel_w * tl.load(ExpertScale + sel_i, mask=omask, other=0.0).to(tl.float32)
    o_off = t.to(tl.int64)[:, None] * TOP_K + kk[None, :]
    if OutW.dtype.element_ty == tl.bfloat16:  # round to nearest even, as torch's cast does (by its bits: the
        # interpreter's own conversion truncates)
        bits = sel_w.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(OutW + o_off, bits.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=omask)
    else:
        tl.store(OutW + o_off, sel_w.to(OutW.dtype.element_ty), mask=omask)
    tl.store(OutIds + o_off, sel_i.to(OutIds.dtype.element_ty), mask=omask)


@triton.jit(do_not_specialize=["T", "slice_h"])
def _router_logits_kernel(
    X, Scale, W, Partial,
    T, H, E, eps, root, slice_h,
    stride_xt, stride_we,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, PREC: tl.constexpr,
    NORM: tl.constexpr, F32: tl.constexpr,
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
        acc += _dot(hv, wv.to(X.dtype.element_ty), PREC, F32)
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
    _store_picks(sel_w, sel_i, t, tmask, kk, ExpertScale, OutW, OutIds, TOP_K, EXPERT_SCALE)


@triton.jit(do_not_specialize=["T"])
def _router_fused_kernel(
    X, Scale, W, ExpertScale, Partial, SumSq, Tickets, OutW, OutIds,
    T, H, E, eps, root,
    stride_xt, stride_we,
    SLICE_H: tl.constexpr, SPLITS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_EF: tl.constexpr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
    NORM: tl.constexpr, EXPERT_SCALE: tl.constexpr, LOGITS: tl.constexpr, HALF: tl.constexpr,
    PREC: tl.constexpr, F32: tl.constexpr,
    Cursor=None, SortedIds=None, ExpertIds=None, NumPadded=None, align_size=0, ALIGN: tl.constexpr = False,
    A_BLOCK_M: tl.constexpr = 16, BINS: tl.constexpr = 16, CHUNK: tl.constexpr = 1024, CB: tl.constexpr = 16,
    PARTS: tl.constexpr = 3,
):
    # One launch for the whole router at decode sizes. Program (t block, e block, h slice) writes
    #   partial[s, t, e] = sum over its slice of (x * scale * H^-0.5)[t, h] * W[e, h]   (NORM false: x[t, h] * W[e, h])
    #   sumsq[s, t]      = sum over its slice of x[t, h]^2                               (e block 0 only)
    # (no program reads the whole row: the RMS factor is constant over h, so it is applied to the summed logit),
    # then takes a ticket from its t block's counter. The last program of the t block (ticket = e blocks x
    # slices - 1) sums the partials in slice order (a fixed order: deterministic), applies rstd and does
    # top-k + the picks' softmax (renormalised) + per-expert scale, and resets the counter to zero, so the
    # counter is clean for the next launch (capturable in a CUDA graph: no memset). HALF: the normed row is
    # split into a half-precision head and tail, two dots with the (exact) half-precision weight: float32-grade
    # products.
    # PARTS < 3 stops early, for benchmarks/router_kernel.py --parts to time the launch's stages (its outputs
    # are then incomplete): 0 after the partial stores, 1 after the ticket, 2 after the partials' sums.
    pid_t = tl.program_id(0)
    pid_e = tl.program_id(1)
    s = tl.program_id(2)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    tmask = t < T
    emask = e < E
    hh = tl.arange(0, BLOCK_H)
    x_row = X + t.to(tl.int64)[:, None] * stride_xt
    acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    ss = tl.zeros([BLOCK_T], tl.float32)
    lo = s * SLICE_H
    for h0 in range(lo, lo + SLICE_H, BLOCK_H):
        hs = h0 + hh
        hmask = hs < H
        xv = tl.load(x_row + hs[None, :], mask=tmask[:, None] & hmask[None, :], other=0.0)
        wv = tl.load(W + e[None, :] * stride_we + hs[:, None], mask=hmask[:, None] & emask[None, :], other=0.0)
        if NORM:
            xf = xv.to(tl.float32)
            ss += tl.sum(xf * xf, 1)
            sc = tl.load(Scale + hs, mask=hmask, other=0.0).to(tl.float32) * root
            hv = xf * sc[None, :]
            if HALF:
                head = hv.to(X.dtype.element_ty)
                tail = (hv - head.to(tl.float32)).to(X.dtype.element_ty)
                acc += _dot(head, wv, PREC, F32)
                acc += _dot(tail, wv, PREC, F32)
            else:
                acc += _dot(hv, wv.to(tl.float32), PREC, F32)
        else:
            acc += _dot(xv, wv.to(X.dtype.element_ty), PREC, F32)
    tl.store(Partial + (s * T + t.to(tl.int64))[:, None] * E + e[None, :], acc, mask=tmask[:, None] & emask[None, :])
    if NORM:
        tl.store(SumSq + s * T + t, ss, mask=tmask & (pid_e == 0))
    if PARTS == 0:
        return
    tl.debug_barrier()  # every thread's stores precede the (one-thread) release below
    ticket = tl.atomic_add(Tickets + pid_t, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(1) * SPLITS - 1:
        tl.atomic_xchg(Tickets + pid_t, 0, sem="relaxed", scope="gpu")
        if PARTS == 1:
            return
        ef = tl.arange(0, BLOCK_EF)
        efmask = ef < E
        m2 = tmask[:, None] & efmask[None, :]
        logits = tl.zeros([BLOCK_T, BLOCK_EF], tl.float32)
        for i in tl.static_range(SPLITS):  # slice order: a fixed summation order
            logits += tl.load(Partial + (i * T + t.to(tl.int64))[:, None] * E + ef[None, :], mask=m2, other=0.0,
                              cache_modifier=".cg")
        if NORM:
            sq = tl.zeros([BLOCK_T], tl.float32)
            for i in tl.static_range(SPLITS):
                sq += tl.load(SumSq + i * T + t, mask=tmask, other=0.0, cache_modifier=".cg")
            logits = logits * tl.rsqrt(sq / H + eps)[:, None]
        if LOGITS != tl.float32:  # the logits rounded to the model's dtype, as its projection gives them
            logits = logits.to(LOGITS).to(tl.float32)
        if PARTS == 2:
            tl.store(OutW + t.to(tl.int64) * TOP_K, tl.max(logits, 1).to(OutW.dtype.element_ty), mask=tmask)
            return
        # top-k over the logits (softmax is monotone, and the picks' weights are renormalised, so the softmax's
        # denominator cancels: only the k picks are exponentiated; H200, session 32: Qwen3.5's router at 8 tokens
        # 7.61 -> 7.21 us, Gemma 4's 6.45 -> 6.25, against the softmax over every expert first). One
        # max-reduction per pick over a packed key: the logit's bits, made to order as signed integers (a
        # negative float's magnitude bits flipped), above; BLOCK_EF - 1 - expert below (the lowest index wins
        # ties, as in _router_topk_kernel).
        bits = logits.to(tl.int32, bitcast=True)
        bits = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        key = (bits.to(tl.int64) << 32) + (BLOCK_EF - 1 - ef).to(tl.int64)[None, :]
        gone = -0x7FFFFFFFFFFFFFFF  # below every key (a -inf logit's included): masked columns and taken picks
        key = tl.where(efmask[None, :], key, gone)
        kk = tl.arange(0, BLOCK_K)
        sel_l = tl.full([BLOCK_T, BLOCK_K], float("-inf"), tl.float32)
        sel_i = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
        for i in tl.static_range(TOP_K):
            best = tl.max(key, 1)
            hi = (best >> 32).to(tl.int32)
            idx = (BLOCK_EF - 1) - (best - (hi.to(tl.int64) << 32)).to(tl.int32)
            hi = tl.where(hi >= 0, hi, hi ^ 0x7FFFFFFF)
            sel_l = tl.where(kk[None, :] == i, hi.to(tl.float32, bitcast=True)[:, None], sel_l)
            sel_i = tl.where(kk[None, :] == i, idx[:, None], sel_i)
            key = tl.where(key == best[:, None], gone, key)
        # the first pick is the largest logit: each pick's exp(logit - max), renormalised in _store_picks
        sel_w = tl.exp(sel_l - tl.max(sel_l, 1)[:, None])
        _store_picks(sel_w, sel_i, t, tmask, kk, ExpertScale, OutW, OutIds, TOP_K, EXPERT_SCALE)
        if ALIGN:  # one token block: this program has every pick; it aligns them for the grouped GEMMs too
            tl.debug_barrier()  # the picks' stores precede their loads by the other threads of this program
            _align_body(OutIds, Cursor, SortedIds, ExpertIds, NumPadded, T * TOP_K, E, align_size, A_BLOCK_M, BINS,
                        CHUNK, CB)


ROUTER_PROGRAMS = 256  # enough programs to keep an H200's 132 SMs reading the router weight at decode sizes
ROUTER_SMALL_BLOCK_TOKENS = 8  # up to here the one-launch router takes a token block of at most 8 rows
# up to here the router is one launch (_router_fused_kernel) on decode-sized tiles; past it a normed router (Gemma
# 4's) is one launch on 32-row blocks of every expert, a softmax router (Qwen3.5's) two kernels
ROUTER_FUSED_MAX_TOKENS = 64
# from here the two-kernel path of a normed router (COMPILED_LLM_ROUTER_PREFILL=two, an A/B) takes one program per
# row block for all experts
ROUTER_WIDE_MIN_TOKENS = 4096
ROUTER_PREFILL_ENV = "COMPILED_LLM_ROUTER_PREFILL"
ROUTER_PREFILL_FEW_TOKENS = 2048  # up to here the one-launch prefill router splits the hidden size in 4, past it in 2


@dataclass(frozen=True)
class RouterLaunch:
    """fused: one _router_fused_kernel launch (decode sizes); else _router_logits_kernel + _router_topk_kernel.
    The grid is (cdiv(T, block_t), cdiv(E, block_e), splits); each program reads a block_e x slice_h tile of
    the weight, block_h columns at a time. Every field is a compile-time constant of the kernels (or picks
    the kernel), so launch_variants keys on the whole tuple."""
    fused: bool
    block_t: int
    block_e: int
    block_h: int
    splits: int
    slice_h: int
    num_warps: int = 4
    num_stages: int = 2
    parts: int = 3  # the fused kernel's stages run (3: all; fewer: benchmarks/router_kernel.py --parts)

    def build_key(self) -> tuple:
        """What decides the kernel build: the two-kernel path takes splits and slice_h as runtime arguments."""
        if self.fused:
            return (self.fused, self.block_t, self.block_e, self.block_h, self.splits, self.slice_h, self.num_warps,
                    self.num_stages, self.parts)
        return (self.fused, self.block_t, self.block_e, self.block_h, self.num_warps, self.num_stages)


def _slices(hidden: int, target: int, block_h: int) -> tuple[int, int]:
    slice_h = triton.cdiv(triton.cdiv(hidden, max(1, target)), block_h) * block_h
    return triton.cdiv(hidden, slice_h), slice_h


def softmax_block_t(num_tokens: int) -> int:
    """The token block of Qwen3.5's softmax router (no norm) at decode sizes, 4 warps up to 4 rows: the block's last
    program picks for fewer rows, and the weight tile is read once more per block (mostly from the L2). H200,
    session 33 (router_kernel.py --parts --sweep --softmax, E 256, H 2048), us, one block of the batch against
    this: T = 2 5.79 -> 5.28, 4: 6.26 -> 5.67, 8: 7.20 -> 6.38, 16: 9.64 -> 7.39. Gemma 4's router (the norm
    first) keeps its 8-row block: 4 rows there ran 6.63 against 6.25 at T = 8."""
    if num_tokens <= 1:
        return 1
    return 2 if num_tokens <= 4 else 4 if num_tokens <= 16 else 16


def router_launch(num_tokens: int, hidden: int, num_experts: int, *, block_e: int | None = None,
                  splits: int | None = None, block_h: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None, fused: bool | None = None, norm: bool = True,
                  block_t: int | None = None) -> RouterLaunch:
    """The router's launch. Keywords override the policy (benchmarks/moe_kernels.py sweeps them).

    Decode (T <= ROUTER_FUSED_MAX_TOKENS): one kernel; the [E, H] weight is split over 16-expert blocks and
    ~12 hidden slices (H = 2816: 8 x 11 = 88 programs a 16-token block, each reading an 8 KB tile), the last
    program of a token block sums the 11 partials and picks the experts. Up to ROUTER_SMALL_BLOCK_TOKENS the
    token block is 8 rows over 8 slices (Qwen3.5's: the batch's power of two), so the decode batch sizes take
    two to five builds, which JIT warm-up makes (launch_variants). Larger T, a softmax router: the two-kernel
    path (the logits split over expert blocks and hidden slices, whose partial sums the top-k kernel adds).
    norm: Gemma 4's router (an RMSNorm of the row first): past ROUTER_FUSED_MAX_TOKENS the one-launch kernel as well, on 32-row blocks of every expert
    (COMPILED_LLM_ROUTER_PREFILL=two: the two kernels, which from ROUTER_WIDE_MIN_TOKENS tokens read each row
    block once for all experts, 64 x 128 tiles, 8 warps)."""
    prefill = num_tokens > ROUTER_FUSED_MAX_TOKENS
    if fused is None:
        fused = not prefill or (norm and block_e is None and splits is None
                                and os.environ.get(ROUTER_PREFILL_ENV, "one") != "two")
    if fused and prefill and norm:
        # one pass over each row: the logits of the scaled row (head + tail products, float32-grade) and its sum of
        # squares in the same loop, the RMS factor applied to the summed logits by each row block's last program;
        # the two-kernel path reads every row twice (its norm, then its product) and rounds the normed row first.
        # 32-row blocks of every expert (one read of the row block), the hidden size in 4 or 2 slices. H100 sweep
        # (prefill_kernels.py --groups router, session 55; 32 / 64 rows x 1-11 slices x 4 / 8 warps), us at 1,024
        # / 8,192 tokens: 16.3 / 65.1, against 27.0 / 86.9 for 64-row blocks in 8 / 2 slices (and ~45 / ~118 for
        # the two kernels in the engine's profile)
        be = min(128, max(16, triton.next_power_of_2(num_experts)))
        bh = block_h or 128
        n, sh = _slices(hidden, splits or (4 if num_tokens <= ROUTER_PREFILL_FEW_TOKENS else 2), bh)
        return RouterLaunch(True, block_t or 32, block_e or be, bh, n, sh, num_warps or 8, num_stages or 3)
    if fused:  # H200 sweep (benchmarks/NOTES.md, 2026-12-01): 128-column steps, 8 warps: 6.7 us vs 11.7 at T=1
        bh = block_h or 128
        # up to ROUTER_SMALL_BLOCK_TOKENS, session 21's sweep (prefill_kernels.py --tokens 1,8): a token block of
        # 8 rows and 8 hidden slices, less softmax and top-k work for the block's last program: Gemma 4 7.14 ->
        # 6.72 us at T = 8 (6.78 -> 6.53 at 1), Qwen3.5 (E = 256, H = 2048) 10.08 -> 7.86; Gemma's is best at 8
        # rows at one token too (7.36 at one). Qwen3.5's softmax router takes blocks of at most 4 rows up to 16
        # tokens (softmax_block_t; session 33)
        small = num_tokens <= ROUTER_SMALL_BLOCK_TOKENS
        if norm:
            bt = block_t or (8 if small else 16)
            warps = 4 if small and bt == 1 else 8
        else:
            bt = block_t or softmax_block_t(num_tokens)
            small = small or bt <= 4
            warps = 4 if bt <= 4 else 8
        n, sh = _slices(hidden, splits or (8 if small else 12), bh)
        return RouterLaunch(True, bt, block_e or 16, bh, n, sh, num_warps or warps, num_stages or 3)
    if norm and num_tokens >= ROUTER_WIDE_MIN_TOKENS and block_e is None and splits is None:
        # H200 sweep (prefill_kernels.py, session 17), 8,192 tokens: 88.7 us against 179.2 for the tiles below
        # (the norm pass and the dot pass read a row block once per expert block there); at 1,024 tokens the
        # tiles below win (33.3 us against 74.4); Qwen3.5's router (no norm) gains nothing from the wide tiles
        be = min(128, max(16, triton.next_power_of_2(num_experts)))
        bh = block_h or 128
        n, sh = _slices(hidden, 1, bh)
        return RouterLaunch(False, 64, be, bh, n, sh, num_warps or 8, num_stages or 3)
    bh = block_h or 64
    block_t = 16 if num_tokens <= 1024 else 32
    be = block_e or (16 if num_tokens <= 64 else min(64, max(16, triton.next_power_of_2(num_experts))))
    rows = triton.cdiv(num_tokens, block_t) * triton.cdiv(num_experts, be)
    n, sh = _slices(hidden, splits or max(1, min(triton.cdiv(hidden, 2 * bh), ROUTER_PROGRAMS // rows)), bh)
    return RouterLaunch(False, block_t, be, bh, n, sh, num_warps or 4, num_stages or 2)


_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def fused_router_topk(x: torch.Tensor, scale: torch.Tensor | None, proj_weight: torch.Tensor,
                      per_expert_scale: torch.Tensor | None, top_k: int, eps: float,
                      launch: RouterLaunch | None = None, ids_dtype: torch.dtype = torch.int32,
                      align_block_m: int | None = None, weights_dtype: torch.dtype = torch.float32):
    """Gemma 4 router. x [T, H]; scale [H]; proj_weight [E, H]; per_expert_scale [E].
    Returns (weights [T, k] in weights_dtype, ids [T, k] in ids_dtype), experts in descending probability.
    scale None: Qwen3.5's softmax router (no norm, no scales; the logits rounded to x's dtype first, as
    its projection gives them). launch: override router_launch's choice (benchmarks, tests).
    align_block_m: also align the picks for the grouped GEMMs at that block_m (moe_align's outputs, made by the
    router's last program: one launch less a MoE layer) where one program sees every pick (the one-launch
    kernel with one token block, below the sort's pair count); then returns (weights, ids, alignment), the
    alignment None where it could not. weights_dtype: the weights rounded to it in the kernel's store (Qwen3.5
    casts them to its dtype; the same rounding as a cast after, without its launch)."""
    norm = scale is not None
    num_tokens, hidden = x.shape
    num_experts = proj_weight.shape[0]
    assert x.stride(1) == 1 and proj_weight.stride(1) == 1 and top_k <= num_experts
    weights = torch.empty(num_tokens, top_k, dtype=weights_dtype, device=x.device)
    ids = torch.empty(num_tokens, top_k, dtype=ids_dtype, device=x.device)  # int64: the op's dtype, no cast kernel
    if num_tokens == 0:
        return (weights, ids) if align_block_m is None else (weights, ids, None)
    # the alignment needs every pick in one program: up to 16 tokens, one token block (the softmax router's
    # default blocks are smaller: softmax_block_t)
    one_block = align_block_m is not None and not norm and num_tokens <= 16
    lp = launch or router_launch(num_tokens, hidden, num_experts, norm=norm,
                                 block_t=triton.next_power_of_2(num_tokens) if one_block else None)
    has_scale = per_expert_scale is not None
    partial = torch.empty(lp.splits, num_tokens, num_experts, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(num_tokens, lp.block_t), triton.cdiv(num_experts, lp.block_e), lp.splits)
    logits_dtype = tl.float32 if norm else _TL_DTYPE[x.dtype]
    if lp.fused:
        sumsq = torch.empty(lp.splits, num_tokens, dtype=torch.float32, device=x.device) if norm else partial
        align, alignment = {}, None
        if align_block_m is not None and grid[0] == 1 and num_tokens * top_k < ALIGN_SORT_MIN_PAIRS:
            bufs, size, meta = _align_buffers(num_tokens * top_k, num_experts, align_block_m, x.device)
            alignment = bufs[1:]
            align = dict(Cursor=bufs[0], SortedIds=bufs[1], ExpertIds=bufs[2], NumPadded=bufs[3], align_size=size,
                         ALIGN=True, A_BLOCK_M=meta["BLOCK_M"], BINS=meta["BINS"], CHUNK=meta["CHUNK"], CB=meta["CB"])
        _router_fused_kernel[grid](
            x, scale.contiguous() if norm else x, proj_weight, per_expert_scale.contiguous() if has_scale else x,
            partial, sumsq, ticket_counters(("router", x.device), grid[0], x.device), weights, ids,
            num_tokens, hidden, num_experts, float(eps), float(hidden ** -0.5),
            x.stride(0), proj_weight.stride(0),
            SLICE_H=lp.slice_h, SPLITS=lp.splits, BLOCK_T=lp.block_t, BLOCK_H=lp.block_h, BLOCK_E=lp.block_e,
            BLOCK_EF=max(16, triton.next_power_of_2(num_experts)), TOP_K=top_k,
            BLOCK_K=triton.next_power_of_2(top_k), NORM=norm, EXPERT_SCALE=has_scale, LOGITS=logits_dtype,
            HALF=x.dtype != torch.float32, PREC=dot_precision(x.dtype),
            F32=dot_f32(x.dtype), num_warps=lp.num_warps, num_stages=lp.num_stages, PARTS=lp.parts, **align,
        )
        return (weights, ids) if align_block_m is None else (weights, ids, alignment)
    _router_logits_kernel[grid](
        x, scale.contiguous() if norm else x, proj_weight, partial,
        num_tokens, hidden, num_experts, float(eps), float(hidden ** -0.5), lp.slice_h,
        x.stride(0), proj_weight.stride(0),
        BLOCK_T=lp.block_t, BLOCK_H=lp.block_h, BLOCK_E=lp.block_e, PREC=dot_precision(x.dtype), NORM=norm,
        F32=dot_f32(x.dtype), num_warps=lp.num_warps, num_stages=lp.num_stages,
    )
    _router_topk_kernel[(grid[0],)](
        partial, per_expert_scale.contiguous() if has_scale else partial, weights, ids, num_tokens, num_experts,
        lp.splits, TOP_K=top_k, BLOCK_T=lp.block_t, BLOCK_E=max(16, triton.next_power_of_2(num_experts)),
        BLOCK_K=triton.next_power_of_2(top_k), EXPERT_SCALE=has_scale, LOGITS=logits_dtype, num_warps=4,
    )
    return (weights, ids) if align_block_m is None else (weights, ids, None)


def launch_variants(num_experts: int, top_k: int, hidden: int, inter: int, max_tokens: int, *,
                    norm: bool = True) -> list[int]:
    """One token count per distinct kernel build the router and grouped GEMMs need for batches of 1 to
    max_tokens tokens (their launch constexprs change with the batch): what JIT warm-up runs, so that no
    batch size compiles a kernel while serving."""
    seen, out = set(), []
    for tokens in range(1, max(1, max_tokens) + 1):
        key = (router_launch(tokens, hidden, num_experts, norm=norm).build_key(),
               moe_launch_policy(tokens, top_k, num_experts, hidden, inter), align_kind(tokens * top_k))
        if key not in seen:
            seen.add(key)
            out.append(tokens)
    return out
