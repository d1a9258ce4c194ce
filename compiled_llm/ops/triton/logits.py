"""The LM-head tail's kernels (ops/logits.py).

The soft cap in one pass: float32(cap * tanh(logits / cap)) with each intermediate rounded to the logits' dtype,
as eager PyTorch's three launches round them (the division is a multiplication by the float32 reciprocal there
too), so the sampler sees the same values.

The greedy rows' argmax in two passes: each program takes a chunk of a row (its maximum and that maximum's first
index), then one program a row merges the chunks in order. torch.argmax's answer, ties and NaN included: the
first index of the maximum, a NaN counting as larger than any number."""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from compiled_llm.ops.jit import MONITOR, JitKernel, register_kernel
from compiled_llm.ops.triton._common import _INTERPRETED, _tanh

BLOCK = 2048
SOFTCAP_WARPS = 4  # H200, 8 x 262,144 bf16 (session 24): 2048 x 4 warps 5.5 us, 2048 x 8 warps 7.7
ARGMAX_CHUNK = 4096  # a row's elements a first-pass program reads
ARGMAX_WARPS = 8


@triton.jit(do_not_specialize=["n"])
def _softcap_kernel(X, Y, n, inv, cap, BLOCK: tl.constexpr, INTERP: tl.constexpr = False):
    # INTERP: the Triton interpreter (tests on the CPU) has no libdevice; tanh from exp there
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0)
    low = X.dtype.element_ty
    y = (x.to(tl.float32) * inv).to(low).to(tl.float32)
    if INTERP:
        t = _tanh(y)
    else:
        t = libdevice.tanh(y)
    t = t.to(low).to(tl.float32)
    tl.store(Y + offs, (t * cap).to(low).to(tl.float32), mask=mask)


def logits_softcap(logits: torch.Tensor, cap: float, block: int = BLOCK, warps: int = SOFTCAP_WARPS) -> torch.Tensor:
    """block, warps: the launch (scripts/check_kernels_gpu.py --only logits times others)."""
    x = logits.contiguous()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    n = x.numel()
    MONITOR.note("logits_softcap", (x.dtype,))
    if n:
        inv = float(np.float32(1.0) / np.float32(cap))  # PyTorch divides by a scalar as this multiplication
        _softcap_kernel[(triton.cdiv(n, block),)](x, y, n, inv, float(cap), BLOCK=block, INTERP=_INTERPRETED,
                                                 num_warps=warps)
    return y


@triton.jit
def _first_max(x, idx, valid, BIG: tl.constexpr):
    """(maximum, first index of it) over the valid lanes; a NaN beats every number (its first index wins)."""
    nan = (x != x) & valid
    any_nan = tl.max(nan.to(tl.int32), 0) > 0
    m = tl.max(tl.where(valid & ~nan, x, float("-inf")), 0)
    hit = tl.where(any_nan, nan, valid & (x == m))
    first = tl.min(tl.where(hit, idx, BIG), 0)
    return tl.where(any_nan, float("nan"), m), first


@triton.jit(do_not_specialize=["n", "chunks"])
def _argmax_chunk_kernel(X, Val, Idx, n, chunks, stride_x, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    valid = offs < n
    x = tl.load(X + row.to(tl.int64) * stride_x + offs, mask=valid, other=float("-inf"))
    m, first = _first_max(x, offs, valid, 2147483647)
    tl.store(Val + row * chunks + c, m)
    tl.store(Idx + row * chunks + c, first)


@triton.jit(do_not_specialize=["chunks"])
def _argmax_merge_kernel(Val, Idx, Out, chunks, BLOCK_C: tl.constexpr):
    # the chunks in order: the first chunk holding the maximum has its first index
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    valid = c < chunks
    v = tl.load(Val + row * chunks + c, mask=valid, other=float("-inf"))
    _, best = _first_max(v, c, valid, BLOCK_C)
    tl.store(Out + row, tl.load(Idx + row * chunks + best).to(tl.int64))


def argmax_rows(logits: torch.Tensor, chunk: int = ARGMAX_CHUNK, warps: int = ARGMAX_WARPS) -> torch.Tensor:
    """[B, V] float logits -> [B] int64, torch.argmax(logits, -1)'s indices. chunk, warps: the first pass's launch."""
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    rows, n = x.shape
    out = torch.empty(rows, dtype=torch.long, device=x.device)
    chunks = triton.cdiv(n, chunk)
    block_c = max(16, triton.next_power_of_2(chunks))
    MONITOR.note("argmax_rows", (x.dtype, block_c))  # the merge's build: its chunks' power of two
    if rows == 0:
        return out
    val = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows, chunks, dtype=torch.int32, device=x.device)
    _argmax_chunk_kernel[(rows, chunks)](x, val, idx, n, chunks, x.stride(0), CHUNK=chunk, num_warps=warps)
    _argmax_merge_kernel[(rows,)](val, idx, out, chunks, BLOCK_C=block_c, num_warps=1 if chunks <= 128 else 4)
    return out


def _keys(facts: dict) -> list:
    return [(facts["dtype"],)] if facts.get("final_logit_softcapping") and "dtype" in facts else []


def _compile(key, device) -> None:
    logits_softcap(torch.zeros(2, 64, dtype=key[0], device=device), 30.0)


register_kernel(JitKernel("logits_softcap", "logits_softcap", "triton", _keys, _compile))


def _argmax_keys(facts: dict) -> list:
    # the sampler's rows are the vocabulary wide: the merge kernel's build depends on it (an H200 server built it
    # on its first request, ~0.6 s of the first TTFTs, while warm-up had built a 64-wide row's)
    return [(torch.float32, facts.get("vocab_size", 64))] if "dtype" in facts else []


def _argmax_compile(key, device) -> None:
    argmax_rows(torch.zeros(2, key[1], dtype=key[0], device=device))


register_kernel(JitKernel("argmax_rows", "argmax_rows", "triton", _argmax_keys, _argmax_compile))
