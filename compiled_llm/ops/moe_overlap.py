"""The routed-expert branch on a side stream: moe_start and moe_join.

A MoE layer's router and routed experts do not depend on its dense branch (Gemma 4's dense MLP, Qwen3.5's
shared expert). In a decode step the branches' kernels are short and latency-bound (the router, the
alignment, the dense GEMMs' ramp-up and tail), so running them one after the other leaves the GPU half idle
at each kernel boundary. `moe_start` forks a side stream from the current one, launches the router and the
grouped expert GEMMs on it and returns at once with the routed output [T, H] (each token's k weighted picks
added by the top-k sum kernel, on the side stream too), or with `slots` those picks themselves [T, k, H], which
the compiled graph adds inside the kernel that reads them (the MoE overlap pass's default); the compiled graph's
dense branch runs meanwhile on the main stream; `moe_join` makes the main stream wait for the side stream. It is
declared to write the start's output (it writes nothing), so that every read of that output in the compiled
graph follows it. The fork and the join are event waits, which CUDA-graph capture records as graph edges; the
side stream's allocations during a capture go to the graph's pool (torch routes every stream of a capture
there). H200, 26B-A4B shapes (benchmarks/ffn_overlap.py): 19.6 us a layer less at 8 tokens, 13.8 at 1.

`passes/moe_overlap.py` rewrites a graph's router + routed-op pair into these two ops. `keep` holds the
start's tensor inputs until the join: the side stream may still read them after the start returns, and the
compiled graph would otherwise free or reuse their memory after their last use in program order. On the
CPU there is no stream: the start computes, the join does nothing (the pass is off there unless asked for).
"""

from __future__ import annotations

import os

import torch

from compiled_llm.ops.activation import gelu_tanh
from compiled_llm.ops.moe import ref_gated_moe, ref_router_topk, ref_softmax_router_topk
from compiled_llm.ops.registry import Capabilities, OpSpec, Provider, custom_op, register

ACTIVATIONS = {"gelu_tanh": gelu_tanh, "silu": torch.nn.functional.silu}

_SIDE: dict[torch.device, torch.cuda.Stream] = {}
# Past this many tokens the branch stays on the current stream: prefill-sized kernels fill the GPU by
# themselves, and such steps run without CUDA graphs, where the fork's host time would add to the step
OVERLAP_MAX_TOKENS = 512
# The routed branch is a decode step's critical path; COMPILED_LLM_MOE_SIDE_PRIORITY=high gives its stream the
# device's highest priority, so that its blocks start before the dense branch's when both wait for SMs (torch
# instantiates CUDA graphs with per-node priority, which a capture takes from the capturing stream). Off: the
# H200 A/B (session 20, 26B-A4B 1024x8x256) gave 1,029.9 tok/s with it and 1,029.2 without.
SIDE_PRIORITY_ENV = "COMPILED_LLM_MOE_SIDE_PRIORITY"


def side_priority() -> int:
    if os.environ.get(SIDE_PRIORITY_ENV, "default") != "high":
        return 0
    return torch.cuda.Stream.priority_range()[1]  # (lowest, highest): the highest is the most negative


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream the routed branch runs on, one per device (the engine runs one forward at a time per device)."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    s = _SIDE.get(device)
    if s is None:
        s = _SIDE[device] = torch.cuda.Stream(device, priority=side_priority())
    return s


def route(router_x, proj_weight, scale, per_expert_scale, top_k, eps, root_size, x_dtype, cast, first,
          gemma_router, softmax_router):
    """The router's (weights, ids) as the routed op takes them: Gemma 4's (scale given) or Qwen3.5's softmax
    router (scale None; its weights cast to the model's dtype where the model casts them: `cast`), ids shifted
    to this rank's experts (`first`, expert parallel)."""
    if scale is not None:
        w, ids = gemma_router(router_x, proj_weight, scale, per_expert_scale, top_k, eps, root_size)
    else:
        w, ids = softmax_router(router_x, proj_weight, top_k)
    if cast:
        w = w.to(x_dtype)
    return w, (ids - first if first else ids)


def ref_moe_start(router_x, proj_weight, scale, per_expert_scale, x, gate_up_proj, down_proj, top_k: int, eps: float,
                  root_size: float, first: int, activation: str, cast: bool, slots: bool = False) -> torch.Tensor:
    """The routed output [T, H] in x's dtype: each pick's weighted expert output (one routed sum per pick, in
    x's dtype) added in float32. slots: those picks themselves, [T, k, H], for the graph to add (the consumer's
    kernel then reads them: passes/moe_overlap.py)."""
    w, ids = route(router_x, proj_weight, scale, per_expert_scale, top_k, eps, root_size, x.dtype, cast, first,
                   ref_router_topk, ref_softmax_router_topk)
    act = ACTIVATIONS[activation]
    picks = torch.stack([ref_gated_moe(x, w[:, j:j + 1], ids[:, j:j + 1], gate_up_proj, down_proj, act)
                         for j in range(top_k)], dim=1)
    return picks if slots else picks.float().sum(1).to(x.dtype)


def _triton(caps: Capabilities, shape: dict) -> str | None:
    return caps.triton_ok()


MOE_START = register(OpSpec("moe_start", "router and routed experts (their top-k sum included), on a side stream", [
    Provider("triton", "compiled_llm.ops.triton.providers:moe_start", _triton),
    Provider("reference", "compiled_llm.ops.moe_overlap:ref_moe_start"),
]))


@custom_op("compiled_llm::moe_start", mutates_args=())
def moe_start(router_x: torch.Tensor, proj_weight: torch.Tensor, scale: torch.Tensor | None,
              per_expert_scale: torch.Tensor | None, x: torch.Tensor, gate_up_proj: torch.Tensor,
              down_proj: torch.Tensor, top_k: int, eps: float, root_size: float, first: int, activation: str,
              cast: bool, slots: bool = False) -> torch.Tensor:
    args = (router_x, proj_weight, scale, per_expert_scale, x, gate_up_proj, down_proj, top_k, eps, root_size, first,
            activation, cast, slots)
    if not x.is_cuda or x.shape[0] > OVERLAP_MAX_TOKENS:
        return MOE_START.impl()(*args)
    side = side_stream(x.device)
    side.wait_stream(torch.cuda.current_stream(x.device))  # everything the branch reads is written by now
    with torch.cuda.stream(side):
        return MOE_START.impl()(*args)


@moe_start.register_fake
def _(router_x, proj_weight, scale, per_expert_scale, x, gate_up_proj, down_proj, top_k, eps, root_size, first,
      activation, cast, slots=False):
    return x.new_empty(x.shape[0], top_k, x.shape[1]) if slots else torch.empty_like(x)


# Declared as writing `routed` (it writes nothing): Inductor then orders every read of the start's output after it
@custom_op("compiled_llm::moe_join", mutates_args=("routed",))
def moe_join(routed: torch.Tensor, keep: list[torch.Tensor]) -> None:
    """The main stream waits for the side stream's work on `routed`, moe_start's output (keep: see the module
    doc)."""
    if routed.is_cuda and routed.shape[0] <= OVERLAP_MAX_TOKENS:
        torch.cuda.current_stream(routed.device).wait_stream(side_stream(routed.device))


@moe_join.register_fake
def _(routed, keep):
    return None
