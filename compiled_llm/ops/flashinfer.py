"""FlashInfer providers (RMSNorm, fused residual-add + RMSNorm). FlashInfer's norms compute
x * rsqrt(mean(x^2) + eps) * weight with float32 statistics, the same function as the reference; their
gemma_* variants scale by 1 + weight (weight_offset 1.0); other offsets take the reference.

Not verified on a GPU here (FlashInfer is not installed on our machines): the resolver prefers the
Triton kernels and picks these only when asked (--op-providers rms_norm=flashinfer,...)."""

from __future__ import annotations

import torch

from compiled_llm.ops.jit import MONITOR


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, weight_offset: float = 0.0) -> torch.Tensor:
    import flashinfer

    if weight is not None and weight_offset:
        if weight_offset != 1.0:
            from compiled_llm.ops.norm import ref_rms_norm

            return ref_rms_norm(x, weight, eps, weight_offset)
        MONITOR.note("flashinfer.gemma_rmsnorm", (x.dtype, x.shape[-1]))
        return flashinfer.norm.gemma_rmsnorm(x.reshape(-1, x.shape[-1]).contiguous(), weight, eps).view(x.shape)
    if weight is None:
        weight = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    MONITOR.note("flashinfer.rmsnorm", (x.dtype, x.shape[-1]))
    return flashinfer.norm.rmsnorm(x.reshape(-1, x.shape[-1]).contiguous(), weight, eps).view(x.shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                       eps: float, weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    import flashinfer

    offset = bool(weight is not None and weight_offset)
    if offset and weight_offset != 1.0:
        from compiled_llm.ops.norm import ref_fused_add_rms_norm

        return ref_fused_add_rms_norm(x, residual, weight, eps, weight_offset)
    if weight is None:
        weight = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    out = x.reshape(-1, x.shape[-1]).clone()  # in place in FlashInfer: out <- norm(x + r), s <- x + r
    s = residual.reshape(-1, x.shape[-1]).clone()
    MONITOR.note("flashinfer.fused_add_rmsnorm", (x.dtype, x.shape[-1], offset))
    (flashinfer.norm.gemma_fused_add_rmsnorm if offset else flashinfer.norm.fused_add_rmsnorm)(out, s, weight, eps)
    return out.view(x.shape), s.view(x.shape)
