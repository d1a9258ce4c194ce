"""Mixture-of-experts ops: router_topk (Gemma 4's router), softmax_router_topk (Qwen3.5's) and geglu_moe
(routed experts, GELU-tanh GEGLU over packed [gate, up] weights; SwiGLU: ops/swiglu_moe.py).

The models call `ref_router_topk`, `ref_softmax_router_topk` and `dense_gated_moe` themselves, and the fusion
passes search for the same functions, so a model and its pass cannot drift apart: changing the math here
changes both."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compiled_llm.ops.activation import gelu_tanh
from compiled_llm.ops.norm import ref_rms_norm
from compiled_llm.ops.registry import Capabilities, OpSpec, Provider, custom_op, register


def ref_router_topk(x: torch.Tensor, proj_weight: torch.Tensor, scale: torch.Tensor, per_expert_scale: torch.Tensor,
                    top_k: int, eps: float, root_size: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Unscaled RMSNorm, learned scale, softmax over experts (float32), top-k, renormalise, per-expert scale.
    Returns (weights [tokens, k] float32, expert ids [tokens, k] int64)."""
    h = ref_rms_norm(x, None, eps) * scale * root_size
    probs = torch.softmax(F.linear(h, proj_weight), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * per_expert_scale[ids], ids


def ref_softmax_router_topk(x: torch.Tensor, proj_weight: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router (Qwen3.5 MoE): projection, softmax over experts (float32), top-k, renormalise.
    Returns (weights [tokens, k] float32, expert ids [tokens, k] int64); the model casts the weights to its
    dtype (outside, so a pattern that ends here is not hidden by a cast that Inductor folds away)."""
    probs = torch.softmax(F.linear(x, proj_weight), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def ref_gated_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up_proj: torch.Tensor,
                  down_proj: torch.Tensor, act) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * down[e] @ (act(gate) * up), [gate, up] = gate_up[e] @ x[t], e = ids[t, j].
    Ids outside [0, E) are skipped (expert parallel: another rank's experts). Loops over the experts that
    were picked (data-dependent); while a CUDA graph is being captured it computes every expert densely
    instead, which has static shapes."""
    num_experts = gate_up_proj.shape[0]
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        route = dense_route(weights, ids, num_experts)
        gate, up = torch.einsum("th,efh->tef", x, gate_up_proj).chunk(2, dim=-1)
        y = torch.einsum("tei,ehi->teh", act(gate) * up, down_proj)
        return torch.einsum("teh,te->th", y.float(), route.float()).to(x.dtype)
    out = torch.zeros_like(x)
    for e in [e for e in ids.unique().tolist() if 0 <= e < num_experts]:
        token, slot = torch.where(ids == e)
        gate, up = F.linear(x[token], gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(act(gate) * up, down_proj[e]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def dense_gated_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up_proj: torch.Tensor,
                    down_proj: torch.Tensor, act, num_experts: int, first: int = 0) -> torch.Tensor:
    """The routed experts' sum with static shapes, which torch.compile can trace: every local expert on every
    token, weighted by a [tokens, experts] routing matrix that is zero off the top-k. ids are global; this
    rank holds experts [first, first + E_local) (expert parallel; first = 0 and E_local = num_experts
    otherwise). E/k times the routed FLOPs: the MoE fusion pass replaces it with the routed op, and the
    compiler refuses to serve a compiled MoE model where that pass missed (compiler/verify.py).

    Returns float32; the caller casts. The pattern ends before that cast because the cast may not be in the
    graph Inductor hands the passes: torch 2.11's joint-graph pass folds it with the next RMSNorm's upcast
    (f32 -> bf16 -> f32 becomes f32), so a pattern that ended in it never matched in bfloat16."""
    t, (e, two_i, h) = x.shape[0], gate_up_proj.shape
    route = torch.zeros(t, num_experts, dtype=weights.dtype, device=x.device).scatter(1, ids, weights)
    if e != num_experts:  # expert parallel: keep the columns of this rank's experts
        route = route[:, first:first + e]
    gate, up = F.linear(x, gate_up_proj.reshape(e * two_i, h)).view(t, e, two_i).chunk(2, dim=-1)
    y = torch.bmm((act(gate) * up).transpose(0, 1), down_proj.transpose(1, 2))  # [e, t, h]
    return torch.bmm(route.float()[:, None, :], y.float().transpose(0, 1)).view(t, h)


def dense_route(weights: torch.Tensor, ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[tokens, experts] routing matrix, zero off the top-k; ids outside [0, num_experts) add nothing."""
    valid = (ids >= 0) & (ids < num_experts)
    route = torch.zeros(ids.shape[0], num_experts, dtype=weights.dtype, device=weights.device)
    return route.scatter_add_(1, ids.clamp(0, num_experts - 1), torch.where(valid, weights, 0))


def ref_geglu_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up_proj: torch.Tensor,
                  down_proj: torch.Tensor) -> torch.Tensor:
    """Routed experts with a GELU-tanh gate (Gemma 4); see ref_gated_moe."""
    return ref_gated_moe(x, weights, ids, gate_up_proj, down_proj, gelu_tanh)


def _triton(caps: Capabilities, shape: dict) -> str | None:
    return caps.triton_ok()


ROUTER_TOPK = register(OpSpec("router_topk", "Gemma 4 router: norm, scale, softmax, top-k, renormalise, expert scale", [
    Provider("triton", "compiled_llm.ops.triton.providers:router_topk", _triton),
    Provider("reference", "compiled_llm.ops.moe:ref_router_topk"),
]))

SOFTMAX_ROUTER_TOPK = register(OpSpec(
    "softmax_router_topk", "Qwen3.5 router: projection, softmax, top-k, renormalise", [
        Provider("triton", "compiled_llm.ops.triton.providers:softmax_router_topk", _triton),
        Provider("reference", "compiled_llm.ops.moe:ref_softmax_router_topk"),
    ]))

GEGLU_MOE = register(OpSpec("geglu_moe", "routed experts, GELU-tanh GEGLU over packed [gate, up] weights", [
    Provider("triton", "compiled_llm.ops.triton.providers:geglu_moe", _triton),
    Provider("reference", "compiled_llm.ops.moe:ref_geglu_moe"),
]))


@custom_op("compiled_llm::router_topk", mutates_args=())
def router_topk(x: torch.Tensor, proj_weight: torch.Tensor, scale: torch.Tensor, per_expert_scale: torch.Tensor,
                top_k: int, eps: float, root_size: float) -> tuple[torch.Tensor, torch.Tensor]:
    return ROUTER_TOPK.impl()(x, proj_weight, scale, per_expert_scale, top_k, eps, root_size)


@router_topk.register_fake
def _(x, proj_weight, scale, per_expert_scale, top_k, eps, root_size):
    n = x.shape[0]
    return x.new_empty(n, top_k, dtype=torch.float32), x.new_empty(n, top_k, dtype=torch.long)


@custom_op("compiled_llm::softmax_router_topk", mutates_args=())
def softmax_router_topk(x: torch.Tensor, proj_weight: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return SOFTMAX_ROUTER_TOPK.impl()(x, proj_weight, top_k)


@softmax_router_topk.register_fake
def _(x, proj_weight, top_k):
    n = x.shape[0]
    return x.new_empty(n, top_k, dtype=torch.float32), x.new_empty(n, top_k, dtype=torch.long)


@custom_op("compiled_llm::geglu_moe", mutates_args=())
def geglu_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up_proj: torch.Tensor,
              down_proj: torch.Tensor) -> torch.Tensor:
    return GEGLU_MOE.impl()(x, weights, ids, gate_up_proj, down_proj)


@geglu_moe.register_fake
def _(x, weights, ids, gate_up_proj, down_proj):
    return torch.empty_like(x)
