"""The op layer: the resolver, and the Triton providers against the reference providers, on the CPU
through the Triton interpreter. TRITON_INTERPRET must be set before triton is first imported, so the kernel
groups run this file as a script in a subprocess, one for all of them (tests/interp_groups.py); each group's
test checks that group's result."""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

from interp_groups import check, nan_empty, run_groups

GROUPS = ["norm", "qk_norm_rope", "qk_norm_mrope", "kv_write", "attention", "moe", "softmax_moe"]
DEV = os.environ.get("OP_TEST_DEVICE", "cpu")  # scripts/compiler_gpu_check.py runs the groups on cuda


def rand(*shape, generator=None):
    return torch.randn(*shape, generator=generator).to(DEV)


@pytest.fixture(scope="module")
def group_results(request):
    """Every selected group in one interpreter subprocess (tests/interp_groups.py)."""
    return run_groups(request, __file__, "test_triton_provider_matches_reference")


@pytest.mark.parametrize("group", GROUPS)
def test_triton_provider_matches_reference(group_results, group):
    check(group_results, group)


def _specs():
    from compiled_llm.ops.attention import AttentionSpec

    return {0: AttentionSpec(0, 4, 2, 32, None, 0), 1: AttentionSpec(1, 4, 2, 32, 8, 1, softcap=20.0),
            2: AttentionSpec(2, 4, 2, 32, None, 0)}


def test_resolver_on_cpu_picks_reference_and_reports_why():
    from compiled_llm.ops.registry import OPS, Capabilities, select_providers

    table = select_providers("cpu", torch.float32, _specs(), {"hidden_size": 64})
    assert set(table) >= {"attention", "kv_cache_write", "rms_norm", "fused_add_rms_norm", "qk_norm_rope_kv_write",
                          "router_topk", "geglu_moe", "allreduce_rms_norm"}
    # the reference everywhere, but for the projections' product (oneDNN's packed weights, tests/test_cpu_linear.py)
    # the decode attention and the KV write (the C++ kernels, ops/cpu_attention.py) and the greedy argmax
    assert table.pop("skinny_mm") == {None: "onednn" if torch.backends.mkldnn.is_available() else "reference"}
    assert table.pop("attention") == {0: "cpu", 1: "cpu", 2: "cpu"}  # resolved per layer
    assert table.pop("kv_cache_write") == {None: "cpu"}  # the C++ KV write
    assert table.pop("argmax_rows") == {None: "cpu"}  # ops/cpu_logits.py
    assert all(p == "reference" for by_key in table.values() for p in by_key.values())
    caps = Capabilities("cpu", None, frozenset({"triton"}))
    _, skipped = OPS["attention"].resolve(caps, {"layer": _specs()[0], "source": _specs()[0], "block_size": 16})
    assert any("CUDA" in why for why in skipped)
    from compiled_llm.ops.attention import AttentionSpec

    kv = AttentionSpec(3, 4, 1, 32, None, 3, k_eq_v=True)
    for shape in ({"layer": kv, "source": kv}, {"layer": _specs()[0], "source": _specs()[0], "dtype": torch.bfloat16}):
        provider, skipped = OPS["attention"].resolve(caps, shape)
        assert provider.name == "reference" and any(w.startswith("cpu: ") for w in skipped), skipped


def test_cpu_calls_reach_each_op_function_without_custom_ops_wrappers():
    """Every compiled_llm op that mutates no argument has its own function as its CPU kernel (ops/registry.py
    custom_op): a CPU call runs it with no Dynamo-disable or alias-check wrapper between. The mutating one keeps
    custom_op's kernel alone. The direct kernel gives what the op gave."""
    import traceback

    from compiled_llm.ops import linear  # (importing compiled_llm.ops registers them all)

    ns = torch.ops.compiled_llm
    ops = [n for n in ns if isinstance(getattr(ns, n), torch._ops.OpOverloadPacket)]
    mutating = {n for n in ops if getattr(ns, n).default._schema.is_mutable}
    assert mutating == {"moe_join"} and len(ops) >= 16
    for n in ops:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"compiled_llm::{n}", "CPU") is (n not in mutating), n
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    stacks = []
    real = linear.SKINNY_MM.impl
    linear.SKINNY_MM.impl = lambda key=None: (lambda a, b: stacks.append(traceback.extract_stack()) or real()(a, b))
    try:
        with torch.inference_mode():
            got = torch.ops.compiled_llm.skinny_mm(x, w)
    finally:
        linear.SKINNY_MM.impl = real
    calls = [1 for stack in stacks if not any(f.filename.endswith("custom_ops.py") for f in stack)]
    assert calls == [1] and torch.allclose(got, x @ w.t())


