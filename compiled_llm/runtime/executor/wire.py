"""What the driver sends the other ranks each step: the prepared inputs, built once on rank 0 and run by
every rank. The wire carries CPU tensors (a gloo broadcast); each rank moves them to its own device.

Under async scheduling the step is sent before the previous step's sampled tokens are known on the host: it
names where they go (fill_at) and rank 0 broadcasts them over the tensor-parallel group on the device
(worker.py `RankWorker.execute`), so no rank waits for them on the host."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from compiled_llm.ops.context import AttentionMetadata
from compiled_llm.ops.state import STATE_KEY
from compiled_llm.runtime.prompt_logprobs import PromptRows


@dataclass
class MediaRefs:
    """A step's media, by reference: each first-stage rank runs the towers on its registered copy."""

    rows: torch.Tensor  # step rows that take soft tokens, in the order of refs
    refs: list[tuple[str, int, int, int]]  # (request id, item index, first soft token, end)
    done: list[str]  # requests whose prompt ends in this step: drop their cached soft tokens after it


@dataclass
class StepInput:
    """One prepared step, as every rank runs it."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    rows: torch.Tensor  # token rows whose logits are wanted
    extra: dict  # forward-context extras (no per-rank state in them: see wire_extras)
    media: MediaRefs | None = None
    # async scheduling: input_ids rows that take the previous step's sampled tokens, and those tokens' rows in
    # rank 0's sampled batch (rank 0 gathers them and broadcasts them to the group, on the device)
    fill_at: torch.Tensor | None = None
    fill_from: torch.Tensor | None = None
    prompt: PromptRows | None = None  # prompt-logprob rows after the sampled ones (runtime/prompt_logprobs.py)


def wire_extras(extra: dict) -> dict:
    """The forward-context extras as the wire carries them: the recurrent-state metadata (slots, offsets)
    without the driver's state caches. Each rank keeps the state of its own heads (rank_extras puts them
    back); sent along, the driver's would be pickled every step and read by the other ranks as theirs."""
    meta = extra.get(STATE_KEY)
    return extra if meta is None else {**extra, STATE_KEY: dataclasses.replace(meta, caches={})}


def rank_extras(extra: dict, state_caches: dict) -> dict:
    """A step's extras as this rank runs them: the recurrent-state metadata on this rank's state caches."""
    meta = extra.get(STATE_KEY)
    return extra if meta is None else {**extra, STATE_KEY: dataclasses.replace(meta, caches=state_caches)}


def to_device(obj, device: torch.device):
    """Tensors inside the step's metadata, moved to device (the wire carries CPU tensors). Onto a GPU through
    pinned memory and non-blocking copies: a plain copy waits for the stream to drain, and under async
    scheduling the stream still runs the previous step."""
    if isinstance(obj, torch.Tensor):
        if torch.device(device).type == "cuda" and obj.device.type == "cpu":
            return obj.pin_memory().to(device, non_blocking=True)
        return obj.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: to_device(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj
