"""RMSNorm + residual add: the model's add followed by its norm fuses; look-alikes that compute something
else (another exponent, another reduction dim, no residual add) are left alone."""

from __future__ import annotations

import pytest
import torch

from compiled_llm.ops.norm import ref_fused_add_rms_norm, ref_rms_norm
from pass_utils import fuse, inspect

PASSES = ("add_rms_norm",)


def add_norm(x, residual, weight):
    s = residual + x
    return ref_rms_norm(s, weight, 1e-6), s


def fourth_power(x, residual, weight):  # x / mean(x^4)^(1/2): the same shape of graph, another exponent
    s = residual + x
    h = s.float()
    return (h * torch.pow(h.pow(4).mean(-1, keepdim=True) + 1e-6, -0.5) * weight.float()).type_as(s), s


def first_dim(x, residual, weight):  # statistics over the tokens instead of the features
    s = residual + x
    h = s.float()
    return (h * torch.pow(h.pow(2).mean(0, keepdim=True) + 1e-6, -0.5) * weight.float()).type_as(s), s


def inputs(n=5, h=32, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, h, generator=g).to(dtype), torch.randn(n, h, generator=g).to(dtype),
            (1 + 0.3 * torch.randn(h, generator=g)).to(dtype)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_then_norm_fuses_and_computes_the_same(dtype):
    args = inputs(dtype=dtype)
    matches, (y, s) = fuse(add_norm, args, PASSES)
    want_y, want_s = ref_fused_add_rms_norm(*args, 1e-6)
    assert matches["add_rms_norm"] == 1
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y, want_y, atol=tol, rtol=tol)
    torch.testing.assert_close(s, want_s)


@pytest.mark.parametrize("fn", [fourth_power, first_dim])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_look_alikes_are_left_alone(fn, device):
    assert inspect(fn, lambda: inputs(), PASSES, device=device)["add_rms_norm"] == 0
    assert inspect(add_norm, lambda: inputs(), PASSES, device=device)["add_rms_norm"] == 1  # the control


def test_a_look_alike_keeps_its_own_result():
    args = inputs()
    matches, (y, _) = fuse(fourth_power, args, PASSES)
    assert matches["add_rms_norm"] == 0
    torch.testing.assert_close(y, fourth_power(*args)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_one_token_static_graph_fuses(dtype):
    """A static batch size of 1 compiles a graph Inductor canonicalises differently (size-1 dims)."""
    assert inspect(add_norm, lambda: inputs(n=1, dtype=dtype), PASSES, dtype=dtype, dynamic=False)["add_rms_norm"] == 1
