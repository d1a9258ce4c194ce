"""All-reduce + RMSNorm in one Triton kernel over symmetric memory (tensor parallel, one host, NVLink).

At decode sizes an all-reduce is latency, not bytes: NCCL's ring kernel, then a norm kernel, then the
next layer's input. Here each row is one program on every rank: it copies its row of x into this rank's
symmetric buffer, signals the same program on every peer and waits for theirs (a block-wise barrier in
the symmetric signal pads, system scope), reads the row from every rank's buffer over NVLink, sums in
float32 in rank order (so every rank gets the same bits), rounds the sum to the input dtype as an
all-reduce in that dtype would, and normalises. One launch instead of two or three, no host involvement,
capturable. So that no rank overwrites a buffer a peer still reads, either a second barrier closes the
call (the default, measured), or the buffer has two halves used in turn by each row's call count, kept on
the device and equal on every rank, since every rank makes the same calls (one barrier a call).

Each signal slot is a flag a sender sets 0 -> 1 and the receiver takes back 1 -> 0 (compare-and-swap),
so the pads are clean after every call; slot = (phase * capacity + program) * world + sender. A program
takes one row, or `rows_per_program` rows behind one barrier.

A peer that dies must not leave this rank's GPU spinning (no one can kill a kernel): a wait gives up after
minutes of tries or as soon as the workspace's status word is set, which `release` does from a side stream
at shutdown (as an NCCL communicator is aborted); a wait that gave up is counted there.

Rows beyond the workspace's capacity (MAX_ROWS: where the H200 measurement stopped favouring this kernel;
prefill) take NCCL's all-reduce and the Triton norm: bigger messages are NCCL's strength. `setup` allocates
the workspace collectively: every rank calls it with the same arguments before the first call (the model
runner does, when this provider is chosen)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from compiled_llm.ops.jit import MONITOR, JitKernel, register_kernel
from compiled_llm.ops.triton.norm import rms_norm

MAX_BYTES = 1 << 20  # one rank's buffer; beyond this NCCL's ring is the better algorithm anyway
# measured on two H200s at hidden 2816 (benchmarks/allreduce_norm.py, NOTES 2026-12-01 session 10): against
# NCCL then the norm, 1.40x at 1 row, 1.36x at 8, 1.25x at 16, 1.09x at 32, 0.90x at 64
MAX_ROWS = 32


@triton.jit
def _swap_flags(addr, limit, status, EXPECT: tl.constexpr, NEW: tl.constexpr, SEM: tl.constexpr, WS: tl.constexpr):
    """Turns each of the WS flags at addr from EXPECT to NEW (compare-and-swap, system scope), spinning on
    those that do not hold EXPECT yet; a lane already done compares with 2, which no flag holds. A wait ends
    without its flags after `limit` tries, or at once when `status` is set (`abort`: a dead peer must not hang
    this rank's GPU, and a spinning kernel cannot be killed); a wait that ends so adds one to `status`, and
    every later one then gives up at once."""
    done = tl.zeros([WS], dtype=tl.int32)
    tries = 0
    while (tl.min(done, 0) == 0) & (tries < limit) & (tl.load(status, volatile=True) == 0):
        cmp = tl.where(done == 0, EXPECT, 2)
        old = tl.atomic_cas(addr, cmp, tl.full([WS], NEW, tl.int32), sem=SEM, scope="sys")
        done = tl.where(old == cmp, 1, done)
        tries += 1
    if tl.min(done, 0) == 0:
        tl.atomic_add(status, 1)


@triton.jit
def _send(pads, slot, rank, limit, status, WS: tl.constexpr):
    """Sets this rank's flag `slot` on every rank (itself too), release: the writes before it are seen first."""
    pad = tl.load(pads + tl.arange(0, WS)).to(tl.pointer_type(tl.int32))
    _swap_flags(pad + slot * WS + rank, limit, status, 0, 1, "release", WS)


@triton.jit
def _wait(pads, slot, rank, limit, status, WS: tl.constexpr):
    """Waits until every rank has set its flag `slot` here, and takes the flags back (acquire)."""
    pad = tl.load(pads + rank).to(tl.pointer_type(tl.int32))
    _swap_flags(pad + slot * WS + tl.arange(0, WS), limit, status, 1, 0, "acquire", WS)


@triton.jit(do_not_specialize=["rank", "capacity", "n_rows", "spin_limit"])  # one compile for every rank
def _allreduce_rms_norm_kernel(X, W, Y, BUFS, PADS, EPOCHS, STATUS, n_rows, D, eps, offset, stride_x, stride_y, rank,
                               capacity, spin_limit, WS: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr,
                               DOUBLE: tl.constexpr, ROWS: tl.constexpr):
    pid = tl.program_id(0)  # rows [pid * ROWS, pid * ROWS + ROWS), one barrier for them; flags by program
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    dtype = Y.dtype.element_ty
    base = pid * ROWS
    if DOUBLE:  # two buffer halves by the program's call count (the same on every rank): no closing barrier
        epoch = tl.load(EPOCHS + pid)
        base += (epoch % 2) * capacity
    own = tl.load(BUFS + rank).to(tl.pointer_type(dtype))
    for i in tl.static_range(ROWS):
        row = pid * ROWS + i
        m = mask & (row < n_rows)
        x = tl.load(X + row.to(tl.int64) * stride_x + cols, mask=m, other=0.0)
        tl.store(own + (base + i) * D + cols, x, mask=m)
    tl.debug_barrier()  # every thread's part of the rows is written before the flag goes out
    _send(PADS, pid, rank, spin_limit, STATUS, WS)
    _wait(PADS, pid, rank, spin_limit, STATUS, WS)
    tl.debug_barrier()
    for i in tl.static_range(ROWS):
        row = pid * ROWS + i
        m = mask & (row < n_rows)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WS):  # rank order on every rank: the same sum everywhere
            buf = tl.load(BUFS + r).to(tl.pointer_type(dtype))
            acc += tl.load(buf + (base + i) * D + cols, mask=m, other=0.0, volatile=True).to(tl.float32)
        s = acc.to(dtype).to(tl.float32)  # an all-reduce in the input dtype returns this
        rstd = 1.0 / tl.sqrt(tl.sum(s * s, 0) / D + eps)
        y = s * rstd
        if HAS_W:
            y = y * (tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) + offset)
        tl.store(Y + row.to(tl.int64) * stride_y + cols, y.to(dtype), mask=m)
    if DOUBLE:
        # a peer writes this half again two calls on, after it has passed the next call's barrier, which this
        # rank enters only once this kernel (and every read in it) is done: stream order
        tl.store(EPOCHS + pid, epoch + 1)
    else:
        tl.debug_barrier()  # every read of the peers' buffers is done before they may write them again
        _send(PADS, capacity + pid, rank, spin_limit, STATUS, WS)
        _wait(PADS, capacity + pid, rank, spin_limit, STATUS, WS)


