"""swiglu_moe: routed experts with SiLU-gated (SwiGLU) MLPs over packed [gate, up] weights (Qwen3.5 MoE).

An op rather than inline code so that the data-dependent expert loop stays out of traced graphs
(no graph break) and a fused kernel can slot in as a provider, as for geglu_moe.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compiled_llm.ops.moe import ref_gated_moe
from compiled_llm.ops.registry import OpSpec, Provider, custom_op, register


def ref_swiglu_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up_proj: torch.Tensor,
                   down_proj: torch.Tensor) -> torch.Tensor:
    """Routed experts with a SiLU gate (Qwen3.5 MoE); see ops.moe.ref_gated_moe."""
    return ref_gated_moe(x, weights, ids, gate_up_proj, down_proj, F.silu)


SWIGLU_MOE = register(OpSpec("swiglu_moe", "routed experts, SiLU-gated MLPs over packed [gate, up] weights", [
    Provider("triton", "compiled_llm.ops.triton.providers:swiglu_moe", lambda caps, shape: caps.triton_ok()),
    Provider("reference", "compiled_llm.ops.swiglu_moe:ref_swiglu_moe"),
]))


@custom_op("compiled_llm::swiglu_moe", mutates_args=())
def swiglu_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up_proj: torch.Tensor,
               down_proj: torch.Tensor) -> torch.Tensor:
    return SWIGLU_MOE.impl()(x, weights, ids, gate_up_proj, down_proj)


@swiglu_moe.register_fake
def _(x, weights, ids, gate_up_proj, down_proj):
    return torch.empty_like(x)
