"""Tensor- and pipeline-parallel execution: one process per rank, rank 0 inside the engine.

Rank 0 (the driver) keeps the scheduler, sampler and detokenizer; it also holds a model shard like
every other rank. Each step it prepares the batch (token ids, positions, block tables), broadcasts it
over a gloo group to the other ranks, and runs its own shard. Tensor-parallel ranks then compute the
same tokens and meet in their all-reduces. Pipeline stages run one after another (no micro-batches in
this version): a stage receives the previous stage's hidden states (and PLE per-layer inputs), runs
its layers and sends them on; the last stage's first rank sends the logits back to rank 0.

Ranks 1..N-1 of the engine's node are spawned processes running `worker_main`; with several nodes,
`run_node` starts a node's ranks, or torchrun starts one process per rank (`torchrun_rank`).

A worker that dies is noticed two ways: a watcher thread sees the process end, and the driver's next
collective fails (gloo reports the closed connection at once; NCCL's pending collectives are aborted
by the watcher). Either way `execute` raises EngineDeadError, and keeps raising it.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_connections
from pathlib import Path

import torch
import torch.distributed as dist

from compiled_llm.config import EngineConfig
from compiled_llm.distributed.communication import broadcast_object, gather_objects, recv_tensors, send_tensors
from compiled_llm.distributed.parallel_state import (abort_parallel, destroy_parallel, get_parallel_state,
                                                     init_parallel, resolve_backend)
from compiled_llm.multimodal import transport
from compiled_llm.multimodal.runner import BIDIR_KEY, has_media, merge, plan_media, soft_tokens
from compiled_llm.ops.context import AttentionMetadata, ForwardContext
from compiled_llm.runtime.errors import EngineDeadError

log = logging.getLogger("compiled_llm")


# ---- configuration -------------------------------------------------------------------------------
def world_size(config: EngineConfig) -> int:
    return config.tensor_parallel_size * config.pipeline_parallel_size


def torchrun_rank() -> int | None:
    """This process's rank when torchrun (or another launcher setting RANK/WORLD_SIZE) started it."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return int(os.environ["RANK"])
    return None


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
    if getattr(config, "sparse_method", None) and pp > 1:
        raise ValueError("sparse KV (sparse_method) does not run with pipeline parallelism yet")
    if str(config.device).startswith("cuda") and world > 1 and torch.cuda.device_count() < world // config.nnodes:
        raise ValueError(f"{world // config.nnodes} GPUs per node are needed, {torch.cuda.device_count()} are visible")
    if model_cls is not None:
        name = model_cls.__name__
        if tp > 1 and not getattr(model_cls, "supports_tensor_parallel", False):
            raise ValueError(f"{name} does not support tensor parallelism yet")
        if pp > 1 and not getattr(model_cls, "supports_pipeline_parallel", False):
            raise ValueError(f"{name} does not support pipeline parallelism yet")
        if config.enable_expert_parallel and not getattr(model_cls, "supports_expert_parallel", False):
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
    from compiled_llm.distributed.parallel_state import timeout

    store = dist.TCPStore(addr, port, world, is_master=rank == 0, timeout=timeout(), wait_for_workers=False)
    if rank != 0:
        store.add(JOINED, 1)
    return store


def free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def _move(obj, device: torch.device):
    """Tensors inside the step's metadata, moved to device (the wire carries CPU tensors)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _move(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, dict):
        return {k: _move(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_move(v, device) for v in obj)
    return obj


@dataclass
class MediaRefs:
    """A step's media, by reference: each first-stage rank runs the towers on its registered copy."""

    rows: torch.Tensor  # step rows that take soft tokens, in the order of refs
    refs: list[tuple[str, int, int, int]]  # (request id, item index, first soft token, end)
    done: list[str]  # requests whose prompt ends in this step: drop their cached soft tokens after it


