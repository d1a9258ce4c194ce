"""Launch configuration of a parallel engine: how many ranks, which one this process is, whether the
settings can run at all, and the rendezvous every rank checks in at before the process group forms."""

from __future__ import annotations

import dataclasses
import os
import socket

import torch
import torch.distributed as dist

from compiled_llm.config import EngineConfig
from compiled_llm.distributed.parallel_state import resolve_backend, timeout
from compiled_llm.models.interfaces import supports_ep, supports_pp, supports_tp


def world_size(config: EngineConfig) -> int:
    return config.tensor_parallel_size * config.pipeline_parallel_size


def torchrun_rank() -> int | None:
    """This process's rank when torchrun (or another launcher setting RANK/WORLD_SIZE) started it."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return int(os.environ["RANK"])
    return None


def is_engine_process(config: EngineConfig) -> bool:
    """False in processes that should run `run_node` instead of an engine."""
    rank = torchrun_rank()
    if rank is not None and world_size(config) > 1:
        return rank == 0
    return config.node_rank == 0


def check_parallel_config(config: EngineConfig, model_cls: type | None = None) -> None:
    """One-line ValueErrors for settings that cannot run."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if tp < 1 or pp < 1:
        raise ValueError("tensor_parallel_size and pipeline_parallel_size must be at least 1")
    if config.nnodes < 1 or not 0 <= config.node_rank < config.nnodes:
        raise ValueError(f"node_rank must lie in [0, nnodes) (nnodes={config.nnodes}, node_rank={config.node_rank})")
    world = tp * pp
    if world % config.nnodes:
        raise ValueError(f"tensor_parallel_size x pipeline_parallel_size ({world}) must be a multiple of nnodes "
                         f"({config.nnodes})")
    resolve_backend(config.distributed_backend, config.device)
    if torchrun_rank() is not None and int(os.environ["WORLD_SIZE"]) != world:
        raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} processes; tensor_parallel_size x "
                         f"pipeline_parallel_size is {world}")
    if config.sparse_method and pp > 1:
        raise ValueError("sparse KV (sparse_method) does not run with pipeline parallelism yet")
    if str(config.device).startswith("cuda") and world > 1 and torch.cuda.device_count() < world // config.nnodes:
        raise ValueError(f"{world // config.nnodes} GPUs per node are needed, {torch.cuda.device_count()} are visible")
    if model_cls is not None:
        name = model_cls.__name__
        if tp > 1 and not supports_tp(model_cls):
            raise ValueError(f"{name} does not support tensor parallelism yet")
        if pp > 1 and not supports_pp(model_cls):
            raise ValueError(f"{name} does not support pipeline parallelism yet")
        if config.enable_expert_parallel and not supports_ep(model_cls):
            raise ValueError(f"{name} does not support expert parallelism")


def rank_config(config: EngineConfig, local_rank: int) -> EngineConfig:
    """The config one rank builds its shard with: its own GPU."""
    if str(config.device).startswith("cuda") and world_size(config) > 1:
        return dataclasses.replace(config, device=f"cuda:{local_rank}")
    return config


JOINED = "compiled_llm/joined"


def join_store(addr: str, port: int, rank: int, world: int) -> dist.TCPStore:
    """The rendezvous store (rank 0 hosts it). Ranks check in before the process group forms, so rank 0
    can wait for them while watching its local workers, instead of blocking in init_process_group."""
    store = dist.TCPStore(addr, port, world, is_master=rank == 0, timeout=timeout(), wait_for_workers=False)
    if rank != 0:
        store.add(JOINED, 1)
    return store


def free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]
