"""Continuous batching: each step takes running sequences first (decodes and unfinished prefill
chunks), then admits waiting ones, all under one token budget. When blocks run out the most
recently admitted sequence is preempted and later recomputed (its cached blocks may still hit). Under the
"priority" policy every one of those orders is (priority, arrival) instead, and the lowest-priority running
sequence is the one preempted.

Hybrid models with prefix caching: a prefill chunk that would cross one of the prompt's snapshot points
(BlockManager.snapshot_cuts: the end of its last full block before the last token; where its cached KV
ended past its snapshot hit) is cut there, and a step that ends on a snapshot point carries
the slot its state is copied to (ScheduledSeq.save_state); an admitted sequence with a prefix hit carries
the snapshot its state starts from (load_state)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from compiled_llm.multimodal.inputs import clamp_chunk
from compiled_llm.runtime.block_manager import BlockManager
from compiled_llm.runtime.sequence import Sequence, Status


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens computed this step, starting at seq.num_computed_tokens
    load_state: int | None = None  # hybrid prefix hit: copy this snapshot slot into the sequence's slot first
    save_state: int | None = None  # copy the sequence's state into this snapshot slot after the step

    @property
    def is_decode(self) -> bool:
        """One token past the prompt (a decode row), not a prompt chunk."""
        return self.num_tokens == 1 and self.seq.num_computed_tokens >= self.seq.num_prompt_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, policy: str = "fcfs"):
        """policy: "fcfs" (arrival order; a preempted sequence goes back to the front; the latest admitted is the
        first preempted) or "priority" (Sequence.priority, lower first, then arrival: the waiting queue, the order
        running sequences take the step's budget, and preemption, which takes the lowest-priority one first)."""
        self.bm = block_manager
        self.by_priority = policy == "priority"
        self.max_num_seqs = max_num_seqs
        self.token_budget = max_num_batched_tokens
        self.chunked = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.prompt_tokens_computed = 0  # prompt tokens scheduled for computing (not served from the cache)

    def add(self, seq: Sequence) -> None:
        if self.by_priority:
            self._insert_waiting(seq)
        else:
            self.waiting.append(seq)

    @staticmethod
    def _rank(seq: Sequence) -> tuple:
        return seq.priority, seq.arrival_time, seq.seq_id

    def _insert_waiting(self, seq: Sequence) -> None:
        """Into the waiting queue at its (priority, arrival) place."""
        key = self._rank(seq)
        i = next((k for k, s in enumerate(self.waiting) if self._rank(s) > key), len(self.waiting))
        self.waiting.insert(i, seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.status = Status.WAITING
        seq.num_computed_tokens = 0
        if self.by_priority:
            self._insert_waiting(seq)
        else:
            self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.token_budget
        out: list[ScheduledSeq] = []
        preempted = False
        for seq in sorted(self.running, key=self._rank) if self.by_priority else list(self.running):
            if seq not in self.running or budget == 0:
                continue
            start = seq.num_computed_tokens
            n = self._cut(seq, start, clamp_chunk(seq, start, min(seq.num_uncomputed, budget)))  # media spans whole
            if n == 0:
                continue
            while not self.bm.can_allocate(seq, n):
                victim = max(self.running, key=self._rank) if self.by_priority else self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self.bm.allocate(seq, n)
                out.append(self._scheduled(seq, n))
                budget -= n

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            plan = self.bm.plan_prefix(seq)
            cached = plan.num_blocks * self.bm.block_size
            n = clamp_chunk(seq, cached, min(len(seq) - cached, budget))
            if n == 0:
                break
            if n < len(seq) - cached and not self.chunked:
                break
            n = self._cut(seq, cached, n)
            if not self.bm.can_allocate(seq, n, plan):
                if not self.running and not out:
                    raise RuntimeError(f"the KV cache cannot hold a sequence of {len(seq)} tokens; "
                                       "give the cache more memory or lower max_model_len")
                break
            self.waiting.popleft()
            self.prefix_queries += len(seq)
            self.prefix_hits += cached
            self.bm.allocate(seq, n, plan)
            seq.status = Status.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.time()
            self.running.append(seq)
            out.append(self._scheduled(seq, n, plan.state_from))
            budget -= n
        return out

    def _cut(self, seq: Sequence, start: int, n: int) -> int:
        """n, or fewer tokens so that the chunk ends at a snapshot point of the prompt (hybrid prefix caching)."""
        for cut in sorted(self.bm.snapshot_cuts(seq)):
            if start < cut < start + n and clamp_chunk(seq, start, cut - start) == cut - start:
                return cut - start
        return n

    def _scheduled(self, seq: Sequence, n: int, load_state: int | None = None) -> ScheduledSeq:
        start = seq.num_computed_tokens
        self.prompt_tokens_computed += max(0, min(start + n, seq.num_prompt_tokens) - start)
        return ScheduledSeq(seq, n, load_state, self.bm.reserve_snapshot(seq, n))

    def advance(self, batch: list[ScheduledSeq]) -> list[Sequence]:
        """After the step's forward: each sequence's computed tokens move on and its newly full blocks are
        committed (hashed for the prefix cache). Returns the sequences that completed their tokens this
        step, in batch order: the ones that sample a token. A sequence that ended while the step ran (async
        scheduling: the step before it stopped it; or an abort) is left alone and not returned."""
        batch = [item for item in batch if not item.seq.is_finished]
        done = [item.seq for item in batch if item.seq.num_computed_tokens + item.num_tokens == len(item.seq)]
        for item in batch:
            item.seq.num_computed_tokens += item.num_tokens
            self.bm.commit(item.seq)
        return done

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)
        seq.status = Status.FINISHED
