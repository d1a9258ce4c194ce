"""The executor: what the engine drives to run a step, whether the model lives in this process or is
split over ranks in several. The engine sees only this interface; `make_executor` picks the kind.

Every executor keeps this process's own ModelRunner in `runner` (rank 0's shard when there are several
ranks): the facts the engine needs before it can plan (the model's config, device, recurrent state,
sparse KV) are the same on every rank and are read from it. Tests and tools reach the model through it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from compiled_llm.runtime.heap import freeze_startup_heap
from compiled_llm.runtime.model_runner import ModelRunner
from compiled_llm.runtime.scheduler import ScheduledSeq


class Executor(ABC):
    runner: ModelRunner

    # ---- facts of the model (the same on every rank) -----------------------------------------
    @property
    def model_config(self):
        return self.runner.model_config

    @property
    def model(self):
        """This process's model (rank 0's shard): the one whose media towers admission may ask about."""
        return self.runner.model

    @property
    def device(self) -> torch.device:
        """Where rank 0 samples (and where seeded requests' generators live)."""
        return self.runner.device

    @property
    def state_specs(self) -> dict:
        return self.runner.state_specs

    @property
    def num_state_slots(self) -> int:
        return self.runner.num_state_slots

    @property
    def num_snapshot_slots(self) -> int:
        """Of the state slots, those that hold prefix-cache snapshots (the last ones)."""
        return self.runner.num_snapshot_slots

    @property
    def sparse(self):
        """The sparse-KV policy (runtime/sparse_kv.py), or None."""
        return self.runner.sparse

    # ---- KV cache ------------------------------------------------------------------------------
    @abstractmethod
    def group_block_bytes(self) -> dict[int | None, int]:
        """Bytes one block takes across all layers (of all ranks) of each KV group."""

    @abstractmethod
    def plan_blocks(self, max_model_len: int) -> dict[int | None, int]:
        """Blocks per KV group that every rank's memory holds."""

    @abstractmethod
    def allocate_kv_cache(self, num_blocks: dict[int | None, int]) -> None:
        """Allocates the caches (and warms the compiler up) on every rank."""

    # ---- steps ---------------------------------------------------------------------------------
    @abstractmethod
    def execute(self, batch: list[ScheduledSeq], pending=None) -> torch.Tensor:
        """float32 logits [sequences that complete their tokens this step, vocab], on rank 0.
        Raises EngineDeadError when a rank is gone. pending (sampler.PendingTokens): the previous step's
        tokens still on the device, for an executor that supports async scheduling."""

    supports_async_scheduling = False  # the next step may launch before the last one's tokens reach the host
    async_refusal = "this executor steps synchronously"  # why not, when it may not (the warning says it)

    def register_media(self, request_id: str, mm) -> None:
        """Makes an admitted request's media available to every rank that runs a tower. One process: the
        sequence carries its media, nothing to do. ValueError if a rank refused it (nothing kept)."""

    def release_media(self, request_ids: list[str]) -> None:
        """Forgets ended requests' media on every rank."""

    # ---- health and shutdown -------------------------------------------------------------------
    def is_healthy(self) -> bool:
        return True

    def freeze_heap(self) -> None:
        """Start-up is over: freezes the heap of this process (runtime/heap.py) and of every other rank's."""
        freeze_startup_heap()

    def shutdown(self) -> None:
        """Stops what the executor started (worker processes); safe to call twice."""
