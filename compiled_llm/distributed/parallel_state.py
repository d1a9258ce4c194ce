"""Who this process is in a tensor-/pipeline-parallel run, and the process groups it talks through.

Ranks are laid out pipeline-major: global rank = pp_rank * tp_size + tp_rank, so the ranks of one
pipeline stage are consecutive (one node holds whole stages when it can). Expert parallelism reuses
the tensor-parallel group: with `enable_expert_parallel`, attention stays tensor-parallel and each
rank of the group owns 1/tp of the routed experts.

The model code reads `get_parallel_state()` while it is built; outside a parallel run it is the
single-process state (every size 1), so the models work unchanged without torch.distributed.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class ParallelState:
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    enable_expert_parallel: bool = False
    rank: int = 0  # global rank
    local_rank: int = 0  # rank on this node (the GPU index)
    backend: str | None = None  # None: torch.distributed is not used
    tp_group: object = None  # ProcessGroup of this rank's pipeline stage
    tp_group_name: str | None = None  # its name, for the functional collectives
    cpu_group: object = None  # gloo group over all ranks, for control messages

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def ep_size(self) -> int:
        return self.tp_size if self.enable_expert_parallel else 1

    @property
    def ep_rank(self) -> int:
        return self.tp_rank if self.enable_expert_parallel else 0

    def global_rank(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp_size + tp_rank

    def pp_layer_range(self, num_layers: int, links: list[tuple[int, int]] = ()) -> tuple[int, int]:
        """This stage's layers [start, end). See `partition_layers`."""
        bounds = partition_layers(num_layers, self.pp_size, links)
        return bounds[self.pp_rank], bounds[self.pp_rank + 1]


_STATE = ParallelState()


def get_parallel_state() -> ParallelState:
    return _STATE


def set_parallel_state(state: ParallelState) -> None:
    """Installs a state without torch.distributed (tests of shapes and weight slicing)."""
    global _STATE
    _STATE = state


def partition_layers(num_layers: int, pp_size: int, links: list[tuple[int, int]] = ()) -> list[int]:
    """Stage boundaries [0, b1, ..., num_layers] for pp_size stages, as even as possible.

    `links` are (source, reader) layer pairs that must sit on one stage: a layer that reads the KV
    cache of an earlier layer. COMPILED_LLM_PP_LAYER_PARTITION="10,12,..." (layers per stage) overrides.
    Raises ValueError (one line) when no split keeps every link on one stage."""
    forbidden = set()  # a boundary b (stage starts at layer b) may not fall in (source, reader]
    for src, reader in links:
        forbidden.update(range(min(src, reader) + 1, max(src, reader) + 1))
    override = os.environ.get("COMPILED_LLM_PP_LAYER_PARTITION")
    if override:
        sizes = [int(s) for s in override.split(",")]
        if len(sizes) != pp_size or sum(sizes) != num_layers or min(sizes) < 1:
            raise ValueError(f"COMPILED_LLM_PP_LAYER_PARTITION={override!r} must give {pp_size} positive layer "
                             f"counts summing to {num_layers}")
        bounds = [0]
        for s in sizes:
            bounds.append(bounds[-1] + s)
        bad = forbidden & set(bounds[1:-1])
        if bad:
            raise ValueError(f"COMPILED_LLM_PP_LAYER_PARTITION splits layers that share a KV cache (boundary "
                             f"at layer {min(bad)})")
        return bounds
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp_size} is larger than the model's {num_layers} layers")
    if pp_size == 1:
        return [0, num_layers]
    # best[k][i]: smallest achievable largest stage when layers [0, i) form k stages, and the split
    inf = num_layers + 1
    best = [[(inf, None)] * (num_layers + 1) for _ in range(pp_size + 1)]
    best[0][0] = (0, None)
    for k in range(1, pp_size + 1):
        for i in range(1, num_layers + 1):
            if i < num_layers and i in forbidden:
                continue
            for j in range(k - 1, i):
                prev, _ = best[k - 1][j]
                if prev == inf:
                    continue
                cost = max(prev, i - j)
                # on ties, give the earlier stages the extra layers: the last one also runs the LM head
                if cost < best[k][i][0] or (cost == best[k][i][0] and j > best[k][i][1]):
                    best[k][i] = (cost, j)
    if best[pp_size][num_layers][0] == inf:
        pairs = ", ".join(f"{r}->{s}" for s, r in links)
        raise ValueError(f"pipeline_parallel_size={pp_size} cannot split the {num_layers} layers without separating "
                         f"a KV-sharing layer from its source ({pairs}); use a smaller pipeline_parallel_size")
    bounds = [num_layers]
    k, i = pp_size, num_layers
    while k > 0:
        j = best[k][i][1]
        bounds.append(j)
        k, i = k - 1, j
    return bounds[::-1]


