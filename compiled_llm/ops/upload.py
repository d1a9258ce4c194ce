"""A step's small host arrays onto the device in one copy.

`to_device_packed` writes (data, dtype) pairs into one pinned buffer, each part at a 16-byte-aligned offset,
copies it once without a stream sync and hands back views of the device copy. A decode step's eleven separate
copies each held the GPU's stream ~2.8 us on the H200 (benchmarks/NOTES.md, session 23), and a plain
`torch.tensor(..., device=cuda)` waits for the stream, the previous step included (async scheduling). The
alignment also keeps Triton's pointer specialisation stable: a part whose offset moved with the batch's size
would build another kernel variant mid-serving. The model runner (its step inputs) and the recurrent state's
layout (ops/state.py) both upload this way.
"""

from __future__ import annotations

import os

import numpy as np
import torch

_NP = {torch.long: np.int64, torch.int32: np.int32, torch.float32: np.float32}
ALIGN_BYTES = 16
# "old": a step's inputs made as before session 56, for an A/B (read at each step): per-token Python columns for
# long chunks and the sampled tokens always scattered into the ids, the logit rows always gathered
# (runtime/model_runner.py); one multi-tensor copy a dtype into the static buffers, a 2-D copy a block table, every
# padding set each step (compiler/model.py)
STEP_INPUTS_ENV = "COMPILED_LLM_STEP_INPUTS"


def new_step_inputs() -> bool:
    return os.environ.get(STEP_INPUTS_ENV, "new") != "old"


def to_device_packed(items: list, device) -> list[torch.Tensor]:
    """items: (data, dtype) pairs, data a list, numpy array or CPU tensor. On CUDA: views of one device buffer
    (pack_host, one non-blocking copy); elsewhere each as a tensor of its own."""
    if torch.device(device).type != "cuda":
        return [torch.as_tensor(np.asarray(d.numpy() if isinstance(d, torch.Tensor) else d, dtype=_NP[dt]))
                for d, dt in items]
    host, layout = pack_host(items, pin=True)
    return unpack(host.to(device, non_blocking=True), layout)


def pack_host(items: list, pin: bool = False) -> tuple[torch.Tensor, list]:
    """(data, dtype) pairs written into one uint8 buffer, each at a 16-byte-aligned offset; returns the buffer
    and the layout `unpack` reads back."""
    arrays = [np.asarray(d.numpy() if isinstance(d, torch.Tensor) else d, dtype=_NP[dt]) for d, dt in items]
    layout, total = [], 0
    for a, (_, dt) in zip(arrays, items):
        layout.append((total, a.nbytes, dt, a.shape))
        total += -(-a.nbytes // ALIGN_BYTES) * ALIGN_BYTES
    host = torch.empty(max(ALIGN_BYTES, total), dtype=torch.uint8, pin_memory=pin)
    raw = host.numpy()
    for a, (off, nbytes, _, _) in zip(arrays, layout):
        raw[off:off + nbytes].view(a.dtype).reshape(a.shape)[...] = a
    return host, layout


def unpack(buf: torch.Tensor, layout: list) -> list[torch.Tensor]:
    """The tensors pack_host wrote, as views of buf (the packed buffer or its copy on a device)."""
    return [buf[off:off + nbytes].view(dt).view(shape) for off, nbytes, dt, shape in layout]
