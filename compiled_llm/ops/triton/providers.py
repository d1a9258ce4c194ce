"""Triton providers of the attention and MoE ops: adapters from the op signatures (per-step data from
the forward context) to the kernels in paged_attention.py and moe.py, and their JIT warm-up keys.

Attention: a batch whose sequences each bring one token goes to the split-K decode kernel, anything
else to the varlen prefill kernel. The metadata tensors (sequence lengths, query offsets) come from the
forward context when the compiler staged them in static buffers (whole-graph decode capture), else
they are built once per step and kept on the metadata. Padding rows of q come back as zeros.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os

import torch
import triton

from compiled_llm.ops.attention import BIDIR_SPANS_KEY, AttentionSpec
from compiled_llm.ops.context import (AttentionMetadata, ForwardContext, GroupMetadata, get_forward_context, layer_cache,
                                      set_forward_context)
from compiled_llm.ops.jit import MONITOR, JitKernel, register_kernel
from compiled_llm.ops.moe_overlap import route
from compiled_llm.ops.triton.moe import (fused_geglu_moe, fused_moe, fused_router_topk, fused_swiglu_moe,
                                         launch_variants, moe_align, moe_launch_policy)
from compiled_llm.ops.triton.paged_attention import DecodeQK, attention_launch_policy, paged_decode, paged_prefill
from compiled_llm.ops.triton.qk_norm_rope import DEFERRED_QK, writes_back

log = logging.getLogger(__name__)

SPLITS = [1 << i for i in range(8)]  # decode split-K counts the launch policy can pick


def _meta_tensors(meta: AttentionMetadata, device) -> tuple[torch.Tensor, torch.Tensor]:
    if meta.seq_lens_tensor is None:
        meta.seq_lens_tensor = torch.tensor(meta.seq_lens, dtype=torch.int32, device=device)
    if meta.query_start_loc_tensor is None:
        meta.query_start_loc_tensor = torch.tensor(meta.query_start_loc, dtype=torch.int32, device=device)
    return meta.seq_lens_tensor, meta.query_start_loc_tensor


def _layer_kwargs(spec: AttentionSpec, source: AttentionSpec) -> dict:
    return dict(scale=spec.scale, sliding_window=spec.sliding_window, softcap=spec.softcap, k_eq_v=source.k_eq_v,
                k_norm_weight=source.k_norm_weight, inv_freq=source.inv_freq, num_kv_heads=spec.num_kv_heads,
                head_dim=spec.head_dim)


def _layer_key(spec: AttentionSpec, source: AttentionSpec, dtype) -> tuple:
    return (dtype, spec.head_dim, spec.num_heads // spec.num_kv_heads, spec.sliding_window is not None,
            spec.softcap is not None, source.k_eq_v, source.rot_keys)


def attention(q: torch.Tensor, layer_idx: int) -> torch.Tensor:
    ctx, spec, cache, group = layer_cache(layer_idx)
    source = ctx.layers[spec.cache_layer]
    meta = ctx.attn_metadata
    seq_lens, qsl = _meta_tensors(meta, q.device)
    num_seqs = seq_lens.shape[0]
    kw = _layer_kwargs(spec, source)
    key = _layer_key(spec, source, q.dtype)
    tables = group.block_tables
    if len(meta.seq_lens) == meta.query_start_loc[-1]:  # decode: one new token per sequence
        max_len = tables.shape[1] * cache.shape[2]
        policy = attention_launch_policy(num_seqs, max_len, spec.head_dim, num_kv_heads=spec.num_kv_heads,
                                         sliding_window=spec.sliding_window, k_eq_v=source.k_eq_v,
                                         rotated_pairs=source.rotated_pairs, rot_keys=bool(source.rot_keys))
        q_in, qk = _deferred_qk(ctx, q, layer_idx) or (q, None)
        MONITOR.note("paged_decode", key + (policy.num_splits,) + (("qk",) if qk else ()))
        out = torch.empty(q.shape[0], spec.num_heads, spec.head_dim, dtype=q.dtype, device=q.device)
        if q.shape[0] > num_seqs:  # padding rows past the batch come back as zeros (no fill kernel otherwise)
            out[num_seqs:].zero_()
        paged_decode(q_in[:num_seqs], cache, tables, seq_lens, policy=policy, out=out[:num_seqs],
                     rotated_pairs=source.rotated_pairs, rot_keys=source.rot_keys, qk=qk, **kw)
    else:
        MONITOR.note("paged_prefill", key)
        # the kernel writes every token's row; only the padding past them is zeroed (a zero fill of the whole
        # output was 24 us a layer of an 8K-token prefill on the H200). Prefill attention never runs inside a
        # CUDA graph (the pieces around it do), so the host's token count is this step's.
        out = torch.empty(q.shape[0], spec.num_heads, spec.head_dim, dtype=q.dtype, device=q.device)
        if q.shape[0] > meta.query_start_loc[-1]:
            out[meta.query_start_loc[-1]:].zero_()
        spans = _span_bounds(ctx, q.shape[0], q.device) if spec.sliding_window is not None else None
        paged_prefill(q, cache, tables, qsl, seq_lens, out=out, spans=spans, **kw)
    return out.view(q.shape[0], -1)


def _deferred_qk(ctx: ForwardContext, q: torch.Tensor, layer_idx: int):
    """(q before its norm and RoPE, the DecodeQK) where this layer's qk_norm_rope_kv_write left its work to the
    decode kernel (ops/triton/qk_norm_rope.py DEFERRED_QK), else None."""
    hit = ctx.extra.get(DEFERRED_QK, {}).pop(layer_idx, None)
    if hit is None:
        return None
    q_out, qk, q_raw = hit
    if q_out.data_ptr() != q.data_ptr():  # its unwritten output reached this op through another tensor
        raise RuntimeError(f"layer {layer_idx}: the attention's query is not the deferred QK-norm's output")
    return q_raw, qk


def _span_bounds(ctx: ForwardContext, num_tokens: int, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per new token, the [lo, hi) positions of the media span it sees both ways (0, 0 outside spans), built
    once per step from the context's spans (sliding layers only, as the reference does)."""
    spans = ctx.extra.get(BIDIR_SPANS_KEY)
    if not spans or not any(spans):
        return None
    cached = ctx.extra.get("_bidir_bounds")
    if cached is None:
        meta = ctx.attn_metadata
        lo = torch.zeros(num_tokens, dtype=torch.int32)
        hi = torch.zeros(num_tokens, dtype=torch.int32)
        for i, seq_spans in enumerate(spans):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            first_pos = meta.seq_lens[i] - (end - start)
            for s, e in seq_spans:
                a, b = max(s, first_pos) - first_pos + start, min(e, meta.seq_lens[i]) - first_pos + start
                if b > a:
                    lo[a:b], hi[a:b] = s, e
        cached = ctx.extra["_bidir_bounds"] = (lo.to(device), hi.to(device))
    return cached


