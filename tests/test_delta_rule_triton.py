"""Triton kernels of the recurrent-state ops (gated delta rule, causal conv1d) against the PyTorch references,
on the CPU through the Triton interpreter.

TRITON_INTERPRET must be set before triton is first imported, so the checks run as a script in a
subprocess (`python tests/test_delta_rule_triton.py <group> ...`), one for all the groups (tests/interp_groups.py);
each group's test checks that group's result.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from interp_groups import check, nan_empty, run_groups


@pytest.fixture(scope="module")
def group_results(request):
    """Every selected group in one interpreter subprocess (tests/interp_groups.py)."""
    pytest.importorskip("triton")
    return run_groups(request, __file__, "test_delta_rule_kernels")


@pytest.mark.parametrize("group", ["recurrent", "chunk", "conv1d", "conv_fused", "engine", "jit_keys"])
def test_delta_rule_kernels(group_results, group):
    check(group_results, group)


def test_recurrent_launch_keys_are_warmed(monkeypatch):
    """Every step's launches of the recurrent kernels (decode of 1 to 9 sequences, prefills of several) take a
    Triton specialisation (argument types, pointer alignment, integer divisibility) that the JIT warm-up built,
    so no batch size compiles a kernel mid-serving (the H200 compiled the conv kernel again at a 3-sequence
    decode: its `slots` pointer moved onto a 16-byte boundary inside the packed layout)."""
    pytest.importorskip("triton")
    jit = pytest.importorskip("triton.runtime.jit")
    if not hasattr(jit, "native_specialize_impl"):
        pytest.skip("this triton has no native_specialize_impl")
    import inspect

    import torch

    from compiled_llm.ops.state import StateLayout
    from compiled_llm.ops.triton import conv1d, delta_rule
    from triton.backends.compiler import BaseBackend

    keys, phase = {}, ["warm"]

    def recorder(name, kernel):
        params = list(inspect.signature(kernel.fn).parameters)
        fixed = {p.name for p in kernel.params if p.do_not_specialize}
        const = {p.name for p in kernel.params if p.is_constexpr}

        class Launch:
            def __getitem__(self, grid):
                def launch(*args, **kw):
                    # runtime arguments by their specialisation (the fused decode passes some by keyword),
                    # compile-time constants and launch options by value
                    runtime = list(zip(params, args)) + [(p, a) for p, a in sorted(kw.items()) if p not in const]
                    spec = tuple((p, jit.native_specialize_impl(BaseBackend, a, False, p not in fixed, True))
                                 for p, a in runtime if isinstance(a, (torch.Tensor, int)))
                    keys.setdefault(phase[0], set()).add((name, spec, tuple((p, a) for p, a in sorted(kw.items())
                                                                            if p in const or p not in params)))
                return launch
        return Launch()

    for mod in (conv1d, delta_rule):
        for name in [n for n, v in vars(mod).items() if n.endswith("_kernel") and hasattr(v, "params")]:
            monkeypatch.setattr(mod, name, recorder(name, getattr(mod, name)))
    dim, k, hk, hv, dk, dv = 96, 4, 2, 4, 16, 16
    conv1d._compile((torch.float32, dim, k), torch.device("cpu"))
    delta_rule._compile((torch.float32, hk, hv, dk, dv, k), torch.device("cpu"))
    phase[0] = "step"
    weight, conv_cache = torch.zeros(dim, k), torch.zeros(12, dim, k - 1)
    ssm_cache = torch.zeros(12, hv, dk, dv)
    qkv_dim = 2 * hk * dk + hv * dv  # the layer's conv channels (the fused decode's)
    qkv_weight, qkv_windows = torch.zeros(qkv_dim, k), torch.zeros(12, qkv_dim, k - 1)
    a_log, dt_bias, norm_w = torch.zeros(hv), torch.zeros(hv), torch.ones(dv)
    batches = [[1] * n for n in range(1, 10)] + [[5, 17, 30], [80], [3, 1, 1], [40, 60], [7, 1, 2, 19, 64, 3]]
    for lens in batches:
        qsl = [0]
        for n in lens:
            qsl.append(qsl[-1] + n)
        layout = StateLayout.build(list(range(len(lens))), [i % 2 == 0 for i in range(len(lens))], qsl, "cpu")
        n = qsl[-1]
        conv1d.causal_conv1d_varlen(torch.zeros(n, dim), weight, conv_cache, layout)
        q, k_, v, z, ba = delta_rule.model_views(n, hk, hv, dk, dv, torch.float32, "cpu")  # the model's layout
        delta_rule.gated_delta_rule_varlen(q, k_, v, None, None, ssm_cache, layout, gating=(ba, a_log, dt_bias),
                                           out_norm=(z, norm_w, 1e-6))
        if layout.decode and delta_rule.conv_in_recurrence(len(lens), dv, k):  # the conv in the recurrent launch
            qkv = ba.as_strided((n, qkv_dim), (ba.stride(0), 1), 0)
            delta_rule.gated_delta_rule_varlen(None, None, None, None, None, ssm_cache, layout,
                                               gating=(ba, a_log, dt_bias), out_norm=(z, norm_w, 1e-6),
                                               conv=(qkv, qkv_weight, qkv_windows, hk))
    missing = keys["step"] - keys["warm"]
    assert not missing, sorted(missing, key=repr)[:2]


# ---- checks (in the subprocess) ------------------------------------------------------------------

def _slots_and_offsets(cache, lens, init):
    """Sequence i uses slot i + 1 (slot 0 and the last stay untouched); a sequence without initial state
    gets a NaN slot, which it must not read. Returns (slots, query_start_loc)."""
    for i, keep in enumerate(init):
        if not keep:
            cache[i + 1] = float("nan")
    qsl = [0]
    for ln in lens:
        qsl.append(qsl[-1] + ln)
    return [i + 1 for i in range(len(lens))], qsl


def _case(lens, hk, hv, dk, dv, init, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    q, k = torch.randn(n, hk, dk, generator=g), torch.randn(n, hk, dk, generator=g)
    v = torch.randn(n, hv, dv, generator=g)
    decay = -torch.rand(n, hv, generator=g) * 1.5
    beta = torch.rand(n, hv, generator=g)
    num_slots = len(lens) + 2
    cache = torch.randn(num_slots, hv, dk, dv, generator=g) * 0.5
    slots, qsl = _slots_and_offsets(cache, lens, init)
    return q, k, v, decay, beta, cache, slots, qsl


def _check(lens, hk, hv, dk, dv, init, chunk=16, seed=0):
    import torch

    from compiled_llm.ops.delta_rule import gated_delta_rule_with_state
    from compiled_llm.ops.state import StateLayout
    from compiled_llm.ops.triton.delta_rule import gated_delta_rule_varlen

    q, k, v, decay, beta, cache, slots, qsl = _case(lens, hk, hv, dk, dv, init, seed)
    ref_cache = cache.clone()
    layout = StateLayout.build(slots, init, qsl, "cpu", chunk=chunk)
    ref = gated_delta_rule_with_state(q, k, v, decay, beta, ref_cache, layout)
    got = gated_delta_rule_varlen(q, k, v, decay, beta, cache, layout)
    err = (got - ref).abs().max().item()
    serr = (cache[slots] - ref_cache[slots]).abs().max().item()
    print(f"  lens={lens} heads={hk}/{hv} dims={dk}/{dv} chunk={chunk}: out {err:.2e} state {serr:.2e}", flush=True)
    assert err < 1e-4 and serr < 1e-4, (err, serr)
    untouched = [i for i in range(cache.shape[0]) if i not in slots]
    assert torch.equal(cache[untouched], ref_cache[untouched])


def _check_gated(lens, hk, hv, dk, dv, init, chunk=16, seed=0, dtype="float32", tiles=None):
    """The op's form: g and beta from the [b; a] columns, the gated output norm applied (in the recurrent
    kernel when its value block holds the head, else by the norm kernel), against the PyTorch reference on
    the model's layout (strided views of the conv's and in_proj's outputs)."""
    import torch

    from compiled_llm.ops.delta_rule import decay_and_beta, gated_delta_rule_with_state, gated_rms_norm
    from compiled_llm.ops.state import StateLayout
    from compiled_llm.ops.triton import delta_rule

    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    q, k, v, z, ba = delta_rule.model_views(n, hk, hv, dk, dv, dt, "cpu")
    for x in (q, k, v, z):
        x.copy_(torch.randn(x.shape, generator=g))
    ba.copy_(torch.randn(ba.shape, generator=g) * 3)
    ba[0, hv] = 30.0  # softplus past its threshold
    a_log = (torch.rand(hv, generator=g) - 0.5).to(dt)
    dt_bias = torch.randn(hv, generator=g).to(dt)
    norm_w = (torch.rand(dv, generator=g) + 0.5).to(dt)
    cache = torch.randn(len(lens) + 2, hv, dk, dv, generator=g) * 0.5
    slots, qsl = _slots_and_offsets(cache, lens, init)
    ref_cache = cache.clone()
    layout = StateLayout.build(slots, init, qsl, "cpu", chunk=chunk)
    decay, beta = decay_and_beta(ba, a_log, dt_bias)
    ref = gated_rms_norm(gated_delta_rule_with_state(q, k, v, decay, beta, ref_cache, layout), z, norm_w, 1e-6)
    got = delta_rule.gated_delta_rule_varlen(q, k, v, None, None, cache, layout, tiles,
                                             gating=(ba, a_log, dt_bias), out_norm=(z, norm_w, 1e-6))
    err = (got.float() - ref.float()).abs().max().item()
    serr = (cache[slots] - ref_cache[slots]).abs().max().item()
    scale = ref.float().abs().max().item()
    print(f"  gated lens={lens} heads={hk}/{hv} dims={dk}/{dv} {dtype} tiles={tiles}: out {err:.2e} "
          f"(max {scale:.2f}) state {serr:.2e}", flush=True)
    # bfloat16: the interpreter's float32 -> bfloat16 cast truncates where torch (and the GPU) round to nearest,
    # so beta and the roundings of o and of the norm can sit an ulp away: a few ulps of the output, a few
    # thousandths of the float32 state. Float32 checks the arithmetic itself.
    tol, stol = (1e-4, 1e-4) if dtype == "float32" else (0.05 * max(1.0, scale), 2e-2)
    assert scale > 0.1 and err < tol and serr < stol, (err, serr, scale)


