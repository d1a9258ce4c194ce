"""Causal depthwise conv1d with a per-sequence state (the last K-1 inputs), SiLU applied.

Reference in plain PyTorch; the Triton provider is ops/triton/conv1d.py. The state of a slot holds the inputs preceding the sequence's next token,
so chunked prefill and decode continue exactly where the previous step stopped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compiled_llm.ops.registry import OpSpec, Provider, custom_op, register
from compiled_llm.ops.state import StateLayout, get_state_metadata


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor,
                      state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence. x: [T, dim]; weight: [dim, K]; state: [dim, K-1] or None (zeros).
    Returns silu(conv(x)) [T, dim] and the new state [dim, K-1]."""
    dim, k = weight.shape
    if state is None:
        state = x.new_zeros(dim, k - 1)
    ext = torch.cat([state.to(x.dtype), x.t()], dim=-1)  # [dim, K-1+T]
    out = F.conv1d(ext[None].to(weight.dtype), weight[:, None, :], groups=dim)[0]
    return F.silu(out).t().to(x.dtype), ext[:, ext.shape[1] - (k - 1):]


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B sequences. x: [B, dim]; state: [B, dim, K-1] -> ([B, dim], new state)."""
    dim = weight.shape[0]
    ext = torch.cat([state.to(x.dtype), x[:, :, None]], dim=-1)  # [B, dim, K]
    out = F.conv1d(ext.to(weight.dtype), weight[:, None, :], groups=dim)[:, :, 0]
    return F.silu(out).to(x.dtype), ext[:, :, 1:]


def causal_conv1d_with_state(x: torch.Tensor, weight: torch.Tensor, cache: torch.Tensor,
                             layout: StateLayout) -> torch.Tensor:
    """Flat tokens of a batch of sequences; cache [num_slots, dim, K-1] is read and updated in place."""
    out = torch.zeros_like(x)  # rows past the last sequence stay zero
    single, batched = layout.single_rows()
    if batched:  # decode tokens, batched
        rows, slot_t, keep = batched
        state = torch.where(keep[:, None, None], cache.index_select(0, slot_t), 0.0)
        y, new = causal_conv1d_step(x.index_select(0, rows), weight, state)
        out.index_copy_(0, rows, y)
        cache.index_copy_(0, slot_t, new.to(cache.dtype))
    for slot, start, end, carries in layout.prefill_spans(single):
        y, new = causal_conv1d_ref(x[start:end], weight, cache[slot] if carries else None)
        out[start:end] = y
        cache[slot] = new.to(cache.dtype)
    return out


def ref_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, layer_idx: int) -> torch.Tensor:
    meta = get_state_metadata()
    return causal_conv1d_with_state(x, weight, meta.caches[layer_idx]["conv"], meta.layout)


CAUSAL_CONV1D = register(OpSpec("causal_conv1d", "depthwise causal conv1d + SiLU with a per-sequence input window", [
    Provider("triton", "compiled_llm.ops.triton.conv1d:causal_conv1d", lambda caps, shape: caps.triton_ok(),
             capturable=True),
    Provider("reference", "compiled_llm.ops.conv1d:ref_causal_conv1d"),
], splits_graph=True, recurrent_state=True))


@custom_op("compiled_llm::causal_conv1d", mutates_args=())
def causal_conv1d_op(x: torch.Tensor, weight: torch.Tensor, layer_idx: int) -> torch.Tensor:
    return CAUSAL_CONV1D.impl()(x, weight, layer_idx)


@causal_conv1d_op.register_fake
def _(x, weight, layer_idx):
    return torch.empty_like(x)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, layer_idx: int) -> torch.Tensor:
    """x: [tokens, dim], rows possibly strided (columns of a wider projection's output: both providers read it in
    place); weight: [dim, K]. Uses and updates the layer's "conv" state in the forward context."""
    return torch.ops.compiled_llm.causal_conv1d(x, weight, layer_idx)
