"""Paged KV-cache blocks: one pool per KV group (full-attention layers; sliding layers of one window),
with a prefix cache of hashed full blocks.

A sequence holds one block table per group. Sliding groups release blocks that fell out of the
window (the table keeps -1 there). Released blocks that carry a hash stay findable until the pool
needs them back (least recently released first), which is what makes prefix hits survive load.

Models with recurrent layers also need one state slot per sequence: it is taken with the sequence's
first blocks and given back with them (finish, abort, preemption), so a recomputed sequence restarts
from a zero state.

Prefix caching for such models (vLLM's "align" mode, SGLang's MambaRadixCache): cached KV blocks are of no use
without the recurrent state at the end of the prefix, so the manager also keeps state snapshots, in a bounded
pool of extra state slots, keyed by the hash of the block they end at (least recently used evicted first;
dropped with their block's KV). A step that ends on a block boundary worth keeping reserves a snapshot slot:
the last full block before the prompt's last token and, when the prompt's cached KV reaches further than any
snapshot, the end of that cached KV (where prompts branch off a shared prefix) -- the scheduler cuts prefill
chunks at both -- or a block boundary that a step computing all known tokens ends on (decode; a sequence
keeps only its latest such "tail" snapshot, which is what a next chat turn hits; tails push only tails out
of a full pool). The runner copies the
sequence's state into the reserved slot after the forward; commit registers it under the block's hash. A
prefix hit then needs a snapshot at its last block (and its attention blocks): the snapshot is copied into
the sequence's slot before its first forward.
"""

from __future__ import annotations

from collections import OrderedDict

from compiled_llm.runtime.block_pool import BlockPool, Group, PrefixPlan, block_hash, group_sinks, group_window
from compiled_llm.runtime.sequence import Sequence

