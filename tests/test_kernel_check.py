"""runtime/kernel_check.py: the engine's Triton kernels built for an H100/H200 (sm_90) on the CPU, through
Triton's own compiler (the interpreter tests run a kernel's Python only)."""

from __future__ import annotations

import sys
from unittest import mock
from pathlib import Path

import pytest
import torch

from compiled_llm.runtime.kernel_check import SMEM_LIMIT, build_sm90, check_model, ptxas_usage, recorded_launches

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from configs import config_dict  # noqa: E402


def test_a_kernel_the_interpreter_runs_but_the_gpu_cannot_build_fails_here():
    """Session 34's bug class: a jitted helper returning differently shaped tensors from its two constexpr
    branches. Triton's interpreter ran it (every CPU test passed); its compiler refuses it whichever branch is
    taken, as the H200's build did; the same helper with one return builds."""
    import triton
    import triton.language as tl

    @triton.jit
    def pick(a, FLIP: tl.constexpr):
        if FLIP:
            return tl.trans(a)
        return a

    @triton.jit
    def pick_once(a, FLIP: tl.constexpr):
        if FLIP:
            r = tl.trans(a)
        else:
            r = a
        return r

    def kernel_with(helper):
        @triton.jit
        def k(X, Y, FLIP: tl.constexpr):
            i = tl.arange(0, 16)
            j = tl.arange(0, 32)
            a = tl.load(X + i[:, None] * 32 + j[None, :])
            b = helper(a, FLIP)
            tl.store(Y + tl.arange(0, 512), tl.reshape(b, [512]))
        return k

    x, y = torch.zeros(16, 32, dtype=torch.bfloat16), torch.zeros(512, dtype=torch.bfloat16)
    for helper, ok in ((pick, False), (pick_once, True)):
        with recorded_launches() as launches:
            kernel_with(helper)[(1,)](x, y, FLIP=True)
        assert len(launches) == 1 and launches[0].kwargs["FLIP"] is True
        if ok:
            ptx = build_sm90(launches[0]).asm["ptx"]
            assert ".target sm_90" in ptx
        else:
            with pytest.raises(Exception) as err:
                build_sm90(launches[0])
            chain = [err.value]
            while chain[-1].__cause__ is not None:
                chain.append(chain[-1].__cause__)
            assert any("return types" in str(e) for e in chain), chain  # (the wording differs by Triton version)


# Qwen3.5 under the GPU's torch 2.11 (Triton 3.6) only: `make test` runs this file there too, and under torch 2.14
# Gemma 4 alone stands for the newer Triton (suite time: ~25 s a model on two cores)
_GPU_TORCH = tuple(int(v) for v in torch.__version__.split(".")[:2]) <= (2, 11)


@pytest.mark.parametrize("name", ["gemma-4-26b-a4b", pytest.param("qwen3.5-35b-a3b", marks=pytest.mark.skipif(
    not _GPU_TORCH, reason="built under the GPU's torch 2.11 (make test's second run)"))])