def test_resolver_shape_limits_and_overrides():
    from compiled_llm.ops.attention import AttentionSpec
    from compiled_llm.ops.registry import OPS, Capabilities, select_providers

    cuda = Capabilities("cuda", (9, 0), frozenset({"triton"}))
    big = AttentionSpec(0, 4, 1, 1024, None, 0)
    ok = AttentionSpec(1, 4, 1, 256, None, 1)
    assert OPS["attention"].resolve(cuda, {"layer": big, "source": big, "block_size": 16})[0].name == "reference"
    assert OPS["attention"].resolve(cuda, {"layer": ok, "source": ok, "block_size": 16})[0].name == "triton"
    assert OPS["attention"].resolve(cuda, {"layer": ok, "source": ok, "block_size": 12})[0].name == "reference"
    with pytest.raises(ValueError, match="triton"):  # forcing a provider that cannot run here is an error
        select_providers("cpu", torch.float32, _specs(), {}, overrides="rms_norm=triton")
    with pytest.raises(ValueError, match="bad op provider override"):
        select_providers("cpu", torch.float32, _specs(), {}, overrides="nonsense=triton")
    select_providers("cpu", torch.float32, _specs(), {})  # leave the process on the reference



def test_cuda_graphs_refuse_a_provider_that_reads_device_values_on_the_host():
    """A reference KV writer checks its padded slots on the host: inside a CUDA graph that fails at capture with
    CUDA's own message. An engine with CUDA graphs refuses it by name at start-up; without graphs (or on the
    CPU), and with the default providers, nothing is refused."""
    from compiled_llm.compiler import check_graph_safe_providers
    from compiled_llm.ops.registry import Capabilities, preserved_choices, select_providers

    cuda, gpu = torch.device("cuda"), Capabilities("cuda", (9, 0), frozenset({"triton"}))
    with preserved_choices():
        select_providers(cuda, torch.bfloat16, _specs(), {}, caps=gpu)
        check_graph_safe_providers(cuda, [1, 2, 4])  # the GPU's defaults run inside graphs
        select_providers(cuda, torch.bfloat16, _specs(), {}, overrides="kv_cache_write=reference,attention=reference",
                         caps=gpu)
        with pytest.raises(ValueError, match=r"kv_cache_write=reference .*--cudagraph-batch-sizes none"):
            check_graph_safe_providers(cuda, [1, 2, 4])
        check_graph_safe_providers(cuda, [])  # no graphs: the host read is only slow
        check_graph_safe_providers(torch.device("cpu"), [1, 2])  # (the reference attention splits: not refused)


def test_fused_allreduce_norm_is_chosen_under_tensor_parallel_cuda_and_its_pass_then_rewrites():
    """The symmetric-memory kernel serves allreduce_rms_norm on CUDA with 2, 4 or 8 TP ranks (the runner puts
    tp_size in the facts); elsewhere the reference stays and the pass only counts; with the kernel chosen the
    pass rewrites the graph (it is no longer in the manager's count-only list)."""
    from compiled_llm.ops.registry import OPS, Capabilities, preserved_choices
    from compiled_llm.passes.manager import PassManager

    spec = OPS["allreduce_rms_norm"]
    cuda = Capabilities("cuda", (9, 0), frozenset({"triton"}))
    assert spec.resolve(cuda, {"tp_size": 2})[0].name == "triton"
    assert spec.resolve(cuda, {"tp_size": 8})[0].name == "triton"
    for caps, facts, why in [(cuda, {"tp_size": 1}, "no tensor parallelism"), (cuda, {}, "no tensor parallelism"),
                             (cuda, {"tp_size": 3}, "not 3"),
                             (Capabilities("cpu", None, frozenset({"triton"})), {"tp_size": 2}, "CUDA"),
                             (Capabilities("cpu", None, frozenset({"triton"}), True), {"tp_size": 2}, "CUDA")]:
        provider, skipped = spec.resolve(caps, facts)
        assert provider.name == "reference" and any(why in s for s in skipped), (facts, skipped)
    with preserved_choices():
        spec.select(cuda, {"tp_size": 2})
        assert PassManager(("allreduce_rms_norm",), torch.float32, "cpu", tp_group="0").unfused == ()
        spec.chosen.clear()
        assert PassManager(("allreduce_rms_norm",), torch.float32, "cpu", tp_group="0").unfused == ("allreduce_rms_norm",)

# ---------------------------------------------------------------------------------------------------
# kernel groups (run under TRITON_INTERPRET=1 in a subprocess)


def _context(specs, num_blocks=8, block_size=4, seqs=((5, 5), (3, 9), (1, 6)), dtype=torch.float32):
    """A forward context for sequences given as (new tokens, context length after them), random caches."""
    from compiled_llm.ops.context import AttentionMetadata, ForwardContext, GroupMetadata

    g = torch.Generator().manual_seed(0)
    caches = {i: torch.randn(1 if s.k_eq_v else 2, num_blocks * len(seqs), block_size, s.num_kv_heads, s.head_dim,
                             generator=g).to(DEV, dtype) for i, s in specs.items() if s.writes_cache}
    qsl, lens, tables, slots = [0], [], [], []
    for i, (new, total) in enumerate(seqs):
        blocks = list(range(i * num_blocks, (i + 1) * num_blocks))
        tables.append(blocks)
        qsl.append(qsl[-1] + new)
        lens.append(total)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(total - new, total)]
    groups = {}
    for gkey in {s.kv_group for s in specs.values()}:
        groups[gkey] = GroupMetadata(torch.tensor(tables, dtype=torch.int32, device=DEV), torch.tensor(slots, device=DEV))
    return ForwardContext(AttentionMetadata(qsl, lens, block_size, groups), caches, specs)


