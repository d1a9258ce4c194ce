"""Paged KV-cache blocks: one pool per KV group (full-attention layers; sliding layers of one window),
with a prefix cache of hashed full blocks.

A sequence holds one block table per group. Sliding groups release blocks that fell out of the
window (the table keeps -1 there). Released blocks that carry a hash stay findable until the pool
needs them back (least recently released first), which is what makes prefix hits survive load.

Models with recurrent layers also need one state slot per sequence: it is taken with the sequence's
first blocks and given back with them (finish, abort, preemption), so a recomputed sequence restarts
from a zero state.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

from compiled_llm.runtime.sequence import Sequence

# None: full attention; W: sliding window W; (W, S): window W plus S sink tokens (StreamingLLM, whose
# groups keep the sink blocks and the window's and release the blocks between them).
Group = int | tuple[int, int] | None


def group_window(group: Group) -> int | None:
    return group[0] if isinstance(group, tuple) else group


def group_sinks(group: Group) -> int:
    return group[1] if isinstance(group, tuple) else 0


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    def allocate(self) -> int:
        block, _ = self.free.popitem(last=False)
        h = self.hash_of[block]
        if h is not None:  # evict its cached content
            del self.by_hash[h]
            self.hash_of[block] = None
        self.ref[block] = 1
        return block

    def touch(self, block: int) -> None:
        if self.ref[block] == 0:
            del self.free[block]
        self.ref[block] += 1

    def release(self, block: int) -> None:
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self.free[block] = None

    def register(self, block: int, h: bytes) -> None:
        if h not in self.by_hash and self.hash_of[block] is None:
            self.by_hash[h] = block
            self.hash_of[block] = h

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)


@dataclass
class PrefixPlan:
    num_blocks: int = 0  # prefix length in blocks served from the cache
    tables: dict[Group, list[int]] = field(default_factory=dict)

    def reactivated(self, pools: dict[Group, BlockPool]) -> dict[Group, int]:
        return {g: sum(1 for b in t if b >= 0 and pools[g].ref[b] == 0) for g, t in self.tables.items()}


def block_hash(parent: bytes | None, tokens: list[int], extra: bytes = b"") -> bytes:
    m = hashlib.sha256(parent or b"")
    m.update(b",".join(str(t).encode() for t in tokens))
    m.update(extra)
    return m.digest()[:16]


class BlockManager:
    def __init__(self, num_blocks: dict[Group, int], block_size: int, enable_prefix_caching: bool,
                 block_bytes: dict[Group, int] | None = None, num_state_slots: int = 0,
                 hash_prompt_only: bool = False):
        self.block_size = block_size
        # OmniKV: blocks holding generated tokens are not offered to the prefix cache (their KV came from
        # sparse decode steps, a fresh prefill of the same tokens would differ)
        self.hash_prompt_only = hash_prompt_only
        self.pools = {g: BlockPool(n) for g, n in num_blocks.items()}
        self.block_bytes = block_bytes or {g: 1 for g in num_blocks}
        self.prefix_caching = enable_prefix_caching
        self.uses_state = num_state_slots > 0
        self.free_state_slots = list(range(num_state_slots - 1, -1, -1))

    # ---- hashing -------------------------------------------------------------------------
    def update_hashes(self, seq: Sequence) -> None:
        bs = self.block_size
        while (len(seq.block_hashes) + 1) * bs <= len(seq.token_ids):
            b = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if b else None
            extra = seq.mm.block_extra(b, bs) if getattr(seq, "mm", None) is not None else b""  # media hashes
            seq.block_hashes.append(block_hash(parent, seq.token_ids[b * bs:(b + 1) * bs], extra))

    def _window_blocks(self, group: Group, next_pos: int) -> int:
        """First block index still needed by a query at next_pos."""
        if group is None:
            return 0
        return max(0, next_pos - group_window(group) + 1) // self.block_size

    def _sink_blocks(self, group: Group) -> int:
        """Leading blocks a StreamingLLM group always keeps (its attention sinks)."""
        return -(-group_sinks(group) // self.block_size)

    # ---- prefix cache ----------------------------------------------------------------------
    def plan_prefix(self, seq: Sequence) -> PrefixPlan:
        if not self.prefix_caching:
            return PrefixPlan()
        self.update_hashes(seq)
        limit = min(len(seq.block_hashes), (len(seq.token_ids) - 1) // self.block_size)
        hits = limit
        for g, pool in self.pools.items():
            if g is None:
                n = 0
                while n < hits and seq.block_hashes[n] in pool.by_hash:
                    n += 1
                hits = n
        for g, pool in self.pools.items():
            if g is not None:
                while hits > 0 and not all(seq.block_hashes[b] in pool.by_hash for b in self._needed(g, hits)):
                    hits -= 1
        plan = PrefixPlan(num_blocks=hits)
        for g, pool in self.pools.items():
            first, sinks = self._window_blocks(g, hits * self.block_size), self._sink_blocks(g)
            plan.tables[g] = [pool.by_hash[seq.block_hashes[b]] if b >= first or b < sinks else -1
                              for b in range(hits)]
        return plan

    def _needed(self, group: Group, hits: int) -> list[int]:
        """Blocks of a windowed group that a prefix of `hits` blocks must still have: the window's
        (and a StreamingLLM group's sink blocks)."""
        first = self._window_blocks(group, hits * self.block_size)
        return list(range(min(self._sink_blocks(group), first))) + list(range(first, hits))

    # ---- allocation ------------------------------------------------------------------------
    def _new_blocks(self, seq: Sequence, num_tokens: int, plan: PrefixPlan | None) -> dict[Group, int]:
        computed = plan.num_blocks * self.block_size if plan else seq.num_computed_tokens
        total = -(-(computed + num_tokens) // self.block_size)
        have = {g: len(plan.tables.get(g, [])) if plan else len(seq.block_tables.get(g, [])) for g in self.pools}
        return {g: max(0, total - have[g]) for g in self.pools}

    def can_allocate(self, seq: Sequence, num_tokens: int, plan: PrefixPlan | None = None) -> bool:
        need = self._new_blocks(seq, num_tokens, plan)
        if plan:
            for g, n in plan.reactivated(self.pools).items():
                need[g] += n
        if self.uses_state and seq.state_slot is None and not self.free_state_slots:
            return False
        return all(need[g] <= len(self.pools[g].free) for g in self.pools)

    def allocate(self, seq: Sequence, num_tokens: int, plan: PrefixPlan | None = None) -> None:
        """Give seq the blocks for num_tokens more tokens (after applying a prefix plan, if any)."""
        if plan is not None:
            for g, table in plan.tables.items():
                for b in table:
                    if b >= 0:
                        self.pools[g].touch(b)
                seq.block_tables[g] = list(table)
            seq.num_computed_tokens = seq.num_cached_tokens = plan.num_blocks * self.block_size
        if self.uses_state and seq.state_slot is None:
            seq.state_slot = self.free_state_slots.pop()
        need = self._new_blocks(seq, num_tokens, None)
        for g, n in need.items():
            table = seq.block_tables.setdefault(g, [])
            table.extend(self.pools[g].allocate() for _ in range(n))

    def commit(self, seq: Sequence) -> None:
        """After a step: register newly full blocks, release sliding blocks out of the window."""
        bs = self.block_size
        if self.prefix_caching:
            self.update_hashes(seq)
            full = min(seq.num_computed_tokens // bs, len(seq.block_hashes))
            if self.hash_prompt_only:
                full = min(full, seq.num_prompt_tokens // bs)
            for g, pool in self.pools.items():
                table = seq.block_tables.get(g, [])
                for b in range(min(full, len(table))):
                    if table[b] >= 0 and pool.hash_of[table[b]] is None:
                        pool.register(table[b], seq.block_hashes[b])
        for g, pool in self.pools.items():
            if g is None:
                continue
            table = seq.block_tables.get(g, [])
            for b in range(self._sink_blocks(g), min(self._window_blocks(g, seq.num_computed_tokens), len(table))):
                if table[b] >= 0:
                    pool.release(table[b])
                    table[b] = -1

    def free(self, seq: Sequence) -> None:
        """Release every block; the tail goes last so that it is evicted last."""
        for g, table in seq.block_tables.items():
            for b in reversed(table):
                if b >= 0:
                    self.pools[g].release(b)
        seq.block_tables = {}
        if seq.state_slot is not None:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = None

    # ---- stats ---------------------------------------------------------------------------
    def usage(self) -> float:
        total = sum(p.num_blocks * self.block_bytes[g] for g, p in self.pools.items())
        used = sum(p.num_used * self.block_bytes[g] for g, p in self.pools.items())
        return used / total if total else 0.0

    def num_free_blocks(self) -> int:
        return sum(len(p.free) for p in self.pools.values())

    def num_total_blocks(self) -> int:
        return sum(p.num_blocks for p in self.pools.values())
