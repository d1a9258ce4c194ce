"""The compiler's self-check (compiler/verify.py): per layer and per compile, the fusions that matched
against those the model declares; a dense MoE fallback refuses to serve."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch

from compiled_llm import LLM
from compiled_llm.compiler.verify import FusionCheckError, Mismatch, compare, per_layer, verify

EXPECTED = {0: {"add_rms_norm": 2, "geglu_moe": 1}, 1: {"add_rms_norm": 2, "geglu_moe": 1}}
ALL_FOUND = Counter({"add_rms_norm": 4, "add_rms_norm@0": 2, "add_rms_norm@1": 2, "geglu_moe": 2, "geglu_moe@0": 1,
                     "geglu_moe@1": 1})


def test_per_layer_reads_the_layer_keys_only():
    assert per_layer(Counter({"x": 3, "x@2": 1, "x@-": 2, "y@2": 5})) == {2: Counter(x=1, y=5), None: Counter(x=2)}


def test_compare_names_each_compile_layer_and_pass_that_differs():
    short = Counter(ALL_FOUND)
    short["geglu_moe@1"] = 0
    extra = Counter(ALL_FOUND)
    extra["add_rms_norm@1"] += 1
    got = compare(EXPECTED, {"dynamic": ALL_FOUND, "8": short, "1/g1": extra}, {"add_rms_norm", "geglu_moe"})
    assert got == [Mismatch("8", 1, "geglu_moe", 1, 0), Mismatch("1/g1", 1, "add_rms_norm", 2, 3)]
    assert compare(EXPECTED, {"dynamic": short}, {"add_rms_norm"}) == []  # passes not enabled are not judged


def test_warn_mode_logs_each_shortfall_and_error_mode_raises(caplog):
    short = Counter(ALL_FOUND)
    short["add_rms_norm@0"] = 1
    with caplog.at_level(logging.WARNING, logger="compiled_llm"):
        problems = verify(EXPECTED, {"dynamic": short}, {"add_rms_norm", "geglu_moe"}, "warn", num_experts=128)
    assert problems == [Mismatch("dynamic", 0, "add_rms_norm", 2, 1)]
    assert "layer 0: add_rms_norm matched 1 of 2 in the dynamic compile" in caplog.text
    with pytest.raises(FusionCheckError, match="layer 0: add_rms_norm matched 1 of 2"):
        verify(EXPECTED, {"dynamic": short}, {"add_rms_norm", "geglu_moe"}, "error")
    with pytest.raises(ValueError, match="warn, error"):
        verify(EXPECTED, {"dynamic": ALL_FOUND}, set(), "ignore")


def test_a_dense_moe_fallback_is_an_error_even_when_warning_or_with_the_pass_off():
    short = Counter(ALL_FOUND)
    short["geglu_moe@1"] = 0
    for enabled in ({"add_rms_norm", "geglu_moe"}, {"add_rms_norm"}):
        with pytest.raises(FusionCheckError, match="all 128 experts on every token"):
            verify(EXPECTED, {"dynamic": short}, enabled, "warn", num_experts=128)
    # a handful of experts: the dense sum is affordable, a warning
    assert verify(EXPECTED, {"dynamic": short}, {"add_rms_norm", "geglu_moe"}, "warn", num_experts=8)


def test_a_dense_swiglu_fallback_is_an_error_too():
    """Qwen3.5's routed experts come from the SwiGLU MoE pass: its miss on a 256-expert model refuses to serve,
    also with the pass switched off; Gemma's GEGLU count (declared 0 there) is judged alongside and holds."""
    expected = {0: {"add_rms_norm": 2, "swiglu_moe": 1}}
    short = Counter({"add_rms_norm@0": 2})
    for enabled in ({"add_rms_norm", "swiglu_moe"}, {"add_rms_norm"}):
        with pytest.raises(FusionCheckError, match=r"MoE fusion \(swiglu_moe\) missed.*all 256 experts"):
            verify(expected, {"dynamic": short}, enabled, "warn", num_experts=256)
    assert verify(expected, {"dynamic": Counter({"add_rms_norm@0": 2, "swiglu_moe@0": 1})}, {"add_rms_norm"}, "error",
                  num_experts=256) == []


