"""MoE overlap: after the router and MoE fusions, a layer's router + routed op become moe_start (before the dense
branch) and moe_join (after it), in Gemma 4's form (normed router, GEGLU experts beside a dense MLP), Qwen3.5's
(softmax router with its weights cast, SwiGLU experts beside the shared expert) and expert parallel's (ids
shifted); the compiled result equals eager, the generated code keeps the dense branch between the two, and a
router whose picks feed anything else is left alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

from compiled_llm.ops.activation import gelu_tanh
from compiled_llm.ops.moe import dense_gated_moe, ref_router_topk, ref_softmax_router_topk
from compiled_llm.ops.norm import ref_rms_norm
from pass_utils import fuse, inspect

PASSES = ("router_topk", "geglu_moe", "swiglu_moe", "moe_overlap")
E, H, I, K, D = 8, 32, 12, 2, 40  # D: the dense branch's intermediate size


def gemma_ffn(x, router_w, scale, pes, n2, gate_up, down, n1, mlp_gu, mlp_d, first=0):
    """Gemma 4's MoE layer after attention, in the model's order: the routed branch's inputs, then the dense MLP."""
    w, ids = ref_router_topk(x, router_w, scale, pes, K, 1e-6, H ** -0.5)
    routed = dense_gated_moe(ref_rms_norm(x, n2, 1e-6), w, ids, gate_up, down, gelu_tanh, first + gate_up.shape[0],
                             first).to(x.dtype)
    g, u = F.linear(ref_rms_norm(x, n1, 1e-6), mlp_gu).chunk(2, dim=-1)
    y = F.linear(gelu_tanh(g) * u, mlp_d)
    return ref_rms_norm(y, n1, 1e-6) + ref_rms_norm(routed, n2, 1e-6)