def group_recurrent():
    _check([1, 1, 3, 1], 2, 4, 16, 16, [True, False, True, True])
    _check([1, 2], 1, 1, 8, 24, [False, True])  # dims below / not a power of two
    _check_padded_decode()
    from compiled_llm.ops.triton.delta_rule import recurrent_tiles_policy
    assert recurrent_tiles_policy(1, 16, True)[0] < recurrent_tiles_policy(2, 128, True)[0] == 128
    _check_gated([1], 2, 4, 16, 16, [True])  # one sequence: the norm kernel after
    _check_gated([1, 1, 1], 2, 4, 16, 16, [True, False, True])  # the whole head: the norm in the kernel
    _check_gated([1, 1, 1], 2, 4, 16, 16, [True, False, True], dtype="bfloat16")
    _check_gated([1, 2], 1, 2, 8, 24, [False, True], tiles=(16, 4))  # dv 24 over two blocks: the norm kernel
    _check_gated([1, 2], 1, 2, 8, 24, [False, True])  # dv 24 in one 32-channel block: in the kernel


def _check_padded_decode():
    """A decode step padded as whole-graph decode pads it (StateMetadata.staged: sequences without tokens on
    slot 0, rows past the real tokens): the real rows equal the unpadded run and slot 0 stays as it was."""
    import torch

    from compiled_llm.ops.conv1d import causal_conv1d_with_state
    from compiled_llm.ops.state import StateLayout, StateMetadata
    from compiled_llm.ops.triton import conv1d, delta_rule
    from compiled_llm.ops.triton.conv1d import causal_conv1d_varlen
    from compiled_llm.ops.triton.delta_rule import gated_delta_rule_varlen

    lens, init, size = [1, 1, 1], [True, False, True], 5
    q, k, v, decay, beta, cache, slots, qsl = _case(lens, 2, 4, 16, 16, init)
    layout = StateLayout.build(slots, init, qsl, "cpu")
    staged = StateMetadata({}, layout).staged(size, {}).layout
    assert staged.decode and staged.num_seqs == size and staged.tensors["query_start_loc"].tolist() == [0, 1, 2, 3, 3, 3]
    pad = lambda x: torch.cat([x, torch.randn(size - x.shape[0], *x.shape[1:])])  # noqa: E731
    want_cache = cache.clone()
    want = gated_delta_rule_varlen(q, k, v, decay, beta, want_cache, layout)
    with nan_empty(conv1d, delta_rule):  # the kernels, not a zero fill, must zero the padding rows
        got = gated_delta_rule_varlen(pad(q), pad(k), pad(v), -pad(decay).abs(), pad(beta).abs(), cache, staged)
    assert torch.equal(got[:3], want) and torch.equal(got[3:], torch.zeros_like(got[3:]))
    assert torch.equal(cache, want_cache)  # slot 0 (the padding's) and the last untouched, the real ones alike
    x, w = torch.randn(3, 40), torch.randn(40, 4)
    conv = torch.randn(len(lens) + 2, 40, 3)
    ref_conv = conv.clone()
    ref = causal_conv1d_with_state(x, w, ref_conv, layout)
    with nan_empty(conv1d, delta_rule):
        got = causal_conv1d_varlen(pad(x), w, conv, staged)
    assert torch.allclose(got[:3], ref, atol=1e-5) and torch.equal(got[3:], torch.zeros_like(got[3:]))
    assert torch.equal(conv[0], ref_conv[0]) and torch.allclose(conv, ref_conv, atol=1e-6)
    print("  padded decode: ok", flush=True)


