"""Router + top-k (Gemma 4): unscaled RMSNorm, learned scale, 1/sqrt(hidden), projection, float32 softmax,
top-k, renormalise, per-expert scale -> one router_topk op."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compiled_llm.ops.norm import ref_rms_norm
from compiled_llm.passes.base import EPS, ROOT, TOP_K, FusionPass, empty


class RouterTopKPass(FusionPass):
    name = "router_topk"
    fusion = "router + top-k"

    def register(self) -> None:
        def search(x, proj_weight, scale, per_expert_scale, top_k, eps, root_size):
            h = ref_rms_norm(x, None, eps) * scale * root_size
            probs = torch.softmax(F.linear(h, proj_weight), dim=-1, dtype=torch.float32)
            weights, ids = torch.topk(probs, top_k, dim=-1)
            weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights * per_expert_scale[ids], ids

        def replace(x, proj_weight, scale, per_expert_scale, top_k, eps, root_size):
            out = torch.ops.compiled_llm.router_topk(x, proj_weight, scale, per_expert_scale, top_k, eps, root_size)
            return out[0], out[1]

        for dt in self.dtypes:
            self.add(search, replace, [empty(8, 32, dtype=dt), empty(16, 32, dtype=dt), empty(32, dtype=dt),
                                       empty(16, dtype=dt)], {"top_k": TOP_K, "eps": EPS, "root_size": ROOT})