@dataclass
class StepInput:
    """One prepared step, as every rank runs it."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    rows: torch.Tensor  # token rows whose logits are wanted
    extra: dict  # forward-context extras (no per-rank state in them)
    media: MediaRefs | None = None


# Test hook: "RANK:REQUEST_ID" makes that rank refuse that request's media registration.
MEDIA_FAULT_ENV = "COMPILED_LLM_MEDIA_REGISTRATION_FAULT"


@dataclass
class RegisteredMedia:
    """One request's media on one rank: (modality, soft-token count, tensors) per item, and the soft tokens
    computed so far (kept until the prompt is done; a preempted request recomputes them)."""

    items: list[tuple[str, int, dict[str, torch.Tensor]]]
    embeds: dict[int, torch.Tensor]


# ---- one rank's shard ----------------------------------------------------------------------------
class RankWorker:
    """A rank's model shard and KV cache; the driver holds one, and so does every worker process."""

    def __init__(self, config: EngineConfig):
        from compiled_llm.runtime.model_runner import ModelRunner

        self.ps = get_parallel_state()
        if str(config.device).startswith("cuda"):
            torch.cuda.set_device(self.ps.local_rank)
        self.runner = ModelRunner(rank_config(config, self.ps.local_rank))
        self.media: dict[str, RegisteredMedia] = {}  # request id -> its media (first stage only)

    # control calls (the driver runs them on every rank through `ParallelRunner.collective_rpc`)
    def kv_info(self) -> tuple[set, dict]:
        return set(self.runner.kv_groups), self.runner.group_block_bytes()

    def set_kv_groups(self, groups: set) -> None:
        self.runner.kv_groups = set(groups)

    def plan_blocks(self, max_model_len: int, settings: dict) -> dict:
        for name, value in settings.items():  # what the engine resolved after the shards were built
            setattr(self.runner.config, name, value)
        return self.runner.plan_blocks(max_model_len)

    def allocate_kv_cache(self, num_blocks: dict) -> bool:
        self.runner.allocate_kv_cache({g: n for g, n in num_blocks.items() if g in self.runner.kv_groups})
        return True

    def param_counts(self) -> dict[str, int]:
        return {name: p.numel() for name, p in self.runner.model.named_parameters()}

    def compiler_summary(self) -> dict | None:
        """Per-pass matches and compiled pieces (None when the model runs eager)."""
        c = getattr(self.runner, "compiler", None)
        return None if c is None else c.summary()

    def info(self) -> dict:
        ps = self.ps
        m = getattr(self.runner.model, "model", None)
        return {"rank": ps.rank, "tp_rank": ps.tp_rank, "pp_rank": ps.pp_rank, "pid": os.getpid(),
                "layers": (getattr(m, "start_layer", None), getattr(m, "end_layer", None)),
                "device": str(self.runner.device)}

    # media of multimodal requests: registered once when admitted, released when they end
    def register_media(self, request_id: str, manifest: transport.Manifest) -> str | None:
        """Copies the request's processor tensors into this rank's registry. Returns None, or the error text:
        it never raises, so a bad registration cannot end the worker loop. Later pipeline stages keep
        nothing (the towers live on the first stage)."""
        try:
            if os.environ.get(MEDIA_FAULT_ENV) == f"{self.ps.rank}:{request_id}":
                raise RuntimeError(f"media registration fault injected on rank {self.ps.rank}")
            if self.ps.is_first_stage:
                self.media[request_id] = RegisteredMedia(transport.unpack(manifest, self.runner.device), {})
            return None
        except Exception as e:  # noqa: BLE001 - reported to the driver, which rolls back on every rank
            return f"{type(e).__name__}: {e}"

    def release_media(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.media.pop(rid, None)

    def media_requests(self) -> list[str]:
        return sorted(self.media)

    def _media_embeds(self, input_ids: torch.Tensor, media: MediaRefs) -> torch.Tensor:
        model, feats = self.runner.model, []
        for rid, k, lo, hi in media.refs:
            entry = self.media[rid]
            modality, num_tokens, tensors = entry.items[k]
            feats.append(soft_tokens(model, entry.embeds, k, modality, tensors, num_tokens)[lo:hi])
        for rid in media.done:
            if rid in self.media:
                self.media[rid].embeds.clear()
        return merge(model, input_ids, media.rows, feats)

    # the step
    @torch.inference_mode()
    def execute(self, step: StepInput) -> torch.Tensor | None:
        """Runs this rank's part of the step; returns the logits on rank 0, None elsewhere."""
        ps, r = self.ps, self.runner
        dev = r.device
        if ps.rank != 0:
            step = _move(step, dev)
        n = step.input_ids.shape[0]
        ctx = ForwardContext(step.meta, r.kv_caches, r.specs, step.extra)
        intermediate = None
        if not ps.is_first_stage:
            shapes = r.model.intermediate_shapes(n, r.dtype)
            intermediate = recv_tensors(shapes, ps.global_rank(ps.pp_rank - 1, ps.tp_rank), dev)
        embeds = None
        if step.media is not None and ps.is_first_stage:  # towers run here, on this rank's registered copy
            embeds = self._media_embeds(step.input_ids, step.media)
        out = r.execute_prepared(step.input_ids, step.positions, ctx, step.rows, intermediate, embeds)
        if not ps.is_last_stage:
            send_tensors(out, ps.global_rank(ps.pp_rank + 1, ps.tp_rank))
            out = None
        num_rows = step.rows.shape[0]
        if ps.pp_size > 1 and num_rows:
            last = ps.global_rank(ps.pp_size - 1, 0)
            if ps.rank == 0:
                out = torch.empty(num_rows, r.model_config.vocab_size, dtype=torch.float32, device=dev)
                dist.recv(out, last)
            elif ps.rank == last:
                dist.send(out.contiguous(), 0)
        return out if ps.rank == 0 else None


def serve_forever(worker: RankWorker) -> None:
    """A worker's loop: run what rank 0 broadcasts until it says stop."""
    while True:
        method, args, gather = broadcast_object()
        if method == "shutdown":
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


# ---- the driver's side ---------------------------------------------------------------------------
class WorkerProcesses:
    """Spawned local ranks and a thread that notices when one ends."""

    def __init__(self, config: EngineConfig, ranks: list[tuple[int, int]], rendezvous: tuple[str, int],
                 on_death=None):
        ctx = mp.get_context("spawn")
        self.procs: dict[int, mp.Process] = {}
        self.conns = {}
        for rank, local_rank in ranks:
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=worker_main, args=(config, rank, local_rank, rendezvous, send, os.getpid()),
                            name=f"compiled_llm-rank{rank}", daemon=True)
            p.start()
            send.close()
            self.procs[rank], self.conns[rank] = p, recv
        self.death: str | None = None
        self.closing = False
        self.on_death = on_death
        self._stop_r, self._stop_w = ctx.Pipe(duplex=False)
        self._watcher = threading.Thread(target=self._watch, name="compiled_llm-worker-watch", daemon=True)
        self._watcher.start()

    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items()}

    def _watch(self) -> None:
        sentinels = {p.sentinel: r for r, p in self.procs.items()}
        ready = wait_connections(list(sentinels) + [self._stop_r])
        if self.closing or self._stop_r in ready:
            return
        rank = next(sentinels[s] for s in ready if s in sentinels)
        p = self.procs[rank]
        p.join(1)
        code = p.exitcode
        how = f"was killed by {signal.Signals(-code).name}" if code and code < 0 else f"exited with code {code}"
        reason = f"worker rank {rank} (pid {p.pid}) {how}"
        conn = self.conns[rank]
        said = None
        try:
            if conn.poll(0.5):
                said = conn.recv()
        except (EOFError, OSError):
            pass
        if said:
            reason += f": {said}"
        elif code == 1:  # typically a spawned child re-running an unguarded script
            reason += (" before it could report why (a script that starts a parallel engine needs "
                       "`if __name__ == '__main__':`, since workers are spawned)")
        self.death = reason
        log.error("%s", reason)
        if self.on_death is not None:
            self.on_death(reason)

    def wait_death(self, timeout: float) -> str | None:
        """The death reason, waiting up to timeout for the watcher to notice (an error may come first)."""
        end = time.monotonic() + timeout
        while self.death is None and time.monotonic() < end:
            if any(not p.is_alive() for p in self.procs.values()):
                self._watcher.join(max(0.0, end - time.monotonic()))
                break
            time.sleep(0.05)
        return self.death

    def stop(self, timeout: float = 10.0) -> None:
        self.closing = True
        try:
            self._stop_w.send(None)
        except OSError:
            pass
        end = time.monotonic() + timeout
        for p in self.procs.values():
            p.join(max(0.0, end - time.monotonic()))
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
                p.join(5)


