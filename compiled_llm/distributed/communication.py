"""Collectives the model code and the runtime use.

Tensor-parallel reductions go through torch's functional collectives (`_c10d_functional` ops plus
`wait_tensor`), which torch.compile traces into the graph, so that compiler passes can see an
all-reduce followed by an RMSNorm and fuse the two. Each helper is the identity at size 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from compiled_llm.distributed.parallel_state import get_parallel_state

_ops = torch.ops._c10d_functional


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the tensor-parallel group."""
    ps = get_parallel_state()
    if ps.tp_size == 1:
        return x
    return _ops.wait_tensor(_ops.all_reduce(x, "sum", ps.tp_group_name))


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenates every rank's x along dim, in rank order."""
    ps = get_parallel_state()
    if ps.tp_size == 1:
        return x
    dim = dim % x.dim()
    out = _ops.wait_tensor(_ops.all_gather_into_tensor(x.contiguous(), ps.tp_size, ps.tp_group_name))
    if dim == 0:
        return out
    out = out.view(ps.tp_size, *x.shape)  # [tp, ...]: move the rank axis next to dim, then merge them
    return out.movedim(0, dim).reshape(*x.shape[:dim], ps.tp_size * x.shape[dim], *x.shape[dim + 1:])


def tp_all_to_all(x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
    """Row i of x goes to the rank whose block of send_counts holds it; returns the rows received."""
    ps = get_parallel_state()
    return _ops.wait_tensor(_ops.all_to_all_single(x.contiguous(), recv_counts, send_counts, ps.tp_group_name))


# ---- pipeline stages: point to point ---------------------------------------------------------
def send_tensors(tensors: dict[str, torch.Tensor], dst: int) -> None:
    """Sends named tensors (in name order) to the global rank dst; the receiver knows their shapes."""
    for name in sorted(tensors):
        dist.send(tensors[name].contiguous(), dst)


def recv_tensors(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], src: int,
                 device: torch.device) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(shapes):
        shape, dtype = shapes[name]
        buf = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(buf, src)
        out[name] = buf
    return out


# ---- control messages (CPU, gloo) --------------------------------------------------------------
def broadcast_object(obj=None):
    """Rank 0's obj, on every rank."""
    ps = get_parallel_state()
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=ps.cpu_group)
    return box[0]


def gather_objects(obj) -> list | None:
    """Every rank's obj, in rank order, on rank 0 (None elsewhere)."""
    ps = get_parallel_state()
    out = [None] * ps.world_size if ps.rank == 0 else None
    dist.gather_object(obj, out, dst=0, group=ps.cpu_group)
    return out
