"""RMSNorm + residual add: `s = residual + x; y = rms_norm(s, w)` (ops/norm.py `ref_fused_add_rms_norm`, the
model's add followed by its RMSNorm, which calls `ref_rms_norm`) -> fused_add_rms_norm(x, residual, w)."""

from __future__ import annotations

import torch

from compiled_llm.ops.norm import ref_fused_add_rms_norm
from compiled_llm.passes.base import EPS, FusionPass, empty


class AddRMSNormPass(FusionPass):
    name = "add_rms_norm"
    fusion = "RMSNorm + residual add"
    count_only_on_reference = True

    def register(self) -> None:
        def search(x, residual, weight, eps):
            return ref_fused_add_rms_norm(x, residual, weight, eps)

        def replace(x, residual, weight, eps):
            out = torch.ops.compiled_llm.fused_add_rms_norm(x, residual, weight, eps)
            return out[0], out[1]

        for dt in self.dtypes:
            self.add(search, replace, [empty(8, 32, dtype=dt), empty(8, 32, dtype=dt), empty(32, dtype=dt)],
                     {"eps": EPS}, tokens=8)
