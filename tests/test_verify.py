"""The compiler's self-check (compiler/verify.py): per layer and per compile, the fusions that matched
against those the model declares; a dense MoE fallback refuses to serve."""

from __future__ import annotations

import logging
from collections import Counter

import pytest

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


def test_a_compiled_moe_engine_without_the_routed_op_refuses_to_start(tiny_ckpt):
    folder, _ = tiny_ckpt("moe16")
    with pytest.raises(FusionCheckError, match=r"layer 0: geglu_moe matched 0 of 1 in the dynamic compile"):
        LLM(str(folder), enforce_eager=False, block_size=4, max_model_len=64, num_kv_blocks=32, dtype="float32",
            compile_passes="add_rms_norm,qk_norm_rope_kv_write,router_topk")
