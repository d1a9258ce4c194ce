"""The four fusions on Qwen3.5's forms, each built from the functions its model layers call: the zero-centred
RMSNorm (scale 1 + w) after a residual add, the zero-centred QK-norm + partial M-RoPE + KV write of its
full-attention layers, its softmax router (renormalised top-k) and its dense SwiGLU expert sum. Each fuses
(and computes what the model computes) in float32 and bfloat16, on the GPU's graph and at one token; the
look-alikes (another offset form, another rotation, another selection, another activation) are left alone.
Match counts on whole models: tests/test_qwen3_5.py (engine) and tests/test_audit.py (released config)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compiled_llm.ops.activation import gelu_tanh
from compiled_llm.ops.attention import AttentionSpec
from compiled_llm.ops.context import AttentionMetadata, ForwardContext, GroupMetadata, set_forward_context
from compiled_llm.ops.moe import dense_gated_moe, ref_softmax_router_topk
from compiled_llm.ops.mrope import apply_mrope, mrope_cos_sin, mrope_owner, rotary_inv_freq
from compiled_llm.ops.norm import ref_fused_add_rms_norm, ref_rms_norm
from compiled_llm.ops.swiglu_moe import ref_swiglu_moe
from pass_utils import fuse, inspect

H, E, I, K = 32, 8, 12, 2
HEADS, KV_HEADS, D = 4, 2, 16


def tol(dtype):
    return 1e-5 if dtype == torch.float32 else 3e-2


def gen():
    return torch.Generator().manual_seed(0)


# ---- RMSNorm (1 + w) + residual add --------------------------------------------------------------------

def add_norm(x, residual, weight):
    s = residual + x
    return ref_rms_norm(s, weight, 1e-6, 1.0), s


def offset_on_the_input(x, residual, weight):  # (h + 1) * w: the offset on the normalised value, not the weight
    s = residual + x
    h = s.float()
    h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + 1e-6, -0.5)
    return ((h + 1.0) * weight.float()).type_as(s), s


def norm_inputs(n=5, dtype=torch.float32):
    g = gen()
    return [torch.randn(n, H, generator=g).to(dtype), torch.randn(n, H, generator=g).to(dtype),
            (0.3 * torch.randn(H, generator=g)).to(dtype)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_centred_add_norm_fuses_and_computes_the_same(dtype):
    args = norm_inputs(dtype=dtype)
    matches, (y, s) = fuse(add_norm, args, ("add_rms_norm",))
    want_y, want_s = ref_fused_add_rms_norm(*args, 1e-6, 1.0)
    assert matches["add_rms_norm"] == 1
    torch.testing.assert_close(y, want_y, atol=tol(dtype), rtol=tol(dtype))
    torch.testing.assert_close(s, want_s)
    assert inspect(add_norm, lambda: norm_inputs(n=1, dtype=dtype), ("add_rms_norm",), dtype=dtype,
                   dynamic=False)["add_rms_norm"] == 1


def test_offset_on_the_normalised_value_is_left_alone():
    assert inspect(offset_on_the_input, lambda: norm_inputs(), ("add_rms_norm",))["add_rms_norm"] == 0


# ---- QK-norm + partial M-RoPE + KV write ---------------------------------------------------------------

def attention_path(q, k, v, cos, sin, qw, kw):
    """Qwen3.5's Attention.forward between its projections and the attention read."""
    n = q.shape[0]
    q, k = apply_mrope(ref_rms_norm(q, qw, 1e-6, 1.0), ref_rms_norm(k, kw, 1e-6, 1.0), cos, sin)
    written = torch.ops.compiled_llm.kv_cache_write(k.reshape(n, -1), v, 0)
    return q, written


