"""Triton RMSNorm and fused residual-add + RMSNorm: one program per row, the row in one block.
Statistics in float32; the residual sum is rounded to the input dtype first, as the reference does; the
scale is (weight_offset + weight) in float32 (1 + w for zero-centred norms)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compiled_llm.ops.jit import MONITOR, JitKernel, register_kernel


@triton.jit
def _rms_norm_kernel(X, R, W, Y, S, D, eps, offset, stride_x, stride_r, stride_y, stride_s,
                     HAS_RES: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        x = tl.load(R + row * stride_r + cols, mask=mask, other=0.0) + x
        tl.store(S + row * stride_s + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / D + eps)
    y = xf * rstd
    if HAS_W:
        y = y * (tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) + offset)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
            offset: float = 0.0):
    shape, d = x.shape, x.shape[-1]
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else x2
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    s = torch.empty_like(y) if residual is not None else y
    block = triton.next_power_of_2(d)
    MONITOR.note("rms_norm", (x.dtype, block, residual is not None, weight is not None))
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight if weight is not None else x2, y, s, d, float(eps), float(offset),
            x2.stride(0), r2.stride(0), y.stride(0), s.stride(0),
            HAS_RES=residual is not None, HAS_W=weight is not None, BLOCK=block,
            num_warps=min(16, max(1, block // 256)))
    return y.view(shape), s.view(shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, weight_offset: float = 0.0) -> torch.Tensor:
    return _launch(x, None, weight, eps, weight_offset)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                       eps: float, weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(x, residual, weight, eps, weight_offset)


def _keys(facts: dict) -> list:
    dtype, hidden = facts["dtype"], facts.get("hidden_size")
    if not hidden:
        return []
    block = triton.next_power_of_2(hidden)
    return [(dtype, block, True, True), (dtype, block, False, True)]


def _compile(key, device) -> None:
    dtype, block, res, has_w = key
    x = torch.zeros(2, block, dtype=dtype, device=device)
    _launch(x, x.clone() if res else None, torch.ones(block, dtype=dtype, device=device) if has_w else None, 1e-6)


register_kernel(JitKernel("rms_norm", "fused_add_rms_norm", "triton", _keys, _compile))
