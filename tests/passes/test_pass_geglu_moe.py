"""GEGLU MoE: the dense expert sum the models trace (ops/moe.py `dense_gated_moe` with GELU-tanh) becomes the
routed geglu_moe op, also when the next RMSNorm's upcast meets the model's cast back to bfloat16 (torch
2.11 folds that pair, which once hid the pattern's end), on the GPU's graph, at one token, and with
expert parallelism's sliced routing; a sum with another activation is left alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compiled_llm.ops.activation import gelu_tanh
from compiled_llm.ops.moe import dense_gated_moe, ref_geglu_moe
from compiled_llm.ops.norm import ref_rms_norm
from pass_utils import fuse, inspect

PASSES = ("geglu_moe",)
E, H, I, K = 8, 32, 12, 2


def moe_then_norm(x, weights, ids, gate_up, down, norm_weight):
    """What a Gemma 4 MoE layer does with the experts' sum: cast back, then RMSNorm (which upcasts)."""
    y = dense_gated_moe(x, weights, ids, gate_up, down, gelu_tanh, gate_up.shape[0]).to(x.dtype)
    return ref_rms_norm(y, norm_weight, 1e-6)


def exact_gelu(x, weights, ids, gate_up, down, norm_weight):
    y = dense_gated_moe(x, weights, ids, gate_up, down, F.gelu, gate_up.shape[0]).to(x.dtype)
    return ref_rms_norm(y, norm_weight, 1e-6)


def local_experts(x, weights, ids, gate_up, down, norm_weight):
    """Expert parallel: this rank holds experts [4, 8) of 8; ids are global."""
    y = dense_gated_moe(x, weights, ids, gate_up, down, gelu_tanh, 2 * gate_up.shape[0], gate_up.shape[0]).to(x.dtype)
    return ref_rms_norm(y, norm_weight, 1e-6)


def inputs(n=6, dtype=torch.float32, experts=E):
    g = torch.Generator().manual_seed(0)
    weights, ids = torch.topk(torch.softmax(torch.randn(n, E, generator=g), -1), K, -1)  # global ids over E experts
    return [torch.randn(n, H, generator=g).to(dtype), weights, ids,
            (0.2 * torch.randn(experts, 2 * I, H, generator=g)).to(dtype),
            (0.2 * torch.randn(experts, H, I, generator=g)).to(dtype), (1 + 0.3 * torch.randn(H, generator=g)).to(dtype)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_sum_becomes_the_routed_op(dtype):
    args = inputs(dtype=dtype)
    matches, out = fuse(moe_then_norm, args, PASSES)
    x, w, ids, gu, d, nw = args
    want = ref_rms_norm(ref_geglu_moe(x, w, ids, gu, d), nw, 1e-6)
    assert matches["geglu_moe"] == 1
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, dynamic", [(6, True), (1, False), (8, False)])
def test_fuses_on_the_gpus_graph(dtype, n, dynamic):
    assert inspect(moe_then_norm, lambda: inputs(n=n, dtype=dtype), PASSES, dtype=dtype, dynamic=dynamic)[
        "geglu_moe"] == 1


def test_expert_parallel_slice_fuses_with_shifted_ids():
    args = inputs(experts=E // 2)  # this rank holds half of the E experts
    matches, out = fuse(local_experts, args, PASSES)
    x, w, ids, gu, d, nw = args
    assert matches["geglu_moe"] == 1
    torch.testing.assert_close(out, ref_rms_norm(ref_geglu_moe(x, w, ids - E // 2, gu, d), nw, 1e-6),
                               atol=1e-5, rtol=1e-5)


def test_another_activation_is_left_alone():
    assert inspect(exact_gelu, lambda: inputs(), PASSES)["geglu_moe"] == 0
    args = inputs()
    matches, out = fuse(exact_gelu, args, PASSES)
    assert matches["geglu_moe"] == 0
    torch.testing.assert_close(out, exact_gelu(*args), atol=1e-5, rtol=1e-5)