def router_topk(x, proj_weight, scale, per_expert_scale, top_k: int, eps: float, root_size: float):
    if abs(root_size - x.shape[-1] ** -0.5) > 1e-12 * root_size:
        from compiled_llm.ops.moe import ref_router_topk  # the kernel scales by hidden ** -0.5

        return ref_router_topk(x, proj_weight, scale, per_expert_scale, top_k, eps, root_size)
    MONITOR.note("router_topk", (x.dtype, x.shape[-1], proj_weight.shape[0], top_k))
    return fused_router_topk(x.contiguous(), scale, proj_weight, per_expert_scale, top_k, eps, ids_dtype=torch.int64)


def softmax_router_topk(x, proj_weight, top_k: int, weights_dtype: torch.dtype = torch.float32):
    MONITOR.note("softmax_router_topk", (x.dtype, x.shape[-1], proj_weight.shape[0], top_k))
    return fused_router_topk(x.contiguous(), None, proj_weight.contiguous(), None, top_k, 0.0, ids_dtype=torch.int64,
                             weights_dtype=weights_dtype)


def geglu_moe(x, weights, ids, gate_up_proj, down_proj):
    MONITOR.note("geglu_moe", (x.dtype, gate_up_proj.shape, ids.shape[1]))
    return fused_geglu_moe(x.contiguous(), gate_up_proj, down_proj, weights, ids)


def swiglu_moe(x, weights, ids, gate_up_proj, down_proj):
    MONITOR.note("swiglu_moe", (x.dtype, gate_up_proj.shape, ids.shape[1]))
    return fused_swiglu_moe(x.contiguous(), gate_up_proj, down_proj, weights, ids)


