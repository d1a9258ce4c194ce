"""QK-norm + RoPE + KV-cache write: per-head RMSNorm of q and k, RoPE with the layer's frequencies, the
value norm and the kv_cache_write op -> one qk_norm_rope_kv_write op. Three shapes of attention layer:
q, k and v (the usual), q and v (K=V layers: the cache keeps the value only), and q alone (layers that
read another layer's cache: norm + RoPE, no write). And Qwen3.5's full-attention layers: zero-centred q/k
norms, then partial M-RoPE from the step's cos/sin table (ops/mrope.py `apply_mrope`, which the model calls),
then the KV write -> qk_norm_mrope_kv_write. The table is an input (the model builds it once per step from
[tokens] or [3, tokens] positions), so the fusion holds for text and media positions alike; its layout is
checked on the match (partial_rotate_half), as is the rotate-half split."""

from __future__ import annotations

import torch

from compiled_llm.ops.mrope import apply_mrope
from compiled_llm.ops.norm import ref_rms_norm
from compiled_llm.ops.rope import apply_rope
from compiled_llm.passes.base import EPS, LAYER, OFFSET, FusionPass, empty, partial_rotate_half, rotate_half


class QKNormRopeKVWritePass(FusionPass):
    name = "qk_norm_rope_kv_write"
    fusion = "QK-norm + RoPE + KV-cache write"
    count_only_on_reference = True

    def register(self) -> None:
        op = torch.ops.compiled_llm.qk_norm_rope_kv_write

        def search_qkv(q, k, v, positions, inv_freq, q_weight, k_weight, eps, layer_idx):
            n = q.shape[0]
            q = apply_rope(ref_rms_norm(q, q_weight, eps), positions, inv_freq)
            k = apply_rope(ref_rms_norm(k, k_weight, eps), positions, inv_freq).reshape(n, -1)
            v = ref_rms_norm(v, None, eps).reshape(n, -1)
            return torch.ops.compiled_llm.kv_cache_write(k, v, layer_idx), q

        def replace_qkv(q, k, v, positions, inv_freq, q_weight, k_weight, eps, layer_idx):
            out = op(q, k, v, positions, inv_freq, q_weight, k_weight, eps, True, layer_idx)
            return out[1], out[0]

        def search_qv(q, v, positions, inv_freq, q_weight, eps, layer_idx):
            n = q.shape[0]
            q = apply_rope(ref_rms_norm(q, q_weight, eps), positions, inv_freq)
            v = ref_rms_norm(v, None, eps).reshape(n, -1)
            return torch.ops.compiled_llm.kv_cache_write(None, v, layer_idx), q

        def replace_qv(q, v, positions, inv_freq, q_weight, eps, layer_idx):
            out = op(q, None, v, positions, inv_freq, q_weight, None, eps, True, layer_idx)
            return out[1], out[0]

        def search_q(q, positions, inv_freq, q_weight, eps):
            return apply_rope(ref_rms_norm(q, q_weight, eps), positions, inv_freq)

        def replace_q(q, positions, inv_freq, q_weight, eps):
            return op(q, None, None, positions, inv_freq, q_weight, None, eps, False, -1)[0]

        def search_mrope(q, k, v, cos, sin, q_weight, k_weight, eps, weight_offset, layer_idx):
            n = q.shape[0]
            q, k = apply_mrope(ref_rms_norm(q, q_weight, eps, weight_offset), ref_rms_norm(k, k_weight, eps, weight_offset),
                               cos, sin)
            return torch.ops.compiled_llm.kv_cache_write(k.reshape(n, -1), v, layer_idx), q

        def replace_mrope(q, k, v, cos, sin, q_weight, k_weight, eps, weight_offset, layer_idx):
            out = torch.ops.compiled_llm.qk_norm_mrope_kv_write(q, k, v, cos, sin, q_weight, k_weight, eps,
                                                                 weight_offset, layer_idx)
            return out[1], out[0]

        for dt in self.dtypes:
            q, k, v = empty(7, 4, 16, dtype=dt), empty(7, 2, 16, dtype=dt), empty(7, 32, dtype=dt)
            qw, kw = empty(16, dtype=dt), empty(16, dtype=dt)
            scalars = {"eps": EPS, "weight_offset": OFFSET, "layer_idx": LAYER}
            for rotary in (8, 16):  # partial rotary (channels past the table pass through), and full
                cos, sin = empty(7, rotary, dtype=dt), empty(7, rotary, dtype=dt)
                self.add(search_mrope, replace_mrope, [q, k, v, cos, sin, qw, kw], scalars, check=partial_rotate_half,
                         tokens=7)

        for dt in self.dtypes:
            # distinct tensors: tracing merges an input passed twice
            q, k, v = empty(7, 4, 16, dtype=dt), empty(7, 2, 16, dtype=dt), empty(7, 2, 16, dtype=dt)
            pos, inv = empty(7, dtype=torch.long), empty(8)
            qw, kw = empty(16, dtype=dt), empty(16, dtype=dt)
            scalars = {"eps": EPS, "layer_idx": LAYER}
            self.add(search_qkv, replace_qkv, [q, k, v, pos, inv, qw, kw], scalars, check=rotate_half, tokens=7)
            self.add(search_qv, replace_qv, [q, v, pos, inv, qw], scalars, check=rotate_half, tokens=7)
            self.add(search_q, replace_q, [q, pos, inv, qw], {"eps": EPS}, stage=1, check=rotate_half, tokens=7)
