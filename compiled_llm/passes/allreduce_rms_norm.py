"""All-reduce + RMSNorm (tensor parallel): `rms_norm(wait(all_reduce(x, "sum", group)), w)` ->
allreduce_rms_norm(x, w). Gemma's sandwich norms put a norm right after each row-parallel projection's
all-reduce (post_attention_layernorm, post_feedforward_layernorm), which is what this matches."""

from __future__ import annotations

import torch

from compiled_llm.ops.norm import ref_rms_norm
from compiled_llm.passes.base import EPS, FusionPass, empty


class AllReduceRMSNormPass(FusionPass):
    name = "allreduce_rms_norm"
    fusion = "all-reduce + RMSNorm"
    op = "allreduce_rms_norm"
    count_only_while_reference = True

    def __init__(self, dtypes, device: str = "cpu", group_name: str | None = None):
        self.group_name = group_name
        super().__init__(dtypes, device)

    def register(self) -> None:
        group = self.group_name
        if group is None:
            return

        def search(x, weight, eps):
            y = torch.ops._c10d_functional.all_reduce(x, "sum", group)
            y = torch.ops._c10d_functional.wait_tensor(y)
            return ref_rms_norm(y, weight, eps)

        def replace(x, weight, eps):
            return torch.ops.compiled_llm.allreduce_rms_norm(x, weight, eps, group)

        for dt in self.dtypes:
            self.add(search, replace, [empty(8, 32, dtype=dt), empty(32, dtype=dt)], {"eps": EPS}, tokens=8)
