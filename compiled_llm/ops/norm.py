"""RMSNorm ops: rms_norm and fused_add_rms_norm (residual add + RMSNorm).

The reference implementations compute exactly what the models' plain RMSNorm computes (float32
statistics, optional weight, cast back), so a fused graph gives the same numbers as the eager one.
`weight_offset` scales by (offset + weight) instead of weight: Qwen3.5's zero-centred norms store w and
scale by 1 + w (offset 1.0); 0.0, the default, is the plain form and adds nothing to the graph.
"""

from __future__ import annotations

import torch

from compiled_llm.ops.registry import Capabilities, INDUCTOR, OpSpec, Provider, custom_op, inductor_codegen, register


def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, weight_offset: float = 0.0) -> torch.Tensor:
    h = x.float()
    h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        h = h * (weight.float() + weight_offset if weight_offset else weight.float())
    return h.type_as(x)


def ref_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                           eps: float, weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    s = residual + x
    return ref_rms_norm(s, weight, eps, weight_offset), s


def _triton_rows(caps: Capabilities, shape: dict) -> str | None:
    return caps.triton_ok()


def _flashinfer_norm(caps: Capabilities, shape: dict) -> str | None:
    why = caps.flashinfer_ok()
    if why is None and shape.get("dtype") not in (torch.float16, torch.bfloat16):
        return "FlashInfer norms take float16/bfloat16 only"
    return why


RMS_NORM = register(OpSpec("rms_norm", "y = x / sqrt(mean(x^2) + eps) * (weight_offset + weight), statistics in float32", [
    Provider("triton", "compiled_llm.ops.triton.norm:rms_norm", _triton_rows),
    Provider("flashinfer", "compiled_llm.ops.flashinfer:rms_norm", _flashinfer_norm),
    Provider("reference", "compiled_llm.ops.norm:ref_rms_norm"),
]))

# Inductor first on the GPU: with the add_rms_norm pass replacing, Gemma 4 26B-A4B's decode step ran 23 kernels
# a layer, three of them norms around our opaque kernel; left to Inductor, its sandwich norms fuse into one
# kernel after attention and one after the MoE (18 kernels a layer): decode +3.7% at batch 8 and +6.7% at
# batch 1 on the H200 (benchmarks/NOTES.md, session 12). `--op-providers fused_add_rms_norm=triton` restores ours.
FUSED_ADD_RMS_NORM = register(OpSpec("fused_add_rms_norm", "s = residual + x; returns (rms_norm(s), s)", [
    Provider(INDUCTOR, "compiled_llm.ops.norm:ref_fused_add_rms_norm", inductor_codegen),
    Provider("triton", "compiled_llm.ops.triton.norm:fused_add_rms_norm", _triton_rows),
    Provider("flashinfer", "compiled_llm.ops.flashinfer:fused_add_rms_norm", _flashinfer_norm),
    Provider("reference", "compiled_llm.ops.norm:ref_fused_add_rms_norm"),
]))


@custom_op("compiled_llm::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, weight_offset: float = 0.0) -> torch.Tensor:
    return RMS_NORM.impl()(x, weight, eps, weight_offset)


@rms_norm.register_fake
def _(x, weight, eps, weight_offset=0.0):
    return torch.empty_like(x)


@custom_op("compiled_llm::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                       eps: float, weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    return FUSED_ADD_RMS_NORM.impl()(x, residual, weight, eps, weight_offset)


@fused_add_rms_norm.register_fake
def _(x, residual, weight, eps, weight_offset=0.0):
    return torch.empty_like(x), torch.empty_like(x)
