"""The executor layer, between the engine and the ranks (docs/architecture.md "Parallelism").

- abstract.py: `Executor`, the one interface the engine drives.
- uniproc.py: `UniProcExecutor`, the whole model in this process.
- multiproc.py: `MultiProcExecutor`, rank 0 of a tensor-/pipeline-parallel run (the driver).
- worker.py: `RankWorker`, one rank's shard, KV cache and media registry.
- worker_main.py: the entry point of a rank's process.
- supervision.py: the spawned processes and their watcher; `run_node` for nodes without the engine.
- launch.py: world size, ranks, config checks, rendezvous.
- wire.py: the step every rank runs (`StepInput`, `MediaRefs`).
"""

from __future__ import annotations

from compiled_llm.config import EngineConfig
from compiled_llm.runtime.executor.abstract import Executor
from compiled_llm.runtime.executor.launch import is_engine_process, world_size
from compiled_llm.runtime.executor.supervision import run_node
from compiled_llm.runtime.executor.uniproc import UniProcExecutor


def make_executor(config: EngineConfig) -> Executor:
    """A MultiProcExecutor (rank 0 here, a process per other rank) when the run has several ranks."""
    if world_size(config) > 1:
        from compiled_llm.runtime.executor.multiproc import MultiProcExecutor

        return MultiProcExecutor(config)
    return UniProcExecutor(config)


__all__ = ["Executor", "UniProcExecutor", "make_executor", "is_engine_process", "run_node"]