def group_chunk():
    _check_gated([5, 40, 1, 17], 2, 4, 16, 16, [False, True, True, False], chunk=16)
    _check_gated([33, 7], 1, 2, 32, 24, [True, False], chunk=32, dtype="bfloat16")
    _check([5, 40, 1, 17], 2, 4, 16, 16, [False, True, True, False], chunk=16)
    _check([33, 7], 1, 2, 32, 24, [True, False], chunk=32)
    _check([20], 2, 2, 12, 20, [True], chunk=16)


def _check_conv(lens, dim, k, init, dtype="float32", seed=0, extra=0, tiles=None):
    """extra: x is the first `dim` columns of a [tokens, dim + extra] tensor (row stride dim + extra), as the
    [q; k; v] columns of Qwen3.5's merged [q; k; v; z; b; a] projection reach the conv; both providers read
    it in place. tiles: the conv kernel's, overriding its policy (the window kernel keeps its own)."""
    import torch

    from compiled_llm.ops.conv1d import causal_conv1d_with_state
    from compiled_llm.ops.state import StateLayout
    from compiled_llm.ops.triton.conv1d import causal_conv1d_varlen

    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(seed)
    pad = 3  # rows past the last sequence, as under a CUDA-graph bucket
    x = torch.randn(sum(lens) + pad, dim + extra, generator=g).to(dt)[:, :dim]
    w = torch.randn(dim, k, generator=g).to(dt)
    cache = torch.randn(len(lens) + 2, dim, k - 1, generator=g).to(dt)
    slots, qsl = _slots_and_offsets(cache, lens, init)
    ref_cache, start = cache.clone(), cache.clone()
    layout = StateLayout.build(slots, init, qsl, "cpu")
    ref = causal_conv1d_with_state(x, w, ref_cache, layout)
    got = causal_conv1d_varlen(x, w, cache, layout, tiles=tiles)
    if extra:
        assert torch.equal(ref, causal_conv1d_with_state(x.contiguous(), w, start, layout))  # the reference too
    tol = 1e-5 if dt == torch.float32 else 1e-2 * ref.float().abs().max().item()  # the reference rounds in bf16
    err = (got.float() - ref.float()).abs().max().item()
    serr = (cache[slots].float() - ref_cache[slots].float()).abs().max().item()
    print(f"  conv lens={lens} dim={dim} K={k} {dtype}: out {err:.2e} state {serr:.2e}", flush=True)
    assert err < tol and serr == 0, (err, serr)
    assert torch.equal(got[sum(lens):], torch.zeros_like(got[sum(lens):]))
    untouched = [0, len(lens) + 1]
    assert torch.equal(cache[untouched], ref_cache[untouched])