def _check(name, got, want, tol=1e-4):
    tol *= 1 if DEV == "cpu" else 25  # tl.dot in float32 runs as TF32 on the GPU
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol, f"{name}: max abs error {err}"


def group_norm():
    from compiled_llm.ops.norm import ref_fused_add_rms_norm, ref_rms_norm
    from compiled_llm.ops.triton import norm

    for d in (16, 48, 64):
        x, r, w = rand(5, d), rand(5, d), rand(d)
        _check("rms_norm", norm.rms_norm(x, w, 1e-6), ref_rms_norm(x, w, 1e-6))
        _check("rms_norm no weight", norm.rms_norm(x, None, 1e-5), ref_rms_norm(x, None, 1e-5))
        got, want = norm.fused_add_rms_norm(x, r, w, 1e-6), ref_fused_add_rms_norm(x, r, w, 1e-6)
        _check("fused_add_rms_norm out", got[0], want[0])
        _check("fused_add_rms_norm sum", got[1], want[1])
        w0 = 0.3 * rand(d)  # zero-centred weight: the norm scales by 1 + w
        _check("rms_norm offset", norm.rms_norm(x, w0, 1e-6, 1.0), ref_rms_norm(x, w0, 1e-6, 1.0))
        got, want = norm.fused_add_rms_norm(x, r, w0, 1e-6, 1.0), ref_fused_add_rms_norm(x, r, w0, 1e-6, 1.0)
        _check("fused_add_rms_norm offset out", got[0], want[0])
        _check("fused_add_rms_norm offset sum", got[1], want[1])
    x3, w3 = rand(3, 4, 16), rand(16)  # per-head norms: over the last dim
    _check("rms_norm 3d", norm.rms_norm(x3, w3, 1e-6), ref_rms_norm(x3, w3, 1e-6))


def group_qk_norm_rope():
    from compiled_llm.ops.attention import AttentionSpec
    from compiled_llm.ops.context import set_forward_context
    from compiled_llm.ops.qk_norm_rope import ref_qk_norm_rope_kv_write
    from compiled_llm.ops.rope import rope_inv_freq
    from compiled_llm.ops.triton import qk_norm_rope as QK
    from compiled_llm.ops.triton.qk_norm_rope import qk_norm_rope_kv_write

    default = QK.heads_per_program
    for k_eq_v, hpp in ((False, None), (True, None), (False, 4), (True, 4)):
        # hpp: a program takes 4 of a token's 6 heads (prefill's kernel; the second program's last 2 are past them)
        QK.heads_per_program = default if hpp is None else (lambda n: hpp)  # noqa: B023
        specs = {0: AttentionSpec(0, 4, 2, 16, None, 0, k_eq_v=k_eq_v), 1: AttentionSpec(1, 4, 2, 16, None, 0)}
        inv = rope_inv_freq(16, 1e6, "proportional", 0.25).to(DEV)  # partial rotary: zero frequencies too
        n = 15
        q, k, v = rand(n + 2, 4, 16), rand(n + 2, 2, 16), rand(n + 2, 2, 16)  # 2 padding rows
        pos = torch.randint(0, 5000, (n + 2,)).to(DEV)
        qw, kw = rand(16), rand(16)
        ctx_ref, ctx_tri = _context(specs), _context(specs)
        ctx_tri.kv_caches[0].copy_(ctx_ref.kv_caches[0])
        kk = None if k_eq_v else k
        with set_forward_context(ctx_ref):
            want = ref_qk_norm_rope_kv_write(q, kk, v, pos, inv, qw, kw, 1e-6, True, 0)
        with set_forward_context(ctx_tri):
            got = qk_norm_rope_kv_write(q, kk, v, pos, inv, qw, kw, 1e-6, True, 0)
        _check(f"q (k_eq_v={k_eq_v})", got, want)
        _check(f"cache (k_eq_v={k_eq_v})", ctx_tri.kv_caches[0], ctx_ref.kv_caches[0])
        with set_forward_context(ctx_tri):  # q only (a layer reading another layer's cache)
            _check("q only", qk_norm_rope_kv_write(q, None, None, pos, inv, qw, None, 1e-6, False, 1),
                   ref_qk_norm_rope_kv_write(q, None, None, pos, inv, qw, None, 1e-6, False, 1))
    QK.heads_per_program = default
    assert default(8) == 1 and default(8192) == 8


