"""Routed experts with a gated activation (Gemma 4's GEGLU experts, Qwen3.5's SwiGLU experts)."""

from __future__ import annotations

from typing import Callable

import torch

from compiled_llm.models.parallel_layers import ExpertWeights
from compiled_llm.ops.moe import dense_gated_moe


class GatedExperts(ExpertWeights):
    """Packed weights gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]; ExpertWeights holds this
    rank's part (tensor parallel: a slice of every expert; expert parallel: whole experts) and loads it; ids
    stay global, `local_expert(e)` says where expert e lives here.

    `act` is the gate's activation; a subclass names the eager routed computation over the picked experts,
    `routed_op(x, weights, local_ids, gate_up_proj, down_proj)` (it skips ids of other ranks' experts), as a
    class attribute: kept on the instance, the op object (a torch.library op, which does not pickle) would
    stop the compile cache from saving the traced forward's guards (compiler/aot.py). Compiled, the layer
    traces the dense sum instead (`dense_gated_moe` with `act`), which the model's MoE fusion pass (GEGLU or
    SwiGLU, passes/geglu_moe.py) finds and replaces with the routed op."""

    routed_op: Callable[..., torch.Tensor]

    def __init__(self, num_experts: int, hidden: int, intermediate: int, top_k: int,
                 act: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__(num_experts, hidden, intermediate, top_k)
        self.act = act

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                shared: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts' output, complete on every rank; with `shared` (this rank's partial sum of a
        shared expert) plus that, summed in the same all-reduce unless all-to-all dispatch already completed
        the routed part."""
        if self.use_all_to_all(x.shape[0]) and not torch.compiler.is_compiling():
            out = self.dispatch_all_to_all(x, weights, ids, self.routed)
            return out if shared is None else out + self.combine(shared)
        routed = self.routed(x, weights, ids)
        return self.combine(routed if shared is None else routed + shared)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's share of the weighted expert outputs (summed over ranks by `combine`)."""
        if torch.compiler.is_compiling():
            return self.dense(x, weights, ids)
        local = ids - self.first_expert if self.first_expert else ids
        return self.routed_op(x, weights, local, self.gate_up_proj, self.down_proj)

    def dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The same sum with static shapes, which torch.compile can trace (every expert on every token)."""
        return dense_gated_moe(x, weights, ids, self.gate_up_proj, self.down_proj, self.act, self.num_experts,
                               self.first_expert).to(x.dtype)