@pytest.mark.slow  # 21 s: starts a compiled engine; the refusal rule itself is the fast test above
def test_a_compiled_moe_engine_without_the_routed_op_refuses_to_start(tiny_ckpt):
    folder, _ = tiny_ckpt("moe16")
    with pytest.raises(FusionCheckError, match=r"layer 0: geglu_moe matched 0 of 1 in the dynamic compile"):
        LLM(str(folder), enforce_eager=False, block_size=4, max_model_len=64, num_kv_blocks=32, dtype="float32",
            compile_passes="add_rms_norm,qk_norm_rope_kv_write,router_topk")


def test_an_fx_cache_hit_from_another_layer_counts_for_this_layer(tiny_ckpt):
    """`softcap` ([sliding, full]) ends with the same graph piece as `dense` ([sliding, full] x 2): its layer 1
    and dense's layer 3 compile to one Inductor graph, so the second model's last piece is an FX-cache hit.
    Match counts replayed from it must count for this model's layer (they are kept relative to the piece's
    first layer), or the check would see layer 3's fusions in a two-layer model and refuse to start."""
    from torch._dynamo.utils import counters

    kw = dict(enforce_eager=False, block_size=4, max_model_len=64, num_kv_blocks=32, dtype="float32",
              fusion_check="error")
    LLM(str(tiny_ckpt("dense")[0]), **kw)
    hits = counters["inductor"]["fxgraph_cache_hit"]
    llm = LLM(str(tiny_ckpt("softcap")[0]), **kw)
    assert counters["inductor"]["fxgraph_cache_hit"] > hits
    got = per_layer(llm.engine.executor.runner.compiler.compiled.matches_by_shape()["dynamic"])
    layer = Counter(qk_norm_rope_kv_write=1, add_rms_norm=1, skinny_mm=4)  # skinny_mm: the CPU's oneDNN projections
    assert got == {0: layer, 1: layer}


def test_a_static_compile_that_misses_a_fusion_replays_the_dynamic_compile(tiny_ckpt, monkeypatch, caplog):
    """Seen on the H200: a static batch-size compile sometimes missed the GEGLU MoE fusion its dynamic compile
    got. That size then replays the dynamic compile (tokens unchanged), with a warning, instead of running
    every expert on every token or refusing to start."""
    from compiled_llm import SamplingParams
    from compiled_llm.passes.geglu_moe import GegluMoEPass

    real = GegluMoEPass.__call__

    def only_dynamic(self, graph):  # the pass misses every graph whose token count is static
        dims = [d for n in graph.nodes if n.op == "placeholder" and hasattr(n.meta.get("val"), "shape")
                for d in n.meta["val"].shape]
        return real(self, graph) if any(isinstance(d, torch.SymInt) for d in dims) else 0

    monkeypatch.setattr(GegluMoEPass, "__call__", only_dynamic)
    folder, _ = tiny_ckpt("moe")
    kw = dict(block_size=4, max_model_len=64, num_kv_blocks=32, dtype="float32")
    with caplog.at_level(logging.WARNING, logger="compiled_llm"):
        llm = LLM(str(folder), enforce_eager=False, cudagraph_batch_sizes="2", compile_sizes="all", fusion_check="error",
                  jit_monitor="error", **kw)
    assert "the static compile for 2 tokens missed geglu_moe" in caplog.text
    pieces = llm.engine.executor.runner.compiler.compiled.backend.pieces
    moe_pieces = [p for p in pieces if p.matches["dynamic"]["geglu_moe"]]
    assert moe_pieces and all(p.static[2] is p.dynamic for p in moe_pieces)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 10]}]
    eager = LLM(str(folder), enforce_eager=True, **kw)
    assert ([o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in eager.generate(prompts, params)])