def test_every_kernel_start_up_builds_on_an_h200_builds_for_sm90(name):
    """Every Triton launch start-up warm-up makes for the released config on an H100/H200 (the providers chosen
    for one) builds for sm_90 within a block's shared memory; the decode attention, the MoE GEMMs and the
    decode projections are among them, and the large-tile prefill GEMMs take Hopper's warpgroup MMA."""
    built = check_model(config_dict(name), torch.bfloat16)
    failed = [b.row() for b in built if b.error or b.shared > SMEM_LIMIT]
    assert not failed, "\n".join(failed)
    names = {b.launch.name for b in built}
    # one build per constexpr value (an H200 run, session 34: the decode's combine at each split count's BLOCK_S,
    # which a dedupe by argument kinds alone had folded into one, built there and not here)
    block_s = {b.launch.kwargs["BLOCK_S"] for b in built if b.launch.name == "_combine_kernel"}
    assert {8, 16, 32, 64} <= block_s, block_s
    assert {"_decode_kernel", "_prefill_kernel", "_gate_up_kernel", "_down_kernel", "_skinny_kernel"} <= names
    if name.startswith("gemma"):  # its 8,192-token prefill reaches the MoE's top tier (a persistent down kernel)
        assert "_down_persistent_kernel" in names
        # the decode with the QK-norm + RoPE + KV write inside (ops/triton/qk_norm_rope.py): the sliding layers',
        # and the global layers' whose rows keep their rotated keys (the engine marks them: kv_plan.mark_rot_keys)
        qk = [b.launch.kwargs for b in built if b.launch.name == "_decode_kernel" and b.launch.kwargs.get("QK")]
        assert {bool(kw.get("ROT_CACHED")) for kw in qk} == {False, True}
        assert all(kw.get("QOut") is not None for kw in qk)  # the default write-back form
        # and the op's own kernels, which a decode step inside a compiled piece's capture and a prefill launch
        qk_own = [b.launch.kwargs for b in built if b.launch.name.startswith("_qk_norm_rope")]
        assert {(kw["HAS_K"], kw.get("ROT", 0)) for kw in qk_own} == {(True, 0), (False, 64)}
        # the global layers' prefill (head_dim 512, K=V) is the Gluon kernel (wgmma, its tiles through TMA)
        assert not [b for b in built if b.launch.name == "_prefill_kernel" and b.launch.kwargs["K_EQ_V"]]
        assert [b.wgmma > 0 for b in built if b.launch.name == "_prefill_d512_kernel"] == [True]
        # the 128-row prefill tiers' MoE gate/up GEMM is the Gluon kernel (ops/triton/gluon_moe.py), one build
        assert [b.wgmma > 0 for b in built if b.launch.name == "_gate_up_gluon_kernel"] == [True]
    assert any(b.wgmma for b in built if b.launch.name == "_gate_up_kernel")
    assert all(b.registers > 0 for b in built)  # ptxas read each one


def test_warm_up_builds_the_samplers_argmax_at_the_vocabulary_width():
    """The greedy sampler's argmax over a vocabulary-wide row merges 64 chunks (262,144 / 4,096): warm-up must
    build that merge, not a narrow row's (an H200 server built it on its first request, ~0.6 s of TTFT)."""
    from compiled_llm.runtime.kernel_check import engine_launches

    launches = engine_launches(config_dict("gemma-4-26b-a4b"), only={"argmax_rows"})
    assert {(lz.name, lz.kwargs.get("BLOCK_C")) for lz in launches} == {("_argmax_chunk_kernel", None),
                                                                       ("_argmax_merge_kernel", 64)}


def test_warm_up_builds_xgrammars_bitmask_kernel_where_the_sampler_runs_triton(monkeypatch):
    """xgrammar's grammar-mask kernel is Triton on CUDA and built on its first launch: warm-up launches it for each
    specialisation the sampler can reach (rows 1, 2 and a multiple of 16; all rows or some by index), at the
    vocabulary width, so that a server's first constrained request builds nothing inside a step."""
    pytest.importorskip("xgrammar")
    from compiled_llm.compiler.warmup import kernel_keys
    from compiled_llm.runtime import structured_output as so
    from compiled_llm.runtime.kernel_check import h100_facts

    with h100_facts(config_dict("gemma-4-26b-a4b")) as facts:
        keys = [key for kernel, key in kernel_keys(facts) if kernel.name == "grammar_bitmask"]
    assert sorted(keys) == [(262144, rows, indexed) for rows in (1, 2, 16) for indexed in (False, True)]
    import xgrammar

    calls = []

    def launch(logits, mask, vocab_size, indices):
        calls.append((logits.shape, mask.shape, vocab_size, indices))

    monkeypatch.setattr(xgrammar, "apply_token_bitmask_inplace", launch)
    so._bitmask_compile((1000, 2, True), torch.device("cpu"))
    assert calls == [((3, 1000), (3, 32), 1000, [0, 1])]  # two rows of three masked, by index
    monkeypatch.setattr(so, "xgrammar_available", lambda: False)
    assert so._bitmask_keys(facts) == []


