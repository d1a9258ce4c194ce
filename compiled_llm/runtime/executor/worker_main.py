"""The entry point of a rank's process (spawned by the engine's node, or the main process of a rank on
another node): join the process group, build the shard, then run what rank 0 broadcasts until it says
stop. A failure is reported to the driver through the pipe before the process dies."""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback

import torch

from compiled_llm.config import EngineConfig
from compiled_llm.distributed.communication import broadcast_object, gather_objects
from compiled_llm.distributed.parallel_state import destroy_parallel, init_parallel, resolve_backend
from compiled_llm.runtime.executor.launch import join_store, world_size
from compiled_llm.runtime.executor.worker import RankWorker


def serve_forever(worker: RankWorker) -> None:
    """A worker's loop: run what rank 0 broadcasts until it says stop. The step's tensors are unpickled in
    inference mode, as warm-up made its inputs: an ordinary tensor (a different dispatch key set) fails the
    compiled forward's guard, and Dynamo compiled the model again after warm-up."""
    while True:
        with torch.inference_mode():
            method, args, gather = broadcast_object()
        if method == "shutdown":
            worker.runner.release()  # before the group is left (executor/multiproc.py shutdown)
            return
        result = getattr(worker, method)(*args)
        if gather:
            gather_objects(result)


def _quiet_worker(num_local: int, device: str) -> None:
    from compiled_llm.models import loader

    bar = loader.tqdm
    loader.tqdm = lambda *a, **k: bar(*a, **{**k, "disable": True})  # one progress bar (rank 0's) is enough
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s worker {os.getpid()}: %(message)s")
    if not str(device).startswith("cuda"):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // num_local))


def _exit_with_parent(parent: int) -> None:
    """A spawned worker ends when the engine process is gone (even if it was killed)."""
    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=watch, name="compiled_llm-parent-watch", daemon=True).start()


def worker_main(config: EngineConfig, rank: int, local_rank: int, rendezvous: tuple[str, int] | None,
                conn=None, parent: int | None = None) -> None:
    """Entry point of a worker process (spawned, or the main process of a rank on another node).
    rendezvous: rank 0's (addr, port); None when torchrun's environment gives it (env://)."""
    try:
        if parent is not None:
            _exit_with_parent(parent)
        _quiet_worker(max(1, world_size(config) // config.nnodes), config.device)
        if str(config.device).startswith("cuda"):
            torch.cuda.set_device(local_rank)  # before NCCL sets up anything
        backend = resolve_backend(config.distributed_backend, config.device)
        tp, pp, ep = config.tensor_parallel_size, config.pipeline_parallel_size, config.enable_expert_parallel
        if rendezvous is None:
            init_parallel(rank, tp, pp, ep, backend, "env://", local_rank)
        else:
            store = join_store(*rendezvous, rank, tp * pp)
            init_parallel(rank, tp, pp, ep, backend, local_rank=local_rank, store=store)
        worker = RankWorker(config)
        gather_objects(("ready", None))
        serve_forever(worker)
    except BaseException as e:  # tell the driver why, then die (the driver's collectives fail)
        msg = f"rank {rank}: {type(e).__name__}: {e}"
        if conn is not None:
            try:
                conn.send(msg + "\n" + traceback.format_exc())
            except Exception:
                pass
        if not isinstance(e, (KeyboardInterrupt, SystemExit)):
            traceback.print_exc()
        os._exit(1)  # skip destroy: the peers may be gone
    destroy_parallel()
