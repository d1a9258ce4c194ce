"""Process supervision: the spawned ranks of this node, a watcher thread that notices when one ends
(process sentinels) and says why (what the worker wrote to its pipe before dying), and the start-up of a
node whose ranks are all workers (`run_node`: node k > 0, or a torchrun rank other than 0)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from multiprocessing.connection import wait as wait_connections

from compiled_llm.config import EngineConfig
from compiled_llm.runtime.executor.launch import check_parallel_config, torchrun_rank, world_size
from compiled_llm.runtime.executor.worker_main import worker_main

log = logging.getLogger("compiled_llm")


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
        for _ in range(20):  # another thread's is_alive() may have reaped it first (its waitpid won the race:
            # this join then saw no child and left the code unset; the code appears once that poll stores it)
            if code is not None:
                break
            time.sleep(0.05)
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

    def kill(self) -> None:
        """Ends every worker now (the engine is dead: none of them can be asked to stop)."""
        self.closing = True
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
        self.stop(5)

    def stop(self, timeout: float = 10.0) -> None:
        """Waits up to timeout for the workers to leave (after the driver's shutdown message), then kills."""
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
