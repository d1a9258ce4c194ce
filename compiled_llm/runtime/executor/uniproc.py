"""The one-process executor: the whole model in this process, the engine's calls go to its ModelRunner."""

from __future__ import annotations

import torch

from compiled_llm.config import EngineConfig
from compiled_llm.runtime.executor.abstract import Executor
from compiled_llm.runtime.model_runner import ModelRunner
from compiled_llm.runtime.scheduler import ScheduledSeq


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig):
        self.runner = ModelRunner(config)
        self._released = False

    def shutdown(self) -> None:
        """Releases the runner's CUDA graphs, KV cache, pinned host memory and staging buffers (the engine's
        shutdown, or its deletion), so that another engine in this process finds them free."""
        if not self._released:
            self._released = True
            self.runner.release()

    def group_block_bytes(self) -> dict[int | None, int]:
        return self.runner.group_block_bytes()

    def plan_blocks(self, max_model_len: int) -> dict[int | None, int]:
        return self.runner.plan_blocks(max_model_len)

    def allocate_kv_cache(self, num_blocks: dict[int | None, int]) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    supports_async_scheduling = True

    def execute(self, batch: list[ScheduledSeq], pending=None) -> torch.Tensor:
        return self.runner.execute(batch, pending)