@dataclass
class Workspace:
    """One rank's symmetric buffer [2 x capacity, hidden] (two halves; the single-buffer variant uses the
    first) and the device tables of every rank's buffer and signal-pad addresses (int64), as the kernel reads
    them."""
    group_name: str
    rank: int
    world: int
    capacity: int
    hidden: int
    dtype: torch.dtype
    bufs: torch.Tensor
    pads: torch.Tensor
    epochs: torch.Tensor  # int32 [capacity]: calls each program has taken part in (DOUBLE: the buffer half)
    # two buffer halves and one barrier a call, or one buffer and two barriers (the measured one; the halves
    # pass the interpreter test and wait for benchmarks/allreduce_norm.py on GPUs)
    double: bool = False
    num_warps: int | None = None  # None: by the row width
    rows_per_program: int = 1  # rows that share one program and its barrier
    status: torch.Tensor | None = None  # int32 [1]: waits that gave up (a peer did not come, or `abort`)
    # compare-and-swap tries before a wait gives up: minutes, as NCCL's watchdog, since ranks can be seconds
    # apart in healthy runs (one compiles while the other loads from the cache)
    spin_limit: int = 1 << 28
    keep: tuple = ()  # the symmetric tensor and its handle, alive as long as the workspace


WORKSPACES: dict[str, Workspace] = {}


def variant() -> tuple[bool, int | None, int]:
    """(two buffer halves, warps or None, rows a program): the default, or COMPILED_LLM_ALLREDUCE_NORM =
    'single|double[:warps[:rows]]' (to try a variant that benchmarks/allreduce_norm.py found faster)."""
    text = os.environ.get("COMPILED_LLM_ALLREDUCE_NORM", "")
    if not text:
        return Workspace.double, Workspace.num_warps, Workspace.rows_per_program
    parts = text.split(":")
    if parts[0] not in ("single", "double") or len(parts) > 3:
        raise ValueError(f"COMPILED_LLM_ALLREDUCE_NORM={text!r}: expected single|double[:warps[:rows]]")
    warps = int(parts[1]) if len(parts) > 1 else None
    rows = int(parts[2]) if len(parts) > 2 else 1
    return parts[0] == "double", warps, rows


def capacity_for(hidden: int, dtype: torch.dtype, world: int, pad_bytes: int) -> int:
    """Rows one call can take: bounded by the buffer size, and by the signal pad (two phases of one int32
    flag per row and sender)."""
    by_bytes = MAX_BYTES // (hidden * torch.empty((), dtype=dtype).element_size())
    by_pad = pad_bytes // (2 * world * 4)
    return max(0, min(MAX_ROWS, by_bytes, by_pad))