_ACTIVE: ParallelRunner | None = None


class ParallelRunner:
    """What the engine drives instead of a ModelRunner when there are several ranks: the same methods
    (plan_blocks, allocate_kv_cache, execute, ...); anything else is read from rank 0's own runner."""

    def __init__(self, config: EngineConfig):
        global _ACTIVE
        from compiled_llm.models.registry import resolve_model_class
        from compiled_llm.runtime.model_runner import read_hf_config

        if _ACTIVE is not None:
            raise RuntimeError("a parallel engine is already running in this process; shut it down first "
                               "(LLMEngine.shutdown())")
        folder = Path(config.resolved_model())
        if not folder.is_dir():
            raise ValueError(f"model folder {folder} does not exist")
        check_parallel_config(config, resolve_model_class(read_hf_config(folder)))
        self.config = config
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
                raise RuntimeError("only rank 0 runs the engine; other ranks run compiled_llm.runtime.workers.run_node")
        else:
            if config.node_rank != 0:
                raise RuntimeError("node 0 runs the engine; other nodes run compiled_llm.runtime.workers.run_node")
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
        self.local = self.worker.runner
        gather_objects(("ready", None))  # every rank has built its shard
        infos = self.collective_rpc("kv_info")
        groups = set().union(*(g for g, _ in infos))
        self.block_bytes = {g: sum(b.get(g, 0) for _, b in infos) for g in groups}
        if groups != self.local.kv_groups:  # pipeline stages hold different layer kinds
            self.collective_rpc("set_kv_groups", groups)

    def _wait_joined(self, store, world: int) -> None:
        """Waits for every rank to check in, failing at once if a local worker dies first."""
        from compiled_llm.distributed.parallel_state import timeout

        end = time.monotonic() + timeout().total_seconds()
        while store.add(JOINED, 0) < world - 1:
            if self.procs is not None and self.procs.death is not None:
                raise EngineDeadError(self.procs.death)
            if time.monotonic() > end:
                raise EngineDeadError(f"only {store.add(JOINED, 0)} of {world - 1} workers joined in time")
            time.sleep(0.05)

    # -- engine-facing methods --
    def __getattr__(self, name):
        if name in ("local", "worker"):
            raise AttributeError(name)
        return getattr(self.local, name)

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

    def execute(self, batch) -> torch.Tensor:
        self._check()
        try:
            input_ids, positions, meta, rows = self.local.prepare(batch)
            ctx = self.local.forward_context(batch, meta)
            media = None
            if has_media(batch):  # the step names the media; every first-stage rank embeds its own copy
                plan = plan_media(batch, input_ids, self.local.model.pad_token_id)
                input_ids = plan.input_ids
                ctx.extra[BIDIR_KEY] = plan.spans
                media = MediaRefs(plan.rows, [(s.request_id, k, lo, hi) for s, k, lo, hi in plan.refs],
                                  sorted({s.request_id for s in plan.done}))
            step = StepInput(input_ids, positions, meta, rows, ctx.extra, media)
            cpu = torch.device("cpu")
            broadcast_object(("execute", (step if self.local.device.type == "cpu" else _move(step, cpu),), False))
            return self.worker.execute(step)
        except Exception as e:
            raise self._fail(e) from e

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
            self.procs.closing = True
            for p in self.procs.procs.values():
                if p.is_alive():
                    p.kill()
            self.procs.stop(5)
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
            if self.procs is not None:
                self.procs.stop(10)
            try:
                destroy_parallel()
            except Exception:
                pass
        else:
            self._teardown()
        _ACTIVE = None


