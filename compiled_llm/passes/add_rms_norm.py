"""RMSNorm + residual add: `s = residual + x; y = rms_norm(s, w)` (ops/norm.py `ref_fused_add_rms_norm`, the
model's add followed by its RMSNorm, which calls `ref_rms_norm`) -> fused_add_rms_norm(x, residual, w). Also the
offset-weight form `rms_norm(s) * (offset + w)` (Qwen3.5's zero-centred norms, offset 1.0), which passes its
offset on to the op."""

from __future__ import annotations

import torch

from compiled_llm.ops.norm import ref_fused_add_rms_norm
from compiled_llm.passes.base import EPS, OFFSET, FusionPass, empty


class AddRMSNormPass(FusionPass):
    name = "add_rms_norm"
    fusion = "RMSNorm + residual add"
    op = "fused_add_rms_norm"  # on the GPU Inductor's own kernel (ops/norm.py): then this pass only counts
    count_only_on_reference = True

    def register(self) -> None:
        def search(x, residual, weight, eps):
            return ref_fused_add_rms_norm(x, residual, weight, eps)

        def replace(x, residual, weight, eps):
            out = torch.ops.compiled_llm.fused_add_rms_norm(x, residual, weight, eps)
            return out[0], out[1]

        def search_offset(x, residual, weight, eps, weight_offset):
            return ref_fused_add_rms_norm(x, residual, weight, eps, weight_offset)

        def replace_offset(x, residual, weight, eps, weight_offset):
            out = torch.ops.compiled_llm.fused_add_rms_norm(x, residual, weight, eps, weight_offset)
            return out[0], out[1]

        for dt in self.dtypes:
            inputs = [empty(8, 32, dtype=dt), empty(8, 32, dtype=dt), empty(32, dtype=dt)]
            self.add(search, replace, inputs, {"eps": EPS}, tokens=8)
            self.add(search_offset, replace_offset, inputs, {"eps": EPS, "weight_offset": OFFSET}, tokens=8)
