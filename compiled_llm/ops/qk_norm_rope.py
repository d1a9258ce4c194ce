"""qk_norm_rope_kv_write: per-head RMSNorm of q and k, RoPE with the layer's own frequencies, and the
k/v write into the paged cache, in one op. Replaces what an attention layer does between its
projections and the attention read (see passes/qk_norm_rope.py)."""

from __future__ import annotations

import torch

from compiled_llm.ops.attention import ref_kv_cache_write
from compiled_llm.ops.context import absolute_layer
from compiled_llm.ops.norm import ref_rms_norm
from compiled_llm.ops.registry import Capabilities, OpSpec, Provider, register
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
        Provider("reference", "compiled_llm.ops.qk_norm_rope:ref_qk_norm_rope_kv_write"),
    ]))


@torch.library.custom_op("compiled_llm::qk_norm_rope_kv_write", mutates_args=())
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