def group_qk_norm_mrope():
    """Qwen3.5's full attention: zero-centred q/k norms, the first rotary_dim channels rotated by the step's
    M-RoPE table (built from [3, tokens] positions here), the rest passed through; k, v cached; padding rows
    write nothing. Strided q (a chunk of the gated q projection) and a flat v, as the model hands them."""
    from compiled_llm.ops.attention import AttentionSpec
    from compiled_llm.ops.context import set_forward_context
    from compiled_llm.ops.mrope import mrope_cos_sin, mrope_owner, rotary_inv_freq
    from compiled_llm.ops.qk_norm_rope import ref_qk_norm_mrope_kv_write
    from compiled_llm.ops.triton.qk_norm_rope import qk_norm_mrope_kv_write

    for d, factor, section in ((16, 0.5, [2, 1, 1]), (24, 0.25, [1, 1, 1]), (16, 1.0, [4, 2, 2])):
        specs = {0: AttentionSpec(0, 4, 2, d, None, 0)}
        inv = rotary_inv_freq(d, 1e6, factor)
        n = 15
        pos = torch.randint(0, 5000, (3, n + 2))
        cos, sin = (t.to(DEV) for t in mrope_cos_sin(pos, inv, mrope_owner(len(inv), section), torch.float32))
        q = rand(n + 2, 4, 2 * d)[..., :d]  # 2 padding rows; a strided view, as the chunk of [query, gate]
        k, v = rand(n + 2, 2, d), rand(n + 2, 2 * d)
        qw, kw = 0.3 * rand(d), 0.3 * rand(d)
        ctx_ref, ctx_tri = _context(specs), _context(specs)
        ctx_tri.kv_caches[0].copy_(ctx_ref.kv_caches[0])
        with set_forward_context(ctx_ref):
            want = ref_qk_norm_mrope_kv_write(q, k, v, cos, sin, qw, kw, 1e-6, 1.0, 0)
        with set_forward_context(ctx_tri):
            got = qk_norm_mrope_kv_write(q, k, v, cos, sin, qw, kw, 1e-6, 1.0, 0)
        _check(f"mrope q d={d} rotary={cos.shape[-1]}", got, want)
        _check(f"mrope cache d={d} rotary={cos.shape[-1]}", ctx_tri.kv_caches[0], ctx_ref.kv_caches[0])


def group_kv_write():
    from compiled_llm.ops.attention import AttentionSpec, ref_kv_cache_write
    from compiled_llm.ops.context import set_forward_context
    from compiled_llm.ops.triton.qk_norm_rope import kv_cache_write

    for k_eq_v in (False, True):
        specs = {0: AttentionSpec(0, 4, 2, 16, None, 0, k_eq_v=k_eq_v)}
        ctx_ref, ctx_tri = _context(specs), _context(specs)
        ctx_tri.kv_caches[0].copy_(ctx_ref.kv_caches[0])
        slots = ctx_ref.attn_metadata.groups[None].slot_mapping
        padded = torch.cat([slots, torch.tensor([-1, -1], device=DEV)])  # CUDA-graph padding writes nothing
        for ctx in (ctx_ref, ctx_tri):
            ctx.attn_metadata.groups[None].slot_mapping = padded
        k, v = rand(len(padded), 32), rand(len(padded), 32)
        with set_forward_context(ctx_ref):
            ref_kv_cache_write(None if k_eq_v else k, v, 0)
        with set_forward_context(ctx_tri):
            kv_cache_write(None if k_eq_v else k, v, 0)
        _check(f"kv cache (k_eq_v={k_eq_v})", ctx_tri.kv_caches[0], ctx_ref.kv_caches[0], 0.0)


