"""The skinny_mm op's CPU provider (ops/linear.py packed_mm): each parameter reordered once into oneDNN's layout,
every later product through that copy where oneDNN measured faster than torch.mm for the shape (or is pinned);
the engine's compiled CPU path and its LM head take it."""

from __future__ import annotations

import pytest
import torch

from compiled_llm.ops import linear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")


@pytest.fixture
def pinned_onednn(monkeypatch):
    monkeypatch.setattr(linear, "PINNED", "onednn")


def test_packed_products_equal_mm_and_each_parameter_is_packed_once(pinned_onednn):
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(96, 64, generator=g), requires_grad=False)
    before = linear.PACKS[0]
    for m in (1, 3, 8, 16):
        x = torch.randn(m, 64, generator=g)
        torch.testing.assert_close(linear.packed_mm(x, w), x @ w.t(), rtol=1e-5, atol=1e-4)
    assert linear.PACKS[0] == before + 1  # one copy for every row count
    x = torch.randn(4, 128, generator=g)[:, ::2]  # a strided input is made contiguous first
    torch.testing.assert_close(linear.packed_mm(x, w), x @ w.t(), rtol=1e-5, atol=1e-4)
    with torch.no_grad():  # a weight written in place (a reload) is packed again
        w.copy_(torch.randn(96, 64, generator=g))
    torch.testing.assert_close(linear.packed_mm(x, w), x @ w.t(), rtol=1e-5, atol=1e-4)
    assert linear.PACKS[0] == before + 2
    plain = torch.randn(96, 64, generator=g)  # not a parameter: torch.mm, nothing kept
    torch.testing.assert_close(linear.packed_mm(x, plain), x @ plain.t())
    assert linear.PACKS[0] == before + 2 and "_onednn_packed" not in plain.__dict__


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no bfloat16 oneDNN on this CPU")
def test_packed_products_in_bfloat16(pinned_onednn):
    g = torch.Generator().manual_seed(1)
    w = torch.nn.Parameter(torch.randn(128, 256, generator=g).bfloat16(), requires_grad=False)
    x = torch.randn(8, 256, generator=g).bfloat16()
    got = linear.packed_mm(x, w)
    assert got.dtype == torch.bfloat16
    want = x.float() @ w.float().t()  # both round a float32 sum once: within a bfloat16 step or two
    assert ((got.float() - want).abs() <= 2 * 2.0 ** -7 * want.abs().clamp(min=1.0)).all()


def test_the_cpu_resolver_picks_onednn_with_its_reasons():
    from compiled_llm.ops.registry import Capabilities

    cpu = Capabilities("cpu", None, frozenset({"triton"}))
    assert linear.SKINNY_MM.resolve(cpu, {"dtype": torch.float32})[0].name == "onednn"
    provider, skipped = linear.SKINNY_MM.resolve(cpu, {"dtype": torch.float16})
    assert provider.name == "reference" and any("float16" in why for why in skipped)
    cuda = Capabilities("cuda", (9, 0), frozenset({"triton"}))
    assert linear.SKINNY_MM.resolve(cuda, {"dtype": torch.bfloat16})[0].name == "triton"
    assert linear.takes(64, 64, 8, linear.CPU) and not linear.takes(64, 64, 17, linear.CPU)
    assert not linear.takes(64, 64, 8, None)  # on a GPU such a small weight stays on cuBLAS


def test_prefill_rows_take_the_packed_weights_where_onednn_is_chosen(pinned_onednn):
    """Past SKINNY_MAX_ROWS (a prefill) the op keeps oneDNN's packed copy on the CPU (faster than torch's mm at
    these shapes); another provider's engine runs torch's mm there, as before."""
    from compiled_llm.ops.registry import Capabilities, preserved_choices

    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 128, generator=g)
    for provider in ("onednn", "reference"):
        w = torch.nn.Parameter(torch.randn(96, 128, generator=g), requires_grad=False)
        with preserved_choices(), torch.inference_mode():
            linear.SKINNY_MM.select(Capabilities("cpu", None, frozenset()), {"dtype": torch.float32}, force=provider)
            got = torch.ops.compiled_llm.skinny_mm(x, w)
        torch.testing.assert_close(got, x @ w.t(), rtol=1e-5, atol=1e-4)
        assert ("_onednn_packed" in w.__dict__) is (provider == "onednn")