class BlockManager:
    def __init__(self, num_blocks: dict[Group, int], block_size: int, enable_prefix_caching: bool,
                 block_bytes: dict[Group, int] | None = None, num_state_slots: int = 0,
                 hash_prompt_only: bool = False, num_snapshot_slots: int = 0):
        self.block_size = block_size
        # OmniKV: blocks holding generated tokens are not offered to the prefix cache (their KV came from
        # sparse decode steps, a fresh prefill of the same tokens would differ)
        self.hash_prompt_only = hash_prompt_only
        self.block_bytes = block_bytes or {g: 1 for g in num_blocks}
        self.uses_state = num_state_slots > 0
        # state slots [0, seq_slots) belong to running sequences, the rest hold prefix snapshots
        seq_slots = num_state_slots - num_snapshot_slots
        self.free_state_slots = list(range(seq_slots - 1, -1, -1))
        # a model with recurrent state has prefix hits only where a state snapshot exists
        self.prefix_caching = enable_prefix_caching and (not self.uses_state or num_snapshot_slots > 0)
        self.snapshotting = self.prefix_caching and self.uses_state
        self.num_snapshot_slots = num_snapshot_slots if self.snapshotting else 0
        self.free_snapshot_slots = list(range(num_state_slots - 1, seq_slots - 1, -1)) if self.snapshotting else []
        self.snapshots: OrderedDict[bytes, int] = OrderedDict()  # block hash -> slot, least recently used first
        self.tail_hashes: set[bytes] = set()  # of those, the tails (taken in decode, not at a prompt's cut)
        self.snapshots_saved = 0
        self.snapshot_hits = 0
        evict = self._drop_snapshot if self.snapshotting else None
        self.pools = {g: BlockPool(n, evict if g is None else None) for g, n in num_blocks.items()}

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
        if not self.prefix_caching or seq.params.prompt_logprobs is not None:  # every prompt token is computed
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
        kv_blocks = hits
        while hits > 0 and not self._usable(seq, hits):
            hits -= 1
        plan = PrefixPlan(num_blocks=hits, kv_blocks=kv_blocks)
        if self.snapshotting:
            if hits:
                plan.state_from = self.snapshots[seq.block_hashes[hits - 1]]
            # the cached KV reaches past the snapshot: keep one there (the scheduler cuts the chunk)
            seq.snapshot_branch = kv_blocks * self.block_size if kv_blocks > hits else 0
        for g, pool in self.pools.items():
            first, sinks = self._window_blocks(g, hits * self.block_size), self._sink_blocks(g)
            plan.tables[g] = [pool.by_hash[seq.block_hashes[b]] if b >= first or b < sinks else -1
                              for b in range(hits)]
        return plan

    def _usable(self, seq: Sequence, hits: int) -> bool:
        """Whether a prefix of `hits` blocks (whose full-group blocks are cached) can be served: each sliding
        group has its needed blocks and, for a model with recurrent state, a snapshot ends it."""
        if self.snapshotting and seq.block_hashes[hits - 1] not in self.snapshots:
            return False
        return all(all(seq.block_hashes[b] in pool.by_hash for b in self._needed(g, hits))
                   for g, pool in self.pools.items() if g is not None)

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
                seq.released_to.pop(g, None)  # a new table: commit looks from the sinks again
            seq.num_computed_tokens = seq.num_cached_tokens = plan.num_blocks * self.block_size
            if plan.state_from is not None:
                self.snapshots.move_to_end(seq.block_hashes[plan.num_blocks - 1])
                self.snapshot_hits += 1
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
        if seq.pending_snapshot is not None:
            self._register_snapshot(seq)
        for g, pool in self.pools.items():
            if g is None:
                continue
            table = seq.block_tables.get(g, [])
            # blocks before released_to[g] are released already: each step looks at the blocks that just left
            # the window, not at every block since the sinks (at 64K tokens that was 4K blocks a sequence a
            # windowed group a step, milliseconds of host time)
            lo = max(self._sink_blocks(g), seq.released_to.get(g, 0))
            hi = min(self._window_blocks(g, seq.num_computed_tokens), len(table))
            for b in range(lo, hi):
                if table[b] >= 0:
                    pool.release(table[b])
                    table[b] = -1
            if hi > lo:
                seq.released_to[g] = hi

    def free(self, seq: Sequence) -> None:
        """Release every block; the tail goes last so that it is evicted last."""
        for g, table in seq.block_tables.items():
            for b in reversed(table):
                if b >= 0:
                    self.pools[g].release(b)
        seq.block_tables = {}
        seq.released_to = {}
        if seq.pending_snapshot is not None:  # its step will not be committed (abort, preemption)
            self.free_snapshot_slots.append(seq.pending_snapshot[0])
            seq.pending_snapshot = None
        if seq.state_slot is not None:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = None

    # ---- recurrent-state snapshots (hybrid models) -------------------------------------------
    def snapshot_cuts(self, seq: Sequence) -> tuple[int, ...]:
        """Where prefill chunks should end so that snapshots can be taken there (block boundaries): where the
        prompt's cached KV ended past its snapshot hit at admission, and the end of the last full block
        before the prompt's last token."""
        if not self.snapshotting:
            return ()
        return seq.snapshot_branch, (seq.num_prompt_tokens - 1) // self.block_size * self.block_size

    def reserve_snapshot(self, seq: Sequence, num_tokens: int) -> int | None:
        """Called when seq is scheduled for num_tokens more tokens: the snapshot slot its state goes to
        after this step (the runner copies it), or None. Snapshots are taken where the step ends on a block
        boundary that is the prompt's cut point (snapshot_cut) or that ends all tokens known so far."""
        if not self.snapshotting:
            return None
        end = seq.num_computed_tokens + num_tokens
        bs = self.block_size
        if end % bs or end == 0:
            return None
        if end not in self.snapshot_cuts(seq) and (end != len(seq) or self.hash_prompt_only):
            return None
        n = end // bs
        if len(seq.block_hashes) >= n and seq.block_hashes[n - 1] in self.snapshots:
            return None  # already kept (one seen now; a placeholder token's block is checked at commit)
        tail, old = end not in self.snapshot_cuts(seq), seq.tail_snapshot
        if tail and old is not None and self.snapshots.get(old[0]) == old[1]:
            # a newer tail takes the slot of the sequence's last one: a sequence holds one tail at a time
            seq.tail_snapshot = None
            self._drop_snapshot(old[0])
            slot = self.free_snapshot_slots.pop()
        elif self.free_snapshot_slots:
            slot = self.free_snapshot_slots.pop()
        else:  # the least recently used snapshot goes; a tail only pushes out tails (prompt snapshots stay)
            victim = next((h for h in self.snapshots if h in self.tail_hashes or not tail), None)
            if victim is None:
                return None
            self._drop_snapshot(victim)
            slot = self.free_snapshot_slots.pop()
        seq.pending_snapshot = (slot, n)
        return slot

    def _register_snapshot(self, seq: Sequence) -> None:
        slot, n = seq.pending_snapshot
        seq.pending_snapshot = None
        h = seq.block_hashes[n - 1] if len(seq.block_hashes) >= n else None
        if h is None or h in self.snapshots:
            self.free_snapshot_slots.append(slot)
            return
        self.snapshots[h] = slot
        self.snapshots_saved += 1
        if n * self.block_size not in self.snapshot_cuts(seq):  # a tail snapshot: the sequence keeps its latest only
            self.tail_hashes.add(h)
            old, seq.tail_snapshot = seq.tail_snapshot, (h, slot)
            if old is not None and self.snapshots.get(old[0]) == old[1]:
                self._drop_snapshot(old[0])

    def _drop_snapshot(self, h: bytes) -> None:
        self.tail_hashes.discard(h)
        slot = self.snapshots.pop(h, None)
        if slot is not None:
            self.free_snapshot_slots.append(slot)

    def snapshot_stats(self) -> dict:
        return {"prefix_state_snapshots": len(self.snapshots), "prefix_state_snapshot_slots": self.num_snapshot_slots,
                "prefix_state_snapshot_hits": self.snapshot_hits, "prefix_state_snapshots_saved": self.snapshots_saved}

    # ---- stats ---------------------------------------------------------------------------
    def usage(self) -> float:
        total = sum(p.num_blocks * self.block_bytes[g] for g, p in self.pools.items())
        used = sum(p.num_used * self.block_bytes[g] for g, p in self.pools.items())
        return used / total if total else 0.0

    def num_free_blocks(self) -> int:
        return sum(len(p.free) for p in self.pools.values())

    def num_total_blocks(self) -> int:
        return sum(p.num_blocks for p in self.pools.values())