def group_attention():
    from compiled_llm.ops.attention import AttentionSpec, ref_attention
    from compiled_llm.ops.context import set_forward_context
    from compiled_llm.ops.triton import providers as P
    from compiled_llm.ops.triton.providers import attention

    d = 32  # the kernels' tl.dot needs half a head >= 16
    specs = {0: AttentionSpec(0, 4, 2, d, None, 0), 1: AttentionSpec(1, 4, 2, d, 4, 1, softcap=5.0),
             2: AttentionSpec(2, 4, 1, d, None, 2, k_eq_v=True)}
    specs[2].k_norm_weight, specs[2].inv_freq = rand(d), torch.rand(d // 2).to(DEV)
    for seqs in (((5, 5), (3, 9), (1, 6)), ((1, 7), (1, 3), (1, 12))):  # prefill + chunk + decode; all decode
        ctx = _context(specs, seqs=seqs)
        n = ctx.attn_metadata.query_start_loc[-1]
        q = rand(n + 3, 4 * d)  # 3 padding rows come back as zeros
        with set_forward_context(ctx):
            for layer in specs:
                want = ref_attention(q, layer)
                with nan_empty(P):  # a row no kernel writes (nor a zero fill) shows as NaN
                    got = attention(q, layer)
                _check(f"attention layer {layer} seqs {seqs}", got, want, 2e-4)


def test_reference_decode_attention_batched_equals_one_sequence_at_a_time():
    """A decode batch takes ref_attention's batched path (one padded gather and product for every sequence);
    it must equal the per-sequence loop for plain GQA, a sliding window shorter than some contexts with
    soft-capping, and K=V keys rebuilt from the cached values; its slots and mask are made once a KV group
    (layers 0, 2 and 3 read the full-attention tables). A step with prefill rows takes the loop."""
    from compiled_llm.ops import attention as A
    from compiled_llm.ops.context import set_forward_context

    d = 16
    specs = {0: A.AttentionSpec(0, 4, 2, d, None, 0), 1: A.AttentionSpec(1, 4, 2, d, 4, 1, softcap=5.0),
             2: A.AttentionSpec(2, 4, 1, d, None, 2, k_eq_v=True), 3: A.AttentionSpec(3, 4, 2, d, None, 0)}
    specs[2].k_norm_weight, specs[2].inv_freq = torch.rand(d) + 0.5, torch.rand(d // 2)
    for seqs in (((1, 7), (1, 3), (1, 12), (1, 1)), ((1, 7), (3, 9)), ((1, 9), (1, 9), (1, 9))):
        ctx = _context(specs, seqs=seqs, dtype=torch.float32)
        for layer, cache in ctx.kv_caches.items():  # slots a layer never reads hold NaN: a masked read must not leak
            flat, window = cache.view(cache.shape[0], -1, *cache.shape[3:]), specs[layer].sliding_window or 10 ** 6
            for i, (new, total) in enumerate(seqs):
                flat[:, i * 32 + total:(i + 1) * 32] = float("nan")
                flat[:, i * 32:i * 32 + max(0, total - new - window + 1)] = float("nan")  # slot 0 too (sliding)
        n = ctx.attn_metadata.query_start_loc[-1]
        q = torch.randn(n + 2, 4 * d, generator=torch.Generator().manual_seed(1))  # 2 padding rows
        calls, plans = [], []
        batched, slots = A._ref_decode_attention, A._decode_slots
        with set_forward_context(ctx):
            for layer, spec in specs.items():
                A._ref_decode_attention = lambda *a: calls.append(layer) or batched(*a)
                A._decode_slots = lambda *a: plans.append(layer) or slots(*a)
                try:
                    got = A.ref_attention(q, layer)
                finally:
                    A._ref_decode_attention, A._decode_slots = batched, slots
                cache, group = ctx.kv_caches[spec.cache_layer], ctx.attn_metadata.groups[spec.kv_group]
                want = A._ref_attention_each(q, spec, specs[spec.cache_layer], cache, group, ctx.attn_metadata)
                assert not got.isnan().any()
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
                assert got[n:].abs().max() == 0
        decode = all(new == 1 for new, _ in seqs)
        assert calls == ([0, 1, 2, 3] if decode else [])  # the batched path was taken for the decode batch only
        assert plans == ([0, 1] if decode else [])
        if decode:  # one length (9, in the 4-token window too): every key is real, SDPA runs without a mask
            masks = [ctx.extra[k][2] for k in ctx.extra if k[0] == "_ref_decode_slots"]
            assert len(masks) == 2 and all((m is None) == (len(set(seqs)) == 1) for m in masks)


@contextlib.contextmanager
def _counted(module, name: str):
    """The module's built-kernel getter `name` wrapped so that each call of the built kernel is counted (the list
    yielded); the getter restored afterwards."""
    calls, real = [], getattr(module, name)
    setattr(module, name, lambda: (lambda *a: calls.append(1) or real()(*a)))
    try:
        yield calls
    finally:
        setattr(module, name, real)


def test_cpu_decode_kernel_equals_the_reference():
    """The CPU's C++ decode attention (ops/cpu_attention.py) reads keys and values through the block tables where
    they lie: it must equal the reference's per-sequence attention for plain GQA, a window shorter than some contexts
    with soft-capping, a layer reading another layer's cache, lengths that end mid-block, a block released out of the
    window, and padding rows (zeros); slots it must not read hold NaN. A step with prompt rows goes to the
    reference."""
    from compiled_llm.ops import attention as A
    from compiled_llm.ops import cpu_attention as C
    from compiled_llm.ops.context import set_forward_context

    d = 32
    specs = {0: A.AttentionSpec(0, 4, 2, d, None, 0), 1: A.AttentionSpec(1, 8, 2, d, 5, 1, softcap=5.0),
             2: A.AttentionSpec(2, 4, 2, d, None, 0)}  # layer 2 reads layer 0's cache
    for seqs in (((1, 7), (1, 3), (1, 12), (1, 1)), ((1, 9), (1, 9)), ((1, 7), (3, 9))):
        ctx = _context(specs, seqs=seqs, dtype=torch.float32)
        for layer, cache in ctx.kv_caches.items():  # slots past each length and out of the window hold NaN
            flat, window = cache.view(cache.shape[0], -1, *cache.shape[3:]), specs[layer].sliding_window or 10 ** 6
            for i, (new, total) in enumerate(seqs):
                flat[:, i * 32 + total:(i + 1) * 32] = float("nan")
                flat[:, i * 32:i * 32 + max(0, total - new - window + 1)] = float("nan")
        if len(seqs) > 2:
            ctx.attn_metadata.groups[5].block_tables[2, 0] = -1  # released: out of the 5-token window at 12 tokens
        n = ctx.attn_metadata.query_start_loc[-1]
        q = torch.randn(n + 2, 8 * d, generator=torch.Generator().manual_seed(1))  # 2 padding rows
        with _counted(C, "kernel") as calls, set_forward_context(ctx):
            for layer, spec in specs.items():
                rows = q[:, :spec.num_heads * d].contiguous()
                got = C.attention(rows, layer)
                cache, group = ctx.kv_caches[spec.cache_layer], ctx.attn_metadata.groups[spec.kv_group]
                want = A._ref_attention_each(rows, spec, specs[spec.cache_layer], cache, group, ctx.attn_metadata)
                assert not got.isnan().any()
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                assert got[n:].abs().max() == 0
        assert len(calls) == (3 if all(new == 1 for new, _ in seqs) else 0)  # prompt rows: the reference


def test_cpu_argmax_equals_torch_argmax():
    """The CPU's C++ greedy argmax (ops/cpu_logits.py) gives torch.argmax's index: the first of tied maxima, the
    first NaN where a row has one, index 0 for a row of -inf; at row lengths that are not a multiple of the
    vector width, on rows with a stride past their length, and at a vocabulary large enough for its threads.
    Other dtypes go to torch.argmax."""
    from compiled_llm.ops import cpu_logits as L

    g = torch.Generator().manual_seed(0)
    for rows, cols in ((8, 8192), (3, 17), (2, 1), (5, 40), (4, 300_000)):
        x = torch.randn(rows, cols + 3, generator=g)[:, :cols]  # a row stride past the row
        x[1 % rows] = x[1 % rows].round()  # ties: the first index wins
        if rows > 2:
            x[2, cols // 2] = float("nan")
            x[2, -1] = float("nan")
            x[rows - 1] = float("-inf")
        with _counted(L, "kernel") as calls:
            got = L.argmax_rows(x)
        assert len(calls) == 1 and torch.equal(got, x.argmax(dim=-1)), (rows, cols)
    x16 = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    with _counted(L, "kernel") as calls:
        assert torch.equal(L.argmax_rows(x16), x16.argmax(dim=-1)) and not calls


def test_cpu_kv_write_equals_the_reference_write():
    """The CPU's C++ KV write (ops/cpu_attention.py kv_cache_write) leaves the caches as the reference write does:
    key and value rows that are column slices of one projection (row strides past the row), a padding slot (-1)
    and padding rows past the slot mapping left out, float32 and bfloat16 (rows copied as bytes), one call of the
    kernel a writing layer; a K=V layer's write goes to the reference."""
    from compiled_llm.ops import attention as A
    from compiled_llm.ops import cpu_attention as C
    from compiled_llm.ops.context import set_forward_context

    d = 32
    specs = {0: A.AttentionSpec(0, 4, 2, d, None, 0), 1: A.AttentionSpec(1, 4, 2, d, 5, 1),
             2: A.AttentionSpec(2, 4, 1, d, None, 2, k_eq_v=True)}
    for dtype in (torch.float32, torch.bfloat16):
        ctx = _context(specs, dtype=dtype)
        n = ctx.attn_metadata.query_start_loc[-1]
        for group in ctx.attn_metadata.groups.values():
            group.slot_mapping[3] = -1  # a padded slot: nothing written for that row
        want = {i: c.clone() for i, c in ctx.kv_caches.items()}
        qkv = torch.randn(n + 2, 8 * d, generator=torch.Generator().manual_seed(3)).to(dtype)  # 2 padding rows
        with _counted(C, "write_kernel") as calls, set_forward_context(ctx):
            for layer, spec in specs.items():
                width = spec.num_kv_heads * d
                k, v = qkv[:, 4 * d:4 * d + width], qkv[:, 6 * d:6 * d + width]
                C.kv_cache_write(None if spec.k_eq_v else k, v, layer)
                group = ctx.attn_metadata.groups[spec.kv_group]
                A.write_kv(want[layer], None if spec.k_eq_v else k, v, group.slot_mapping, spec)
                assert torch.equal(ctx.kv_caches[layer], want[layer]), (dtype, layer)
        assert len(calls) == 2  # the K=V layer through the reference


def test_decode_slots_on_the_host_equal_the_device_formulation():
    """The decode plan is made in numpy where the block tables are on the CPU and with tensor ops elsewhere (no
    host copy inside a device step): both give the same key positions, slots and mask, for a full and a sliding
    group, with a block released out of the window (-1) and lengths that end mid-block."""
    from compiled_llm.ops import attention as A
    from compiled_llm.ops.context import AttentionMetadata

    bs, seq_lens = 4, [9, 3, 14, 1]
    tables = torch.arange(16, dtype=torch.int32).view(4, 4)
    tables[2, 0] = -1  # released: out of a 8-token window at 14 tokens (positions 6..13 are read)
    for with_tensor in (False, True):
        meta = AttentionMetadata([0, 1, 2, 3, 4], seq_lens, bs, {})
        if with_tensor:
            meta.seq_lens_tensor = torch.tensor(seq_lens + [0, 0], dtype=torch.int32)  # padded, as the runner's
        for window in (None, 8):
            longest = max(min(s, window or s) for s in seq_lens)
            host = A._decode_slots(meta, window, tables, torch.device("cpu"))
            device = A._decode_slots_device(meta, window, tables, longest)
            for h, d in zip(host, device):
                assert torch.equal(h, d.to(h.dtype)), (window, h, d)
            k_pos, slots, mask = host
            assert mask is not None  # lengths differ: the host's mask is None only where the device's is all True
            same = AttentionMetadata([0, 1, 2], [6, 6], bs, {})
            none, full = A._decode_slots(same, window, tables[:2], torch.device("cpu")), \
                A._decode_slots_device(same, window, tables[:2], 6)
            assert none[2] is None and bool(full[2].all()) and torch.equal(none[1], full[1].to(none[1].dtype))
            assert k_pos[2, 0] == (6 if window else 0) and bool(mask[2, 0, 0, 0]) is (window is not None)
            assert mask.sum().item() == sum(min(s, window or s) for s in seq_lens) - (0 if window else 4)
            assert slots.min() >= 0


def group_moe():
    from compiled_llm.ops.moe import ref_geglu_moe, ref_router_topk
    from compiled_llm.ops.triton.providers import geglu_moe, router_topk

    g = torch.Generator().manual_seed(1)
    x = rand(9, 32, generator=g)
    proj, scale, pes = rand(8, 32, generator=g), (torch.rand(32, generator=g) + 0.5).to(DEV), torch.rand(8, generator=g).to(DEV)
    w_ref, ids_ref = ref_router_topk(x, proj, scale, pes, 2, 1e-6, 32 ** -0.5)
    w, ids = router_topk(x, proj, scale, pes, 2, 1e-6, 32 ** -0.5)
    assert ids.dtype == torch.long and torch.equal(ids, ids_ref), (ids, ids_ref)
    _check("router weights", w, w_ref)
    gate_up, down = rand(8, 24, 32, generator=g) * 0.2, rand(8, 32, 12, generator=g) * 0.2
    _check("geglu_moe", geglu_moe(x, w, ids, gate_up, down), ref_geglu_moe(x, w, ids, gate_up, down), 1e-3)


def group_softmax_moe():
    """Qwen3.5's router (projection, softmax, top-k, renormalise) and SwiGLU experts."""
    from compiled_llm.ops.moe import ref_softmax_router_topk
    from compiled_llm.ops.swiglu_moe import ref_swiglu_moe
    from compiled_llm.ops.triton.providers import softmax_router_topk, swiglu_moe

    g = torch.Generator().manual_seed(2)
    for t, e, h, k in ((9, 8, 32, 2), (3, 128, 160, 8), (70, 20, 64, 3)):
        x, proj = rand(t, h, generator=g), rand(e, h, generator=g)
        w_ref, ids_ref = ref_softmax_router_topk(x, proj, k)
        w, ids = softmax_router_topk(x, proj, k)
        assert ids.dtype == torch.long and torch.equal(ids, ids_ref), (ids, ids_ref)
        _check(f"softmax router T={t} E={e} k={k}", w, w_ref)
    x = rand(9, 32, generator=g)
    w, ids = ref_softmax_router_topk(x, rand(8, 32, generator=g), 2)
    gate_up, down = rand(8, 24, 32, generator=g) * 0.2, rand(8, 32, 12, generator=g) * 0.2
    _check("swiglu_moe", swiglu_moe(x, w, ids, gate_up, down), ref_swiglu_moe(x, w, ids, gate_up, down), 1e-3)


if __name__ == "__main__":  # python tests/test_op_providers.py GROUP [GROUP ...]
    from interp_groups import main

    main(sys.argv[1:], lambda g: globals()[f"group_{g}"](), before_each=lambda: torch.manual_seed(0))


def test_fused_allreduce_norm_variant_comes_from_the_environment(monkeypatch):
    """COMPILED_LLM_ALLREDUCE_NORM picks the kernel variant a benchmark favoured; the JIT warm-up keys follow it
    (a key it did not warm would be a compile after warm-up), and a malformed value is refused by name."""
    from compiled_llm.ops.triton import allreduce_norm as arn

    facts = {"dtype": torch.bfloat16, "hidden_size": 2816, "tp_size": 2}
    monkeypatch.delenv("COMPILED_LLM_ALLREDUCE_NORM", raising=False)
    assert arn.variant() == (False, None, 1)
    assert arn._keys(facts) == [(torch.bfloat16, 2816, 2, True, False, 16, 1)]
    monkeypatch.setenv("COMPILED_LLM_ALLREDUCE_NORM", "double:8:4")
    assert arn.variant() == (True, 8, 4)
    assert arn._keys(facts) == [(torch.bfloat16, 2816, 2, True, True, 8, 4)]
    assert arn._keys(dict(facts, tp_size=1)) == []
    monkeypatch.setenv("COMPILED_LLM_ALLREDUCE_NORM", "triple:8")
    with pytest.raises(ValueError, match="COMPILED_LLM_ALLREDUCE_NORM"):
        arn.variant()


def test_qk_norm_rope_warm_up_builds_the_launches_a_forward_makes(monkeypatch):
    """JIT warm-up's QK-norm + RoPE builds, in warm-up's order: its forward passes of a few tokens launch the
    one-head-a-program kernel first, then each registry key not yet seen is compiled. Every launch a forward
    then makes (a decode batch, a 300-token prefill: the kernel of 8 heads a program) must be one warm-up made,
    constexprs and warps alike. On the H200 (session 27) the prefill kernel was built at the first long prompt
    twice over: its stand-in query had 2 heads (the head count is a constexpr), and then the registry's key
    did not tell the two kernels apart, so the warm-up forward's launch marked it built. Launches are
    recorded here, not run."""
    from compiled_llm.ops.attention import AttentionSpec
    from compiled_llm.ops.context import set_forward_context
    from compiled_llm.ops.jit import JitMonitor
    from compiled_llm.ops.triton import qk_norm_rope as QK

    seen = {"warm-up": set(), "forward": set()}
    phase = ["warm-up"]

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: seen[phase[0]].add((self.name, tuple(sorted(kw.items()))))

    for name in ("_qk_norm_rope_kernel", "_qk_norm_rope_heads_kernel"):
        monkeypatch.setattr(QK, name, Recorder(name))
    monitor = JitMonitor()
    monkeypatch.setattr(QK, "MONITOR", monitor)
    specs = {0: AttentionSpec(0, 16, 8, 16, None, 0), 1: AttentionSpec(1, 16, 8, 16, None, 0),  # 1 reads 0's cache
             2: AttentionSpec(2, 16, 2, 32, None, 2, k_eq_v=True)}
    ctx = _context(specs, num_blocks=200, seqs=((300, 300),))

    def forward(n):
        pos = torch.arange(n)
        with set_forward_context(ctx):
            for layer, (d, kv, k_eq_v) in {0: (16, 8, False), 1: (16, 0, False), 2: (32, 2, True)}.items():
                w = torch.ones(d)
                v = torch.zeros(n, kv, d) if kv else None
                QK.qk_norm_rope_kv_write(torch.zeros(n, 16, d), v if kv and not k_eq_v else None, v, pos,
                                         torch.ones(d // 2), w, w, 1e-6, v is not None, layer)

    forward(3)  # warm-up's forward passes (a few tokens)
    keys = QK._qk_keys({"dtype": torch.float32, "layers": specs})
    assert {k[5] for k in keys} == {16}
    for key in keys:  # then the registry, as compiler/warmup.py: the keys no launch has noted yet
        if ("qk_norm_rope_kv_write", key) not in monitor.seen:
            QK._qk_compile(key, torch.device("cpu"))
    phase[0] = "forward"
    forward(3)
    forward(300)
    assert any(name == "_qk_norm_rope_heads_kernel" for name, _ in seen["forward"])
    assert seen["forward"] <= seen["warm-up"], seen["forward"] - seen["warm-up"]


def test_decode_qk_norm_is_deferred_to_the_decode_kernel_only_where_that_kernel_runs_after_it(monkeypatch):
    """At a decode step a K!=V layer's QK-norm + RoPE + KV write is left to the Triton decode attention kernel
    (ops/triton/qk_norm_rope.py DEFERRED_QK): only where the layer's attention provider is Triton, on a decode batch,
    for a layer with its own cache, and never inside a compiled piece's CUDA-graph capture (the attention op runs
    after that graph, outside it; in the whole forward's capture it runs inside). The attention op refuses a
    query that is not the deferred op's output (its rows were never written)."""
    from compiled_llm.ops import attention as A
    from compiled_llm.ops import context as C
    from compiled_llm.ops.triton import providers
    from compiled_llm.ops.triton import qk_norm_rope as QK

    specs = {0: A.AttentionSpec(0, 4, 2, 16, None, 0), 1: A.AttentionSpec(1, 4, 2, 16, None, 0),  # 1 reads 0's
             2: A.AttentionSpec(2, 4, 2, 16, None, 2, k_eq_v=True),
             3: A.AttentionSpec(3, 4, 2, 16, None, 3, k_eq_v=True, rotated_pairs=2, rot_keys=2)}  # keeps its keys
    decode, prefill = _context(specs, seqs=((1, 5), (1, 9))), _context(specs)
    q, kv = torch.zeros(2, 4, 16), torch.zeros(2, 2, 16)
    for layer in specs:
        monkeypatch.setitem(A.ATTENTION.chosen, layer, ("triton", providers.attention))
    with C.set_forward_context(decode):
        assert QK._defers(q, kv, kv, True, 0) and QK._defers(q, None, kv, True, 3)
        # K=V rebuilding its keys; another layer's cache; no value norm where the rows keep keys; no write
        assert not QK._defers(q, None, kv, True, 2) and not QK._defers(q, kv, kv, True, 1)
        assert not QK._defers(q, None, kv, False, 3) and not QK._defers(q, None, None, False, 3)
        monkeypatch.setenv(QK.DECODE_QK_ENV, "0")
        assert not QK._defers(q, kv, kv, True, 0) and not QK._defers(q, None, kv, True, 3)
        monkeypatch.delenv(QK.DECODE_QK_ENV)
        monkeypatch.setitem(A.ATTENTION.chosen, 0, ("reference", A.ref_attention))
        assert not QK._defers(q, kv, kv, True, 0)
        monkeypatch.setitem(A.ATTENTION.chosen, 0, ("triton", providers.attention))
        out = QK.qk_norm_rope_kv_write(q, kv, kv, torch.zeros(2, dtype=torch.long), torch.ones(8), torch.ones(16),
                                       torch.ones(16), 1e-6, True, 0)
        # the default form writes the normalised queries back into the op's output (the kernel's QOut)
        assert decode.extra[QK.DEFERRED_QK][0][1].q_out is out
        with pytest.raises(RuntimeError, match="not the deferred QK-norm's output"):
            providers.attention(torch.zeros_like(out).view(2, -1), 0)
    with C.set_forward_context(prefill):
        assert not QK._defers(torch.zeros(15, 4, 16), torch.zeros(15, 2, 16), torch.zeros(15, 2, 16), True, 0)
        assert not QK._defers(torch.zeros(15, 4, 16), None, torch.zeros(15, 2, 16), True, 3)
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not C.later_op_runs_with_this(cuda) and C.later_op_runs_with_this(torch.device("cpu"))
    with C.whole_capture():
        assert C.later_op_runs_with_this(cuda)
    assert not C.later_op_runs_with_this(cuda)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert C.later_op_runs_with_this(cuda)