def group_conv1d():
    _check_conv([1, 1, 1], 40, 4, [True, False, True])  # decode; dim not a multiple of the tile
    _check_conv([5, 1, 2, 19], 130, 4, [False, True, True, False])  # prefill chunks shorter than K-1 too
    _check_conv([3, 1], 24, 3, [True, True], dtype="bfloat16")
    _check_conv([1, 1, 1], 40, 4, [True, False, True], extra=24)  # row-strided x: decode, prefill
    _check_conv([5, 1, 2, 19], 130, 4, [False, True, True, False], extra=7)
    _check_conv([5, 1, 2, 19], 300, 4, [False, True, True, False], tiles=(16, 256, 4))  # conv tile > window's
    _check_conv([1, 1], 24, 5, [True, False])  # decode with 5 taps: the general loop and its window move
    for k, dtype in ((4, "float32"), (4, "bfloat16"), (3, "bfloat16"), (2, "float32")):
        _check_conv_decode_taps(40, k, [True, False, True], dtype)


def _check_conv_decode_taps(dim, k, init, dtype="float32", seed=0):
    """The decode branch (each input read once: _conv_taps) against the general loop on the same tokens: three
    one-token sequences run as a decode step, and again beside a two-token sequence (a prefill-shaped step, the
    loop and the window launch): the same outputs and windows, bitwise."""
    import torch

    from compiled_llm.ops.state import StateLayout
    from compiled_llm.ops.triton.conv1d import causal_conv1d_varlen

    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, dim, generator=g).to(dt)
    w = torch.randn(dim, k, generator=g).to(dt)
    cache = torch.randn(6, dim, k - 1, generator=g).to(dt)
    one, mixed = cache.clone(), cache.clone()
    dec = StateLayout.build([1, 2, 3], init, [0, 1, 2, 3], "cpu")
    pre = StateLayout.build([1, 2, 3, 4], init + [True], [0, 1, 2, 3, 5], "cpu")
    assert dec.decode and not pre.decode
    got = causal_conv1d_varlen(x[:3], w, one, dec)
    want = causal_conv1d_varlen(x, w, mixed, pre)
    assert torch.equal(got, want[:3]) and torch.equal(one[1:4], mixed[1:4]), (k, dtype)
    print(f"  conv decode taps dim={dim} K={k} {dtype}: bitwise the general loop's", flush=True)