def test_compile_cache_dry_run_kernels_prints_each_kernels_build(tmp_path, capsys):
    """`compile-cache --dry-run --kernels` from a config.json alone: the table, one row a distinct kernel build,
    and exit 0; a kernel that cannot build for sm_90 makes it exit 1 and names it."""
    import json
    from unittest import mock

    from compiled_llm.cli import main
    from compiled_llm.runtime import kernel_check

    (tmp_path / "config.json").write_text(json.dumps(config_dict("gemma-4-26b-a4b")))
    args = ["compile-cache", "--dry-run", "--kernels", "--model", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Triton kernels built for sm_90" in out and "all built" in out
    assert any(line.strip().startswith("_decode_kernel") and "regs" in line for line in out.splitlines())

    real = kernel_check.build_sm90

    def refuse_decode(launch):
        if launch.name == "_decode_kernel":
            raise RuntimeError("no registers left")
        return real(launch)

    with mock.patch.object(kernel_check, "build_sm90", refuse_decode):
        assert main(args) == 1
    out = capsys.readouterr().out
    assert "_decode_kernel" in out and "FAILED RuntimeError: no registers left" in out and "failed" in out


def test_the_projection_of_a_split_decodes_output_launches_with_pdl_on_an_h200():
    """The o_proj right after the decode's combine (the combine's output tensor) launches with programmatic
    dependent launch on an H100/H200 (the combine lets it start; it asks L2 for its first weight steps, then
    waits): recorded as an H200 would launch them. Any other decode projection (Qwen3.5's out_proj after the delta
    rule, where PDL lost 0.7%) launches plainly, and so does everything with COMPILED_LLM_DECODE_PDL=0."""
    from compiled_llm.ops.triton import paged_attention as PA
    from compiled_llm.ops.triton.skinny_gemm import decode_mm

    rows, heads, splits, d = 2, 16, 8, 256
    mid_o, mid_lse = torch.zeros(rows, heads, splits, d), torch.zeros(rows, heads, splits)
    out = torch.empty(rows, heads, d, dtype=torch.bfloat16)
    w = torch.zeros(2816, heads * d, dtype=torch.bfloat16)  # Gemma 4's o_proj: narrow (split K)
    other = torch.zeros(rows, heads * d, dtype=torch.bfloat16)

    def launched(pdl_env):
        with mock.patch.dict("os.environ", {"COMPILED_LLM_DECODE_PDL": pdl_env}), \
                recorded_launches(as_sm90=True) as launches:
            PA.combine_splits(mid_o, mid_lse, out)
            decode_mm(out.view(rows, -1), w)
            decode_mm(other, w)
        return [(ln.name, ln.kwargs.get("GDC", False), ln.kwargs.get("launch_pdl", False),
                 ln.kwargs.get("PREFETCH", 0)) for ln in launches]

    assert launched("2") == [("_combine_kernel", True, False, 0), ("_skinny_kernel", False, True, 2),
                             ("_skinny_kernel", False, False, 0)]
    assert launched("0") == [("_combine_kernel", False, False, 0), ("_skinny_kernel", False, False, 0),
                             ("_skinny_kernel", False, False, 0)]


def test_parallel_builds_parse_one_kernel_source_at_a_time():
    """Start-up's parallel build and the sm_90 check build on threads; CPython 3.11.7 can raise "AST constructor
    recursion depth mismatch" when two threads parse at once (a clean-clone run of the check above did), so within
    serial_ast_parse no two parses overlap, and ast.parse is itself again after."""
    import ast
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from compiled_llm.ops.jit import serial_ast_parse

    real, inside, most = ast.parse, [0], [0]
    count = threading.Lock()

    def slow_parse(*args, **kwargs):  # a parse that takes long enough for the threads to meet
        with count:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.01)
        with count:
            inside[0] -= 1
        return real(*args, **kwargs)

    with mock.patch.object(ast, "parse", slow_parse):
        with serial_ast_parse(), ThreadPoolExecutor(4) as pool:
            trees = list(pool.map(lambda i: ast.parse(f"def f{i}(): return {i}"), range(16)))
        assert ast.parse is slow_parse
    assert most[0] == 1 and [t.body[0].name for t in trees] == [f"f{i}" for i in range(16)]


