"""RMSNorm + residual add: `s = residual + x; y = rms_norm(s, w)` -> fused_add_rms_norm(x, residual, w)."""

from __future__ import annotations

import torch

from compiled_llm.ops.norm import ref_rms_norm
from compiled_llm.passes.base import EPS, FusionPass, empty


class AddRMSNormPass(FusionPass):
    name = "add_rms_norm"
    fusion = "RMSNorm + residual add"

    def register(self) -> None:
        def search(x, residual, weight, eps):
            s = residual + x
            return ref_rms_norm(s, weight, eps), s

        def replace(x, residual, weight, eps):
            out = torch.ops.compiled_llm.fused_add_rms_norm(x, residual, weight, eps)
            return out[0], out[1]

        for dt in self.dtypes:
            self.add(search, replace, [empty(8, 32, dtype=dt), empty(8, 32, dtype=dt), empty(32, dtype=dt)],
                     {"eps": EPS})