def _check_conv_fused(lens, hk, hv, dk, dv, kw, init, dtype="float32", seed=0, tiles=None, pad_to=None):
    """A decode step with the conv inside the recurrent launch (gated_delta_rule_varlen conv=...) against the
    conv launch followed by the recurrent launch, on the model's layout (in_proj's [q; k; v] columns read in
    place): the same outputs and the same conv windows and delta-rule states, bitwise (the same sums in the same
    order). Twice in a row: the second step reads the first's windows, and finds the key heads' ticket counters
    back at zero. pad_to: whole-graph decode padding (sequences without tokens on slot 0, rows past the real
    ones): those rows come out zero and slot 0 is left alone."""
    import torch

    from compiled_llm.ops.delta_rule import split_qkv
    from compiled_llm.ops.state import StateLayout, StateMetadata
    from compiled_llm.ops.triton import delta_rule
    from compiled_llm.ops.triton._common import TICKETS
    from compiled_llm.ops.triton.conv1d import causal_conv1d_varlen

    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(seed)
    n_real = sum(lens)
    n = pad_to or n_real
    conv_dim = 2 * hk * dk + hv * dv
    a_log = (torch.rand(hv, generator=g) - 0.5).to(dt)
    dt_bias = torch.randn(hv, generator=g).to(dt)
    norm_w = (torch.rand(dv, generator=g) + 0.5).to(dt)
    conv_w = (torch.randn(conv_dim, kw, generator=g) * 0.5).to(dt)
    conv = torch.randn(len(lens) + 2, conv_dim, kw - 1, generator=g).to(dt)
    ssm = torch.randn(len(lens) + 2, hv, dk, dv, generator=g) * 0.5
    slots, qsl = _slots_and_offsets(ssm, lens, init)
    conv[[i + 1 for i, keep in enumerate(init) if not keep]] = float("nan")  # never read without initial state
    layout = StateLayout.build(slots, init, qsl, "cpu")
    if pad_to:
        layout = StateMetadata({}, layout).staged(pad_to, {}).layout
    want_conv, want_ssm = conv.clone(), ssm.clone()
    for step in range(2):
        _, _, _, z, ba = delta_rule.model_views(n, hk, hv, dk, dv, dt, "cpu")
        y = ba.as_strided((n, ba.stride(0)), (ba.stride(0), 1), 0)  # in_proj's whole output [q; k; v; z; b; a]
        y.copy_(torch.randn(y.shape, generator=g))
        ba.mul_(3)
        qkv = y[:, :conv_dim]
        mixed = causal_conv1d_varlen(qkv, conv_w, want_conv, layout, tiles=tiles and tiles[0])
        q, k, v = split_qkv(mixed, hk, hv, dv)
        want = delta_rule.gated_delta_rule_varlen(q, k, v, None, None, want_ssm, layout, tiles and tiles[1],
                                                  gating=(ba, a_log, dt_bias), out_norm=(z, norm_w, 1e-6))
        got = delta_rule.gated_delta_rule_varlen(None, None, None, None, None, ssm, layout, tiles and tiles[1],
                                                 gating=(ba, a_log, dt_bias), out_norm=(z, norm_w, 1e-6),
                                                 conv=(qkv, conv_w, conv, hk))
        live = [i + 1 for i in range(len(lens))]
        assert torch.equal(got, want), (step, (got.float() - want.float()).abs().max())
        assert torch.equal(ssm[live], want_ssm[live]) and torch.equal(conv[live], want_conv[live]), step
        for other in (0, len(lens) + 1):  # the padding's slot and an unused one: untouched (NaN-safe compare)
            assert torch.equal(conv[other].nan_to_num(7.0), want_conv[other].nan_to_num(7.0)), other
            assert torch.equal(ssm[other].nan_to_num(7.0), want_ssm[other].nan_to_num(7.0)), other
        if pad_to:
            assert torch.equal(got[n_real:], torch.zeros_like(got[n_real:]))
        counters = [t for key, t in TICKETS.items() if key[0] == "gdr_conv"]
        assert counters and all(int(t.abs().sum()) == 0 for t in counters)
        init = [True] * len(init)
        layout = StateLayout.build(slots, init, qsl, "cpu")
        if pad_to:
            layout = StateMetadata({}, layout).staged(pad_to, {}).layout
    print(f"  conv fused lens={lens} heads={hk}/{hv} dims={dk}/{dv} K={kw} {dtype} tiles={tiles} pad={pad_to}: "
          f"bitwise the two launches'", flush=True)


