"""A request's media tensors, handed once to every rank of a parallel engine (runtime/executor/).

The driver writes the processor tensors of all the request's items into one shared-memory file (under
/dev/shm) and sends a small `Manifest` (names, dtypes, shapes, offsets) with the registration RPC; each
rank copies what it needs out of the file. The driver unlinks the file once every rank has answered.
Ranks on other nodes cannot see that file: when the engine spans nodes the bytes travel inline, inside
the manifest (so through the RPC broadcast) instead.
"""

from __future__ import annotations

import itertools
import os
import secrets
import tempfile
from dataclasses import dataclass

import torch

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
PREFIX = "compiled_llm-media-"
_ALIGN = 64
_names = itertools.count()

# (name, dtype, shape, byte offset, byte count) of one tensor
TensorSlot = tuple[str, str, tuple[int, ...], int, int]


@dataclass
class Manifest:
    items: list[tuple[str, int, list[TensorSlot]]]  # (modality, soft-token count, tensors) per item
    nbytes: int
    path: str | None = None  # the shared file (ranks of this node)
    payload: bytes | None = None  # the bytes themselves (ranks on other nodes)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def pack(items: list[tuple[str, int, dict[str, torch.Tensor]]], inline: bool = False) -> Manifest:
    """items: (modality, soft-token count, tensors) per media item -> a manifest whose bytes live in a new
    shared file (or inline). The caller unlinks it (`unlink`) once every rank has copied."""
    layout, flats, off = [], [], 0
    for modality, num_tokens, tensors in items:
        slots = []
        for name, t in tensors.items():
            flat = _flat(t)
            slots.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), off, flat.numel()))
            flats.append((off, flat))
            off += -(-flat.numel() // _ALIGN) * _ALIGN
        layout.append((modality, num_tokens, slots))
    if inline:
        buf = torch.zeros(off, dtype=torch.uint8)
        for o, flat in flats:
            buf[o:o + flat.numel()] = flat
        return Manifest(layout, off, payload=buf.numpy().tobytes())
    path = os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}-{next(_names)}-{secrets.token_hex(4)}")  # (pids recur)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, off)
        for o, flat in flats:
            view = memoryview(flat.numpy())
            while len(view):
                n = os.pwrite(fd, view, o)
                view, o = view[n:], o + n
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return Manifest(layout, off, path=path)


def unpack(m: Manifest, device: torch.device | str = "cpu") -> list[tuple[str, int, dict[str, torch.Tensor]]]:
    """This rank's own copy of every item's tensors, on device."""
    if not m.nbytes:
        data = torch.zeros(0, dtype=torch.uint8)
    elif m.payload is not None:
        data = torch.frombuffer(bytearray(m.payload), dtype=torch.uint8)
    else:  # a private mapping of the shared file; each tensor is copied out of it
        data = torch.from_file(m.path, shared=False, size=m.nbytes, dtype=torch.uint8)
    out = []
    for modality, num_tokens, slots in m.items:
        tensors = {}
        for name, dtype, shape, off, n in slots:
            t = data[off:off + n].view(getattr(torch, dtype)).reshape(shape)
            tensors[name] = t.to(device, copy=True)
        out.append((modality, num_tokens, tensors))
    return out


def unlink(m: Manifest) -> None:
    if m.path is not None:
        try:
            os.unlink(m.path)
        except FileNotFoundError:
            pass
