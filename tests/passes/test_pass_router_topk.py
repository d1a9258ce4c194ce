"""Router + top-k: ops/moe.py `ref_router_topk` (what Gemma 4's router calls) fuses, on the CPU's graph and
on the GPU's (where Inductor's own post-grad passes rewrite softmax: ours run before them); a router
with another softmax dim or another selection is left alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compiled_llm.ops.moe import ref_router_topk
from compiled_llm.ops.norm import ref_rms_norm
from pass_utils import fuse, inspect

PASSES = ("router_topk",)
E, H, K = 16, 32, 4


def router(x, proj, scale, per_expert):
    return ref_router_topk(x, proj, scale, per_expert, K, 1e-6, H ** -0.5)


def smallest(x, proj, scale, per_expert):  # picks the least likely experts
    h = ref_rms_norm(x, None, 1e-6) * scale * H ** -0.5
    probs = torch.softmax(F.linear(h, proj), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, K, dim=-1, largest=False)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * per_expert[ids], ids


def no_renormalise(x, proj, scale, per_expert):
    h = ref_rms_norm(x, None, 1e-6) * scale * H ** -0.5
    probs = torch.softmax(F.linear(h, proj), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, K, dim=-1)
    return weights * per_expert[ids], ids


def inputs(n=6, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, H, generator=g).to(dtype), (0.2 * torch.randn(E, H, generator=g)).to(dtype),
            (1 + 0.3 * torch.randn(H, generator=g)).to(dtype), (1 + 0.3 * torch.randn(E, generator=g)).to(dtype)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_fuses_and_picks_the_same_experts(dtype):
    args = inputs(dtype=dtype)
    matches, (w, ids) = fuse(router, args, PASSES)
    want_w, want_ids = router(*args)
    assert matches["router_topk"] == 1
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dynamic", [True, False])
def test_router_fuses_on_the_gpus_graph(dtype, dynamic):
    n = 6 if dynamic else 1
    assert inspect(router, lambda: inputs(n=n, dtype=dtype), PASSES, dtype=dtype, dynamic=dynamic)["router_topk"] == 1


@pytest.mark.parametrize("fn", [smallest, no_renormalise])
def test_other_routers_are_left_alone(fn):
    assert inspect(fn, lambda: inputs(), PASSES)["router_topk"] == 0
