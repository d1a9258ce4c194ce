"""RMSNorm as the models build it (Gemma 4's plain and scale-free norms, Qwen3.5's zero-centred ones)."""

from __future__ import annotations

import torch
from torch import nn

from compiled_llm.ops.norm import ref_rms_norm


class RMSNorm(nn.Module):
    """x / rms(x) * (weight_offset + weight), statistics in float32 (ops/norm.py `ref_rms_norm`, the function
    the norm fusions search for; its pow(-0.5) is rsqrt, bit for bit). weight_offset 0.0 is the plain norm;
    1.0 is Qwen3.5's zero-centred one, which stores w and scales by 1 + w. The weight starts at the identity
    scale (ones, or zeros when centred); with_scale=False has no weight (Gemma 4's value norm)."""

    def __init__(self, dim: int, eps: float, weight_offset: float = 0.0, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - weight_offset)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ref_rms_norm(x, self.weight, self.eps, self.weight_offset)