def gemma_ffn_ep(x, router_w, scale, pes, n2, gate_up, down, n1, mlp_gu, mlp_d):
    """Expert parallel: this rank holds experts [E/2, E); ids are global."""
    return gemma_ffn(x, router_w, scale, pes, n2, gate_up, down, n1, mlp_gu, mlp_d, first=E // 2)


def picks_used_twice(x, router_w, scale, pes, n2, gate_up, down, n1, mlp_gu, mlp_d):
    """The router's weights also feed the output: the routed branch cannot leave the main stream."""
    w, ids = ref_router_topk(x, router_w, scale, pes, K, 1e-6, H ** -0.5)
    routed = dense_gated_moe(ref_rms_norm(x, n2, 1e-6), w, ids, gate_up, down, gelu_tanh, E).to(x.dtype)
    return routed + w.sum(-1, keepdim=True).to(x.dtype)


def qwen_moe(x, router_w, shared_gu, shared_d, shared_gate, gate_up, down):
    """Qwen3.5's sparse MoE block: softmax router (weights cast to the model's dtype), the shared expert, the
    routed SwiGLU experts, their sum."""
    w, ids = ref_softmax_router_topk(x, router_w, K)
    g, u = F.linear(x, shared_gu).chunk(2, dim=-1)
    shared = torch.sigmoid(F.linear(x, shared_gate)) * F.linear(F.silu(g) * u, shared_d)
    routed = dense_gated_moe(x, w.to(x.dtype), ids, gate_up, down, F.silu, E).to(x.dtype)
    return routed + shared


def gemma_inputs(n=6, dtype=torch.float32, experts=E):
    g = torch.Generator().manual_seed(0)
    r = lambda *s, a=0.2: (a * torch.randn(*s, generator=g)).to(dtype)  # noqa: E731
    norm = lambda: (1 + 0.3 * torch.randn(H, generator=g)).to(dtype)  # noqa: E731
    return [torch.randn(n, H, generator=g).to(dtype), r(E, H, a=1.0), norm(), (0.5 + torch.rand(E, generator=g)).to(dtype),
            norm(), r(experts, 2 * I, H), r(experts, H, I), norm(), r(2 * D, H), r(H, D)]


def qwen_inputs(n=6, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    r = lambda *s, a=0.2: (a * torch.randn(*s, generator=g)).to(dtype)  # noqa: E731
    return [torch.randn(n, H, generator=g).to(dtype), r(E, H, a=1.0), r(2 * D, H), r(H, D), r(1, H), r(E, 2 * I, H),
            r(E, H, I)]


def _order(code: str) -> tuple[int, int, list[int]]:
    start, join = code.index("compiled_llm.moe_start"), code.index("compiled_llm.moe_join")
    mms = [i for i in range(len(code)) if code.startswith("extern_kernels.mm(", i)]
    return start, join, mms


def _compiled(model: str, dtype):
    """The model's MoE block compiled by Inductor with the passes: (fn, args, its output, the generated code)."""
    from torch._inductor.compile_fx import compile_fx

    from compiled_llm.passes.manager import PassManager

    fn, args = (gemma_ffn, gemma_inputs(dtype=dtype)) if model == "gemma" else (qwen_moe, qwen_inputs(dtype=dtype))
    torch._dynamo.reset()
    pm = PassManager(PASSES, dtype, "cpu")
    compiled = torch.compile(fn, backend=lambda gm, ex: compile_fx(gm, ex, config_patches=pm.inductor_config()))
    with torch.inference_mode():
        out, codes = run_and_get_code(compiled, *args)
    return fn, args, out, "\n".join(codes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model", ["gemma", "qwen"])
def test_routed_branch_is_split_around_the_dense_branch(model, dtype):
    """Gemma 4: the dense MLP beside; Qwen3.5: the shared expert beside (softmax router, weights cast)."""
    fn, args, moe = ((gemma_ffn, gemma_inputs(dtype=dtype), "geglu_moe") if model == "gemma"
                     else (qwen_moe, qwen_inputs(dtype=dtype), "swiglu_moe"))
    matches, out = fuse(fn, args, PASSES)
    assert (matches["router_topk"], matches[moe], matches["moe_overlap"]) == (1, 1, 1)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out, fn(*args), atol=tol, rtol=tol)


@pytest.mark.parametrize("model, dtype, dense", [("gemma", torch.float32, 2), ("qwen", torch.bfloat16, 3)])
def test_the_generated_code_runs_the_dense_branch_between_start_and_join(model, dtype, dense):
    """Gemma 4: the dense MLP's gate/up and down GEMMs; Qwen3.5: the shared expert's gate/up, down and gate
    GEMMs (its routed op sits early in the graph, with the output's casts right after it)."""
    fn, args, out, code = _compiled(model, dtype)
    start, join, mms = _order(code)
    assert start < join
    assert len([i for i in mms if start < i < join]) == dense, (start, join, mms)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out, fn(*args), atol=tol, rtol=tol)


@pytest.mark.parametrize("model, dtype", [("gemma", torch.float32), ("qwen", torch.bfloat16)])
def test_the_routed_output_is_read_after_the_join(model, dtype):
    """moe_start returns the routed picks (the graph adds them); the join only waits, and is declared to write the
    start's output, so every kernel that reads it comes after the join in the generated code (on the GPU the side
    stream's work on it is done by then)."""
    import re

    fn, args, out, code = _compiled(model, dtype)
    start = code.index("torch.ops.compiled_llm.moe_start.default(")
    found = re.search(r"torch\.ops\.compiled_llm\.moe_join\.default\((buf\d+), ", code)
    routed, join = found.group(1), found.start()  # the start's output (some torch versions rename it once)
    assert start < join
    readers = [m for m in re.finditer(r"\n\s*(cpp_fused_\w+)\(([^)]*)\)", code)
               if routed in re.split(r"[\s,]+", m.group(2))]
    assert readers and all(m.start() > join for m in readers), [(m.group(1), m.start(), join) for m in readers]
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out, fn(*args), atol=tol, rtol=tol)


@pytest.mark.parametrize("model, dtype", [("gemma", torch.bfloat16), ("qwen", torch.bfloat16)])
def test_the_picks_added_in_the_graph_fuse_into_the_join_s_norm(monkeypatch, model, dtype):
    """By default the start returns each pick's weighted output [T, k, H] and the graph adds them after the join,
    inside the kernel that reads the routed output: as many kernels as with the start's own top-k sum
    (COMPILED_LLM_MOE_SUM_IN_NORM=0), the start called with slots, the compiles keyed apart, and the output equal
    to eager's."""
    import re

    from compiled_llm.passes.manager import PassManager
    from compiled_llm.passes.moe_overlap import SUM_ENV, UNROLL_SLOTS

    monkeypatch.setenv(SUM_ENV, "0")
    _, _, _, before = _compiled(model, dtype)
    summed = PassManager(PASSES, dtype, "cpu")
    monkeypatch.delenv(SUM_ENV)
    fn, args, out, code = _compiled(model, dtype)
    slots = PassManager(PASSES, dtype, "cpu")
    assert slots.uuid() != summed.uuid() and slots.inductor_config()["unroll_reductions_threshold"] == UNROLL_SLOTS
    assert "unroll_reductions_threshold" not in summed.inductor_config()
    call = lambda c: re.search(r"moe_start\.default\(([^\n]*)\)", c).group(1).split(", ")  # noqa: E731
    assert call(code)[-1] == "True" and len(call(code)) == len(call(before)) + 1  # the arguments, then slots
    kernels = lambda c: re.findall(r"\n\s*(cpp_fused_\w+)\(", c)  # noqa: E731
    assert len(kernels(code)) == len(kernels(before)), (kernels(code), kernels(before))
    torch.testing.assert_close(out, fn(*args), atol=3e-2, rtol=3e-2)


