"""Per-sequence recurrent state for linear-attention layers (conv window, delta-rule matrix).

A model with recurrent layers declares one StateSpec per layer (`model.state_specs()`). The runner
allocates, for every named state of every layer, a tensor [num_slots, *shape] and gives each running
sequence one slot for its lifetime. Each step it puts a StateMetadata into the forward context
(`ctx.extra["state"]`) saying which slot each sequence of the batch uses and whether the sequence
carries state from an earlier step (False on its first chunk: the ops start from zeros then).
Tokens of sequence i are query_start_loc[i]:query_start_loc[i + 1] of the flat token dimension.

The batch layout (StateLayout) is built once per step on the host and reaches the device in one pinned,
non-blocking copy: the state ops read only its device tensors (and host ints that choose a kernel path),
so they never wait for the stream and a CUDA graph can replay them. A whole-graph decode capture reads
static copies of those tensors (`StateMetadata.staged`), refreshed before each replay.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from compiled_llm.ops.context import get_forward_context
from compiled_llm.ops.upload import to_device_packed

STATE_KEY = "state"
# tokens per chunk of the Triton delta rule's chunked prefill: the step's chunk plan is built with the layout
DELTA_RULE_CHUNK = 64
# (slots, has initial state, query start offsets) of the steps whose launches the recurrent kernels' JIT warm-up
# builds: decode of one and of two sequences (integer arguments specialise on 1), one prefill and two
WARM_LAYOUTS = (([0], [True], [0, 1]), ([0, 1], [True, False], [0, 1, 2]), ([0], [False], [0, 80]),
                ([0, 1], [True, False], [0, 40, 100]))


@dataclass
class StateSpec:
    layer_idx: int
    shapes: dict[str, tuple[int, ...]]  # state name -> shape of one slot
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # absent: the serving dtype

    def dtype(self, name: str, default: torch.dtype) -> torch.dtype:
        return self.dtypes.get(name) or default

    def slot_bytes(self, default: torch.dtype) -> int:
        total = 0
        for name, shape in self.shapes.items():
            n = 1
            for d in shape:
                n *= d
            total += n * torch.empty((), dtype=self.dtype(name, default)).element_size()
        return total


def plan_chunks(loc: list[int], chunk: int) -> tuple[list[int], list[int], list[int]]:
    """Chunk starts and ends (the sequence's end) in token order, and each sequence's first chunk index."""
    starts, ends, first = [], [], [0]
    for a, b in zip(loc[:-1], loc[1:]):
        starts.extend(range(a, b, chunk))
        ends.extend([b] * len(range(a, b, chunk)))
        first.append(len(starts))
    return starts, ends, first


@dataclass
class StateLayout:
    """Which tokens, slots and initial states the sequences of one step have: host lists (the reference's
    per-sequence prefill loop, kernel-path choices) and their int32 device copies in `tensors`:
    query_start_loc [seqs + 1], slots and has_initial_state [seqs]; on steps that are not decode also
    seq_of [tokens] (each token's sequence), single (the one-token sequences) and the delta rule's chunk plan
    chunk_starts, chunk_ends [chunks], chunk_first [seqs + 1]."""

    slots: list[int]
    has_initial_state: list[bool]
    query_start_loc: list[int]
    max_query_len: int  # longest sequence of the step (host: picks the recurrent or chunked kernel)
    # token t, if any, is sequence t's only token (a decode step; whole-graph padding adds empty sequences)
    decode: bool
    tensors: dict[str, torch.Tensor]
    chunk: int = DELTA_RULE_CHUNK
    num_chunks: int = 0

    @classmethod
    def build(cls, slots: list[int], has_initial_state: list[bool], query_start_loc: list[int],
              device: torch.device | str, chunk: int = DELTA_RULE_CHUNK) -> "StateLayout":
        """Once per step, on the host. On CUDA the upload goes through pinned memory without a sync (a plain
        torch.tensor(..., device=cuda) waits for the stream, the previous step included)."""
        lens = [b - a for a, b in zip(query_start_loc[:-1], query_start_loc[1:])]
        max_len = max(lens, default=0)
        decode = bool(lens) and all(n == 1 for n in lens)
        parts = {"query_start_loc": query_start_loc, "slots": slots,
                 "has_initial_state": [int(b) for b in has_initial_state]}
        num_chunks = 0
        if not decode:
            starts, ends, first = plan_chunks(query_start_loc, chunk)
            num_chunks = len(starts)
            parts.update(seq_of=[i for i, n in enumerate(lens) for _ in range(n)],
                         single=[i for i, n in enumerate(lens) if n == 1],
                         chunk_starts=starts, chunk_ends=ends, chunk_first=first)
        # one copy on CUDA, each part on a 16-byte boundary (ops/upload.py): Triton keys a kernel by its pointers'
        # alignment, so a part whose offset moved with the batch's size would build another variant mid-serving
        # (a 3-sequence decode put `slots` on a boundary that the 1- and 2-sequence warm-up layouts did not)
        tensors = dict(zip(parts, to_device_packed([(v, torch.int32) for v in parts.values()], device)))
        return cls(list(slots), list(has_initial_state), list(query_start_loc), max_len, decode, tensors, chunk,
                   num_chunks)

    @property
    def num_seqs(self) -> int:
        return len(self.slots)

    def single_rows(self) -> tuple[list[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
        """The sequences with one token this step, for one batched state update: their indices and, on the
        device, their token rows (int64), state slots (int64) and whether each carries state (bool)."""
        t = self.tensors
        if self.decode:
            single = list(range(self.num_seqs))
            rows, slots, init = t["query_start_loc"][:-1], t["slots"], t["has_initial_state"]
        else:
            single = [i for i in range(self.num_seqs) if self.query_start_loc[i + 1] - self.query_start_loc[i] == 1]
            if not single:
                return single, None
            pick = t["single"]
            rows = t["query_start_loc"].index_select(0, pick)
            slots, init = t["slots"].index_select(0, pick), t["has_initial_state"].index_select(0, pick)
        return single, (rows.long(), slots.long(), init != 0)

    def prefill_spans(self, skip: list[int]):
        """(slot, start, end, carries state) of every other sequence with tokens this step."""
        done = set(skip)
        for i, slot in enumerate(self.slots):
            start, end = self.query_start_loc[i], self.query_start_loc[i + 1]
            if i not in done and end > start:
                yield slot, start, end, self.has_initial_state[i]


@dataclass
class StateMetadata:
    caches: dict[int, dict[str, torch.Tensor]]  # layer -> state name -> [num_slots, *shape]
    layout: StateLayout
    # prefix caching of hybrid models: (source slot, destination slot) state copies the runner makes before
    # the forward (a cached snapshot into a sequence's slot) and after it (a sequence's slot into a snapshot);
    # outside the forward, so never inside a captured graph
    copies_before: list[tuple[int, int]] = field(default_factory=list)
    copies_after: list[tuple[int, int]] = field(default_factory=list)

    @property
    def slots(self) -> list[int]:
        return self.layout.slots

    @property
    def has_initial_state(self) -> list[bool]:
        return self.layout.has_initial_state

    @property
    def query_start_loc(self) -> list[int]:
        return self.layout.query_start_loc

    def staged(self, size: int, buffers: dict[str, torch.Tensor],
               copies: list | None = None) -> "StateMetadata":
        """This decode step padded to `size` sequences in static buffers (made in `buffers` on first use): what
        a whole-graph decode capture reads and each replay refreshes, with device-to-device copies outside the
        graph. Padded sequences have no token (their offsets repeat the last), slot 0 and no initial state:
        the kernels skip them. copies: where given, the (buffer, source) pairs are appended to it for the
        caller to copy (with the step's other inputs, in one launch per dtype) instead of copied here."""
        lay = self.layout
        if not lay.decode:
            raise ValueError("only a decode step replays a whole-graph capture")
        pad, last = size - lay.num_seqs, lay.query_start_loc[-1]
        if not buffers:
            dev = lay.tensors["slots"].device
            buffers.update(query_start_loc=torch.zeros(size + 1, dtype=torch.int32, device=dev),
                           slots=torch.zeros(size, dtype=torch.int32, device=dev),
                           has_initial_state=torch.zeros(size, dtype=torch.int32, device=dev))
        for name, buf in buffers.items():
            src = lay.tensors[name]
            if copies is None:
                buf[:src.numel()].copy_(src, non_blocking=True)
            else:
                copies.append((buf[:src.numel()], src))
            buf[src.numel():].fill_(last if name == "query_start_loc" else 0)
        layout = StateLayout(lay.slots + [0] * pad, lay.has_initial_state + [False] * pad,
                             lay.query_start_loc + [last] * pad, lay.max_query_len, True, dict(buffers), lay.chunk)
        return dataclasses.replace(self, layout=layout)


def allocate_states(specs: dict[int, StateSpec], num_slots: int, dtype: torch.dtype,
                    device: torch.device) -> dict[int, dict[str, torch.Tensor]]:
    return {i: {name: torch.zeros((num_slots, *shape), dtype=s.dtype(name, dtype), device=device)
                for name, shape in s.shapes.items()}
            for i, s in specs.items()}


def copy_state_slots(caches: dict[int, dict[str, torch.Tensor]], pairs: list[tuple[int, int]]) -> None:
    """Copies every state of every layer from slot src to slot dst for each (src, dst) pair (on the device,
    in stream order with the forward passes around it)."""
    if not pairs:
        return
    index: dict = {}
    for layer in caches.values():
        for t in layer.values():
            if t.device not in index:
                host = torch.tensor(list(zip(*pairs)), dtype=torch.long)  # [2, pairs]: sources, destinations
                if t.device.type == "cuda":  # no host sync (as the runner's other step inputs)
                    host = host.pin_memory()
                index[t.device] = host.to(t.device, non_blocking=True)
            src, dst = index[t.device]
            t.index_copy_(0, dst, t.index_select(0, src))


def get_state_metadata() -> StateMetadata:
    ctx = get_forward_context()
    meta = ctx.extra.get(STATE_KEY)
    if meta is None:
        raise RuntimeError("a recurrent layer ran without state metadata in the forward context")
    return meta
