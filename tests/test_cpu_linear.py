"""The skinny_mm op's CPU provider (ops/linear.py packed_mm): each parameter reordered once into oneDNN's layout,
every later product through that copy; the engine's compiled CPU path and its LM head take it."""

from __future__ import annotations

import pytest
import torch

from compiled_llm.ops import linear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")


def test_packed_products_equal_mm_and_each_parameter_is_packed_once():
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
def test_packed_products_in_bfloat16():
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


def test_prefill_rows_take_the_packed_weights_where_onednn_is_chosen():
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
