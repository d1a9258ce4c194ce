"""swiglu_moe: routed experts with SiLU-gated (SwiGLU) MLPs over packed [gate, up] weights (Qwen3.5 MoE).

An op rather than inline code so that the data-dependent expert loop stays out of traced graphs
(no graph break) and a fused kernel can slot in as a provider, as for geglu_moe.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compiled_llm.ops.moe import dense_route, local_experts
from compiled_llm.ops.registry import OpSpec, Provider, register


def ref_swiglu_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up_proj: torch.Tensor,
                   down_proj: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * down[e] @ (silu(gate) * up), [gate, up] = gate_up[e] @ x[t], e = ids[t, j].
    Ids outside [0, E) are skipped. Loops over the experts a batch picked; while a CUDA graph is captured,
    computes every expert densely."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        route = dense_route(weights, ids, gate_up_proj.shape[0])
        gate, up = torch.einsum("th,efh->tef", x, gate_up_proj).chunk(2, dim=-1)
        y = torch.einsum("tei,ehi->teh", F.silu(gate) * up, down_proj)
        return torch.einsum("teh,te->th", y.float(), route.float()).to(x.dtype)
    out = torch.zeros_like(x)
    for e in local_experts(ids, gate_up_proj.shape[0]):
        token, slot = torch.where(ids == e)
        gate, up = F.linear(x[token], gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down_proj[e]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


SWIGLU_MOE = register(OpSpec("swiglu_moe", "routed experts, SiLU-gated MLPs over packed [gate, up] weights", [
    Provider("triton", "compiled_llm.ops.triton.providers:swiglu_moe", lambda caps, shape: caps.triton_ok()),
    Provider("reference", "compiled_llm.ops.swiglu_moe:ref_swiglu_moe"),
]))


@torch.library.custom_op("compiled_llm::swiglu_moe", mutates_args=())
def swiglu_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up_proj: torch.Tensor,
               down_proj: torch.Tensor) -> torch.Tensor:
    return SWIGLU_MOE.impl()(x, weights, ids, gate_up_proj, down_proj)


@swiglu_moe.register_fake
def _(x, weights, ids, gate_up_proj, down_proj):
    return torch.empty_like(x)