def setup(group_name: str, world: int, hidden: int, dtype: torch.dtype, device: torch.device) -> Workspace:
    """Allocates and exchanges the symmetric workspace (collective: every rank of the group, same arguments)."""
    import torch.distributed._symmetric_memory as symm_mem
    from torch._C._distributed_c10d import _SymmetricMemory

    if world & (world - 1) or world > 8:
        raise ValueError(f"the fused all-reduce + RMSNorm takes 2, 4 or 8 ranks, not {world}")
    capacity = capacity_for(hidden, dtype, world, _SymmetricMemory.signal_pad_size)
    buf = symm_mem.empty(2 * capacity, hidden, dtype=dtype, device=device)
    handle = symm_mem.rendezvous(buf, group_name)
    if handle.world_size != world:
        raise ValueError(f"group {group_name} has {handle.world_size} ranks, not {world}")
    bufs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
    pads = torch.tensor(list(handle.signal_pad_ptrs), dtype=torch.int64, device=device)
    epochs = torch.zeros(capacity, dtype=torch.int32, device=device)
    double, warps, rows = variant()
    ws = Workspace(group_name, handle.rank, handle.world_size, capacity, hidden, dtype, bufs, pads, epochs,
                   double=double, num_warps=warps, rows_per_program=rows,
                   status=torch.zeros(1, dtype=torch.int32, device=device), keep=(buf, handle))
    WORKSPACES[group_name] = ws
    return ws


def abort(ws: Workspace) -> None:
    """Ends every wait of this rank's kernels now (spinning ones too): status is set from a side stream, which
    runs beside a kernel that spins on the main one."""
    side = torch.cuda.Stream(device=ws.status.device)
    with torch.cuda.stream(side):
        ws.status.fill_(1)
    side.synchronize()


def release(group_name: str | None = None) -> None:
    """At shutdown, before the device is synchronised: a kernel still waiting for a dead peer ends (`abort`)."""
    for name in [group_name] if group_name else list(WORKSPACES):
        ws = WORKSPACES.pop(name, None)
        if ws is not None and ws.status is not None and ws.status.is_cuda:
            abort(ws)


def _warps(block: int) -> int:
    return min(16, max(1, block // 256))


def launch(x: torch.Tensor, weight: torch.Tensor | None, eps: float, ws: Workspace, offset: float = 0.0) -> torch.Tensor:
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(d)
    warps, rows = ws.num_warps or _warps(block), ws.rows_per_program
    MONITOR.note("allreduce_rms_norm", (x.dtype, d, ws.world, weight is not None, ws.double, warps, rows))
    if x2.shape[0]:
        _allreduce_rms_norm_kernel[(triton.cdiv(x2.shape[0], rows),)](
            x2, weight if weight is not None else x2, y, ws.bufs, ws.pads, ws.epochs, ws.status, x2.shape[0], d,
            float(eps), float(offset), x2.stride(0), y.stride(0), ws.rank, ws.capacity, ws.spin_limit,
            WS=ws.world, HAS_W=weight is not None, BLOCK=block, DOUBLE=ws.double, ROWS=rows, num_warps=warps)
    return y.view(x.shape)


def allreduce_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, group_name: str) -> torch.Tensor:
    ws = WORKSPACES.get(group_name)
    if ws is None:
        raise RuntimeError(f"allreduce_rms_norm (triton): no symmetric workspace for group {group_name}; "
                           "every rank must call compiled_llm.ops.collective.prepare first")
    rows = x.numel() // x.shape[-1]
    if rows <= ws.capacity and x.shape[-1] == ws.hidden and x.dtype == ws.dtype:
        return launch(x, weight, eps, ws)
    # prefill-sized (or another width): NCCL's all-reduce, then the Triton norm
    y = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", group_name))
    return rms_norm(y, weight, eps)


def _keys(facts: dict) -> list:
    dtype, hidden, world = facts["dtype"], facts.get("hidden_size"), facts.get("tp_size", 1)
    if not hidden or world < 2:
        return []
    double, warps, rows = variant()
    return [(dtype, hidden, world, True, double, warps or _warps(triton.next_power_of_2(hidden)), rows)]


def _compile(key, device) -> None:
    """Compiles without launching (a launch is a collective: every rank would have to be in it)."""
    dtype, d, world, has_w, double, warps, rows = key
    x = torch.zeros(1, d, dtype=dtype, device=device)
    ptrs = torch.zeros(world, dtype=torch.int64, device=device)
    epochs = torch.zeros(1, dtype=torch.int32, device=device)
    _allreduce_rms_norm_kernel.warmup(x, x, x, ptrs, ptrs, epochs, epochs, 1, d, 1e-6, 0.0, d, d, 0, 1, 1 << 28,
                                      WS=world, HAS_W=has_w,
                                      BLOCK=triton.next_power_of_2(d), DOUBLE=double, ROWS=rows, num_warps=warps,
                                      grid=(1,))
    MONITOR.note("allreduce_rms_norm", key)


register_kernel(JitKernel("allreduce_rms_norm", "allreduce_rms_norm", "triton", _keys, _compile))