# the overlapped branch's alignment in the router's last program (1), or its own launch (the default). H200, batch 8
# (session 18): Gemma 4 +0.7% (router 9.2 + alignment 5.4 us -> 13.4 us in one), Qwen3.5 +0.15% (10.5 + 6.8 -> 19.7 us:
# its 256 experts' alignment is slower in the router's one program). Gemma's decode batches now skip the
# alignment altogether (ops/triton/moe.py self_routed), so this stays off.
ROUTER_ALIGN = os.environ.get("COMPILED_LLM_ROUTER_ALIGN", "0") == "1"


def moe_start(router_x, proj_weight, scale, per_expert_scale, x, gate_up_proj, down_proj, top_k: int, eps: float,
              root_size: float, first: int, activation: str, cast: bool, slots: bool = False):
    """The routed branch [T, H] (ops/moe_overlap.py): the same router, grouped-GEMM and top-k sum kernels as
    router_topk / geglu_moe (swiglu_moe); slots: each pick's weighted output [T, k, H], no top-k sum."""
    num_tokens, hidden = x.shape
    pol = moe_launch_policy(num_tokens, top_k, gate_up_proj.shape[0], hidden, gate_up_proj.shape[1] // 2)
    exact_root = scale is None or abs(root_size - router_x.shape[-1] ** -0.5) <= 1e-12 * root_size
    alignment = None
    # Qwen3.5 casts its routing weights to its dtype: the router kernel stores them so (one launch less)
    w_dtype = x.dtype if cast else torch.float32
    if (ROUTER_ALIGN and not first and not pol.unsorted and not pol.self_routed and exact_root
            and proj_weight.shape[0] == gate_up_proj.shape[0]):
        # the router's last program also aligns the picks (one token block: decode batches up to 16)
        if scale is not None:
            MONITOR.note("router_topk", (router_x.dtype, hidden, proj_weight.shape[0], top_k))
        else:
            MONITOR.note("softmax_router_topk", (router_x.dtype, hidden, proj_weight.shape[0], top_k))
        w, ids, alignment = fused_router_topk(router_x.contiguous(), scale, proj_weight.contiguous(), per_expert_scale,
                                              top_k, eps if scale is not None else 0.0, ids_dtype=torch.int64,
                                              align_block_m=pol.block_m, weights_dtype=w_dtype)
    else:  # (route's cast is then a no-op)
        softmax = functools.partial(softmax_router_topk, weights_dtype=w_dtype)
        w, ids = route(router_x, proj_weight, scale, per_expert_scale, top_k, eps, root_size, x.dtype, cast, first,
                       router_topk, softmax)
    name = "geglu_moe" if activation == "gelu_tanh" else "swiglu_moe"
    MONITOR.note(name, (x.dtype, gate_up_proj.shape, ids.shape[1]))
    fn = fused_geglu_moe if activation == "gelu_tanh" else fused_swiglu_moe
    return fn(x.contiguous(), gate_up_proj, down_proj, w, ids, alignment=alignment, policy=pol, sum_slots=not slots)


# ---- JIT warm-up ---------------------------------------------------------------------------------

@contextlib.contextmanager
def scratch_context(head_dim: int, dtype, device, k_eq_v: bool = False, num_heads: int = 2, num_kv_heads: int = 1,
                    window: int | None = None, softcap: float | None = None, block_size: int = 16,
                    num_seqs: int = 2, tokens: int = 1, width: int = 2, rot_keys: int = 0):
    """A throwaway one-layer cache and forward context, to compile kernels that read one. rot_keys: a K=V layer
    whose rows keep that many rotated key dims a half (AttentionSpec.rot_keys)."""
    spec = AttentionSpec(0, num_heads, num_kv_heads, head_dim, window, 0, 1.0, softcap, k_eq_v,
                         rotated_pairs=rot_keys or None, rot_keys=rot_keys)
    if k_eq_v:
        spec.k_norm_weight = torch.ones(head_dim, dtype=dtype, device=device)
        spec.inv_freq = torch.zeros(head_dim // 2, device=device)
    cache = torch.zeros(1 if k_eq_v else 2, width, block_size, num_kv_heads, spec.cache_dim, dtype=dtype,
                        device=device)[..., :head_dim]
    n = num_seqs * tokens
    group = GroupMetadata(torch.zeros(num_seqs, width, dtype=torch.int32, device=device),
                          torch.zeros(n, dtype=torch.long, device=device))
    meta = AttentionMetadata([i * tokens for i in range(num_seqs + 1)], [tokens] * num_seqs, block_size,
                             {spec.kv_group: group}, positions=torch.arange(tokens, device=device).repeat(num_seqs))
    with set_forward_context(ForwardContext(meta, {0: cache}, {0: spec})):
        yield get_forward_context()


def _attention_keys(facts: dict) -> list:
    """The layers that chose this provider (`layers`), each with its cache's source layer (`all_layers`)."""
    dtype, keys = facts["dtype"], set()
    layers = facts.get("layers", {})
    every = facts.get("all_layers", layers)
    for spec in layers.values():
        keys.add(("attention",) + _layer_key(spec, every[spec.cache_layer], dtype))
    return sorted(keys, key=repr)


def _attention_compile(key, device) -> None:
    """Prefill once, and decode at every split count the policy can choose (each is its own build)."""
    _, dtype, head_dim, group, sliding, softcap, k_eq_v, rot = key
    # a window wider than any context here, so that the split counts below reach a sliding layer's decode too
    # (a 64-token window kept it at one split: its split launch built at its first real launch)
    kw = dict(k_eq_v=k_eq_v, num_heads=group, window=1 << 20 if sliding else None, softcap=30.0 if softcap else None,
              rot_keys=rot)
    with scratch_context(head_dim, dtype, device, tokens=3, **kw):
        attention(torch.zeros(6, group * head_dim, dtype=dtype, device=device), 0)
    for splits in SPLITS:
        width = max(1, splits * 256 // 16)  # a context long enough for the policy to pick this split count
        # and the form with the deferred QK-norm (K!=V, and K=V rows that keep rotated keys)
        for qk in (False, True) if not k_eq_v or rot else (False,):
            with scratch_context(head_dim, dtype, device, num_seqs=1, width=width, **kw) as ctx:
                ctx.attn_metadata.seq_lens = [width * 16]
                ctx.attn_metadata.seq_lens_tensor = torch.tensor([width * 16], dtype=torch.int32, device=device)
                q = torch.zeros(1, group * head_dim, dtype=dtype, device=device)
                if qk:
                    ctx.extra[DEFERRED_QK] = {0: (q, _scratch_qk(head_dim, dtype, device, k_eq_v, group),
                                                  q.view(1, group, -1))}
                attention(q, 0)


def _scratch_qk(head_dim: int, dtype, device, k_eq_v: bool, group: int) -> DecodeQK:
    """A stand-in DecodeQK for warm-up's builds (its values are never looked at)."""
    kv, w = torch.zeros(2, 1, 1, head_dim, dtype=dtype, device=device), torch.ones(head_dim, dtype=dtype, device=device)
    inv = torch.zeros(head_dim // 2, device=device)
    slots = layer_cache(0)[3].slot_mapping
    q_out = torch.zeros(1, group, head_dim, dtype=dtype, device=device) if writes_back() else None
    return DecodeQK(None if k_eq_v else kv[0], kv[1], torch.zeros(1, dtype=torch.long, device=device), inv, w, w,
                    slots, 1e-6, True, q_out)


def _moe_keys(op: str):
    def keys(facts: dict) -> list:
        if not facts.get("num_experts") or facts.get("moe_op") != op:  # the model's routed-expert op only
            return []
        return [(facts["dtype"], facts["hidden_size"], facts["num_experts"], facts["moe_intermediate_size"],
                 facts["top_k_experts"], facts.get("max_num_batched_tokens", 64))]
    return keys


def _moe_weights(experts: int, inter: int, hidden: int, dtype, device):
    # zero weights with a zero expert stride: the kernels build as for real ones (strides divisible by 16)
    # without the memory of every expert
    gate_up = torch.zeros(1, 2 * inter, hidden, dtype=dtype, device=device).expand(experts, -1, -1)
    return gate_up, torch.zeros(1, hidden, inter, dtype=dtype, device=device).expand(experts, -1, -1)


def _moe_tma_builds(tokens: int, ids: torch.Tensor, weights: torch.Tensor, experts: int, inter: int, hidden: int,
                    dtype: torch.dtype, activation: str) -> None:
    """The build of a batch-size class whose grouped GEMMs load their weight tiles through TMA (moe_launch_policy's
    prefill tiers): its descriptors need whole weight tensors, which the zero-stride stand-ins are not, and
    allocating every expert (~1.5 GB at 26B-A4B) at warm-up could take memory the KV cache was given. Those
    builds take the expert count as a runtime argument (not specialised), so top_k experts' zero weights stand in,
    with the picks folded onto them, the launch of the real expert count and its alignment (that build too)."""
    top_k = ids.shape[1]
    pol = moe_launch_policy(tokens, top_k, experts, hidden, inter)
    if not pol.tma:
        return
    x = torch.zeros(tokens, hidden, dtype=dtype, device=ids.device)  # the model's dtype (weights: the router's)
    gate_up = torch.zeros(top_k, 2 * inter, hidden, dtype=x.dtype, device=x.device)
    down = torch.zeros(top_k, hidden, inter, dtype=x.dtype, device=x.device)
    ids = ids.remainder(top_k)
    try:
        fused_moe(x, gate_up, down, weights, ids, activation=activation, policy=pol,
                  alignment=moe_align(ids, experts, pol.block_m))
    except Exception as e:  # (a warm-up-only build: the engine still starts, as before this build was here)
        log.warning("JIT warm-up: the grouped MoE GEMMs' TMA launch for %d tokens did not build (%s: %s); it builds "
                    "at the first prefill of that size instead", tokens, type(e).__name__, str(e)[:200])


def _moe_compile(key, device) -> None:
    dtype, hidden, experts, inter, top_k, max_tokens = key
    gate_up, down = _moe_weights(experts, inter, hidden, dtype, device)
    for tokens in launch_variants(experts, top_k, hidden, inter, max_tokens):  # each batch-size class's build
        x = torch.zeros(tokens, hidden, dtype=dtype, device=device)
        w, ids = router_topk(x, torch.zeros(experts, hidden, dtype=dtype, device=device),
                             torch.ones(hidden, dtype=dtype, device=device),
                             torch.ones(experts, dtype=dtype, device=device), top_k, 1e-6, hidden ** -0.5)
        geglu_moe(x, w, ids, gate_up, down)
        _moe_tma_builds(tokens, ids, w, experts, inter, hidden, dtype, "gelu_tanh")
        moe_start(x, torch.zeros(experts, hidden, dtype=dtype, device=device), torch.ones(hidden, dtype=dtype, device=device),
                  torch.ones(experts, dtype=dtype, device=device), x, gate_up, down, top_k, 1e-6, hidden ** -0.5, 0,
                  "gelu_tanh", False)  # the overlapped branch (the router kernel that aligns too)


def _swiglu_compile(key, device) -> None:
    dtype, hidden, experts, inter, top_k, max_tokens = key
    gate_up, down = _moe_weights(experts, inter, hidden, dtype, device)
    for tokens in launch_variants(experts, top_k, hidden, inter, max_tokens, norm=False):
        x = torch.zeros(tokens, hidden, dtype=dtype, device=device)
        w, ids = softmax_router_topk(x, torch.zeros(experts, hidden, dtype=dtype, device=device), top_k)
        swiglu_moe(x, w.to(dtype), ids, gate_up, down)
        _moe_tma_builds(tokens, ids, w.to(dtype), experts, inter, hidden, dtype, "silu")
        moe_start(x, torch.zeros(experts, hidden, dtype=dtype, device=device), None, None, x, gate_up, down, top_k, 0.0,
                  1.0, 0, "silu", True)


register_kernel(JitKernel("paged_attention", "attention", "triton", _attention_keys, _attention_compile))
register_kernel(JitKernel("geglu_moe", "geglu_moe", "triton", _moe_keys("geglu_moe"), _moe_compile))
register_kernel(JitKernel("swiglu_moe", "swiglu_moe", "triton", _moe_keys("swiglu_moe"), _swiglu_compile))

__all__ = ["attention", "router_topk", "softmax_router_topk", "geglu_moe", "swiglu_moe", "scratch_context", "triton"]