def swapped_sign(q, k, v, cos, sin, qw, kw):  # cat([-x1, x2]) instead of cat([-x2, x1]): the inverse rotation
    n, rd = q.shape[0], cos.shape[-1]

    def rotate(x):
        rot, rest = x[..., :rd], x[..., rd:]
        turned = torch.cat([-rot[..., :rd // 2], rot[..., rd // 2:]], dim=-1)
        return torch.cat([rot * cos[:, None, :] + turned * sin[:, None, :], rest], dim=-1)

    q, k = rotate(ref_rms_norm(q, qw, 1e-6, 1.0)), rotate(ref_rms_norm(k, kw, 1e-6, 1.0))
    return q, torch.ops.compiled_llm.kv_cache_write(k.reshape(n, -1), v, 0)


def last_channels_rotated(q, k, v, cos, sin, qw, kw):  # rotates the head's last rotary_dim channels instead
    n, rd = q.shape[0], cos.shape[-1]

    def rotate(x):
        rot, rest = x[..., -rd:], x[..., :-rd]
        turned = torch.cat([-rot[..., rd // 2:], rot[..., :rd // 2]], dim=-1)
        return torch.cat([rot * cos[:, None, :] + turned * sin[:, None, :], rest], dim=-1)

    q, k = rotate(ref_rms_norm(q, qw, 1e-6, 1.0)), rotate(ref_rms_norm(k, kw, 1e-6, 1.0))
    return q, torch.ops.compiled_llm.kv_cache_write(k.reshape(n, -1), v, 0)


def attn_inputs(n=5, dtype=torch.float32, factor=0.5, media=True):
    """q as the model hands it (the query half of the gated projection, a strided view), flat v, and the step's
    cos/sin table from [3, tokens] positions (media) or [tokens] (text)."""
    g = gen()
    inv = rotary_inv_freq(D, 10_000.0, factor)
    pos = torch.randint(0, 300, (3, n) if media else (n,), generator=g)
    cos, sin = mrope_cos_sin(pos, inv, mrope_owner(len(inv), [2, 1, 1] if factor == 0.5 else [4, 2, 2]), dtype)
    q = torch.randn(n, HEADS, 2 * D, generator=g).to(dtype)[..., :D]
    return [q, torch.randn(n, KV_HEADS, D, generator=g).to(dtype), torch.randn(n, KV_HEADS * D, generator=g).to(dtype),
            cos, sin, (0.3 * torch.randn(D, generator=g)).to(dtype), (0.3 * torch.randn(D, generator=g)).to(dtype)]


def context(n, dtype):
    spec = AttentionSpec(0, HEADS, KV_HEADS, D, None, 0, D ** -0.5)
    cache = torch.zeros(2, 4, 4, KV_HEADS, D, dtype=dtype)
    slots = torch.tensor([3, 9, 2, 14, 7, 0, 5][:n])
    meta = AttentionMetadata([0, n], [n], 4, {None: GroupMetadata(torch.tensor([[0, 1, 2, 3]], dtype=torch.int32), slots)})
    return ForwardContext(meta, {0: cache}, {0: spec})


@pytest.mark.parametrize("dtype, factor", [(torch.float32, 0.5), (torch.bfloat16, 0.5), (torch.float32, 1.0)],
                         ids=["partial-f32", "partial-bf16", "full-f32"])
def test_qk_norm_mrope_kv_write_fuses_and_computes_the_same(dtype, factor):
    """The replacement runs (the pass unit tests replace on the CPU too): same query, same cache."""
    args = attn_inputs(dtype=dtype, factor=factor)
    eager, fused = context(5, dtype), context(5, dtype)
    with set_forward_context(eager):
        want_q, _ = attention_path(*args)
    with set_forward_context(fused):
        matches, (q, _) = fuse(attention_path, args, ("qk_norm_rope_kv_write",))
    assert matches["qk_norm_rope_kv_write"] == 1
    torch.testing.assert_close(q, want_q, atol=tol(dtype), rtol=tol(dtype))
    torch.testing.assert_close(fused.kv_caches[0], eager.kv_caches[0], atol=tol(dtype), rtol=tol(dtype))
    assert fused.kv_caches[0].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, dynamic", [(5, True), (1, False)])
def test_qk_norm_mrope_fuses_on_the_gpus_graph(dtype, n, dynamic):
    assert inspect(attention_path, lambda: attn_inputs(n=n, dtype=dtype, media=False), ("qk_norm_rope_kv_write",),
                   dtype=dtype, dynamic=dynamic)["qk_norm_rope_kv_write"] == 1


@pytest.mark.parametrize("fn", [swapped_sign, last_channels_rotated])
@pytest.mark.parametrize("factor", [0.5, 0.25])
def test_other_rotations_are_left_alone(fn, factor):
    """At a quarter of the head a slice-bound check alone would catch both; at half of it, the rotated and the
    passed-through halves have the same size, and only the node-by-node check tells them apart."""
    def make():
        return attn_inputs(factor=factor) if factor == 0.5 else [*attn_inputs()[:3], *quarter_table(), *attn_inputs()[5:]]

    assert inspect(fn, make, ("qk_norm_rope_kv_write",))["qk_norm_rope_kv_write"] == 0


def quarter_table(n=5):
    inv = rotary_inv_freq(D, 10_000.0, 0.25)
    return mrope_cos_sin(torch.arange(n), inv, mrope_owner(len(inv), [1, 1, 0]), torch.float32)


# ---- softmax router + top-k ---------------------------------------------------------------------------

def router(x, proj):
    w, ids = ref_softmax_router_topk(x, proj, K)
    return w.to(x.dtype), ids


def no_renormalise(x, proj):
    probs = torch.softmax(F.linear(x, proj), dim=-1, dtype=torch.float32)
    w, ids = torch.topk(probs, K, dim=-1)
    return w.to(x.dtype), ids


def smallest(x, proj):
    probs = torch.softmax(F.linear(x, proj), dim=-1, dtype=torch.float32)
    w, ids = torch.topk(probs, K, dim=-1, largest=False)
    return (w / w.sum(dim=-1, keepdim=True)).to(x.dtype), ids


def router_inputs(n=6, dtype=torch.float32):
    g = gen()
    return [torch.randn(n, H, generator=g).to(dtype), (0.3 * torch.randn(E, H, generator=g)).to(dtype)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_router_fuses_and_picks_the_same_experts(dtype):
    args = router_inputs(dtype=dtype)
    matches, (w, ids) = fuse(router, args, ("router_topk",))
    want_w, want_ids = router(*args)
    assert matches["router_topk"] == 1
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w)
    assert inspect(router, lambda: router_inputs(n=1, dtype=dtype), ("router_topk",), dtype=dtype,
                   dynamic=False)["router_topk"] == 1


@pytest.mark.parametrize("fn", [no_renormalise, smallest])
def test_other_routers_are_left_alone(fn):
    assert inspect(fn, lambda: router_inputs(), ("router_topk",))["router_topk"] == 0


# ---- SwiGLU MoE (the routed experts; the shared expert stays around it) -------------------------------

def moe_layer(x, weights, ids, gate_up, down, shared_gate, shared_gu, shared_down):
    """What SparseMoE does with the routed sum: cast back, add the sigmoid-gated shared expert."""
    gate, up = F.linear(x, shared_gu).chunk(2, dim=-1)
    shared = torch.sigmoid(F.linear(x, shared_gate)) * F.linear(F.silu(gate) * up, shared_down)
    return dense_gated_moe(x, weights, ids, gate_up, down, F.silu, gate_up.shape[0]).to(x.dtype) + shared


def local_experts(x, weights, ids, gate_up, down, shared_gate, shared_gu, shared_down):
    """Expert parallel: this rank holds experts [4, 8) of 8; ids are global."""
    e = gate_up.shape[0]
    return dense_gated_moe(x, weights, ids, gate_up, down, F.silu, 2 * e, e).to(x.dtype)


def gelu_experts(x, weights, ids, gate_up, down, shared_gate, shared_gu, shared_down):
    return dense_gated_moe(x, weights, ids, gate_up, down, gelu_tanh, gate_up.shape[0]).to(x.dtype)


def moe_inputs(n=6, dtype=torch.float32, experts=E):
    g = gen()
    weights, ids = torch.topk(torch.softmax(torch.randn(n, E, generator=g), -1), K, -1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)  # the router's weights in the model's dtype
    return [torch.randn(n, H, generator=g).to(dtype), weights, ids,
            (0.2 * torch.randn(experts, 2 * I, H, generator=g)).to(dtype),
            (0.2 * torch.randn(experts, H, I, generator=g)).to(dtype), (0.2 * torch.randn(1, H, generator=g)).to(dtype),
            (0.2 * torch.randn(2 * I, H, generator=g)).to(dtype), (0.2 * torch.randn(H, I, generator=g)).to(dtype)]


def test_dense_swiglu_sum_becomes_the_routed_op():
    """bfloat16 (float32: the expert-parallel case below), the shared expert around it."""
    dtype = torch.bfloat16
    args = moe_inputs(dtype=dtype)
    matches, out = fuse(moe_layer, args, ("swiglu_moe", "geglu_moe"))
    x, w, ids, gu, d, sg, sgu, sd = args
    gate, up = F.linear(x, sgu).chunk(2, dim=-1)
    want = ref_swiglu_moe(x, w, ids, gu, d) + torch.sigmoid(F.linear(x, sg)) * F.linear(F.silu(gate) * up, sd)
    assert matches == {"swiglu_moe": 1}
    torch.testing.assert_close(out, want, atol=tol(dtype), rtol=tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, dynamic", [(6, True), (1, False)])
def test_swiglu_fuses_on_the_gpus_graph(dtype, n, dynamic):
    assert inspect(moe_layer, lambda: moe_inputs(n=n, dtype=dtype), ("swiglu_moe",), dtype=dtype,
                   dynamic=dynamic)["swiglu_moe"] == 1


def test_expert_parallel_slice_fuses_with_shifted_ids():
    args = moe_inputs(experts=E // 2)
    matches, out = fuse(local_experts, args, ("swiglu_moe",))
    x, w, ids, gu, d = args[:5]
    assert matches["swiglu_moe"] == 1
    torch.testing.assert_close(out, ref_swiglu_moe(x, w, ids - E // 2, gu, d), atol=1e-5, rtol=1e-5)


def test_each_moe_pass_takes_its_own_activation_only():
    assert inspect(gelu_experts, lambda: moe_inputs(), ("swiglu_moe", "geglu_moe")) == {"geglu_moe": 1}
    assert inspect(moe_layer, lambda: moe_inputs(), ("geglu_moe",))["geglu_moe"] == 0
