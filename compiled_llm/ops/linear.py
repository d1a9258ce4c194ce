"""skinny_mm: a decode step's narrow projections, x [M <= 16, K] @ W [N, K]^T with N < K (Gemma 4's o_proj,
Qwen3.5's out_proj and o_proj, its shared expert's gate_up).

At a decode batch these products stream their weight, and for N < K cuBLAS picks a split-K kernel plus a second
launch that adds the slices (`splitKreduce_kernel`, ~1.8 us and a launch gap on the H200). The Triton provider
(ops/triton/skinny_gemm.py) splits K four ways too, but the last program of each output tile adds the slices
(`merge`): one launch. H200, CUDA-graph replays, weights from HBM (benchmarks/skinny_gemm.py, session 28), us at
M = 8: Gemma 4 o_proj 10.61 -> 9.66 (sliding) and 16.26 -> 15.03 (global), Qwen3.5 out_proj 8.99 -> 7.65, its
full-attention o_proj 8.98 -> 7.63, its shared expert's gate_up 5.57 -> 4.25. Where N >= K cuBLAS takes no
split and our kernel is not faster at every such shape (sliding qkv 13.61 against 13.72), so passes/skinny_mm.py
rewrites only the N < K products. Every decode batch size replays the dynamic-token compile by default, so the
op decides by the call's row count: up to 16 rows the provider, past them torch's mm (cuBLAS).

The sum over K is float32 in both; the slices are added in a fixed order (deterministic), a different order
from cuBLAS's, so outputs may differ from torch.mm's in the last bf16 place.
"""

from __future__ import annotations

import torch

from compiled_llm.ops.registry import Capabilities, OpSpec, Provider, register

SKINNY_MAX_ROWS = 16  # one 16-row block of the kernel: past it the weight would be read once per block
SKINNY_MIN_ELEMENTS = 1 << 21  # smaller weights (4 MB in bf16) are launch-bound either way: not measured


def ref_skinny_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(x, w.t())


def _triton(caps: Capabilities, shape: dict) -> str | None:
    return caps.triton_ok()


SKINNY_MM = register(OpSpec("skinny_mm", "x [M <= 16, K] @ W [N, K]^T, N < K: split-K in one launch", [
    Provider("triton", "compiled_llm.ops.triton.skinny_gemm:decode_mm", _triton, capturable=True),
    Provider("reference", "compiled_llm.ops.linear:ref_skinny_mm", capturable=True),
]))


def takes(n: int, k: int, m: int | None = None) -> bool:
    """The products the op serves: a narrow output and a weight worth streaming; m, where known: a decode batch's
    rows (a symbolic row count is decided per call by the op)."""
    return n < k and n * k >= SKINNY_MIN_ELEMENTS and (m is None or 1 <= m <= SKINNY_MAX_ROWS)


@torch.library.custom_op("compiled_llm::skinny_mm", mutates_args=())
def skinny_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T: the chosen provider up to SKINNY_MAX_ROWS rows (a decode batch), torch's mm past them (a prefill
    piece of the dynamic-token compile, which every decode size replays too: its CUDA graph records the branch
    its size took)."""
    if x.shape[0] > SKINNY_MAX_ROWS:
        return torch.mm(x, w.t())
    return SKINNY_MM.impl()(x, w)


@skinny_mm.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0])
