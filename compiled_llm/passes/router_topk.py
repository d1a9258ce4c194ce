"""Router + top-k. Gemma 4: ops/moe.py `ref_router_topk`, which the model's router calls (unscaled RMSNorm,
learned scale, 1/sqrt(hidden), projection, float32 softmax, top-k, renormalise, per-expert scale) -> one
router_topk op. Qwen3.5: `ref_softmax_router_topk` (projection, float32 softmax, top-k, renormalise) -> one
softmax_router_topk op. Gemma's router ends in Qwen's (its normed input is Qwen's x), so Qwen's pattern
runs in the second stage, after Gemma's has taken whole routers."""

from __future__ import annotations

import torch

from compiled_llm.ops.moe import ref_router_topk, ref_softmax_router_topk
from compiled_llm.passes.base import EPS, ROOT, TOP_K, FusionPass, empty


class RouterTopKPass(FusionPass):
    name = "router_topk"
    fusion = "router + top-k"

    def register(self) -> None:
        def search(x, proj_weight, scale, per_expert_scale, top_k, eps, root_size):
            return ref_router_topk(x, proj_weight, scale, per_expert_scale, top_k, eps, root_size)

        def replace(x, proj_weight, scale, per_expert_scale, top_k, eps, root_size):
            out = torch.ops.compiled_llm.router_topk(x, proj_weight, scale, per_expert_scale, top_k, eps, root_size)
            return out[0], out[1]

        def search_softmax(x, proj_weight, top_k):
            return ref_softmax_router_topk(x, proj_weight, top_k)

        def replace_softmax(x, proj_weight, top_k):
            out = torch.ops.compiled_llm.softmax_router_topk(x, proj_weight, top_k)
            return out[0], out[1]

        for dt in self.dtypes:
            self.add(search, replace, [empty(8, 32, dtype=dt), empty(16, 32, dtype=dt), empty(32, dtype=dt),
                                       empty(16, dtype=dt)], {"top_k": TOP_K, "eps": EPS, "root_size": ROOT},
                     tokens=8)
            self.add(search_softmax, replace_softmax, [empty(8, 32, dtype=dt), empty(16, 32, dtype=dt)],
                     {"top_k": TOP_K}, stage=1, tokens=8)
