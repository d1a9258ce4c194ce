"""The compiler's Inductor code-generation choices (compiler/codegen.py) and the fused norm left to Inductor on
the GPU (ops/norm.py's "inductor" provider): both decide what a GPU decode step runs, and both are checked
here on the CPU, the first at Inductor's decision point, the second at the resolver and the pass manager."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import sympy
import torch

from compiled_llm.compiler import codegen


class Features:  # what Inductor's persistent-reduction heuristic reads of a kernel
    def __init__(self, numel: int, hint):
        self.reduction_numel = sympy.Integer(numel)
        self.numel = sympy.Integer(1)
        self.hint = hint

    def get_reduction_hint(self):
        return self.hint

    def strict_sum_rblock(self):
        return None

    def has_strict_sum_multirow_reduction(self):
        return False


def test_rows_of_a_layer_norm_are_reduced_in_registers():
    """A row of 2,816 (Gemma 4 26B-A4B's hidden size) is a looped reduction for Inductor's own heuristic and a
    persistent one for ours; wider than the limit or another kind of reduction, ours answers as Inductor
    does."""
    from torch._inductor.choices import InductorChoices
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.sizevars import SizeVarAllocator
    from torch._inductor.virtualized import V

    inner, outer = ReductionHint.INNER, ReductionHint.OUTER
    with V.set_graph_handler(SimpleNamespace(sizevars=SizeVarAllocator())):
        ours = codegen.choices(8192)
        assert not InductorChoices.should_use_persistent_reduction(Features(2816, inner), False)
        assert ours.should_use_persistent_reduction(Features(2816, inner), False)
        assert ours.should_use_persistent_reduction(Features(8192, inner), False)
        assert ours.should_use_persistent_reduction(Features(512, inner), False)  # Inductor's own yes stays
        assert not ours.should_use_persistent_reduction(Features(8193, inner), False)
        assert not ours.should_use_persistent_reduction(Features(2816, outer), False)
        assert not codegen.choices(1024).should_use_persistent_reduction(Features(2816, inner), False)


def test_the_limit_comes_from_the_environment_and_keys_the_cache(monkeypatch):
    from torch._inductor.choices import InductorChoices
    from torch._inductor.virtualized import V

    monkeypatch.delenv(codegen.ENV, raising=False)
    assert codegen.persistent_rows() == codegen.DEFAULT_PERSISTENT_ROWS
    default_key = codegen.cache_key()
    with codegen.heuristics():
        assert V.choices.rows == codegen.DEFAULT_PERSISTENT_ROWS
    assert type(V.choices) is InductorChoices  # restored on exit
    monkeypatch.setenv(codegen.ENV, "0")  # Inductor's own heuristic
    with codegen.heuristics():
        assert type(V.choices) is InductorChoices
    assert codegen.cache_key() != default_key
    monkeypatch.setenv(codegen.ENV, "wide")
    with pytest.raises(ValueError, match=codegen.ENV):
        codegen.persistent_rows()


def test_inductor_pdl_only_for_cuda_compiles_on_sm90_and_keys_the_cache(monkeypatch):
    """Inductor's kernels take programmatic dependent launch where the compile is for CUDA on sm_90 or later, the
    GPU answering; not for a CPU compile, an older GPU, no GPU at all, or with COMPILED_LLM_INDUCTOR_PDL=0. The
    choice is part of the cache key (a compile cache made without it is not reused with it)."""
    monkeypatch.delenv(codegen.PDL_ENV, raising=False)
    cap = {"value": (9, 0)}

    def capability(*args, **kwargs):
        if cap["value"] is None:
            raise RuntimeError("Found no NVIDIA driver on your system")
        return cap["value"]

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    assert codegen.inductor_pdl("cuda") and not codegen.inductor_pdl("cpu")
    on = codegen.cache_key("cuda")
    assert on.endswith(",inductor_pdl") and codegen.cache_key("cpu") == on.removesuffix(",inductor_pdl")
    for cap["value"] in ((8, 0), None):
        assert not codegen.inductor_pdl("cuda") and codegen.cache_key("cuda") != on
    cap["value"] = (10, 0)
    assert codegen.inductor_pdl("cuda")
    monkeypatch.setenv(codegen.PDL_ENV, "0")
    assert not codegen.inductor_pdl("cuda") and codegen.cache_key("cuda") != on


def test_fused_norm_is_left_to_inductor_on_the_gpu_and_ours_when_forced():
    """On a CUDA device with Triton the fused add + RMSNorm resolves to Inductor's own kernel: the pass counts
    its matches (the fusion check holds) and leaves the graph, so Inductor fuses the norms around it. Forcing
    our Triton kernel makes the pass replace again; the CPU keeps the reference (its engine counts anyway)."""
    from compiled_llm.models.gemma4 import Gemma4ForCausalLM  # noqa: F401  (registers the ops)
    from compiled_llm.ops.registry import INDUCTOR, OPS, Capabilities, preserved_choices
    from compiled_llm.passes.manager import PassManager

    spec = OPS["fused_add_rms_norm"]
    cuda = Capabilities("cuda", (9, 0), frozenset({"triton"}))
    assert spec.resolve(cuda, {})[0].name == INDUCTOR
    assert spec.resolve(Capabilities("cuda", (9, 0), frozenset()), {})[0].name == "reference"
    assert spec.resolve(Capabilities("cpu", None, frozenset({"triton"}), True), {})[0].name == "triton"
    with preserved_choices():
        spec.select(cuda, {})
        assert PassManager(("add_rms_norm",), torch.bfloat16, "cuda").unfused == ("add_rms_norm",)
        spec.select(cuda, {}, force="triton")
        assert PassManager(("add_rms_norm",), torch.bfloat16, "cuda").unfused == ()
    # the inductor provider's target is the reference: a call outside a compiled graph computes the same
    x, r, w = torch.randn(3, 16), torch.randn(3, 16), torch.randn(16)
    got = spec.providers[0].load()(x, r, w, 1e-6)
    want = spec.reference()(x, r, w, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
