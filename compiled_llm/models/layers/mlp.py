"""The gated MLP: down(act(gate(x)) * up(x)), GEGLU (Gemma 4, gelu_tanh) or SwiGLU (Qwen3.5, SiLU)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from compiled_llm.models.parallel_layers import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    """Split column/row: every rank holds a slice of the intermediate features, the down projection sums
    them (reduce=False leaves the rank's partial sum to the caller: Qwen3.5's shared expert, whose partial
    joins the routed experts' in one all-reduce).

    merged=True computes [gate; up] in one projection (`gate_up_proj`, one GEMM, which decode reads at a
    better share of bandwidth than two narrow ones; the checkpoint's gate_proj and up_proj load into its
    segments, see the model's `hf_to_ours`); merged=False keeps the checkpoint's `gate_proj` and `up_proj`."""

    def __init__(self, hidden: int, intermediate: int, act: Callable[[torch.Tensor], torch.Tensor],
                 merged: bool = True, reduce: bool = True):
        super().__init__()
        self.act = act
        self.merged = merged
        if merged:
            self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate])  # [gate; up]
        else:
            self.gate_proj = ColumnParallelLinear(hidden, intermediate)
            self.up_proj = ColumnParallelLinear(hidden, intermediate)
        self.down_proj = RowParallelLinear(intermediate, hidden, reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged:
            gate, up = self.gate_up_proj(x).split(self.gate_up_proj.local_sizes, dim=-1)
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
