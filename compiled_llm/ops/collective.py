"""allreduce_rms_norm: tensor-parallel all-reduce (sum) followed by RMSNorm, as one op.

The reference issues the functional all-reduce and the norm back to back (the pass then only counts its
matches: Inductor computes that graph faster than an opaque reference call). On CUDA under tensor
parallelism the Triton provider does both in one kernel over symmetric memory (ops/triton/allreduce_norm.py);
it needs a workspace that every rank allocates together: `prepare`, called by the model runner."""

from __future__ import annotations

import torch

from compiled_llm.ops.norm import ref_rms_norm
from compiled_llm.ops.registry import Capabilities, OpSpec, Provider, custom_op, register


def ref_allreduce_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, group_name: str) -> torch.Tensor:
    y = torch.ops._c10d_functional.all_reduce(x, "sum", group_name)
    y = torch.ops._c10d_functional.wait_tensor(y)
    return ref_rms_norm(y, weight, eps)


def _symmetric_memory(caps: Capabilities, shape: dict) -> str | None:
    why = caps.triton_ok()
    if why is not None:
        return why
    if caps.device_type != "cuda":
        return "symmetric memory needs CUDA GPUs"
    world = shape.get("tp_size", 1)
    if world < 2:
        return "no tensor parallelism"
    if world & (world - 1) or world > 8:
        return f"takes 2, 4 or 8 ranks, not {world}"
    return None


ALLREDUCE_RMS_NORM = register(OpSpec("allreduce_rms_norm", "sum all-reduce over the TP group, then RMSNorm", [
    Provider("triton", "compiled_llm.ops.triton.allreduce_norm:allreduce_rms_norm", _symmetric_memory),
    Provider("reference", "compiled_llm.ops.collective:ref_allreduce_rms_norm"),
]))


def prepare(group_name: str, world: int, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
    """Collective, on every rank of the TP group: the chosen provider's workspace (nothing for the reference)."""
    if ALLREDUCE_RMS_NORM.provider_name() == "triton":
        from compiled_llm.ops.triton.allreduce_norm import setup

        setup(group_name, world, hidden, dtype, device)


def release() -> None:
    if ALLREDUCE_RMS_NORM.provider_name() == "triton":
        from compiled_llm.ops.triton import allreduce_norm

        allreduce_norm.release()


@custom_op("compiled_llm::allreduce_rms_norm", mutates_args=())
def allreduce_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, group_name: str) -> torch.Tensor:
    return ALLREDUCE_RMS_NORM.impl()(x, weight, eps, group_name)


@allreduce_rms_norm.register_fake
def _(x, weight, eps, group_name):
    return torch.empty_like(x)