# ---- ranks other than the engine's -------------------------------------------------------------------
def run_node(config: EngineConfig) -> int:
    """Runs this process's ranks when it is not rank 0: a torchrun-started rank, or node k > 0 of
    `--nnodes N --node-rank k` (its first rank in this process, the others spawned). Returns on shutdown."""
    check_parallel_config(config)
    rank = torchrun_rank()
    if rank is not None:
        worker_main(config, rank, int(os.environ.get("LOCAL_RANK", rank)), None)
        return 0
    per_node = world_size(config) // config.nnodes
    first = config.node_rank * per_node
    rendezvous = (config.master_addr, config.master_port or 29500)
    procs = WorkerProcesses(config, [(first + i, i) for i in range(1, per_node)], rendezvous)
    try:
        worker_main(config, first, 0, rendezvous)
    finally:
        procs.stop(10)
    return 0


def is_engine_process(config: EngineConfig) -> bool:
    """False in processes that should run `run_node` instead of an engine."""
    rank = torchrun_rank()
    if rank is not None and world_size(config) > 1:
        return rank == 0
    return config.node_rank == 0


if __name__ == "__main__":  # pragma: no cover - `python -m compiled_llm.runtime.workers` is not an entry point
    sys.exit("use `python -m compiled_llm serve ... --node-rank K` or torchrun")