def test_the_cpu_product_is_measured_once_a_shape_and_row_bucket(monkeypatch):
    """Unpinned, the first call of a (weight shape, dtype, row bucket) times torch.mm against oneDNN's packed copy and
    every later call of that key takes the faster; a weight whose shape chose torch.mm is never packed."""
    monkeypatch.setattr(linear, "PINNED", None)
    monkeypatch.setattr(linear, "CPU_CHOICES", {})
    verdict, measured = {}, []

    def fake_measure(x, w, p):  # the verdict this test sets for the shape; p is the packed copy timed
        measured.append((tuple(w.shape), linear.row_bucket(x.shape[0])))
        assert p is w.__dict__["_onednn_packed"][1]
        return verdict[tuple(w.shape)], 1e-5, 2e-5

    monkeypatch.setattr(linear, "_measure", fake_measure)
    g = torch.Generator().manual_seed(3)
    fast_dnn = torch.nn.Parameter(torch.randn(80, 32, generator=g), requires_grad=False)
    fast_mm = torch.nn.Parameter(torch.randn(48, 32, generator=g), requires_grad=False)
    verdict.update({(80, 32): "onednn", (48, 32): "mm"})
    for m in (5, 8, 6, 1, 40):
        x = torch.randn(m, 32, generator=g)
        for w in (fast_dnn, fast_mm):
            torch.testing.assert_close(linear.packed_mm(x, w), x @ w.t(), rtol=1e-5, atol=1e-4)
    # buckets 8 (5, 8 and 6 rows), 1 and 64, each measured once per shape
    assert measured == [((80, 32), 8), ((48, 32), 8), ((80, 32), 1), ((48, 32), 1), ((80, 32), 64), ((48, 32), 64)]
    assert linear.CPU_CHOICES[(48, 32, torch.float32, 8)] == "mm"
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or real(*a))
    twin = torch.nn.Parameter(torch.randn(48, 32, generator=g), requires_grad=False)  # same shape, chose mm
    linear.packed_mm(torch.randn(7, 32, generator=g), twin)
    assert not calls and "_onednn_packed" not in twin.__dict__  # not packed, not measured again
    linear.packed_mm(torch.randn(7, 32, generator=g), fast_dnn)
    assert calls == [1]
    monkeypatch.setattr(linear, "PINNED", "onednn")  # the pin overrides a measured choice
    linear.packed_mm(torch.randn(7, 32, generator=g), twin)
    assert calls == [1, 1] and "_onednn_packed" in twin.__dict__
    monkeypatch.setattr(linear, "PINNED", "mkl")
    with pytest.raises(ValueError, match="onednn or mm"):
        linear.packed_mm(torch.randn(7, 32, generator=g), twin)


def test_faster_takes_the_lower_best_time_and_measuring_returns_a_verdict():
    assert linear.faster([3.0, 1.0], [1.5, 1.2]) == "mm"
    assert linear.faster([3.0, 2.0], [9.0, 1.9]) == "onednn"
    assert [linear.row_bucket(m) for m in (0, 1, 2, 3, 8, 9, 16, 17, 4096, 5000)] == [1, 1, 2, 4, 8, 16, 16, 32, 4096,
                                                                                     4096]
    w = torch.nn.Parameter(torch.randn(64, 32), requires_grad=False)
    x = torch.randn(8, 32)
    choice, t_mm, t_dnn = linear._measure(x, w, linear._packed(w))
    assert choice in ("mm", "onednn") and t_mm > 0 and t_dnn > 0


def test_the_env_var_pins_the_library_in_a_new_process():
    import subprocess
    import sys

    code = ("import torch; from compiled_llm.ops import linear; "
            "w = torch.nn.Parameter(torch.randn(8, 4), requires_grad=False); "
            "linear.packed_mm(torch.randn(2, 4), w); print(linear.PINNED, '_onednn_packed' in w.__dict__)")
    env = dict(__import__("os").environ, COMPILED_LLM_CPU_MM="onednn")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["onednn", "True"]


def test_added_wide_shapes_join_the_gpu_table_with_their_launch(monkeypatch):
    """COMPILED_LLM_SKINNY_WIDE_ADD (an A/B before a shape enters WIDE_MEASURED): its wide weights are the op's on any
    GPU model at a decode batch's rows, on the unsplit launch or, marked ":split", on the narrow weights' split one;
    "none" adds nothing and a wrong launch name is refused. COMPILED_LLM_SKINNY_SPLIT sets the split launch's slices."""
    import dataclasses

    from compiled_llm.ops.triton import skinny_gemm

    monkeypatch.setenv(linear.WIDE_ADD_ENV, "4224x2816:split, 2816x2112")
    assert linear.added_wide() == {(4224, 2816): True, (2816, 2112): False}
    assert linear.takes(4224, 2816, 4, "Some GPU") and linear.takes(2816, 2112, 1, "Some GPU")
    assert not linear.takes(4224, 2816, 17, "Some GPU") and not linear.takes(4096, 2816, 4, "Some GPU")
    assert skinny_gemm.decode_launch(4224, 2816) == skinny_gemm.DECODE_LAUNCH
    assert skinny_gemm.decode_launch(2816, 2112) == skinny_gemm.WIDE_LAUNCH
    monkeypatch.setenv(skinny_gemm.SPLIT_ENV, "3")  # the split launch's K slices (an A/B of its 4)
    assert skinny_gemm.decode_launch(2816, 4096) == dataclasses.replace(skinny_gemm.DECODE_LAUNCH, split_k=3)
    assert skinny_gemm.decode_launch(4224, 2816).split_k == 3 and skinny_gemm.decode_launch(2816, 2112).split_k == 1
    monkeypatch.delenv(skinny_gemm.SPLIT_ENV)
    monkeypatch.setenv(linear.WIDE_ENV, "0")  # the whole wide table off, the added shapes with it
    assert not linear.takes(4224, 2816, 4, "Some GPU")
    monkeypatch.delenv(linear.WIDE_ENV)
    monkeypatch.setenv(linear.WIDE_ADD_ENV, "none")
    assert linear.added_wide() == {} and not linear.takes(4224, 2816, 4, "Some GPU")
    monkeypatch.setenv(linear.WIDE_ADD_ENV, "4224x2816:wide")
    with pytest.raises(ValueError, match="NxK:split"):
        linear.added_wide()