def resolve_backend(backend: str, device: str) -> str:
    if backend in (None, "auto"):
        return "nccl" if str(device).startswith("cuda") else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"distributed_backend must be auto, gloo or nccl, not {backend!r}")
    return backend


def timeout() -> datetime.timedelta:
    """Longest a collective may wait (weights load between the first collectives, so it is long)."""
    return datetime.timedelta(seconds=float(os.environ.get("COMPILED_LLM_DIST_TIMEOUT", "1800")))


def init_parallel(rank: int, tp_size: int, pp_size: int, enable_expert_parallel: bool, backend: str,
                  init_method: str | None = None, local_rank: int = 0, store=None) -> ParallelState:
    """Joins the process group (every rank calls this; through init_method, e.g. env://, or a store)
    and builds the stage groups."""
    world = tp_size * pp_size
    dist.init_process_group(backend, init_method=init_method, store=store, rank=rank, world_size=world,
                            timeout=timeout())
    pp_rank, tp_rank = divmod(rank, tp_size)
    tp_group = None
    for stage in range(pp_size):  # every rank creates every group, in the same order
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        group = dist.new_group(ranks)
        if stage == pp_rank:
            tp_group = group
    cpu_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout())
    state = ParallelState(tp_size=tp_size, tp_rank=tp_rank, pp_size=pp_size, pp_rank=pp_rank,
                          enable_expert_parallel=enable_expert_parallel, rank=rank, local_rank=local_rank,
                          backend=backend, tp_group=tp_group, tp_group_name=tp_group.group_name,
                          cpu_group=cpu_group)
    set_parallel_state(state)
    return state


def destroy_parallel(timeout: float | None = None) -> None:
    """Leaves the process groups. With a timeout, a teardown that does not return in time (NCCL's can wait on
    a peer that already left) is aborted with a warning instead of hanging the process at exit."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        # NCCL's graceful destroy waits on its peers: on the H200 it hung at shutdown, and so did the abort
        # that followed it from another thread. An abort is local and the group has no work left: abort only
        abort_parallel()
    if dist.is_initialized():  # gloo (or an abort that did not take)
        if timeout is None:
            dist.destroy_process_group()
        else:
            import threading

            done = threading.Event()

            def destroy():
                try:
                    dist.destroy_process_group()
                finally:
                    done.set()

            threading.Thread(target=destroy, name="compiled_llm-destroy-pg", daemon=True).start()
            if not done.wait(timeout):
                logging.getLogger("compiled_llm").warning(
                    "leaving the process group took over %.0f s; aborting it instead", timeout)
                abort_parallel()
    set_parallel_state(ParallelState())


def abort_parallel() -> None:
    """Aborts pending collectives (a peer died): NCCL would otherwise wait out its timeout."""
    try:
        from torch.distributed.distributed_c10d import _abort_process_group

        if dist.is_initialized():
            _abort_process_group()
    except Exception:  # best effort: gloo notices closed connections by itself
        pass
    set_parallel_state(ParallelState())


def cuda_device_for(local_rank: int) -> torch.device:
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)
