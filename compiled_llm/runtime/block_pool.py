"""The blocks of one KV group: reference counts, the free list (least recently released first) and the
prefix-cache index of hashed full blocks; the hash chain; what a prefix hit brings back. BlockManager
(runtime/block_manager.py) holds one pool per group."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

# None: full attention; W: sliding window W; (W, S): window W plus S sink tokens (StreamingLLM, whose
# groups keep the sink blocks and the window's and release the blocks between them).
Group = int | tuple[int, int] | None


def group_window(group: Group) -> int | None:
    return group[0] if isinstance(group, tuple) else group


def group_sinks(group: Group) -> int:
    return group[1] if isinstance(group, tuple) else 0


class BlockPool:
    def __init__(self, num_blocks: int, on_evict=None):
        self.num_blocks = num_blocks
        self.on_evict = on_evict  # called with the hash of an evicted block
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
            if self.on_evict is not None:
                self.on_evict(h)
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
    state_from: int | None = None  # hybrid models: the snapshot slot holding the state at the prefix's end
    kv_blocks: int = 0  # hybrid models: blocks whose full-attention KV is cached (may pass num_blocks)
    tables: dict[Group, list[int]] = field(default_factory=dict)

    def reactivated(self, pools: dict[Group, BlockPool]) -> dict[Group, int]:
        return {g: sum(1 for b in t if b >= 0 and pools[g].ref[b] == 0) for g, t in self.tables.items()}


def block_hash(parent: bytes | None, tokens: list[int], extra: bytes = b"") -> bytes:
    """A full block's key: its tokens (8 bytes each) after its parent block's key, then `extra` (media hashes).
    The ids go in as one machine-word array: joining their decimal strings took ~1.5 ms of an 8K prompt's
    scheduling (512 blocks), ~0.6 ms this way."""
    m = hashlib.sha256(parent or b"")
    m.update(array("q", tokens).tobytes())
    m.update(extra)
    return m.digest()[:16]
