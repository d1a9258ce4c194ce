"""The multi-process executor: tensor- and pipeline-parallel execution, one process per rank, rank 0
inside the engine (the driver).

Rank 0 keeps the scheduler, sampler and detokenizer; it also holds a model shard like every other rank
(worker.py RankWorker). Each step it prepares the batch (token ids, positions, block tables), broadcasts
it over a gloo group to the other ranks (wire.py StepInput), and runs its own shard. Tensor-parallel ranks
then compute the same tokens and meet in their all-reduces. Pipeline stages run one after another (no
micro-batches in this version): a stage receives the previous stage's hidden states (and PLE per-layer
inputs), runs its layers and sends them on; the last stage's first rank sends the logits back to rank 0.

Under async scheduling (tensor parallel, with or without expert parallel) the driver prepares step N+1 on
the host and sends it before step N's tokens are read: the step names the input rows that take them, and rank
0, the only rank that samples, broadcasts those tokens over the tensor-parallel group on the device ahead of
the step's forward (worker.py `_fill_pending`). Nothing of it waits on the host, on the driver or a worker;
greedy and seeded draws are the one-process engine's, since they are rank 0's alone. Pipeline stages step
synchronously.

Ranks 1..N-1 of the engine's node are spawned processes running worker_main.py's `worker_main`
(supervision.py WorkerProcesses); with several nodes, `run_node` starts a node's ranks, or torchrun
starts one process per rank (launch.py `torchrun_rank`).

A worker that dies is noticed two ways: a watcher thread sees the process end, and the driver's next
collective fails (gloo reports the closed connection at once; NCCL's pending collectives are aborted
by the watcher). Either way `execute` raises EngineDeadError, and keeps raising it.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from pathlib import Path

import torch

from compiled_llm.config import EngineConfig
from compiled_llm.distributed.communication import broadcast_object, gather_objects
from compiled_llm.distributed.parallel_state import (abort_parallel, destroy_parallel, init_parallel, resolve_backend,
                                                     timeout)
from compiled_llm.models.registry import resolve_model_class
from compiled_llm.multimodal import transport
from compiled_llm.multimodal.runner import BIDIR_KEY, has_media, plan_media
from compiled_llm.runtime.errors import EngineDeadError
from compiled_llm.runtime.executor.abstract import Executor
from compiled_llm.runtime.executor.launch import (JOINED, check_parallel_config, free_port, join_store, torchrun_rank,
                                                  world_size)
from compiled_llm.runtime.executor.supervision import WorkerProcesses
from compiled_llm.runtime.executor.wire import MediaRefs, StepInput, to_device, wire_extras
from compiled_llm.runtime.executor.worker import RankWorker
from compiled_llm.runtime.model_runner import read_hf_config
from compiled_llm.runtime.scheduler import ScheduledSeq

log = logging.getLogger("compiled_llm")

_ACTIVE: MultiProcExecutor | None = None


class MultiProcExecutor(Executor):
    """Rank 0's side of a parallel engine: its own shard, the other ranks' processes, and the calls that
    reach every rank (`collective_rpc`)."""

    def __init__(self, config: EngineConfig):
        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError("a parallel engine is already running in this process; shut it down first "
                               "(LLMEngine.shutdown())")
        folder = Path(config.resolved_model())
        if not folder.is_dir():
            raise ValueError(f"model folder {folder} does not exist")
        check_parallel_config(config, resolve_model_class(read_hf_config(folder)))
        self.config = config
        # tensor parallel (with or without experts): rank 0 broadcasts the sampled tokens (worker.py)
        self.supports_async_scheduling = config.pipeline_parallel_size == 1
        if not self.supports_async_scheduling:
            self.async_refusal = "pipeline-parallel stages step synchronously (one after another)"
        self.dead: EngineDeadError | None = None
        # all ranks on this node see its /dev/shm; across nodes media bytes travel with the RPC
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size(config)))
        self.ranks_share_memory = config.nnodes == 1 and local_world >= world_size(config)
        self.procs: WorkerProcesses | None = None
        backend = resolve_backend(config.distributed_backend, config.device)
        world = world_size(config)
        per_node = world // config.nnodes
        rendezvous = None  # torchrun: env://
        if torchrun_rank() is not None:
            if torchrun_rank() != 0:
                raise RuntimeError("only rank 0 runs the engine; other ranks run "
                                   "compiled_llm.runtime.executor.run_node")
        else:
            if config.node_rank != 0:
                raise RuntimeError("node 0 runs the engine; other nodes run compiled_llm.runtime.executor.run_node")
            port = config.master_port or (free_port(config.master_addr) if config.nnodes == 1 else 29500)
            rendezvous = (config.master_addr, port)
            self.procs = WorkerProcesses(config, [(r, r) for r in range(1, per_node)], rendezvous,
                                         self._on_death if backend == "nccl" else None)
        log.info("starting %d ranks (tensor parallel %d x pipeline parallel %d%s, %s)", world,
                 config.tensor_parallel_size, config.pipeline_parallel_size,
                 ", expert parallel" if config.enable_expert_parallel else "", backend)
        _ACTIVE = self
        try:
            self._start(config, backend, rendezvous)
        except BaseException as e:
            death = self.procs.wait_death(2.0) if self.procs else None
            self._teardown()
            if death:
                raise EngineDeadError(f"the engine could not start: {death}") from e
            raise
        atexit.register(self.shutdown)

    def _start(self, config: EngineConfig, backend: str, rendezvous: tuple[str, int] | None) -> None:
        tp, pp, ep = config.tensor_parallel_size, config.pipeline_parallel_size, config.enable_expert_parallel
        if str(config.device).startswith("cuda"):
            torch.cuda.set_device(0)
        if rendezvous is None:
            init_parallel(0, tp, pp, ep, backend, "env://", 0)
        else:
            store = join_store(*rendezvous, 0, tp * pp)
            self._wait_joined(store, tp * pp)
            init_parallel(0, tp, pp, ep, backend, local_rank=0, store=store)
        self.worker = RankWorker(config)
        self.runner = self.worker.runner
        gather_objects(("ready", None))  # every rank has built its shard
        infos = self.collective_rpc("kv_info")
        groups = set().union(*(g for g, _ in infos))
        self.block_bytes = {g: sum(b.get(g, 0) for _, b in infos) for g in groups}
        if groups != self.runner.kv_groups:  # pipeline stages hold different layer kinds
            self.collective_rpc("set_kv_groups", groups)

    def _wait_joined(self, store, world: int) -> None:
        """Waits for every rank to check in, failing at once if a local worker dies first."""
        end = time.monotonic() + timeout().total_seconds()
        while store.add(JOINED, 0) < world - 1:
            if self.procs is not None and self.procs.death is not None:
                raise EngineDeadError(self.procs.death)
            if time.monotonic() > end:
                raise EngineDeadError(f"only {store.add(JOINED, 0)} of {world - 1} workers joined in time")
            time.sleep(0.05)

    # -- engine-facing methods --
    def group_block_bytes(self) -> dict:
        return dict(self.block_bytes)

    def plan_blocks(self, max_model_len: int) -> dict:
        """Every rank plans for its own layers and memory; each group gets the smallest count."""
        c = self.config
        settings = {"max_model_len": c.max_model_len, "max_num_batched_tokens": c.max_num_batched_tokens,
                    "enable_prefix_caching": c.enable_prefix_caching}
        plans = self.collective_rpc("plan_blocks", max_model_len, settings)
        return {g: min(p[g] for p in plans if g in p) for g in self.block_bytes}

    def allocate_kv_cache(self, num_blocks: dict) -> None:
        self.collective_rpc("allocate_kv_cache", num_blocks)

    def freeze_heap(self) -> None:
        self.collective_rpc("freeze_heap")  # rank 0's RankWorker is this process

    @torch.inference_mode()  # the step's tensors as warm-up made them: an ordinary tensor fails Dynamo's
    def execute(self, batch: list[ScheduledSeq], pending=None) -> torch.Tensor:  # guard, a recompile each run
        """pending (async scheduling, tensor parallel only): the previous step's tokens on rank 0's device. The
        step goes to the workers before they are read; rank 0 broadcasts the ones it needs on the device."""
        if pending is not None and not self.supports_async_scheduling:
            raise ValueError(f"async scheduling is not supported here: {self.async_refusal}")
        self._check()
        try:
            step = self._step_input(batch, pending)
            broadcast_object(("execute", (step,), False))
            return self.worker.execute(step, None if pending is None else pending.tokens)
        except Exception as e:
            raise self._fail(e) from e

    def _step_input(self, batch: list[ScheduledSeq], pending=None) -> StepInput:
        """The step as every rank runs it, prepared once here on the host: copying device tensors back for
        the wire would wait for the step still running (each rank moves them to its device)."""
        cpu = torch.device("cpu")
        input_ids, positions, meta, rows, fill, prompt = self.runner.prepare_inputs(
            batch, None if pending is None else pending.rows, cpu)
        ctx = self.runner.forward_context(batch, meta)
        media = None
        if has_media(batch):  # the step names the media; every first-stage rank embeds its own copy
            plan = plan_media(batch, input_ids, self.runner.model.pad_token_id)
            input_ids = plan.input_ids
            ctx.extra[BIDIR_KEY] = plan.spans
            media = MediaRefs(plan.rows, [(s.request_id, k, lo, hi) for s, k, lo, hi in plan.refs],
                              sorted({s.request_id for s in plan.done}))
        step = StepInput(input_ids, positions, meta, rows, wire_extras(ctx.extra), media, *(fill or (None, None)),
                         prompt=prompt)
        return to_device(step, cpu)  # any device tensor an extra holds (sparse KV: synchronous steps only)

    def register_media(self, request_id: str, mm) -> None:
        """Hands a multimodal request's processor tensors to every rank once (docs/multimodal.md). If a rank
        fails, every rank forgets the request and the first failure's own message is raised as a ValueError;
        the workers keep serving."""
        items = [(it.modality, it.positions.numel(), it.tensors) for it in mm.items]
        manifest = transport.pack(items, inline=not self.ranks_share_memory)
        try:
            errors = self.collective_rpc("register_media", request_id, manifest)
        finally:
            transport.unlink(manifest)  # every rank has copied (or given up)
        failed = [(rank, e) for rank, e in enumerate(errors) if e]
        if failed:
            self.collective_rpc("release_media", [request_id], gather=False)
            rank, error = failed[0]
            raise ValueError(f"the media could not be registered on rank {rank}: {error}")

    def release_media(self, request_ids: list[str]) -> None:
        """Drops finished or aborted requests' media on every rank."""
        if request_ids:
            self.collective_rpc("release_media", list(request_ids), gather=False)

    def collective_rpc(self, method: str, *args, gather: bool = True) -> list | None:
        """Runs RankWorker.method(*args) on every rank; returns the results in rank order."""
        self._check()
        try:
            broadcast_object((method, args, gather))
            result = getattr(self.worker, method)(*args)
            return gather_objects(result) if gather else [result]
        except Exception as e:
            raise self._fail(e) from e

    def worker_pids(self) -> dict[int, int]:
        return self.procs.pids() if self.procs else {}

    def is_healthy(self) -> bool:
        return self.dead is None and (self.procs is None or self.procs.death is None)

    # -- failure and shutdown --
    def _check(self) -> None:
        if self.dead is not None:
            raise self.dead
        if self.procs is not None and self.procs.death is not None:
            raise self._fail(None)

    def _on_death(self, reason: str) -> None:
        abort_parallel()  # NCCL: unblock the driver's pending collectives

    def _fail(self, error: BaseException | None) -> EngineDeadError:
        if isinstance(error, EngineDeadError):
            return error
        if self.dead is None:
            death = self.procs.wait_death(2.0) if self.procs else None
            what = death or f"a collective failed: {type(error).__name__}: {error}"
            self.dead = EngineDeadError(f"the engine is dead: {what}")
            self._teardown()
        return self.dead

    def _teardown(self) -> None:
        global _ACTIVE
        if self.procs is not None:
            self.procs.kill()
        try:
            destroy_parallel()
        except Exception:
            pass
        if _ACTIVE is self:
            _ACTIVE = None

    def shutdown(self) -> None:
        """Stops the workers and leaves the process group (another engine may start afterwards)."""
        global _ACTIVE
        if _ACTIVE is not self:
            return
        if self.dead is None:
            try:
                broadcast_object(("shutdown", (), False))
            except Exception:
                pass
            self.runner.release()  # graphs first: NCCL's abort waited on collectives captured in live graphs
            try:  # together with the workers (each leaves on the message): NCCL's teardown waits for its peers
                destroy_parallel(timeout=10.0)
            except Exception:
                pass
            if self.procs is not None:
                self.procs.stop(10)
        else:
            self._teardown()
        _ACTIVE = None