def group_conv_fused():
    _check_conv_fused([1, 1, 1], 2, 4, 16, 16, 4, [True, False, True])  # the whole head a program (norm inside)
    _check_conv_fused([1], 2, 4, 16, 16, 4, [True])  # one sequence, the whole head a program
    _check_conv_fused([1], 2, 4, 16, 64, 4, [True])  # one sequence: the policy's 32-channel value blocks (norm after)
    _check_conv_fused([1, 1], 1, 2, 8, 24, 3, [False, True], dtype="bfloat16")  # dims not powers of two
    _check_conv_fused([1, 1, 1], 2, 4, 16, 32, 4, [True, True, False], tiles=((8, 32, 2), (16, 4)))  # 2 blocks
    _check_conv_fused([1, 1, 1], 2, 4, 16, 16, 4, [True, False, True], pad_to=5)  # whole-graph padding


def group_engine():
    """The tiny Qwen3.5 MoE model end to end with the Triton state ops and the SwiGLU MoE kernel selected
    (the interpreter makes them eligible on the CPU) gives the reference providers' greedy tokens."""
    import tempfile

    from compiled_llm import LLM, SamplingParams
    from qwen3_5_tiny import make_qwen_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        make_qwen_checkpoint(Path(tmp), "moe")
        prompts = [{"prompt_token_ids": [5 + i for i in range(n)]} for n in (3, 11)]
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        out = {}
        for name, override in (("triton", None), ("reference", "causal_conv1d=reference,gated_delta_rule=reference,"
                                                               "swiglu_moe=reference")):
            llm = LLM(tmp, enforce_eager=True, block_size=4, max_model_len=64, max_num_seqs=4,
                      max_num_batched_tokens=8, op_providers=override)
            chosen = llm.engine.executor.runner.op_providers
            want = "triton" if override is None else "reference"
            assert all(chosen[op][None] == want for op in ("causal_conv1d", "gated_delta_rule", "swiglu_moe")), chosen
            out[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    print("  engine:", out, flush=True)
    assert out["triton"] == out["reference"]


def group_jit_keys():
    """The JIT registry names the recurrent kernels a Qwen3.5 model launches, from its layers' state shapes
    (so the parallel build makes them before the profile step), and each key's compile function runs the
    layouts it builds for: decode of one and two sequences, one and two prefills."""
    import json
    import tempfile

    import torch

    from compiled_llm.compiler.warmup import kernel_keys
    from compiled_llm.models.interfaces import recurrent_state_specs
    from compiled_llm.models.registry import resolve_model_class
    from compiled_llm.ops.registry import Capabilities, model_facts, preserved_choices, select_providers
    from qwen3_5_tiny import make_qwen_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        make_qwen_checkpoint(Path(tmp), "moe")
        hf = json.loads((Path(tmp) / "config.json").read_text())
    cls = resolve_model_class(hf)
    cfg = cls.config_from_hf(hf)
    with torch.device("meta"):
        model = cls(cfg)
    specs, states = model.attention_specs(), recurrent_state_specs(model)
    facts = model_facts(cfg, block_size=16, states=states)
    with preserved_choices():
        select_providers("cpu", torch.float32, specs, facts, caps=Capabilities("cpu", None, frozenset({"triton"}), True))
        keys = {kernel.name: (kernel, key) for kernel, key in kernel_keys(dict(facts, dtype=torch.float32, layers=specs))
                if kernel.name in ("gated_delta_rule", "causal_conv1d")}
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        assert keys["gated_delta_rule"][1] == (torch.float32, hk, hv, dk, dv, cfg.linear_conv_kernel_dim), keys
        assert keys["causal_conv1d"][1] == (torch.float32, 2 * hk * dk + hv * dv, cfg.linear_conv_kernel_dim), keys
        for kernel, key in keys.values():
            kernel.compile(key, torch.device("cpu"))
    print("  jit keys:", {name: key[1:] for name, (_, key) in keys.items()}, flush=True)


if __name__ == "__main__":  # python tests/test_delta_rule_triton.py GROUP [GROUP ...]
    from interp_groups import main

    main(sys.argv[1:], lambda g: globals()[f"group_{g}"]())