def test_the_decodes_query_norm_reduces_once_before_its_loop():
    """The sliding layers' decode with its QK work inside (the write-back form a decode step runs) normalises each
    row with one cross-warp reduction over both halves' squares (ops/triton/qk_norm_rope.py _norm, _norm_rows), not
    a sum of two: three reductions before its key loop in the sm_90 build (the queries', the new key's and the new
    value's norms; two a norm: six). Triton 3.6 (the GPU's): 26 -> 17 barriers before the first KV copy."""
    from compiled_llm.ops.triton import paged_attention as PA

    seqs, kvh, d, page = 2, 8, 256, 16
    cache = torch.zeros(2, 16, page, kvh, d, dtype=torch.bfloat16)
    tables = torch.arange(16, dtype=torch.int32).view(seqs, 8)
    lens = torch.tensor([100, 37], dtype=torch.int32)
    q = torch.zeros(seqs, 2 * kvh * d, dtype=torch.bfloat16)
    kv = torch.zeros(seqs, kvh, d, dtype=torch.bfloat16)
    w = torch.ones(d, dtype=torch.bfloat16)
    last = lens.long() - 1
    qk = PA.DecodeQK(kv, kv, last, torch.ones(d // 2), w, w, last, 1e-6, True, torch.empty_like(q))
    with recorded_launches(as_sm90=True) as launches:
        PA.paged_decode(q, cache, tables, lens, scale=d ** -0.5, sliding_window=64, num_kv_heads=kvh, head_dim=d,
                        qk=qk)
    lz = next(ln for ln in launches if ln.name == "_decode_kernel")
    assert lz.kwargs["QK"] and lz.kwargs["QOut"] is not None
    ttir = build_sm90(lz).asm["ttir"].splitlines()
    loop = next(i for i, ln in enumerate(ttir) if "scf.for" in ln)
    assert sum("tt.reduce" in ln and "tt.reduce.return" not in ln for ln in ttir[:loop]) == 3


def _global_prefill_launches(softcap=None):
    """paged_prefill at Gemma 4 26B-A4B's global layers (head_dim 512, K=V, 2 KV heads of 8-head groups, page 16),
    three sequences with cached prefixes (one new token, a chunk, a whole prompt), recorded as on an H100/H200."""
    from compiled_llm.ops.rope import rope_inv_freq
    from compiled_llm.ops.triton.paged_attention import paged_prefill

    seq_lens, q_lens = [1000, 300, 77], [1, 200, 77]
    qsl = torch.tensor([0, 1, 201, 278], dtype=torch.int32)
    tables = torch.arange(3 * 64, dtype=torch.int32).view(3, 64)  # 1,024 positions a sequence
    cache = torch.zeros(1, 3 * 64, 16, 2, 512, dtype=torch.bfloat16)
    q = torch.zeros(sum(q_lens), 16, 512, dtype=torch.bfloat16)
    inv = rope_inv_freq(512, 1e6, "proportional", partial_rotary_factor=0.25)
    with recorded_launches(as_sm90=True) as launches, torch.inference_mode():
        paged_prefill(q, cache, tables, qsl, torch.tensor(seq_lens, dtype=torch.int32), scale=1.0, softcap=softcap,
                      k_eq_v=True, k_norm_weight=torch.ones(512, dtype=torch.bfloat16), inv_freq=inv,
                      num_kv_heads=2, head_dim=512)
    return launches


def test_the_global_layers_prefill_runs_the_gluon_kernel_on_hopper_and_it_builds(monkeypatch, caplog):
    """On an H100/H200 Gemma 4's global-layer prefill (head_dim 512, K=V) rebuilds its keys and copies its values
    into the dense buffers (their tails zeroed to the 64-key tile), then launches the Gluon kernel
    (ops/triton/gluon_prefill.py) over query tiles of 8 tokens x 8 heads plus one per sequence, for both KV heads;
    that launch builds for sm_90 within shared memory, with wgmma, TMA and no spills, under the GPU's Triton (3.6)
    as well as 3.8. Gluon has no interpreter: this build and the launch's arguments are what the CPU can check. A
    soft-capped layer runs the Triton tile and says why; the A/B switch runs the Triton tile without a word."""
    launches = _global_prefill_launches()
    assert [lz.name for lz in launches] == ["_rebuild_k_kernel", "_prefill_d512_kernel"]
    rebuild, gluon = launches
    assert rebuild.kwargs["COPY_V"] and rebuild.kwargs["TAIL"] == 64
    assert gluon.grid == (-(-278 // 8) + 3, 2)
    assert (gluon.kwargs["GROUP"], gluon.kwargs["BLOCK_N"], gluon.kwargs["STAGES"], gluon.kwargs["num_warps"]) == (
        8, 64, 1, 8)
    k_desc, v_desc, dense_rows = gluon.args[1], gluon.args[2], gluon.args[8]
    assert dense_rows == 1024 and list(k_desc.shape) == list(v_desc.shape) == [3 * 1024, 2 * 512]
    assert list(k_desc.block_shape) == [64, 256]
    kernel = build_sm90(gluon)
    regs, spilled = ptxas_usage(kernel.asm["ptx"])
    assert kernel.metadata.shared <= SMEM_LIMIT and spilled == 0 and regs > 0, (kernel.metadata.shared, regs, spilled)
    assert kernel.asm["ptx"].count("wgmma.mma_async") > 0 and "cp.async.bulk.tensor" in kernel.asm["ptx"]

    caplog.set_level("WARNING", logger="compiled_llm")
    capped = _global_prefill_launches(softcap=30.0)
    assert [lz.name for lz in capped] == ["_rebuild_k_kernel", "_prefill_kernel"] and capped[1].kwargs["TMA"]
    assert "soft-cap 30.0" in caplog.text and "not the Gluon kernel" in caplog.text
    caplog.clear()
    monkeypatch.setenv("COMPILED_LLM_PREFILL_GLUON", "0")
    triton_tile = _global_prefill_launches()
    assert [lz.name for lz in triton_tile] == ["_rebuild_k_kernel", "_prefill_kernel"]
    assert triton_tile[1].kwargs["TMA"] and triton_tile[1].kwargs["BLOCK_N"] == 32 and not caplog.text


def _prefill_moe_launches(tokens, activation="gelu_tanh", hidden=2816, inter=704, hopper=True):
    """fused_moe at the policy of a `tokens`-token prefill of Gemma 4 26B-A4B's experts (128 experts, top-8),
    on 40 stand-in tokens over 3 experts, recorded as on an H100/H200 (hopper=False: an sm_90+ GPU that is not
    Hopper, e.g. a B200's sm_100, which has no wgmma); the alignment made by torch's ops."""
    from compiled_llm.ops.triton import _common, moe as M

    T, E, k = 40, 3, 8
    x = torch.zeros(T, hidden, dtype=torch.bfloat16)
    w, d = torch.zeros(E, 2 * inter, hidden, dtype=torch.bfloat16), torch.zeros(E, hidden, inter, dtype=torch.bfloat16)
    ids = (torch.arange(T * k, dtype=torch.int32) % E).view(T, k)
    pol = M.moe_launch_policy(tokens, k, 128, hidden, inter)
    with recorded_launches(as_sm90=True) as launches, torch.inference_mode():
        _common.hopper = lambda device: hopper  # (recorded_launches puts the real one back)
        M.fused_moe(x, w, d, torch.rand(T, k), ids, activation=activation, policy=pol,
                    alignment=M.moe_align_sorted(ids, E, pol.block_m))
    return pol, launches


def test_the_prefill_moe_gate_up_runs_the_gluon_kernel_on_hopper_and_it_builds(monkeypatch, caplog):
    """On an H100/H200 the 128-row prefill tiers (2,048 and 8,192 tokens of Gemma 4) launch the gate/up GEMM on
    the Gluon kernel (ops/triton/gluon_moe.py: a program a 128-column block of gate and up and a row block, the
    descriptor over the weights as [E * 2I, H] in [128, 64] boxes), which builds for sm_90 with one N = 256 wgmma a
    16-deep K slice, TMA and cp.async, within shared memory and without spills, under the GPU's Triton (3.6) as well
    as 3.8; SwiGLU (Qwen3.5) takes the same kernel with SILU. The 64-row tier (1,024 tokens) and the A/B switch run
    the Triton kernel without a word; a GPU that is not Hopper (no wgmma) runs it and says why."""
    from triton.experimental.gluon._runtime import GluonJITFunction

    for tokens, down in [(2048, "_down_kernel"), (8192, "_down_persistent_kernel")]:
        pol, launches = _prefill_moe_launches(tokens)
        assert pol.block_m == 128 and pol.gluon
        assert [lz.name for lz in launches] == ["_gate_up_gluon_kernel", down, "_topk_sum_kernel"]
        up = launches[0]
        assert isinstance(up.kernel, GluonJITFunction) and up.grid == (6, up.args[3].numel())
        assert (up.kwargs["BLOCK_M"], up.kwargs["BLOCK_N"], up.kwargs["STAGES"], up.kwargs["num_warps"]) == (
            128, 128, 4, 8)
        assert not up.kwargs["SILU"] and up.args[6:10] == (40 * 8, 704, 2816, 3)
        assert list(up.args[1].shape) == [3 * 2 * 704, 2816] and list(up.args[1].block_shape) == [128, 64]
    kernel = build_sm90(up)
    ptx = kernel.asm["ptx"]
    regs, spilled = ptxas_usage(ptx)
    assert kernel.metadata.shared <= SMEM_LIMIT and spilled == 0 and regs > 0, (kernel.metadata.shared, regs, spilled)
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n256k16") == 4
    assert "cp.async.bulk.tensor" in ptx and "cp.async.cg.shared.global" in ptx and "ld.local" not in ptx
    _, (swiglu, *_) = _prefill_moe_launches(8192, "silu", hidden=2048, inter=512)
    assert swiglu.name == "_gate_up_gluon_kernel" and swiglu.kwargs["SILU"] and swiglu.grid[0] == 4

    caplog.set_level("WARNING", logger="compiled_llm")
    pol, launches = _prefill_moe_launches(1024)
    assert not pol.gluon and launches[0].name == "_gate_up_kernel" and launches[0].kwargs["BLOCK_M"] == 64
    monkeypatch.setenv("COMPILED_LLM_MOE_GLUON", "0")
    pol, launches = _prefill_moe_launches(8192)
    assert not pol.gluon and launches[0].name == "_gate_up_kernel" and launches[0].kwargs["TMA"]
    assert not caplog.text
    monkeypatch.delenv("COMPILED_LLM_MOE_GLUON")
    _, launches = _prefill_moe_launches(8192, hopper=False)
    assert launches[0].name == "_gate_up_kernel" and launches[0].kwargs["TMA"]
    assert "not a Hopper GPU" in caplog.text and "not the Gluon one" in caplog.text


def test_the_prefill_moe_down_runs_the_gluon_kernel_under_its_switch_and_it_builds(monkeypatch, caplog):
    """COMPILED_LLM_MOE_GLUON_DOWN=1 (an experiment, off by default) puts the 128-row prefill tiers' down GEMM on
    the persistent Gluon kernel (ops/triton/gluon_moe.py _down_gluon_kernel: a CTA an SM walking the tiles, act
    and the weights through TMA): at 2,048 tokens on 128 x 128 tiles at four stages, at 8,192 on the Triton
    kernel's 128 x 256 at three, both built for sm_90 with a N = BLOCK_N wgmma a 16-deep K slice, within shared
    memory and without spills, under the GPU's Triton (3.6) as well as 3.8. Unset, or at the 64-row tier, the
    Triton kernels run; a GPU that is not Hopper runs them and says why."""
    from triton.experimental.gluon._runtime import GluonJITFunction

    pol, launches = _prefill_moe_launches(8192)
    assert not pol.gluon_down and launches[1].name == "_down_persistent_kernel"
    monkeypatch.setenv("COMPILED_LLM_MOE_GLUON_DOWN", "1")
    for tokens, block_n, stages in [(2048, 128, 4), (8192, 256, 3)]:
        pol, launches = _prefill_moe_launches(tokens)
        assert pol.gluon_down and [lz.name for lz in launches] == [
            "_gate_up_gluon_kernel", "_down_gluon_kernel", "_topk_sum_kernel"]
        down = launches[1]
        blocks = down.args[3].numel()  # 3 experts' blocks of 40 x 8 pairs
        assert isinstance(down.kernel, GluonJITFunction) and down.grid == (min(132, blocks * 2816 // block_n),)
        assert (down.kwargs["BLOCK_M"], down.kwargs["BLOCK_N"], down.kwargs["STAGES"]) == (128, block_n, stages)
        assert down.args[7:11] == (40 * 8, 2816, 704, 3) and list(down.args[1].shape) == [3 * 2816, 704]
        assert list(down.args[0].block_shape) == [128, 64] and list(down.args[1].block_shape) == [block_n, 64]
        kernel = build_sm90(down)
        ptx = kernel.asm["ptx"]
        regs, spilled = ptxas_usage(ptx)
        assert kernel.metadata.shared <= SMEM_LIMIT and spilled == 0 and regs > 0, (tokens, regs, spilled)
        assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{block_n}k16") == 4 and "cp.async.bulk.tensor" in ptx
        assert "ld.local" not in ptx

    caplog.set_level("WARNING", logger="compiled_llm")
    pol, launches = _prefill_moe_launches(1024)
    assert not pol.gluon_down and launches[1].name == "_down_kernel" and not caplog.text
    _, launches = _prefill_moe_launches(8192, hopper=False)
    assert launches[1].name == "_down_persistent_kernel"
    assert "grouped MoE down GEMM" in caplog.text and "not a Hopper GPU" in caplog.text


def test_the_gluon_moe_gate_up_prototype_builds_for_sm90_without_spills():
    """benchmarks/gluon_moe_gate_up.py: the MoE gate/up grouped GEMM as a Gluon kernel (gathered token rows by
    cp.async, gate and up tiles by TMA into one buffer, wgmma; not in the engine). Gluon has no interpreter, so the
    CPU checks the sm_90 build, under the GPU's Triton (3.6) as well as 3.8: 128-row blocks (two warpgroups) with
    gate and up in one N = 128 wgmma, the same warp-specialized (loader warps apart), and 64-row blocks (the
    1,024-token policy's) with the N = 256 one, within shared memory and without spills; and the launch: one
    program a column block and row block, the descriptor over the weights as [E * 2I, H]."""
    import gluon_moe_gate_up as G

    for variant, block_m in [("f64x6", 128), ("w64x6", 128), ("f128x4", 64)]:
        kernel = G.build_sm90(variant, block_m)
        ptx = kernel.asm["ptx"]
        regs, spilled = ptxas_usage(ptx)
        assert kernel.metadata.shared <= SMEM_LIMIT and spilled == 0 and regs > 0, (variant, block_m, regs, spilled)
        n = 2 * G.VARIANTS[variant][0]
        assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{n}k16") == 4, variant  # a 64-deep K step
        assert "cp.async.bulk.tensor" in ptx and "cp.async.cg.shared.global" in ptx and "ld.local" not in ptx

    x, w = torch.zeros(5, 2816, dtype=torch.bfloat16), torch.zeros(3, 2 * 704, 2816, dtype=torch.bfloat16)
    sorted_ids, expert_ids = torch.zeros(4 * 128, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    act = torch.empty(4 * 128, 704, dtype=torch.bfloat16)
    grid, args, kwargs = G.launch_args(x, w, sorted_ids, expert_ids, expert_ids[:1], act, 8, 128, "f128x4")
    assert grid == (6, 4) and kwargs["num_warps"] == 8 and args[6:9] == (5 * 8, 704, 2816)
    assert list(args[1].shape) == [3 * 2 * 704, 2816] and list(args[1].block_shape) == [128, 64]


def test_the_gluon_moe_down_prototype_builds_for_sm90_without_spills():
    """benchmarks/gluon_moe_down.py: the MoE down grouped GEMM as a persistent Gluon kernel (activation rows and
    weight tiles by TMA, wgmma, the stage ring running across tiles; not in the engine). Gluon has no interpreter,
    so the CPU checks the sm_90 build under the GPU's Triton (3.6) as well as 3.8: the engine's 8,192-token tile
    (128 x 256, two warpgroups, 3 stages plus the epilogue's buffer) in one partition and warp-specialized (TMA
    warps apart, their registers handed to the consumers), and 128 x 128 at 4 stages, within shared memory and
    without spills; and the launch: a program an SM (never more than the tiles), descriptors over act in
    [BLOCK_M, 64] boxes and over the weights as [E * H, I]."""
    import gluon_moe_down as D

    for variant in ("p256x3", "w256x3", "p128x4"):
        kernel = D.build_sm90(variant, 128)
        ptx = kernel.asm["ptx"]
        regs, spilled = ptxas_usage(ptx)
        assert kernel.metadata.shared <= SMEM_LIMIT and spilled == 0 and regs > 0, (variant, regs, spilled)
        n = D.VARIANTS[variant][0]
        assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{n}k16") == 4, variant  # a 64-deep K step
        assert "cp.async.bulk.tensor" in ptx and "ld.local" not in ptx, variant
        assert ("setmaxnreg" in ptx) == D.is_ws(variant), variant

    act, w = torch.zeros(4 * 128, 704, dtype=torch.bfloat16), torch.zeros(3, 2816, 704, dtype=torch.bfloat16)
    sorted_ids, expert_ids = torch.zeros(4 * 128, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    y = torch.empty(5 * 8, 2816, dtype=torch.bfloat16)
    grid, args, kwargs = D.launch_args(act, w, sorted_ids, expert_ids, expert_ids[:1], torch.zeros(5, 8), y, 128,
                                       "p256x3", 132)
    assert grid == (4 * 11,) and kwargs["num_warps"] == 8 and args[7:11] == (5 * 8, 2816, 704, 3)
    assert list(args[0].block_shape) == [128, 64] and list(args[1].shape) == [3 * 2816, 704]
    assert list(args[1].block_shape) == [256, 64]
    assert D.launch_args(act, w, sorted_ids, expert_ids, expert_ids[:1], torch.zeros(5, 8), y, 128, "p128x4",
                         20)[0] == (20,)
