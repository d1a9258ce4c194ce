"""Per-sequence recurrent state for linear-attention layers (conv window, delta-rule matrix).

A model with recurrent layers declares one StateSpec per layer (`model.state_specs()`). The runner
allocates, for every named state of every layer, a tensor [num_slots, *shape] and gives each running
sequence one slot for its lifetime. Each step it puts a StateMetadata into the forward context
(`ctx.extra["state"]`) saying which slot each sequence of the batch uses and whether the sequence
carries state from an earlier step (False on its first chunk: the ops start from zeros then).
Tokens of sequence i are query_start_loc[i]:query_start_loc[i + 1] of the flat token dimension.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from compiled_llm.ops.context import get_forward_context

STATE_KEY = "state"


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


@dataclass
class StateMetadata:
    caches: dict[int, dict[str, torch.Tensor]]  # layer -> state name -> [num_slots, *shape]
    slots: list[int]  # per sequence of the batch
    has_initial_state: list[bool]  # per sequence: False on its first chunk
    query_start_loc: list[int]  # num_seqs + 1 offsets into the token dimension
    # prefix caching of hybrid models: (source slot, destination slot) state copies the runner makes before
    # the forward (a cached snapshot into a sequence's slot) and after it (a sequence's slot into a snapshot)
    copies_before: list[tuple[int, int]] = field(default_factory=list)
    copies_after: list[tuple[int, int]] = field(default_factory=list)
    _device_tensors: dict = field(default_factory=dict, repr=False)

    def device_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(query_start_loc int32, slots int32, has_initial_state int32) on device, built once per step."""
        key = str(device)
        if key not in self._device_tensors:
            self._device_tensors[key] = tuple(torch.tensor(x, dtype=torch.int32, device=device) for x in (
                self.query_start_loc, self.slots, [int(b) for b in self.has_initial_state]))
        return self._device_tensors[key]


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


def decode_rows(slots: list[int], has_initial_state: list[bool], query_start_loc: list[int], device):
    """The sequences that have one token this step, for one batched state update: their indices and,
    as tensors, their token rows, state slots and whether each carries state (else it starts at zero)."""
    single = [i for i in range(len(slots)) if query_start_loc[i + 1] - query_start_loc[i] == 1]
    if not single:
        return single, None
    rows = torch.tensor([query_start_loc[i] for i in single], device=device)
    slot_t = torch.tensor([slots[i] for i in single], device=device)
    keep = torch.tensor([has_initial_state[i] for i in single], device=device)
    return single, (rows, slot_t, keep)


def prefill_spans(slots: list[int], has_initial_state: list[bool], query_start_loc: list[int], skip: list[int]):
    """(slot, start, end, carries state) of every other sequence with tokens this step."""
    done = set(skip)
    for i, slot in enumerate(slots):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        if i not in done and end > start:
            yield slot, start, end, has_initial_state[i]
