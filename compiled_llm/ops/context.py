"""The forward context: the one channel from the runtime to the ops.

A model's forward signature carries only tokens and positions, so what an op needs per step (block
tables, slot mappings, sequence lengths, the cache tensors, extras such as recurrent-state slots or
sparse-KV picks) is set here around each forward by whoever runs it (the model runner, the compiler's
warm-up and graph capture) and read back inside the op. This module imports no other op, so every op
can read it without importing attention (ops/sparse.py used to reach it through ops/attention.py, which
imports sparse.py back).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from compiled_llm.ops.attention import AttentionSpec


@dataclass
class GroupMetadata:
    """Block tables and slot mapping of one KV-cache group (full layers, or sliding layers of one window)."""

    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, -1 where a block was released
    slot_mapping: torch.Tensor  # [num_tokens] int64: block * block_size + offset of each new token


@dataclass
class AttentionMetadata:
    query_start_loc: list[int]  # num_seqs + 1 offsets into the token dimension
    seq_lens: list[int]  # context length of each sequence after this step's tokens
    block_size: int
    groups: dict[int | None, GroupMetadata]
    seq_lens_tensor: torch.Tensor | None = None
    query_start_loc_tensor: torch.Tensor | None = None
    # the step's token positions on the device (the runner's; the compiler's static buffer in a CUDA graph):
    # the K=V cache writers rotate the keys they keep at them (AttentionSpec.rot_keys)
    positions: torch.Tensor | None = None


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    kv_caches: dict[int, torch.Tensor]  # cache layer -> [2 or 1, num_blocks, block_size, kv_heads, head_dim]
    layers: dict[int, AttentionSpec]
    extra: dict = field(default_factory=dict)


_CONTEXT: ForwardContext | None = None


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext):
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, ctx
    try:
        yield ctx
    finally:
        _CONTEXT = prev


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("attention called outside a forward context (the runtime sets one per step)")
    return _CONTEXT


def step_memo(ctx: ForwardContext, key, make):
    """make()'s value, once a step: ctx.extra is the step's, so what a step's layers share (a KV group's tables,
    a check of its slots) is made by the first layer call that needs it."""
    got = ctx.extra.get(key)
    if got is None:
        got = ctx.extra[key] = make()
    return got


def current_forward_context() -> ForwardContext | None:
    """The context if one is set (ops that only look at it, e.g. for an optional extra)."""
    return _CONTEXT


# True while the compiler's CUDA-graph wrapper captures the whole forward of a decode batch (compiler/cuda_graph.py).
# An op may leave its kernel to a later op of the same forward (qk_norm_rope_kv_write to the decode attention) only
# where both run in one graph or both eagerly: a compiled piece's own capture replays without the op between
# pieces, which runs eagerly after it.
WHOLE_CAPTURE = [False]


@contextlib.contextmanager
def whole_capture():
    prev, WHOLE_CAPTURE[0] = WHOLE_CAPTURE[0], True
    try:
        yield
    finally:
        WHOLE_CAPTURE[0] = prev


def later_op_runs_with_this(device: torch.device) -> bool:
    """Whether an op of this forward that runs after the caller also runs where the caller's kernels do: eagerly,
    or in the whole forward's capture (not in a compiled piece's capture)."""
    return WHOLE_CAPTURE[0] or device.type != "cuda" or not torch.cuda.is_current_stream_capturing()


# Compiled pieces carry the layer indices of the ops inside them relative to the piece's first layer, so that
# the pieces of look-alike layers are one graph and compile once (compiler/piecewise.py); the piece runner sets
# the base around each call. Outside a piece it is 0 and indices are absolute.
_LAYER_BASE = 0


def set_layer_base(base: int) -> int:
    """Sets the base layer of the piece about to run; returns the previous one (to restore)."""
    global _LAYER_BASE
    prev, _LAYER_BASE = _LAYER_BASE, base
    return prev


def absolute_layer(layer_idx: int) -> int:
    """An op's layer index as the model numbers it (ops that can sit inside a compiled piece call this)."""
    return layer_idx + _LAYER_BASE


def layer_cache(layer_idx: int) -> tuple[ForwardContext, AttentionSpec, torch.Tensor, GroupMetadata]:
    """The forward context, the layer's spec, the cache it reads and its group's block tables."""
    ctx = get_forward_context()
    spec = ctx.layers[layer_idx]
    return ctx, spec, ctx.kv_caches[spec.cache_layer], ctx.attn_metadata.groups[spec.kv_group]