def test_more_picks_than_inductor_unrolls_stay_summed_by_the_start():
    """Nine picks a token: past the unroll threshold the graph's sum would be a reduction kernel of its own, so
    the start keeps its top-k sum (no slots argument) and the output is eager's."""
    import re

    g = torch.Generator().manual_seed(2)
    experts = 12
    x, router_w = torch.randn(5, H, generator=g), torch.randn(experts, H, generator=g)
    shared = [0.2 * torch.randn(*shape, generator=g) for shape in ((2 * D, H), (H, D), (1, H))]
    gate_up, down = 0.2 * torch.randn(experts, 2 * I, H, generator=g), 0.2 * torch.randn(experts, H, I, generator=g)

    def block(x, router_w, shared_gu, shared_d, shared_gate, gate_up, down):
        w, ids = ref_softmax_router_topk(x, router_w, 9)
        g_, u = F.linear(x, shared_gu).chunk(2, dim=-1)
        y = torch.sigmoid(F.linear(x, shared_gate)) * F.linear(F.silu(g_) * u, shared_d)
        return dense_gated_moe(x, w.to(x.dtype), ids, gate_up, down, F.silu, experts).to(x.dtype) + y

    from torch._inductor.compile_fx import compile_fx

    from compiled_llm.passes.manager import PassManager

    args = [x, router_w, *shared, gate_up, down]
    torch._dynamo.reset()
    pm = PassManager(PASSES, torch.float32, "cpu")
    assert pm.moe_sum_in_graph
    compiled = torch.compile(block, backend=lambda gm, ex: compile_fx(gm, ex, config_patches=pm.inductor_config()))
    with torch.inference_mode():
        out, codes = run_and_get_code(compiled, *args)
    call = re.search(r"moe_start\.default\(([^\n]*)\)", "\n".join(codes)).group(1).split(", ")
    assert call[7] == "9" and call[-1] == "False"  # ..., top_k, eps, root, first, activation, cast: no slots
    torch.testing.assert_close(out, block(*args), atol=1e-5, rtol=1e-5)


def test_expert_parallel_shift_moves_into_the_start():
    args = gemma_inputs(experts=E // 2)
    matches, out = fuse(gemma_ffn_ep, args, PASSES)
    assert matches["moe_overlap"] == 1
    torch.testing.assert_close(out, gemma_ffn_ep(*args), atol=1e-5, rtol=1e-5)


def test_picks_used_elsewhere_stay_on_the_main_stream():
    args = gemma_inputs()
    matches, out = fuse(picks_used_twice, args, PASSES)
    assert matches["geglu_moe"] == 1 and matches["moe_overlap"] == 0
    torch.testing.assert_close(out, picks_used_twice(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n, dynamic", [(6, True), (1, False), (8, False)])
def test_splits_on_the_gpus_graph(n, dynamic):
    got = inspect(gemma_ffn, lambda: gemma_inputs(n=n, dtype=torch.bfloat16), PASSES, dtype=torch.bfloat16,
                  dynamic=dynamic)
    assert got["moe_overlap"] == 1


def test_on_by_default_on_cuda_only(monkeypatch):
    from compiled_llm.passes.manager import PassManager

    assert "moe_overlap" in [p.name for p in PassManager(None, torch.bfloat16, "cuda").passes]
    assert "moe_overlap" not in [p.name for p in PassManager(None, torch.bfloat16, "cpu").passes]
    monkeypatch.setenv("COMPILED_LLM_MOE_OVERLAP", "0")
    assert "moe_overlap" not in [p.name for p in PassManager(None, torch.bfloat16, "cuda").passes]


def test_side_stream_priority_switch(monkeypatch):
    """COMPILED_LLM_MOE_SIDE_PRIORITY=high asks for the device's highest stream priority for the routed branch;
    by default the side stream has the normal one."""
    from compiled_llm.ops import moe_overlap

    monkeypatch.setattr(torch.cuda.Stream, "priority_range", staticmethod(lambda: (0, -5)))
    monkeypatch.delenv(moe_overlap.SIDE_PRIORITY_ENV, raising=False)
    assert moe_overlap.side_priority() == 0
    monkeypatch.setenv(moe_overlap.SIDE_PRIORITY_ENV, "high")
    assert moe_overlap.side_priority() == -5
