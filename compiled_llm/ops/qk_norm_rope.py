"""qk_norm_rope_kv_write: per-head RMSNorm of q and k, RoPE with the layer's own frequencies, and the
k/v write into the paged cache, in one op. Replaces what an attention layer does between its
projections and the attention read (see passes/qk_norm_rope.py).

qk_norm_mrope_kv_write: the same for Qwen3.5's full-attention layers, whose RoPE is M-RoPE with partial
rotation: the model computes one cos/sin table [tokens, rotary_dim] per step from its positions ([tokens],
or [3, tokens] with each frequency taking its angle from the time, height or width component;
ops/mrope.py), and every layer rotates the first rotary_dim channels of each head with it (rotate-half),
passing the rest through. The op takes that table, so the section layout and the position kind (text or
media) stay out of the kernel; the norms scale by weight_offset + w (zero-centred: 1 + w)."""

from __future__ import annotations

import torch

from compiled_llm.ops.attention import ref_kv_cache_write
from compiled_llm.ops.context import absolute_layer
from compiled_llm.ops.mrope import apply_mrope
from compiled_llm.ops.norm import ref_rms_norm
from compiled_llm.ops.registry import Capabilities, OpSpec, Provider, custom_op, register
from compiled_llm.ops.rope import apply_rope


def ref_qk_norm_rope_kv_write(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                              positions: torch.Tensor, inv_freq: torch.Tensor, q_weight: torch.Tensor,
                              k_weight: torch.Tensor | None, eps: float, norm_v: bool, layer_idx: int) -> torch.Tensor:
    """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] or None. Returns rope(norm(q));
    writes rope(norm(k)) and v (RMS-normalised without weight when norm_v) to the cache when v is given."""
    q_out = apply_rope(ref_rms_norm(q, q_weight, eps), positions, inv_freq)
    if v is not None:
        v = ref_rms_norm(v, None, eps) if norm_v else v
        if k is not None:
            k = apply_rope(ref_rms_norm(k, k_weight, eps), positions, inv_freq)
        ref_kv_cache_write(k, v, layer_idx)
    return q_out


def _triton(caps: Capabilities, shape: dict) -> str | None:
    if any(d % 2 for d in shape.get("head_dims", ())):
        return "odd head_dim"
    return caps.triton_ok()


QK_NORM_ROPE_KV_WRITE = register(OpSpec(
    "qk_norm_rope_kv_write", "q,k: per-head RMSNorm + RoPE; v: optional RMSNorm; k/v written to the paged cache", [
        Provider("triton", "compiled_llm.ops.triton.qk_norm_rope:qk_norm_rope_kv_write", _triton),
        Provider("reference", "compiled_llm.ops.qk_norm_rope:ref_qk_norm_rope_kv_write", syncs=True),
    ]))


@custom_op("compiled_llm::qk_norm_rope_kv_write", mutates_args=())
def qk_norm_rope_kv_write(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, positions: torch.Tensor,
                          inv_freq: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor | None, eps: float,
                          norm_v: bool, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (q after norm and rope, an empty marker for the attention op: the cache is written).
    layer_idx: relative to the compiled piece's first layer (ops/context.py absolute_layer)."""
    layer_idx = absolute_layer(layer_idx)
    q_out = QK_NORM_ROPE_KV_WRITE.impl(layer_idx)(q, k, v, positions, inv_freq, q_weight, k_weight, eps, norm_v,
                                                  layer_idx)
    return q_out, q.new_empty(0)


@qk_norm_rope_kv_write.register_fake
def _(q, k, v, positions, inv_freq, q_weight, k_weight, eps, norm_v, layer_idx):
    return torch.empty_like(q), q.new_empty(0)


def ref_qk_norm_mrope_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                               q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, weight_offset: float,
                               layer_idx: int) -> torch.Tensor:
    """q: [tokens, heads, head_dim]; k: [tokens, kv_heads, head_dim]; v: [tokens, kv_heads * head_dim] (or
    [tokens, kv_heads, head_dim]); cos, sin: [tokens, rotary_dim]. Returns rotate(norm(q)); writes
    rotate(norm(k)) and v to the layer's cache."""
    q, k = apply_mrope(ref_rms_norm(q, q_weight, eps, weight_offset), ref_rms_norm(k, k_weight, eps, weight_offset),
                       cos, sin)
    ref_kv_cache_write(k.reshape(k.shape[0], -1), v, layer_idx)
    return q


def _triton_mrope(caps: Capabilities, shape: dict) -> str | None:
    return caps.triton_ok()


QK_NORM_MROPE_KV_WRITE = register(OpSpec(
    "qk_norm_mrope_kv_write", "q,k: per-head RMSNorm + partial rotation by a cos/sin table (M-RoPE); k/v written "
    "to the paged cache", [
        Provider("triton", "compiled_llm.ops.triton.qk_norm_rope:qk_norm_mrope_kv_write", _triton_mrope),
        Provider("reference", "compiled_llm.ops.qk_norm_rope:ref_qk_norm_mrope_kv_write", syncs=True),
    ]))


@custom_op("compiled_llm::qk_norm_mrope_kv_write", mutates_args=())
def qk_norm_mrope_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, weight_offset: float,
                           layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (q after norm and rotation, an empty marker for the attention op: the cache is written).
    layer_idx: relative to the compiled piece's first layer (ops/context.py absolute_layer)."""
    layer_idx = absolute_layer(layer_idx)
    q_out = QK_NORM_MROPE_KV_WRITE.impl(layer_idx)(q, k, v, cos, sin, q_weight, k_weight, eps, weight_offset, layer_idx)
    return q_out, q.new_empty(0)


@qk_norm_mrope_kv_write.register_fake
def _(q, k, v, cos, sin, q_weight, k_weight, eps, weight_offset, layer_idx):
    return torch.empty_like(q), q.new_empty(0)
