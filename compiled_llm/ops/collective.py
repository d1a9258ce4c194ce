"""allreduce_rms_norm: tensor-parallel all-reduce (sum) followed by RMSNorm, as one op.

The reference issues the functional all-reduce and the norm back to back; a fused provider (one
kernel that reduces and normalises, e.g. FlashInfer's TRT-LLM all-reduce fusion) slots in here."""

from __future__ import annotations

import torch

from compiled_llm.ops.norm import ref_rms_norm
from compiled_llm.ops.registry import OpSpec, Provider, register


def ref_allreduce_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, group_name: str) -> torch.Tensor:
    y = torch.ops._c10d_functional.all_reduce(x, "sum", group_name)
    y = torch.ops._c10d_functional.wait_tensor(y)
    return ref_rms_norm(y, weight, eps)


ALLREDUCE_RMS_NORM = register(OpSpec("allreduce_rms_norm", "sum all-reduce over the TP group, then RMSNorm", [
    Provider("reference", "compiled_llm.ops.collective:ref_allreduce_rms_norm"),
]))


@torch.library.custom_op("compiled_llm::allreduce_rms_norm", mutates_args=())
def allreduce_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, group_name: str) -> torch.Tensor:
    return ALLREDUCE_RMS_NORM.impl()(x, weight, eps, group_name)


@allreduce_rms_norm.register_fake
def _(x, weight, eps, group_name):
    return torch.empty_like(x)
