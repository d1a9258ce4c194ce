"""Triton kernels (compiled_llm/ops/triton) against the PyTorch references, on the CPU through the Triton
interpreter. TRITON_INTERPRET must be set before triton is first imported, so every kernel group runs
this file as a script in a subprocess (`python tests/test_triton_kernels.py <group> ...`): the fast groups all
in one (tests/interp_groups.py), each group's test checking that group's result; each slow sweep in its own.
Everything is float32 at small sizes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from interp_groups import check, run_groups

ROOT = Path(__file__).resolve().parents[1]

# in an order whose round-robin halves (interp_groups.shards: the two processes) take about as long: ~57 and ~53 s
# on a 2-core host (moe 25, skinny_gemm 24 and prefill 21 s the longest)
FAST = ["moe", "skinny_gemm", "prefill", "decode_qk", "router", "decode_qk_rot", "argmax_rows", "moe_align_sorted",
        "gelu", "allreduce_norm", "logits_softcap", "decode", "rot_keys", "swiglu_moe"]
SLOW = ["decode_sweep", "prefill_sweep", "moe_sweep"]


def _run_group(group: str, timeout: int):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), group], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"group {group} failed:\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}"


@pytest.fixture(scope="module")
def group_results(request):
    """Every selected fast group in one interpreter subprocess (tests/interp_groups.py)."""
    return run_groups(request, __file__, "test_triton_kernels")


@pytest.mark.parametrize("group", FAST)
def test_triton_kernels(group_results, group):
    check(group_results, group)


@pytest.mark.slow
@pytest.mark.parametrize("group", SLOW)
def test_triton_kernels_sweep(group):
    _run_group(group, timeout=1800)


# ------------------------------------------------------------------------------------------------------
# checkers (run in the subprocess, with TRITON_INTERPRET=1 already set)


def _close(name, got, ref, rtol=1e-3, atol=2e-4):
    import torch

    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    assert torch.isfinite(got).all(), f"{name}: non-finite output"
    err = (got.float() - ref.float()).abs()
    bound = atol + rtol * ref.float().abs()
    ok = bool((err <= bound).all())
    print(f"  {name}: max err {err.max().item():.2e} {'ok' if ok else 'FAIL'}", flush=True)
    assert ok, f"{name}: max err {err.max().item():.3e}"


def _attn_case(seq_lens, q_lens, *, page, kv_heads, group, head_dim, window=None, softcap=None, k_eq_v=False,
               seed=0):
    """Random paged cache + block tables. Slots nobody may see are NaN, blocks wholly outside every
    query's window are released (-1), so a kernel that reads either fails the finiteness check."""
    import torch

    from compiled_llm.ops.rope import rope_inv_freq

    g = torch.Generator().manual_seed(seed)
    nblk = [-(-L // page) for L in seq_lens]
    num_blocks = sum(nblk) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    bt = torch.full((len(seq_lens), max(nblk) + 1), -1, dtype=torch.int32)
    cache = torch.full((1 if k_eq_v else 2, num_blocks, page, kv_heads, head_dim), float("nan"))
    for i, (L, ql) in enumerate(zip(seq_lens, q_lens)):
        first = 0 if window is None else max(0, L - ql - window + 1)  # first position any query sees
        for b in range(nblk[i]):
            blk = perm.pop()
            if (b + 1) * page <= first:
                continue  # released
            bt[i, b] = blk
            for s in range(page):
                if first <= b * page + s < L:
                    cache[:, blk, s] = torch.randn(cache.shape[0], kv_heads, head_dim, generator=g)
    q = torch.randn(sum(q_lens), kv_heads * group, head_dim, generator=g)
    extra = {}
    if k_eq_v:
        extra["k_norm_weight"] = 1.0 + 0.3 * torch.randn(head_dim, generator=g)
        extra["inv_freq"] = rope_inv_freq(head_dim, 10000.0, "proportional", partial_rotary_factor=0.5)
        assert (extra["inv_freq"] == 0).any()
    return q, cache, bt, extra


def _attn_reference(q, cache, bt, seq_lens, q_lens, *, page, kv_heads, group, head_dim, window, softcap, k_eq_v,
                    scale, k_norm_weight=None, inv_freq=None, spans=None):
    """compiled_llm.ops.attention.reference_attention through a ForwardContext (reading layer, no writes)."""
    import torch

    from compiled_llm.ops import attention as A
    from compiled_llm.ops import context as C

    qsl = [0]
    for ql in q_lens:
        qsl.append(qsl[-1] + ql)
    src = A.AttentionSpec(layer_idx=0, num_heads=kv_heads * group, num_kv_heads=kv_heads, head_dim=head_dim,
                          sliding_window=window, cache_layer=0, scale=scale, softcap=softcap, k_eq_v=k_eq_v,
                          k_norm_weight=k_norm_weight, inv_freq=inv_freq)
    spec = A.AttentionSpec(layer_idx=1, num_heads=kv_heads * group, num_kv_heads=kv_heads, head_dim=head_dim,
                           sliding_window=window, cache_layer=0, scale=scale, softcap=softcap)
    meta = C.AttentionMetadata(query_start_loc=qsl, seq_lens=list(seq_lens), block_size=page,
                               groups={window: C.GroupMetadata(block_tables=bt, slot_mapping=torch.empty(0))})
    ctx = C.ForwardContext(attn_metadata=meta, kv_caches={0: cache}, layers={0: src, 1: spec},
                           extra={A.BIDIR_SPANS_KEY: spans} if spans else {})
    with C.set_forward_context(ctx):
        out = A.reference_attention(q.reshape(q.shape[0], -1), None, None, 1)
    return out.view(q.shape), ctx


def _check_attention(mode, *, seq_lens, q_lens=None, page, kv_heads, group, head_dim, window=None, softcap=None,
                     k_eq_v=False, splits=None, block_n=None, block_m=None, inloop_k=False, spans=None, seed=0,
                     full_rebuild=False, split_d=False):
    import torch

    from compiled_llm.ops.triton import paged_attention as PA

    # prefill of K=V layers: dense pre-rebuilt keys unless inloop_k forces the in-loop rebuild
    PA.DENSE_K_LIMIT_BYTES = 0 if inloop_k else 1 << 30

    q_lens = q_lens or [1] * len(seq_lens)
    q, cache, bt, extra = _attn_case(seq_lens, q_lens, page=page, kv_heads=kv_heads, group=group,
                                     head_dim=head_dim, window=window, softcap=softcap, k_eq_v=k_eq_v, seed=seed)
    scale = head_dim ** -0.5 * 1.7
    opts = dict(scale=scale, sliding_window=window, softcap=softcap, k_eq_v=k_eq_v, num_kv_heads=kv_heads,
                head_dim=head_dim, **extra)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    ref, ctx = _attn_reference(q, cache, bt, seq_lens, q_lens, page=page, kv_heads=kv_heads, group=group,
                               head_dim=head_dim, window=window, softcap=softcap, k_eq_v=k_eq_v, scale=scale,
                               spans=spans, **extra)
    if spans:  # media spans seen both ways: the provider's per-token bounds
        from compiled_llm.ops.triton.providers import _span_bounds

        opts["spans"] = _span_bounds(ctx, q.shape[0], q.device)
        assert opts["spans"] is not None and (opts["spans"][1] > 0).any()
    if mode == "decode":
        base = PA.attention_launch_policy(len(seq_lens), max(seq_lens), head_dim, num_kv_heads=kv_heads,
                                          sliding_window=window, k_eq_v=k_eq_v)
        pol = PA.AttnLaunch(num_splits=splits or base.num_splits, block_n=block_n or base.block_n)
        # K=V: keys rebuilt on the rotated dims only, as the engine runs it (full_rebuild: every dim)
        from compiled_llm.ops.rope import rotated_pairs

        rot = None if full_rebuild or not k_eq_v else rotated_pairs(head_dim, "proportional", 0.5)
        out = PA.paged_decode(q, cache, bt, sl, policy=pol, rotated_pairs=rot, **opts)
    else:
        qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
        base = PA.attention_launch_policy(len(seq_lens), max(seq_lens), head_dim, prefill=True)
        pol = PA.AttnLaunch(block_m=block_m or base.block_m, block_n=block_n or base.block_n, split_d=split_d)
        out = PA.paged_prefill(q, cache, bt, qsl, sl, policy=pol, **opts)
    name = ("in-loop-k " if inloop_k and k_eq_v and mode == "prefill" else "") + (f"{mode} lens={seq_lens} q={q_lens if mode == 'prefill' else 1} page={page} kv={kv_heads} g={group} "
            f"d={head_dim} W={window} cap={softcap} kv=v:{k_eq_v} splits={pol.num_splits} bn={pol.block_n}"
            + (f" bm={pol.block_m}" if mode == "prefill" else "") + (f" spans={spans}" if spans else "")
            + (" split-d" if split_d else "")
            + (f" rebuilt dims/2={PA.rotated_block(rot, head_dim // 2)}" if mode == "decode" and k_eq_v else ""))
    _close(name, out, ref)


def check_logits_softcap():
    import torch

    from compiled_llm.ops.logits import ref_logits_softcap
    from compiled_llm.ops.triton.logits import logits_softcap

    g = torch.Generator().manual_seed(3)
    for dtype, cap in ((torch.bfloat16, 30.0), (torch.float32, 30.0), (torch.bfloat16, 7.5)):
        x = (torch.randn(3, 5003, generator=g) * 40).to(dtype)  # past the cap both ways; a partial last block
        got, ref = logits_softcap(x, cap), ref_logits_softcap(x, cap)
        assert got.dtype == torch.float32 and got.shape == x.shape
        # each intermediate rounded to the logits' dtype as eager rounds it. float32: equal up to tanh's last
        # bits. bfloat16: the interpreter truncates float32 -> bfloat16 (the GPU rounds to nearest even, as
        # eager does), so up to three roundings one ulp off here (scripts/check_kernels_gpu.py: equal there)
        ulp = cap * (2.0 ** -6 if dtype == torch.bfloat16 else 2.0 ** -21)
        _close(f"logits_softcap {dtype} cap={cap}", got, ref, rtol=0, atol=(4 if dtype == torch.bfloat16 else 1) * ulp)
        assert (got.abs() <= cap).all()


def check_rot_keys():
    """K=V rows that keep their rotated keys (AttentionSpec.rot_keys): the Triton write equals the reference
    write (the value exactly, the rotated keys to float32 rounding), and the decode kernel reading them equals the
    reference decode, which rebuilds the keys from the values; with those cached keys spoiled it no longer does
    (so they are what it reads)."""
    import torch

    from compiled_llm.ops import attention as A
    from compiled_llm.ops import context as C
    from compiled_llm.ops.rope import rope_inv_freq, rotated_pairs
    from compiled_llm.ops.triton.providers import attention as triton_attention
    from compiled_llm.ops.triton.qk_norm_rope import kv_cache_write

    g = torch.Generator().manual_seed(5)
    d, kvh, heads, page = 64, 2, 4, 16
    spec = A.AttentionSpec(0, heads, kvh, d, None, 0, d ** -0.5, 40.0, True,
                           rotated_pairs=rotated_pairs(d, "proportional", 0.25))
    spec.rot_keys = A.cached_rot_keys(spec)
    assert spec.rot_keys == 16 and spec.cache_dim == 96  # 8 rotated pairs a half, as a 16-wide block
    spec.k_norm_weight = torch.rand(d, generator=g) + 0.5
    spec.inv_freq = rope_inv_freq(d, 10_000.0, "proportional", 0.25)
    lens = [37, 50, 9]
    nblk = [-(-n // page) for n in lens]
    perm = torch.randperm(sum(nblk), generator=g)
    bt = torch.full((3, max(nblk)), -1, dtype=torch.int32)
    off = 0
    for i, nb in enumerate(nblk):
        bt[i, :nb] = perm[off:off + nb].int()
        off += nb
    pos = torch.cat([torch.arange(n) for n in lens])
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    slots = (bt[seq, pos // page].long() * page + pos % page)
    qsl = [0, 37, 87, 96]
    v = torch.randn(len(pos), kvh * d, generator=g)
    caches = [torch.full((1, sum(nblk), page, kvh, spec.cache_dim), float("nan"))[..., :d] for _ in range(2)]
    meta = C.AttentionMetadata(qsl, lens, page, {None: C.GroupMetadata(bt, slots)}, positions=pos)
    with C.set_forward_context(C.ForwardContext(meta, {0: caches[0]}, {0: spec})):
        kv_cache_write(None, v, 0)
    A.write_kv(caches[1], None, v, slots, spec, pos)
    rows = [A.cache_rows(c, spec) for c in caches]
    written = rows[1].reshape(-1, kvh, spec.cache_dim)[slots]
    assert torch.isfinite(written).all()
    assert torch.equal(rows[0].reshape(-1, kvh, 96)[slots][..., :d], written[..., :d])
    _close("rot_keys write", rows[0].reshape(-1, kvh, 96)[slots][..., d:], written[..., d:], rtol=1e-5, atol=1e-5)
    # decode: each sequence's last token
    q = torch.randn(3, heads * d, generator=g)
    dmeta = C.AttentionMetadata([0, 1, 2, 3], lens, page, {None: C.GroupMetadata(bt, slots[[36, 86, 95]])})
    with C.set_forward_context(C.ForwardContext(dmeta, {0: caches[0]}, {0: spec})):
        ref = A.ref_attention(q, 0)
        got = triton_attention(q, 0)
        _close("rot_keys decode (cached rotated keys) vs reference (rebuilt)", got, ref)
        # the provider tells the launch policy that the rows keep the keys, and the kept-keys kernel on the
        # 64-key tiles the policy gives such layers at head_dim 512 (4 warps, 2 stages) is right too
        from compiled_llm.ops.triton import paged_attention as PA
        from compiled_llm.ops.triton import providers as P

        seen = []

        def wide(*args, **kw):
            seen.append(kw.get("rot_keys"))
            return PA.AttnLaunch(num_splits=2, block_n=64, num_warps=4, num_stages=2)
        real, P.attention_launch_policy = P.attention_launch_policy, wide
        try:
            _close("rot_keys decode, 64-key tiles", triton_attention(q, 0), ref)
        finally:
            P.attention_launch_policy = real
        assert seen == [True]
        rows[0][..., d:] = torch.randn(rows[0][..., d:].shape, generator=g)  # (a shift alike for every key
        spoiled = triton_attention(q, 0)  # would cancel in the softmax)
    assert (spoiled - ref).abs().max() > 1e-1, "the decode kernel did not read the cached rotated keys"


def check_argmax_rows():
    import torch

    from compiled_llm.ops.triton.logits import argmax_rows

    g = torch.Generator().manual_seed(4)
    x = torch.randn(7, 5003, generator=g)
    x[1, 4000:] = 0.0
    x[1, [7, 4100, 5002]] = 9.0  # a tie across chunks: the first index
    x[2, [300, 301]] = 9.0  # a tie inside one chunk
    x[3, 5002] = 50.0  # the partial last chunk
    x[4] = float("-inf")  # every value -inf: index 0
    x[5, [10, 3000]] = float("nan")  # NaN beats every number, the first NaN wins
    x[5, 20] = float("inf")
    x[6, 4500] = float("inf")
    for chunk in (64, 1024, 8192):  # many chunks (the merge's wider block), a few, one
        got = argmax_rows(x, chunk=chunk)
        assert got.dtype == torch.long
        assert torch.equal(got, x.argmax(dim=-1)), (chunk, got, x.argmax(dim=-1))
    col = x[:, 1:2001:2]  # a strided view (no stride-1 rows)
    assert torch.equal(argmax_rows(col), col.argmax(dim=-1))
    sub = x[:, :3000]  # rows with a stride past their length
    assert torch.equal(argmax_rows(sub), sub.argmax(dim=-1))


def check_gelu():
    import torch

    from compiled_llm.ops.triton._common import gelu_tanh

    x = torch.cat([torch.linspace(-30, 30, 3001), torch.randn(2000) * 3, torch.tensor([0.0, 1e-6, -1e-6])])
    _close("gelu_tanh", gelu_tanh(x), torch.nn.functional.gelu(x, approximate="tanh"), rtol=1e-5, atol=1e-6)


DECODE_CASES = [
    dict(seq_lens=[1, 17, 50], page=16, kv_heads=2, group=1, head_dim=32),
    dict(seq_lens=[37, 5, 70], page=4, kv_heads=2, group=2, head_dim=64, window=13, softcap=30.0, splits=3),
    dict(seq_lens=[100, 33], page=16, kv_heads=2, group=8, head_dim=64, k_eq_v=True, splits=4, block_n=16),
    dict(seq_lens=[45, 3], page=4, kv_heads=1, group=8, head_dim=32, k_eq_v=True, window=10, softcap=20.0),
    dict(seq_lens=[66], page=16, kv_heads=2, group=2, head_dim=32, window=35, splits=2, block_n=16),
    # K=V at head_dim 128: 32 of 64 angles rotate, so only those keys are rebuilt (the rest: q * w . v);
    # the same case with every key rebuilt
    dict(seq_lens=[90, 7], page=16, kv_heads=2, group=8, head_dim=128, k_eq_v=True, splits=3, block_n=16),
    dict(seq_lens=[90, 7], page=16, kv_heads=2, group=8, head_dim=128, k_eq_v=True, splits=3, block_n=16,
         full_rebuild=True),
    # one sequence's 64-key tiles (the batch-1 global-layer launch), a partial last tile
    dict(seq_lens=[150], page=16, kv_heads=2, group=8, head_dim=128, k_eq_v=True, splits=2, block_n=64),
    # 40 splits: the combine's 64-split block in four chunks of dims, the short sequence's later splits empty
    dict(seq_lens=[700, 45], page=16, kv_heads=1, group=2, head_dim=256, splits=40, block_n=16),
]

PREFILL_CASES = [
    # media spans seen both ways (sliding layers), longer than the window, one per chunk or before it
    dict(seq_lens=[30, 20], q_lens=[30, 12], page=4, kv_heads=2, group=2, head_dim=32, window=9, softcap=30.0,
         block_m=16, block_n=16, spans=[[(3, 9), (15, 27)], [(2, 6), (10, 14)]]),
    dict(seq_lens=[40], q_lens=[24], page=16, kv_heads=1, group=4, head_dim=32, k_eq_v=True, window=50, block_m=32,
         block_n=16, spans=[[(20, 37)]]),
    dict(seq_lens=[5, 7, 45], q_lens=[1, 7, 20], page=4, kv_heads=2, group=2, head_dim=32, window=9, softcap=30.0,
         block_m=16, block_n=16),
    dict(seq_lens=[13, 77], q_lens=[13, 40], page=16, kv_heads=2, group=8, head_dim=64, k_eq_v=True, block_m=32,
         block_n=16),
    dict(seq_lens=[60, 9], q_lens=[25, 9], page=16, kv_heads=2, group=1, head_dim=32, window=20, block_m=16,
         block_n=32),
    dict(seq_lens=[13, 77], q_lens=[13, 40], page=16, kv_heads=2, group=8, head_dim=64, k_eq_v=True, block_m=32,
         block_n=16, inloop_k=True),
    dict(seq_lens=[50, 31], q_lens=[20, 31], page=4, kv_heads=1, group=4, head_dim=32, k_eq_v=True, window=11,
         softcap=20.0, block_m=16, block_n=16),
    dict(seq_lens=[50, 31], q_lens=[20, 31], page=4, kv_heads=1, group=4, head_dim=32, k_eq_v=True, window=11,
         softcap=20.0, block_m=16, block_n=16, inloop_k=True),
    # split_d (one program per output half): K=V from the dense rebuilt keys (global-like), K!=V (also with
    # a head_dim whose half is not a power of two), sliding window + softcap, spans both ways; the in-loop
    # rebuild needs both halves of v, so there split_d falls back to the whole-head launch
    dict(seq_lens=[13, 77], q_lens=[13, 40], page=16, kv_heads=2, group=8, head_dim=64, k_eq_v=True, block_m=32,
         block_n=16, split_d=True),
    dict(seq_lens=[13, 77], q_lens=[13, 40], page=16, kv_heads=2, group=8, head_dim=64, k_eq_v=True, block_m=32,
         block_n=16, inloop_k=True, split_d=True),
    dict(seq_lens=[33, 70], q_lens=[33, 25], page=16, kv_heads=2, group=2, head_dim=64, softcap=30.0, block_m=32,
         block_n=32, split_d=True),
    dict(seq_lens=[40, 9], q_lens=[17, 9], page=4, kv_heads=2, group=1, head_dim=48, block_m=16, block_n=16,
         split_d=True),
    dict(seq_lens=[50, 31], q_lens=[20, 31], page=4, kv_heads=1, group=4, head_dim=32, k_eq_v=True, window=11,
         softcap=20.0, block_m=16, block_n=16, split_d=True),
    dict(seq_lens=[30, 20], q_lens=[30, 12], page=4, kv_heads=2, group=2, head_dim=32, window=9, softcap=30.0,
         block_m=16, block_n=16, spans=[[(3, 9), (15, 27)], [(2, 6), (10, 14)]], split_d=True),
    dict(seq_lens=[40], q_lens=[24], page=16, kv_heads=1, group=4, head_dim=32, k_eq_v=True, window=50, block_m=32,
         block_n=16, spans=[[(20, 37)]], split_d=True),
]

# split_d against the whole-head launch on the same inputs and tiles
SPLIT_D_CASES = [
    dict(seq_lens=[9, 45], q_lens=[9, 20], page=16, kv_heads=2, group=4, head_dim=64, k_eq_v=True),
    dict(seq_lens=[50, 31], q_lens=[20, 31], page=4, kv_heads=2, group=2, head_dim=64, window=11, softcap=20.0),
]


def check_decode():
    for case in DECODE_CASES:
        _check_attention("decode", **case)


def _decode_qk_step(deferred, dtype, *, seq_lens, page, kv_heads, group, head_dim, window, softcap, splits,
                    norm_v, pad_seq, device="cpu"):
    """One decode step of a layer through the ops as the compiled graph calls them: the Triton qk_norm_rope_kv_write
    (deferred to the decode kernel, or its own launch: COMPILED_LLM_DECODE_QK=0), then the Triton attention
    provider. The new tokens' cache rows start NaN (a kernel reading them before they are written fails);
    sequence pad_seq's slot is -1 (CUDA-graph padding: no write). Returns (output, cache)."""
    import torch

    from compiled_llm.ops import attention as A
    from compiled_llm.ops import context as C
    from compiled_llm.ops.rope import rope_inv_freq
    from compiled_llm.ops.triton import qk_norm_rope as QK

    g = torch.Generator().manual_seed(7)
    q, cache, bt, _ = _attn_case(seq_lens, [1] * len(seq_lens), page=page, kv_heads=kv_heads, group=group,
                                 head_dim=head_dim, window=window, softcap=softcap, seed=3)
    cache = cache.to(dtype)
    slots = []
    for i, L in enumerate(seq_lens):
        s = int(bt[i, (L - 1) // page]) * page + (L - 1) % page
        cache.view(cache.shape[0], -1, kv_heads, head_dim)[:, s] = float("nan")
        slots.append(-1 if i == pad_seq else s)
    n = len(seq_lens) + 1  # a padding token past the batch, as in a CUDA graph of a larger size
    q = torch.randn(n, kv_heads * group, head_dim, generator=g).to(dtype) * 3
    k, v = (torch.randn(n, kv_heads, head_dim, generator=g).to(dtype) * 2 for _ in range(2))
    pos = torch.tensor([L - 1 for L in seq_lens] + [0])
    inv = rope_inv_freq(head_dim, 10000.0, "default")
    qw = (1.0 + 0.2 * torch.randn(head_dim, generator=g)).to(dtype)
    kw = (0.8 + 0.2 * torch.rand(head_dim, generator=g)).to(dtype)
    q, k, v, pos, inv, qw, kw, cache, bt = (t.to(device) for t in (q, k, v, pos, inv, qw, kw, cache, bt))
    spec = A.AttentionSpec(0, kv_heads * group, kv_heads, head_dim, window, 0, head_dim ** -0.5, softcap)
    meta = C.AttentionMetadata(list(range(len(seq_lens) + 1)), list(seq_lens), page, {window: C.GroupMetadata(
        bt, torch.tensor(slots + [-1], device=device))})
    ctx = C.ForwardContext(meta, {0: cache}, {0: spec})
    out, q_out = _qk_then_attention(ctx, lambda: QK.qk_norm_rope_kv_write(q, k, v, pos, inv, qw, kw, 1e-6, norm_v, 0),
                                    deferred, splits)
    return out.view(n, -1, head_dim), cache, slots, q_out


def _qk_then_attention(ctx, qk_op, deferred, splits: int):
    """qk_op() (the QK-norm op of layer 0) and then the Triton attention provider on its output, in ctx, with the
    op's decode deferral off (False), on (True) or in the kernel's write-back form ("back"), and the decode on
    `splits` splits of 16-key tiles; checks the deferral happened (or not) and was taken. Returns the attention's
    output and the op's."""
    from compiled_llm.ops import attention as A
    from compiled_llm.ops import context as C
    from compiled_llm.ops.triton import paged_attention as PA
    from compiled_llm.ops.triton import providers, qk_norm_rope as QK

    os.environ[QK.DECODE_QK_ENV] = {False: "0", True: "1", "back": "2"}[deferred]
    saved, policy = dict(A.ATTENTION.chosen), providers.attention_launch_policy
    A.ATTENTION.chosen[0] = ("triton", providers.attention)
    providers.attention_launch_policy = lambda *a, **kw: PA.AttnLaunch(num_splits=splits, block_n=16)
    try:
        with C.set_forward_context(ctx):
            q_out = qk_op()
            assert (0 in ctx.extra.get(QK.DEFERRED_QK, {})) == bool(deferred), "the decode step's QK-norm deferred"
            out = providers.attention(q_out.reshape(q_out.shape[0], -1), 0)
            assert not ctx.extra.get(QK.DEFERRED_QK), "the attention op took the deferred work"
    finally:
        providers.attention_launch_policy = policy
        A.ATTENTION.chosen.clear()
        A.ATTENTION.chosen.update(saved)
        os.environ.pop(QK.DECODE_QK_ENV)
    return out, q_out


def check_decode_qk():
    """The decode step's QK-norm + RoPE + KV write inside the decode kernel (ops/triton/qk_norm_rope.py DEFERRED_QK)
    gives the outputs and the cache rows of the op's own launch followed by the plain decode, at one split and
    several, with a window and a soft-cap, with and without the value norm, in float32 and bfloat16; a padding
    slot (-1) is not written."""
    import torch

    cases = [dict(seq_lens=[37, 5, 70], page=4, kv_heads=2, group=2, head_dim=32, window=None, softcap=None, splits=1),
             dict(seq_lens=[37, 5, 70], page=4, kv_heads=2, group=2, head_dim=64, window=13, softcap=30.0, splits=3),
             dict(seq_lens=[1, 50], page=16, kv_heads=1, group=4, head_dim=32, window=None, softcap=None, splits=4)]
    for case in cases:
        for dtype, norm_v in ((torch.float32, True), (torch.bfloat16, True), (torch.float32, False)):
            pad = len(case["seq_lens"]) - 1
            ref, ref_cache, slots, ref_q = _decode_qk_step(False, dtype, **case, norm_v=norm_v, pad_seq=pad)
            got, cache, _, _ = _decode_qk_step(True, dtype, **case, norm_v=norm_v, pad_seq=pad)
            back, back_cache, _, back_q = _decode_qk_step("back", dtype, **case, norm_v=norm_v, pad_seq=pad)
            n = len(case["seq_lens"])  # the write-back form: the op's output written as its launch writes it
            assert torch.equal(back_q[:n], ref_q[:n]), "the write-back form's queries"
            assert torch.equal(back.nan_to_num(), got.nan_to_num()), "the write-back form's output"
            assert torch.equal(back_cache.nan_to_num(), cache.nan_to_num()), "the write-back form's rows"
            name = f"decode qk {dtype} norm_v={norm_v} {case}"
            live = list(range(pad))
            tol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 2e-2)
            _close(name, got[live].float(), ref[live].float(), *tol)
            assert torch.equal(got[pad].isnan(), ref[pad].isnan()) and (got[pad + 1] == 0).all(), name + ": padding"
            flat, ref_flat = (c.view(c.shape[0], -1, c.shape[3], c.shape[4]) for c in (cache, ref_cache))
            for i in live:
                assert torch.equal(flat[:, slots[i]], ref_flat[:, slots[i]]), f"{name}: cache row of sequence {i}"
            assert torch.equal(flat.isnan(), ref_flat.isnan()), name + ": rows written"  # the padding slot too


def _decode_qk_rot_step(mode, dtype, *, lens, page, kv_heads, group, head_dim, softcap, splits, pad_seq,
                        device="cpu"):
    """One decode step of a K=V layer whose rows keep their rotated keys (Gemma 4's global layers), through the
    Triton qk_norm_rope_kv_write (q, v) and attention provider: mode "deferred" (the work in the decode kernel),
    "launch" (the op's own kernel first) or "reference" (the PyTorch op, then the Triton attention). The new
    tokens' rows start NaN; sequence pad_seq's slot is -1. Returns (output, whole cache rows, slots)."""
    import torch

    from compiled_llm.ops import attention as A
    from compiled_llm.ops import context as C
    from compiled_llm.ops.qk_norm_rope import ref_qk_norm_rope_kv_write
    from compiled_llm.ops.rope import rope_inv_freq, rotated_pairs
    from compiled_llm.ops.triton import qk_norm_rope as QK

    g = torch.Generator().manual_seed(11)
    spec = A.AttentionSpec(0, kv_heads * group, kv_heads, head_dim, None, 0, head_dim ** -0.5, softcap, True,
                           rotated_pairs=rotated_pairs(head_dim, "proportional", 0.25))
    spec.rot_keys = A.cached_rot_keys(spec)
    spec.k_norm_weight = (0.5 + torch.rand(head_dim, generator=g)).to(dtype)
    spec.inv_freq = rope_inv_freq(head_dim, 10_000.0, "proportional", 0.25)
    nblk = [-(-n // page) for n in lens]
    perm = torch.randperm(sum(nblk), generator=g)
    bt = torch.full((len(lens), max(nblk)), -1, dtype=torch.int32)
    off = 0
    for i, nb in enumerate(nblk):
        bt[i, :nb] = perm[off:off + nb].int()
        off += nb
    rows = torch.randn(1, sum(nblk), page, kv_heads, spec.cache_dim, generator=g).to(dtype)
    slots = []
    for i, L in enumerate(lens):
        s = int(bt[i, (L - 1) // page]) * page + (L - 1) % page
        rows.view(-1, kv_heads, spec.cache_dim)[s] = float("nan")
        slots.append(-1 if i == pad_seq else s)
    cache = rows[..., :head_dim]
    n = len(lens) + 1  # a padding token past the batch
    q = torch.randn(n, kv_heads * group, head_dim, generator=g).to(dtype) * 3
    v = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype) * 2
    pos = torch.tensor([L - 1 for L in lens] + [0])
    qw = (1.0 + 0.2 * torch.randn(head_dim, generator=g)).to(dtype)
    rows, bt, q, v, pos, qw = (t.to(device) for t in (rows, bt, q, v, pos, qw))
    cache = rows[..., :head_dim]
    spec.k_norm_weight, spec.inv_freq = spec.k_norm_weight.to(device), spec.inv_freq.to(device)
    meta = C.AttentionMetadata(list(range(n)), list(lens), page,
                               {None: C.GroupMetadata(bt, torch.tensor(slots + [-1], device=device))}, positions=pos)
    ctx = C.ForwardContext(meta, {0: cache}, {0: spec})
    op = ref_qk_norm_rope_kv_write if mode == "reference" else QK.qk_norm_rope_kv_write
    deferred = {"reference": False, "launch": False, "deferred": True, "back": "back"}[mode]
    out, _ = _qk_then_attention(ctx, lambda: op(q, None, v, pos, spec.inv_freq, qw, None, 1e-6, True, 0), deferred,
                                splits)
    return out.view(n, -1, head_dim), rows, slots


def check_decode_qk_rot():
    """Gemma 4's global layers (K=V, rows that keep their rotated keys): the op's own kernel writes the rows the
    PyTorch reference writes (the value exactly, the kept keys to rounding), and the decode step with the op's
    work inside the decode kernel gives the outputs and rows of the op's launch followed by the plain decode
    (bitwise rows), at one split and several, in float32 and bfloat16; a padding slot is not written."""
    import torch

    cases = [dict(lens=[37, 5, 70], page=4, kv_heads=2, group=4, head_dim=64, softcap=None, splits=1),
             dict(lens=[37, 50, 9], page=16, kv_heads=1, group=8, head_dim=64, softcap=30.0, splits=3)]
    for case in cases:
        for dtype in (torch.float32, torch.bfloat16):
            pad = len(case["lens"]) - 1
            live = list(range(pad))
            ref, ref_rows, slots = _decode_qk_rot_step("reference", dtype, **case, pad_seq=pad)
            own, own_rows, _ = _decode_qk_rot_step("launch", dtype, **case, pad_seq=pad)
            got, rows, _ = _decode_qk_rot_step("deferred", dtype, **case, pad_seq=pad)
            back, back_rows, _ = _decode_qk_rot_step("back", dtype, **case, pad_seq=pad)
            assert torch.equal(back[live], got[live]) and torch.equal(back_rows.isnan(), rows.isnan())
            assert torch.equal(back_rows.nan_to_num(), rows.nan_to_num()), "the write-back form's rows"
            name = f"decode qk rot {dtype} {case}"
            d = case["head_dim"]
            flat, own_flat, ref_flat = (r.view(-1, r.shape[3], r.shape[4]) for r in (rows, own_rows, ref_rows))
            tol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 2e-2)
            for i in live:  # the launch against the reference: the value, then the kept keys
                v_tol = (1e-6, 1e-6) if dtype == torch.float32 else (1e-2, 1e-2)
                _close(f"{name}: launch's value, sequence {i}", own_flat[slots[i], :, :d], ref_flat[slots[i], :, :d],
                       *v_tol)
                _close(f"{name}: launch's kept keys, sequence {i}", own_flat[slots[i], :, d:],
                       ref_flat[slots[i], :, d:], *tol)
                assert torch.equal(flat[slots[i]], own_flat[slots[i]]), f"{name}: deferred row of sequence {i}"
            _close(name + ": launch vs reference", own[live].float(), ref[live].float(), *tol)
            _close(name + ": deferred vs launch", got[live].float(), own[live].float(), 1e-6, 1e-6)
            assert torch.equal(flat.isnan(), own_flat.isnan()), name + ": rows written"  # the padding slot too
            assert torch.equal(flat.isnan(), ref_flat.isnan()), name + ": rows written by the reference"
            assert (got[pad + 1] == 0).all(), name + ": padding row"
    _check_qk_rot_prefill()


def _check_qk_rot_prefill():
    """The op's prefill kernel (8 heads a program, from PREFILL_HEADS_MIN_TOKENS tokens) writes a K=V layer's rows
    with their kept keys as the reference does, and rotates q alike."""
    import torch

    from compiled_llm.ops import attention as A
    from compiled_llm.ops import context as C
    from compiled_llm.ops.qk_norm_rope import ref_qk_norm_rope_kv_write
    from compiled_llm.ops.rope import rope_inv_freq, rotated_pairs
    from compiled_llm.ops.triton import qk_norm_rope as QK

    g = torch.Generator().manual_seed(12)
    QK.PREFILL_HEADS_MIN_TOKENS, threshold = 32, QK.PREFILL_HEADS_MIN_TOKENS  # (fewer programs to interpret)
    n, d, kvh, page = 40, 64, 2, 16
    assert QK.heads_per_program(n) > 1
    spec = A.AttentionSpec(0, 4 * kvh, kvh, d, None, 0, d ** -0.5, None, True,
                           rotated_pairs=rotated_pairs(d, "proportional", 0.25))
    spec.rot_keys = A.cached_rot_keys(spec)
    spec.k_norm_weight = 0.5 + torch.rand(d, generator=g)
    spec.inv_freq = rope_inv_freq(d, 10_000.0, "proportional", 0.25)
    blocks = -(-n // page)
    bt = torch.randperm(blocks, generator=g).int()[None]
    pos = torch.arange(n)
    slots = bt[0, pos // page].long() * page + pos % page
    meta = C.AttentionMetadata([0, n], [n], page, {None: C.GroupMetadata(bt, slots)}, positions=pos)
    q = torch.randn(n, 4 * kvh, d, generator=g) * 3
    v = torch.randn(n, kvh, d, generator=g) * 2
    qw = 1.0 + 0.2 * torch.randn(d, generator=g)
    outs = []
    for op in (QK.qk_norm_rope_kv_write, ref_qk_norm_rope_kv_write):
        rows = torch.full((1, blocks, page, kvh, spec.cache_dim), float("nan"))
        with C.set_forward_context(C.ForwardContext(meta, {0: rows[..., :d]}, {0: spec})):
            outs.append((op(q, None, v, pos, spec.inv_freq, qw, None, 1e-6, True, 0), rows))
    QK.PREFILL_HEADS_MIN_TOKENS = threshold
    (q_got, rows), (q_ref, ref_rows) = outs
    _close("qk rot prefill: q", q_got, q_ref, 1e-5, 1e-5)
    _close("qk rot prefill: rows", rows.view(-1, kvh, spec.cache_dim)[slots],
           ref_rows.view(-1, kvh, spec.cache_dim)[slots], 1e-5, 1e-5)


def _check_split_d_same(dtype, *, seq_lens, q_lens, page, kv_heads, group, head_dim, window=None, softcap=None,
                        k_eq_v=False):
    """paged_prefill with split_d equals the whole-head launch to float32 rounding (float32), within a couple
    of output roundings in bfloat16, where both also stay close to the float32 reference on the same inputs."""
    import torch

    from compiled_llm.ops.triton import paged_attention as PA

    PA.DENSE_K_LIMIT_BYTES = 1 << 30
    q, cache, bt, extra = _attn_case(seq_lens, q_lens, page=page, kv_heads=kv_heads, group=group, head_dim=head_dim,
                                     window=window, softcap=softcap, k_eq_v=k_eq_v)
    q, cache = q.to(dtype), cache.to(dtype)
    scale = head_dim ** -0.5 * 1.7
    opts = dict(scale=scale, sliding_window=window, softcap=softcap, k_eq_v=k_eq_v, num_kv_heads=kv_heads,
                head_dim=head_dim, **extra)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    outs = [PA.paged_prefill(q, cache, bt, qsl, sl, **opts, policy=PA.AttnLaunch(
        block_m=32, block_n=16, num_warps=8, num_stages=2, split_d=split)) for split in (False, True)]
    name = f"split-d vs whole-head {dtype} lens={seq_lens} d={head_dim} W={window} cap={softcap} kv=v:{k_eq_v}"
    if dtype == torch.float32:
        _close(name, outs[1], outs[0], rtol=1e-6, atol=1e-6)
        return
    _close(name, outs[1], outs[0], rtol=1e-2, atol=2e-2)
    ref, _ = _attn_reference(q.float(), cache.float(), bt, seq_lens, q_lens, page=page, kv_heads=kv_heads,
                             group=group, head_dim=head_dim, window=window, softcap=softcap, k_eq_v=k_eq_v,
                             scale=scale, **extra)
    _close(name + " (split-d) vs float32 reference", outs[1], ref, rtol=5e-2, atol=5e-2)


def _check_prefill_interior():
    """The prefill's interior key tiles (no position masks) give bit for bit what masking every tile gives, and
    cases with whole tiles inside the causal edge and the window do take them (the tile helper counted)."""
    import torch

    from compiled_llm.ops.triton import paged_attention as PA

    PA.DENSE_K_LIMIT_BYTES = 1 << 30
    orig, calls = PA._prefill_tile, {True: 0, False: 0}
    mask_arg = orig.arg_names.index("MASK")

    def counting(*args):
        calls[bool(args[mask_arg])] += 1
        return orig.fn(*args)

    cases = [  # (seq_lens, q_lens, group, head_dim, window, k_eq_v, block_m, block_n, split_d, inloop_k)
        ([100, 9], [90, 9], 1, 32, 50, False, 16, 16, False, False),
        ([77, 40], [40, 40], 2, 32, None, False, 32, 16, False, False),  # causal, a cached prefix
        ([13, 77], [13, 40], 8, 64, None, True, 32, 16, True, False),  # K=V dense keys, split output
        ([96], [64], 4, 32, 33, True, 16, 16, False, True),  # K=V keys rebuilt in the loop, sliding
    ]
    PA._prefill_tile = counting
    try:
        for lens, q_lens, group, d, window, k_eq_v, bm, bn, split_d, inloop_k in cases:
            PA.DENSE_K_LIMIT_BYTES = 0 if inloop_k else 1 << 30
            q, cache, bt, extra = _attn_case(lens, q_lens, page=16, kv_heads=2, group=group, head_dim=d,
                                             window=window, k_eq_v=k_eq_v)
            opts = dict(scale=d ** -0.5, sliding_window=window, k_eq_v=k_eq_v, num_kv_heads=2, head_dim=d, **extra)
            sl = torch.tensor(lens, dtype=torch.int32)
            qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
            outs, unmasked = [], []
            for interior in (True, False):
                calls.update({True: 0, False: 0})
                pol = PA.AttnLaunch(block_m=bm, block_n=bn, split_d=split_d, interior=interior)
                outs.append(PA.paged_prefill(q, cache, bt, qsl, sl, policy=pol, **opts))
                unmasked.append(calls[False])
            name = f"prefill interior tiles lens={lens} q={q_lens} g={group} W={window} kv=v:{k_eq_v} split-d:{split_d}"
            ok = torch.equal(outs[0], outs[1]) and unmasked[0] > 0 and unmasked[1] == 0
            print(f"  {name}: equal {torch.equal(outs[0], outs[1])}, unmasked tiles {unmasked} {'ok' if ok else 'FAIL'}")
            assert ok, name
    finally:
        PA._prefill_tile = orig
        PA.DENSE_K_LIMIT_BYTES = 1 << 30


def _check_prefill_tma():
    """The K=V prefill's key and value tiles through TMA descriptors over the dense buffers (AttnLaunch.tma) give
    bit for bit what the same tiles loaded through the registers give, with both dense buffers NaN-filled before
    the rebuild (the rows past each sequence's last key, which the descriptors read unmasked, must be zeroed) and
    a block table wider than the longest sequence; a window keeps the registers' loads (the rebuild writes only
    the window's rows)."""
    import torch

    from compiled_llm.ops.triton import paged_attention as PA

    PA.DENSE_K_LIMIT_BYTES = 1 << 30
    made = []

    def poisoned(*args):
        made.append(args[:4])
        return PA.torch.full(args[:4], float("nan"), dtype=args[4].dtype, device=args[4].device)

    cases = [  # (seq_lens, q_lens, group, head_dim, window, block_m, block_n, split_d, dtype)
        ([13, 77], [13, 40], 8, 64, None, 32, 16, True, torch.float32),  # a cached prefix, split output
        ([13, 77], [13, 40], 8, 64, None, 32, 32, False, torch.float32),  # whole head
        ([45, 9], [45, 9], 4, 64, None, 32, 16, True, torch.bfloat16),
        ([50, 31], [20, 31], 4, 32, 11, 16, 16, True, torch.float32),  # window: no TMA
    ]
    orig = PA._dense_buffer
    PA._dense_buffer = poisoned
    try:
        for lens, q_lens, group, d, window, bm, bn, split_d, dtype in cases:
            q, cache, bt, extra = _attn_case(lens, q_lens, page=16, kv_heads=2, group=group, head_dim=d,
                                             window=window, k_eq_v=True)
            q, cache = q.to(dtype), cache.to(dtype)
            bt = torch.cat([bt, torch.full((bt.shape[0], 2), -1, dtype=bt.dtype)], 1)  # 32 rows past the longest
            opts = dict(scale=d ** -0.5, sliding_window=window, k_eq_v=True, num_kv_heads=2, head_dim=d, **extra)
            sl = torch.tensor(lens, dtype=torch.int32)
            qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
            outs, buffers = [], []
            for tma in (True, False):
                made.clear()
                pol = PA.AttnLaunch(block_m=bm, block_n=bn, num_warps=8, num_stages=1, split_d=split_d, tma=tma)
                outs.append(PA.paged_prefill(q, cache, bt, qsl, sl, policy=pol, **opts))
                buffers.append(len(made))
            name = f"prefill TMA tiles {dtype} lens={lens} q={q_lens} g={group} d={d} W={window} split-d:{split_d}"
            want = [1, 1] if window else [2, 1]  # the value copy is made only for the TMA tiles
            ok = torch.equal(outs[0], outs[1]) and not outs[0].isnan().any() and buffers == want
            print(f"  {name}: equal {torch.equal(outs[0], outs[1])}, dense buffers {buffers} {'ok' if ok else 'FAIL'}")
            assert ok, name
    finally:
        PA._dense_buffer = orig


def check_prefill():
    import torch

    _check_prefill_interior()
    _check_prefill_tma()
    for case in PREFILL_CASES:
        _check_attention("prefill", **case)
    for case in SPLIT_D_CASES:
        for dtype in (torch.float32, torch.bfloat16):
            _check_split_d_same(dtype, **case)


def check_decode_sweep():
    import itertools

    for i, (page, group, k_eq_v, window, softcap) in enumerate(
            itertools.product([4, 16], [1, 2, 8], [False, True], [None, 7, 40], [None, 50.0])):
        _check_attention("decode", seq_lens=[1, 29, 95, 130][: 2 + i % 3], page=page, kv_heads=2, group=group,
                         head_dim=64 if i % 2 else 32, window=window, softcap=softcap, k_eq_v=k_eq_v,
                         splits=1 + i % 4, block_n=16 * (1 + i % 2), seed=i)


def check_prefill_sweep():
    import itertools

    for i, (page, group, k_eq_v, window, softcap) in enumerate(
            itertools.product([4, 16], [1, 2, 8], [False, True], [None, 11, 33], [None, 50.0])):
        _check_attention("prefill", seq_lens=[3, 50, 97][: 1 + i % 3], q_lens=[3, 17, 40][: 1 + i % 3], page=page,
                         kv_heads=2, group=group, head_dim=32 if i % 2 else 64, window=window, softcap=softcap,
                         k_eq_v=k_eq_v, block_m=16 * (1 + i % 2), block_n=16 * (1 + (i // 2) % 2),
                         inloop_k=bool(i % 3 == 0), seed=i)


def _moe_modules(E, H, I, k, seed):
    import torch

    from compiled_llm.models.gemma4 import Experts, Router

    torch.manual_seed(seed)
    cfg = SimpleNamespace(num_experts=E, moe_intermediate_size=I, hidden_size=H, top_k_experts=k, rms_norm_eps=1e-6)
    experts, router = Experts(cfg), Router(cfg)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, H ** -0.5)
        experts.down_proj.normal_(0, I ** -0.5)
        router.proj.weight.normal_(0, 1.0)
        router.scale.uniform_(0.5, 1.5)
        router.per_expert_scale.uniform_(0.5, 1.5)
    return experts, router


def _check_moe_align(ids, E, bm, align=None):
    import torch

    from compiled_llm.ops.triton.moe import moe_align, moe_max_padded

    sorted_ids, expert_ids, total = (align or moe_align)(ids, E, bm)
    n = ids.numel()
    assert sorted_ids.numel() == moe_max_padded(n, E + 1, bm) and sorted_ids.numel() % bm == 0
    total = int(total.item())
    assert total % bm == 0 and total <= sorted_ids.numel()
    valid = sorted_ids[:total]
    real = valid[valid < n]
    assert sorted(real.tolist()) == list(range(n)), "every pair exactly once"
    assert (sorted_ids[total:] == n).all()
    flat = ids.reshape(-1)
    for b in range(total // bm):
        rows = sorted_ids[b * bm:(b + 1) * bm]
        rows = rows[rows < n]
        want = flat[rows.long()].where((flat[rows.long()] >= 0) & (flat[rows.long()] < E), -1)
        assert (want == expert_ids[b]).all(), "block holds one expert (-1: another rank's)"
    assert (expert_ids[total // bm:] == -1).all()
    used = expert_ids[: total // bm]
    assert (torch.diff(used[used >= 0]) >= 0).all()  # segments in expert order (another rank's last, as -1)


def _check_moe(T, E, H, I, k, seed, policy=None):
    import torch

    from compiled_llm.ops.triton.moe import MoELaunch, fused_geglu_moe

    experts, router = _moe_modules(E, H, I, k, seed)
    x = torch.randn(T, H)
    with torch.no_grad():
        w, ids = router(x)
        ref = experts(x, w, ids)
        _check_moe_align(ids, E, 16)
        pol = MoELaunch(*policy) if policy else None
        out = fused_geglu_moe(x, experts.gate_up_proj, experts.down_proj, w, ids, policy=pol)
    _close(f"moe T={T} E={E} H={H} I={I} k={k} policy={policy}", out, ref)


def _check_moe_skipped(T, E, H, I, k, first, seed, policy=None):
    """Expert parallel: ids are global, this rank holds experts [first, first + E); the others are skipped."""
    import torch

    from compiled_llm.ops.moe import ref_geglu_moe
    from compiled_llm.ops.triton.moe import MoELaunch, fused_geglu_moe

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    gate_up, down = torch.randn(E, 2 * I, H, generator=g) * 0.1, torch.randn(E, H, I, generator=g) * 0.1
    w, ids = torch.topk(torch.softmax(torch.randn(T, 3 * E, generator=g), -1), k, -1)
    local = ids - first
    keep = (local >= 0) & (local < E)
    assert keep.any() and not keep.all()
    ref = torch.zeros(T, H)
    for t in range(T):  # the local experts only, one pair at a time
        for j in range(k):
            if keep[t, j]:
                gate, up = (gate_up[local[t, j]] @ x[t]).chunk(2)
                ref[t] += w[t, j] * (down[local[t, j]] @ (torch.nn.functional.gelu(gate, approximate="tanh") * up))
    _close(f"moe skipped ids reference T={T}", ref_geglu_moe(x, w, local, gate_up, down), ref)
    pol = MoELaunch(*policy) if policy else None
    _close(f"moe skipped ids T={T} E={E} first={first} policy={policy}",
           fused_geglu_moe(x, gate_up, down, w, local, policy=pol), ref)


def check_moe_align_sorted():
    """The sort-based and the parallel alignments (large prefills) against the one-program kernel: the same
    blocks, experts and length, also with another rank's ids; the parallel one as moe_align's choice past its
    threshold."""
    import torch

    from unittest import mock

    from compiled_llm.ops.triton import moe

    g = torch.Generator().manual_seed(3)
    for n_tok, E, k, bm, lo, hi in ((7, 8, 2, 16, 0, 8), (300, 16, 4, 16, 0, 16), (100, 6, 3, 32, -4, 10)):
        ids = torch.randint(lo, hi, (n_tok, k), generator=g)
        _check_moe_align(ids, E, bm, moe.moe_align_sorted)
        a, b = moe.moe_align_sorted(ids, E, bm), moe.moe_align_program(ids, E, bm)
        assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]), "the same blocks and length"
        for blk in range(int(a[2]) // bm):  # the same pairs in each block (their order inside may differ)
            assert sorted(a[0][blk * bm:(blk + 1) * bm].tolist()) == sorted(b[0][blk * bm:(blk + 1) * bm].tolist())
    # the parallel alignment (chunks of pairs): the sort's exact output (pairs ascending within a segment), with
    # one chunk, several, a last partial one, another rank's ids, and Qwen3.5's 256 experts (512 bins); small
    # chunks but one case (the interpreter sorts ~500 keys a second)
    for n_tok, E, k, bm, lo, hi, chunk in ((7, 8, 2, 16, 0, 8, 1024), (150, 16, 4, 16, -3, 16, 64),
                                           (40, 256, 8, 64, 0, 256, 64), (100, 128, 8, 128, 0, 130, 128)):
        ids = torch.randint(lo, hi, (n_tok, k), generator=g)
        a = moe.moe_align_parallel(ids, E, bm, chunk)
        _check_moe_align(ids, E, bm, lambda *_: a)
        assert all(torch.equal(x, y) for x, y in zip(a, moe.moe_align_sorted(ids, E, bm))), \
            f"parallel == sorted at {n_tok}x{k}, E={E}"
    with mock.patch.object(moe, "moe_align_parallel", wraps=moe.moe_align_parallel) as par:
        par.side_effect = lambda ids, E, bm: moe.moe_align_sorted(ids, E, bm)  # (the same output, quicker here)
        big = torch.randint(0, 16, (moe.ALIGN_PARALLEL_MIN_PAIRS // 4, 4), generator=g)
        moe.moe_align(big, 16, 16)  # through moe_align's switch
        moe.moe_align(big[:-1], 16, 16)
    assert par.call_count == 1


def _check_moe_start(T, E, H, I, k, gemma: bool, seed: int):
    """The MoE overlap's start (ops/moe_overlap.py) through its Triton provider: each pick's weighted output,
    whose float32 sum is what the router + routed op give (the same kernels, the top-k sum left out)."""
    import torch

    from compiled_llm.ops.triton import providers as P

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    proj = torch.randn(E, H, generator=g)
    gu, dn = 0.2 * torch.randn(E, 2 * I, H, generator=g), 0.2 * torch.randn(E, H, I, generator=g)
    if gemma:
        scale, pes = 1 + 0.2 * torch.randn(H, generator=g), 0.5 + torch.rand(E, generator=g)
        w, ids = P.router_topk(x, proj, scale, pes, k, 1e-6, H ** -0.5)
        want = P.geglu_moe(x, w, ids, gu, dn)
        slots = P.moe_start(x, proj, scale, pes, x, gu, dn, k, 1e-6, H ** -0.5, 0, "gelu_tanh", False)
    else:
        w, ids = P.softmax_router_topk(x, proj, k)
        want = P.swiglu_moe(x, w, ids, gu, dn)
        slots = P.moe_start(x, proj, None, None, x, gu, dn, k, 0.0, 1.0, 0, "silu", True)
    assert slots.shape == (T, H)  # the routed output, its top-k sum included (in the down kernel at decode sizes)
    _close(f"moe_start T={T} gemma={gemma}", slots, want, rtol=1e-5, atol=1e-5)
    picks = P.moe_start(x, proj, scale if gemma else None, pes if gemma else None, x, gu, dn, k, 1e-6 if gemma else 0.0,
                        H ** -0.5 if gemma else 1.0, 0, "gelu_tanh" if gemma else "silu", not gemma, True)
    assert picks.shape == (T, k, H) and torch.equal(picks.float().sum(1).to(slots.dtype), slots)  # the sum left out
    # the router's last program aligning the picks (one token block) against the separate alignment launch
    from compiled_llm.ops.triton import moe as M

    pol = M.moe_launch_policy(T, k, E, H, I)
    if not pol.unsorted:
        got = M.fused_router_topk(x, scale if gemma else None, proj, pes if gemma else None, k, 1e-6 if gemma else 0.0,
                                  ids_dtype=torch.int64, align_block_m=pol.block_m)
        assert got[2] is not None
        for a, b in zip(got[2], M.moe_align(got[1], E, pol.block_m)):
            assert torch.equal(a, b), (T, a, b)
        was = P.ROUTER_ALIGN
        try:
            out = {}
            for P.ROUTER_ALIGN in (True, False):  # COMPILED_LLM_ROUTER_ALIGN=1 and its default
                out[P.ROUTER_ALIGN] = P.moe_start(x, proj, scale if gemma else None, pes if gemma else None, x, gu, dn,
                                                  k, 1e-6 if gemma else 0.0, H ** -0.5 if gemma else 1.0, 0,
                                                  "gelu_tanh" if gemma else "silu", not gemma)
        finally:
            P.ROUTER_ALIGN = was
        assert torch.equal(out[False], slots)  # the default path again: the same arithmetic, the same bits
        # the aligning router runs one token block where the default may run several: on the GPU each logit's sum
        # is the same either way, but the interpreter's dots are numpy's BLAS, whose FMA kernels (OpenBLAS Haswell
        # and Zen) round a row differently with the block's row count (T=9 here: 1.7e-6 apart on an AMD host,
        # bitwise equal on others). So the alignment is checked bit for bit above and the output to float32 here
        _close(f"moe_start T={T} gemma={gemma} router-aligned", out[True], slots, rtol=1e-5, atol=1e-5)


def _check_moe_half_tail():
    """MoELaunch.half_tail: aligned TMA blocks whose second half is all padding compute their first half only;
    the routing below has blocks of both kinds (checked on the alignment), and the output is the reference's,
    with the activations' unwritten half-block rows poisoned with NaN first (the down kernel must not read them
    into a stored row)."""
    from unittest import mock

    import torch

    from compiled_llm.ops.triton import moe as M

    E, H, I, k, bm = 4, 64, 64, 2, 32
    experts, router = _moe_modules(E, H, I, k, 23)
    x = torch.randn(90, H)
    with torch.no_grad():
        w, ids = router(x)
        ref = experts(x, w, ids)
    sorted_ids, expert_ids, num_padded = M.moe_align(ids.to(torch.int32), E, bm)
    blocks = sorted_ids[: int(num_padded.item())].view(-1, bm)
    half = (blocks[:, bm // 2:] >= ids.numel()).all(dim=1)
    assert half.any() and not half.all(), half
    real_empty = torch.empty

    def nan_empty(*a, **kw):  # the activation buffer (and every other one) starts as NaN
        t = real_empty(*a, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    pol = M.MoELaunch(bm, 32, 32, 4, 2, 32, 32, 4, 2, False, False, True, True, 0, True)
    with torch.no_grad(), mock.patch.object(M.torch, "empty", nan_empty):
        out = M.fused_geglu_moe(x, experts.gate_up_proj, experts.down_proj, w, ids, policy=pol)
    _close(f"moe half tail ({int(half.sum())} of {len(half)} blocks)", out, ref)
    # and with the down kernel persistent
    pol = M.MoELaunch(bm, 32, 32, 4, 2, 32, 32, 4, 2, False, False, True, True, 1, True)
    with torch.no_grad(), mock.patch.object(M.torch, "empty", nan_empty):
        out = M.fused_geglu_moe(x, experts.gate_up_proj, experts.down_proj, w, ids, policy=pol)
    _close("moe half tail, persistent down", out, ref)


def _check_moe_tma():
    """MoELaunch.tma (prefill tiers): the weight tiles, and the down kernel's activation rows, through TMA
    descriptors (the interpreter emulates them): K tails in both GEMMs, several column blocks an expert, another
    rank's pairs; and where the tiles do not divide the expert's rows the per-thread loads run instead."""
    from unittest import mock

    import torch

    from compiled_llm.ops.triton import moe as M

    T = (32, 32, 32, 4, 2, 16, 64, 4, 2, False, False, True, True)  # tma, n_fast
    assert M.tma_usable(torch.zeros(1, 80), torch.zeros(4, 192, 80), torch.zeros(4, 80, 96), M.MoELaunch(*T))
    _check_moe(100, 4, 80, 96, 2, 12, policy=T)  # H 80 over 32-wide K steps, I 96 over 64
    _check_moe(70, 6, 64, 64, 3, 17, policy=(64, 32, 32, 4, 2, 32, 32, 4, 2, False, False, False, True))
    _check_moe_skipped(60, 4, 32, 32, 3, 4, 13, policy=(16, 32, 32, 4, 2, 32, 32, 4, 2, False, False, False, True))
    # the decode tiers through TMA too (COMPILED_LLM_MOE_TMA=all): self-routed blocks (with another rank's pairs
    # zeroed by the spare block), and one token's unsorted pairs
    _check_moe(7, 8, 64, 64, 3, 21, policy=(16, 32, 64, 4, 2, 32, 64, 4, 2, False, True, False, True))
    _check_moe_skipped(6, 16, 32, 32, 2, 16, 11, policy=(16, 32, 32, 4, 2, 32, 32, 4, 2, False, True, False, True))
    _check_moe(1, 8, 64, 64, 2, 22, policy=(16, 32, 64, 4, 2, 32, 64, 4, 2, True, False, False, True))
    # I 48 is not a whole number of 64-wide column tiles: not usable (the loads without TMA, still right)
    assert not M.tma_usable(torch.zeros(1, 64), torch.zeros(4, 96, 64), torch.zeros(4, 64, 48),
                            M.moe_launch_policy(100, 2, 4, 64, 48))
    assert M.moe_launch_policy(8192, 8, 128, 2816, 704).tma and not M.moe_launch_policy(8, 8, 128, 2816, 704).tma
    # 97-256 pairs an expert with TMA: 128-row blocks at 8 warps (Gemma 4 at 2-4K tokens, Qwen3.5 at 4-8K); without
    # TMA, and at 96 pairs or fewer: 64
    for tokens, experts in ((4096, 128), (8192, 256), (2048, 128), (4096, 256)):
        pol = M.moe_launch_policy(tokens, 8, experts, 2048, 512)
        assert (pol.block_m, pol.a_warps, pol.b_warps, pol.tma) == (128, 8, 8, True), pol
    assert M.moe_launch_policy(1536, 8, 128, 2816, 704).block_m == 64  # 96 pairs an expert
    with mock.patch.object(M, "TMA", False):
        assert M.moe_launch_policy(4096, 8, 128, 2816, 704).block_m == 64
    with mock.patch.object(M._common, "_INTERPRETED", False):  # a CPU tensor without the interpreter: no TMA
        assert not M.tma_usable(torch.zeros(1, 80), torch.zeros(4, 192, 80), torch.zeros(4, 80, 96), M.MoELaunch(*T))
        # a GPU with TMA whose experts' rows the tiles do not divide (Gemma 4 at TP 2: I = 352): a warning, once
        import logging
        from types import SimpleNamespace

        records = []
        handler = logging.Handler()
        handler.emit = records.append
        M.log.addHandler(handler)
        gpu = SimpleNamespace(is_cuda=True, device=torch.device("cuda:7"))
        try:
            from compiled_llm.ops.triton import _common

            with mock.patch.object(_common, "_INTERPRETED", False), \
                    mock.patch.dict(_common._SM90, {torch.device("cuda:7"): True}):
                pol = M.moe_launch_policy(8192, 8, 128, 2816, 352)
                for _ in range(2):
                    assert not M.tma_usable(gpu, torch.zeros(4, 704, 256), torch.zeros(4, 256, 352), pol)
                assert M.tma_usable(gpu, torch.zeros(4, 1408, 256), torch.zeros(4, 256, 704), pol)
                # JIT warm-up's zero-stride stand-ins: not usable, and no warning (they are not served weights)
                stand_ins = (torch.zeros(1, 1408, 256).expand(4, -1, -1), torch.zeros(1, 256, 704).expand(4, -1, -1))
                assert not M.tma_usable(gpu, *stand_ins, pol)
        finally:
            M.log.removeHandler(handler)
        assert len(records) == 1 and "without TMA" in records[0].getMessage(), records


def _check_moe_warmup_tma():
    """JIT warm-up builds the TMA launches of the prefill tiers (on whole stand-in weights: the zero-stride ones the
    other builds use cannot hold a descriptor), so no prompt builds a kernel while serving."""
    from unittest import mock

    import torch

    from compiled_llm.ops.triton import moe as M
    from compiled_llm.ops.triton import providers as P

    hidden, experts, inter, top_k, max_tokens = 256, 4, 64, 2, 600
    tma_tokens = {t for t in M.launch_variants(experts, top_k, hidden, inter, max_tokens)
                  if M.moe_launch_policy(t, top_k, experts, hidden, inter).tma}
    seen, usable = set(), M.tma_usable

    def spy(x, gate_up, down, pol):
        ok = usable(x, gate_up, down, pol)
        if ok:
            seen.add((x.shape[0], x.dtype, gate_up.dtype, down.dtype))
        return ok

    from triton.runtime.interpreter import InterpretedFunction

    for compile_fn in (P._moe_compile, P._swiglu_compile):
        seen.clear()
        # the model's dtype (the routing weights are float32); the launches not run: which ones the warm-up makes is
        # the question here (running every class's kernels in the interpreter took ~30 s of the suite)
        with mock.patch.object(M, "tma_usable", spy), \
                mock.patch.object(InterpretedFunction, "run", lambda *a, **k: None):
            compile_fn((torch.bfloat16, hidden, experts, inter, top_k, max_tokens), "cpu")
        built = {t for t, *dtypes in seen if dtypes == [torch.bfloat16] * 3}
        ok = len(tma_tokens) >= 2 and built == tma_tokens
        print(f"  warm-up TMA builds ({compile_fn.__name__}): TMA classes {sorted(tma_tokens)}, built {sorted(built)} "
              f"{'ok' if ok else 'FAIL'}")
        assert ok
    # a TMA build that fails at warm-up is a warning naming the class; the rest of warm-up goes on
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    P.log.addHandler(handler)
    try:
        with mock.patch.object(P, "fused_moe", side_effect=RuntimeError("out of resource: shared memory")):
            P._moe_tma_builds(100, torch.zeros(100, top_k, dtype=torch.long), torch.ones(100, top_k), experts, inter,
                              hidden, torch.bfloat16, "silu")
    finally:
        P.log.removeHandler(handler)
    msgs = [r.getMessage() for r in records]
    assert len(msgs) == 1 and "100 tokens did not build" in msgs[0] and "shared memory" in msgs[0], msgs


def check_moe():
    from compiled_llm.ops.triton.moe import moe_launch_policy

    _check_moe_warmup_tma()

    _check_moe_start(5, 8, 64, 48, 2, True, 0)
    _check_moe_start(1, 8, 64, 48, 3, True, 1)  # one token: pairs unsorted
    _check_moe_start(9, 6, 64, 40, 2, False, 2)
    _check_moe_start(16, 8, 64, 48, 4, True, 3)  # a full token block (64 pairs)

    assert moe_launch_policy(1, 8, 128, 2816, 704).unsorted and not moe_launch_policy(2, 8, 128, 2816, 704).unsorted
    _check_moe_skipped(9, 4, 32, 24, 3, 4, 7)
    _check_moe_skipped(1, 4, 32, 24, 3, 4, 5)  # unsorted: ids below and past this rank's
    _check_moe(1, 8, 64, 48, 2, 0)  # unsorted
    _check_moe(1, 8, 64, 200, 3, 4)  # unsorted, an intermediate size past one column block
    _check_moe(1, 8, 64, 48, 2, 0, policy=(16, 32, 64, 4, 2, 64, 32, 4, 2))  # aligned at one token
    _check_moe(6, 4, 160, 48, 3, 5, policy=(16, 32, 64, 4, 2, 64, 32, 4, 2, True))  # unsorted, experts shared
    _check_moe(5, 8, 64, 48, 3, 1)
    _check_moe(37, 6, 96, 40, 2, 2, policy=(32, 16, 32, 4, 2, 32, 16, 4, 2))
    # the column blocks on grid axis 0 (MoELaunch.n_fast): several of them in both kernels
    _check_moe(37, 6, 96, 40, 2, 2, policy=(32, 16, 32, 4, 2, 32, 16, 4, 2, False, False, True))
    _check_moe(100, 4, 64, 48, 2, 12)  # a prefill tier (50 pairs an expert): n_fast by default
    _check_moe_skipped(60, 4, 32, 24, 3, 4, 13)  # the same with another rank's pairs (45 an expert)
    _check_moe_tma()
    _check_moe(20, 16, 64, 32, 1, 3)
    # MoELaunch.persistent (TMA tiers, the down kernel): one loop over every tile a program, a K tail, several
    # column blocks an expert, fewer programs than tiles; another rank's pairs zeroed
    from unittest import mock

    from compiled_llm.ops.triton import moe as M

    P = (32, 32, 32, 4, 2, 16, 64, 4, 2, False, False, True, True, 1)
    runs = {}
    for kern in (M._gate_up_kernel, M._down_kernel, M._down_persistent_kernel):
        def counted(*a, _real=kern.run, _name=kern.fn.__name__, **kw):
            runs[_name] = runs.get(_name, 0) + 1
            return _real(*a, **kw)
        mock.patch.object(kern, "run", counted).start()
    _check_moe(100, 4, 80, 96, 2, 12, policy=P)
    mock.patch.stopall()
    assert runs == {"_gate_up_kernel": 1, "_down_persistent_kernel": 1}, runs
    _check_moe_half_tail()
    # the policy's: the top tier's down kernel persistent (Gemma 4 at 8,192 tokens), not the tiers below
    assert moe_launch_policy(8192, 8, 128, 2816, 704).persistent == 1
    assert moe_launch_policy(4096, 8, 128, 2816, 704).persistent == 0
    assert moe_launch_policy(1024, 8, 128, 2816, 704).persistent == 0
    _check_moe(70, 6, 64, 64, 3, 17, policy=(64, 32, 32, 4, 2, 32, 32, 4, 2, False, False, True, True, 2))
    _check_moe_skipped(60, 4, 32, 32, 3, 4, 13, policy=(16, 32, 32, 4, 2, 32, 32, 4, 2, False, False, True, True, 1))
    # decode batches up to block_m tokens: the grouped kernels rank the picked experts themselves
    pol = moe_launch_policy(2, 8, 128, 2816, 704)
    assert pol.self_routed and moe_launch_policy(16, 8, 128, 2816, 704).self_routed
    assert not moe_launch_policy(17, 8, 128, 2816, 704).self_routed and not moe_launch_policy(1, 8, 128, 2816, 704).self_routed
    assert moe_launch_policy(8, 8, 256, 2048, 512).self_routed  # Qwen3.5's 256 experts (faster on the H200)
    _check_moe(16, 8, 64, 48, 4, 6)  # a full token block; experts shared by many tokens
    _check_moe(7, 6, 64, 200, 3, 8)  # an intermediate size past one column block
    _check_moe_self_routed(11, 32, 64, 48, 4, 9)
    _check_moe_skipped(6, 16, 32, 24, 2, 16, 11)  # self-routed: another rank's pairs zeroed by the spare block
    _check_cast_weights(6, 32, 64, 32, 4, 14)
    _check_cast_weights(40, 16, 64, 32, 4, 15)  # aligned, two token blocks in the router
    _check_moe_self_routed(3, 128, 64, 40, 8, 10)  # experts with no pick between the picked ones
    _check_moe_self_routed(16, 256, 64, 32, 8, 12)  # Qwen3.5's expert count
    _check_moe_self_routed(9, 24, 64, 32, 3, 13)  # an expert count that is not a power of two


def _check_cast_weights(T, E, H, I, k, seed):
    """Qwen3.5 casts its routing weights to bfloat16: the router kernel stores them rounded (no cast launch)
    and the down kernel reads them as they are (no float32 copy): bitwise what the casts gave."""
    import torch

    from compiled_llm.ops.triton import providers as P
    from compiled_llm.ops.triton.moe import fused_swiglu_moe

    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    x, proj = torch.randn(T, H, generator=g).to(bf), torch.randn(E, H, generator=g).to(bf)
    gu, dn = (0.2 * torch.randn(E, 2 * I, H, generator=g)).to(bf), (0.2 * torch.randn(E, H, I, generator=g)).to(bf)
    w32, ids = P.softmax_router_topk(x, proj, k)
    w16, ids16 = P.softmax_router_topk(x, proj, k, weights_dtype=bf)
    assert w16.dtype == bf and torch.equal(ids, ids16) and torch.equal(w16, w32.to(bf))
    want = fused_swiglu_moe(x, gu, dn, w32.to(bf).float(), ids, sum_slots=False)
    assert torch.equal(fused_swiglu_moe(x, gu, dn, w16, ids, sum_slots=False), want)
    assert torch.equal(P.moe_start(x, proj, None, None, x, gu, dn, k, 0.0, 1.0, 0, "silu", True),
                       fused_swiglu_moe(x, gu, dn, w16, ids))
    print(f"  router weights stored in bfloat16 T={T}: ok", flush=True)


def _check_moe_self_routed(T, E, H, I, k, seed):
    """Self-routed blocks against the aligned path at the same tiles: the same rows through the same products.
    Bitwise the same on a GPU; under the interpreter tl.dot is numpy's BLAS, whose sum for a row can depend on
    the row's place in the block and on the CPU (this failed on one machine and passed on another), so the
    check is float32 rounding: a wrong pairing of rows and experts is off by the outputs' whole scale."""
    import dataclasses

    import torch

    from compiled_llm.ops.triton.moe import fused_geglu_moe, moe_launch_policy

    experts, router = _moe_modules(E, H, I, k, seed)
    x = torch.randn(T, H)
    pol = dataclasses.replace(moe_launch_policy(T, k, E, H, I), self_routed=True)  # the default up to 16 tokens
    with torch.no_grad():
        w, ids = router(x)
        a = fused_geglu_moe(x, experts.gate_up_proj, experts.down_proj, w, ids, policy=pol, sum_slots=False)
        b = fused_geglu_moe(x, experts.gate_up_proj, experts.down_proj, w, ids, sum_slots=False,
                            policy=dataclasses.replace(pol, self_routed=False))
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), f"self-routed != aligned, T={T} E={E}: {(a - b).abs().max()}"
    assert float(b.abs().max()) > 1e-2  # outputs of a real scale: the tolerance cannot hide a missing pair


def _check_swiglu(T, E, H, I, k, seed):
    import torch

    from compiled_llm.ops.swiglu_moe import ref_swiglu_moe
    from compiled_llm.ops.triton.moe import fused_swiglu_moe

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    gate_up, down = torch.randn(E, 2 * I, H, generator=g) * 0.1, torch.randn(E, H, I, generator=g) * 0.1
    probs = torch.softmax(torch.randn(T, E, generator=g), -1)
    w, ids = torch.topk(probs, k, -1)
    ref = ref_swiglu_moe(x, w, ids, gate_up, down)
    _close(f"swiglu moe T={T} E={E} H={H} I={I} k={k}", fused_swiglu_moe(x, gate_up, down, w, ids), ref)


def check_swiglu_moe():
    _check_swiglu(1, 8, 64, 48, 2, 0)
    _check_swiglu(21, 6, 96, 40, 3, 1)


def check_moe_sweep():
    for i, T in enumerate([1, 2, 7, 16, 33, 64, 100]):
        _check_moe(T, 16, 64, 48, 4, 10 + i)
        _check_moe(T, 8, 128, 80, 8, 20 + i, policy=(16, 32, 64, 4, 2, 64, 32, 4, 2))


def _check_router(T, E, H, k, seed):
    import torch

    from compiled_llm.ops.triton.moe import fused_router_topk

    _, router = _moe_modules(E, H, 32, k, seed)
    x = torch.randn(T, H) * 3
    with torch.no_grad():
        ref_w, ref_ids = router(x)
        w, ids = fused_router_topk(x, router.scale, router.proj.weight, router.per_expert_scale, k,
                                   router.eps)
    assert torch.equal(ids.long(), ref_ids), (ids, ref_ids)
    _close(f"router T={T} E={E} H={H} k={k}", w, ref_w, rtol=1e-4, atol=1e-6)


def check_router():
    _check_router(5, 16, 96, 4, 0)  # decode sizes (<= 64 tokens): the one-launch fused kernel
    _check_router(37, 20, 64, 3, 1)
    _check_router(3, 128, 160, 8, 2)
    _check_router(70, 128, 320, 8, 3)  # past 64 tokens: one launch of 32-row blocks of every expert
    _check_router_exact(1, 128, 2816, 8, torch_dtype="bfloat16")  # Gemma 4 26B-A4B's router, one token
    _check_router_exact(64, 128, 320, 8, torch_dtype="bfloat16", seed=4)  # 4 token blocks, 4 tickets
    _check_router_exact(8, 128, 704, 8, seed=5)
    _check_router_exact(80, 24, 192, 4, torch_dtype="bfloat16", seed=6)  # prefill size: one launch as well
    _check_router_exact(150, 128, 704, 8, torch_dtype="bfloat16", seed=7)  # three row blocks of every expert
    _check_ticket_growth()
    _check_router_paths()


def _check_ticket_growth():
    """A launch with more token blocks than the router's counters hold gets a larger set; the outgrown set stays
    allocated (a CUDA graph captured with it keeps its address) and the new one is zero."""
    import torch

    from compiled_llm.ops.triton import _common as C

    key = ("test-growth", torch.device("cpu"))
    small = C.ticket_counters(key, 8, torch.device("cpu"))
    assert C.ticket_counters(key, 64, torch.device("cpu")) is small  # 64 at least: no growth yet
    big = C.ticket_counters(key, 100, torch.device("cpu"))
    assert big is not small and big.numel() >= 100 and int(big.abs().sum()) == 0
    assert any(t is small for t in C._OUTGROWN)
    C.TICKETS.pop(key)


def _router_case(T, E, H, seed, dtype):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=g) * 3).to(dtype)
    w = torch.randn(E, H, generator=g).to(dtype)
    scale = (torch.rand(H, generator=g) + 0.5).to(dtype)
    pes = (torch.rand(E, generator=g) + 0.5).to(dtype)
    return x, w, scale, pes


def _check_router_exact(T, E, H, k, seed=0, torch_dtype="float32"):
    """Against the exact math (ref_router_topk in float64 on the same inputs). The model's own bfloat16 run
    rounds four times (normed row, x scale, x H^-0.5, logits) and differs from the exact ids in ~20% of
    tokens at these shapes (the order of near-equal picks), so it is no oracle for ids; the fused kernel's
    products are float32-grade (bf16 head + tail) and its ids must equal the exact ones, except that each
    pick's exact logit may trail the true rank's by a rounding-sized margin (two-kernel path: it rounds the
    normed row to the model's dtype once)."""
    import torch

    from compiled_llm.ops.moe import ref_router_topk
    from compiled_llm.ops.triton.moe import fused_router_topk, router_launch

    dtype = getattr(torch, torch_dtype)
    x, w, scale, pes = _router_case(T, E, H, seed, dtype)
    lp = router_launch(T, H, E)
    got_w, got_ids = fused_router_topk(x, scale, w, pes, k, 1e-6)
    ref_w, ref_ids = ref_router_topk(x.double(), w.double(), scale.double(), pes.double(), k, 1e-6, H ** -0.5)
    name = f"router exact {torch_dtype} T={T} E={E} H={H} k={k} fused={lp.fused}"
    if lp.fused:
        assert torch.equal(got_ids.long(), ref_ids), (name, got_ids, ref_ids)
        _close(name, got_w, ref_w.float(), rtol=1e-4, atol=1e-6)
        return
    xd = x.double()
    h = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * scale.double() * H ** -0.5
    logits = h @ w.double().t()
    top = logits.topk(k, dim=-1).values
    picked = logits.gather(1, got_ids.long())
    margin = (top - picked).max().item()
    print(f"  {name}: ids equal {torch.equal(got_ids.long(), ref_ids)}, worst pick margin {margin:.2e}", flush=True)
    assert margin < 0.05, (name, margin)
    assert len({tuple(r) for r in got_ids.sort(1).values.tolist()}) > 1  # not degenerate


def _check_router_paths():
    """Fused and two-kernel paths agree (float32), the fused result is bitwise reproducible, its counters are
    back to zero after each launch, and the Qwen3.5 form (no norm, no scales) matches its reference."""
    import torch

    from compiled_llm.ops.moe import ref_softmax_router_topk
    from compiled_llm.ops.triton import moe as M
    from compiled_llm.ops.triton._common import TICKETS

    x, w, scale, pes = _router_case(19, 40, 200, 7, torch.float32)
    fused = M.router_launch(19, 200, 40, fused=True)
    assert fused.fused and fused.splits > 1 and 19 > fused.block_t  # several token blocks and slices
    a = M.fused_router_topk(x, scale, w, pes, 6, 1e-6, launch=fused)
    assert int(TICKETS[("router", x.device)].abs().sum()) == 0
    b = M.fused_router_topk(x, scale, w, pes, 6, 1e-6, launch=fused)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    c = M.fused_router_topk(x, scale, w, pes, 6, 1e-6, launch=M.router_launch(19, 200, 40, fused=False))
    assert torch.equal(a[1], c[1])
    eight = M.fused_router_topk(x, scale, w, pes, 6, 1e-6, launch=M.router_launch(19, 200, 40, fused=True, block_t=8))
    assert torch.equal(a[1], eight[1]) and int(TICKETS[("router", x.device)].abs().sum()) == 0  # 8-row blocks: three
    _close("router fused vs two kernels", a[0], c[0], rtol=1e-5, atol=1e-7)
    # prefill sizes of a normed router: one launch, 32-row blocks of every expert, the hidden size in 4 slices (2
    # past ROUTER_PREFILL_FEW_TOKENS); COMPILED_LLM_ROUTER_PREFILL=two: the two kernels, which from
    # ROUTER_WIDE_MIN_TOKENS read a row block once for all experts (once for the norm, once for the dot)
    from unittest import mock

    one = M.router_launch(100, 200, 40)
    assert (one.fused, one.block_t, one.block_e, one.splits) == (True, 32, 64, 2)  # 200 columns: two 128-wide slices
    assert M.router_launch(M.ROUTER_PREFILL_FEW_TOKENS + 1, 2816, 128).splits == 2
    assert M.router_launch(M.ROUTER_PREFILL_FEW_TOKENS, 2816, 128).splits == 4
    assert not M.router_launch(100, 200, 40, norm=False).fused  # Qwen3.5's softmax router keeps its two kernels
    with mock.patch.dict(os.environ, {M.ROUTER_PREFILL_ENV: "two"}):
        wide = M.router_launch(M.ROUTER_WIDE_MIN_TOKENS, 200, 40)
        assert M.router_launch(M.ROUTER_WIDE_MIN_TOKENS - 1, 200, 40).block_t < 64
    assert (wide.fused, wide.block_t, wide.block_e, wide.splits) == (False, 64, 64, 1)
    x, w, scale, pes = _router_case(150, 40, 200, 9, torch.float32)  # three row blocks, a ragged last one
    d = M.fused_router_topk(x, scale, w, pes, 6, 1e-6, launch=wide)
    e = M.fused_router_topk(x, scale, w, pes, 6, 1e-6, launch=M.router_launch(150, 200, 40, fused=True,
                                                                              block_t=16))
    f = M.fused_router_topk(x, scale, w, pes, 6, 1e-6)  # the policy's: one launch, 32-row blocks
    assert torch.equal(d[1], e[1]) and torch.equal(d[1], f[1])
    assert int(TICKETS[("router", x.device)].abs().sum()) == 0
    _close("router wide two kernels vs fused", d[0], e[0], rtol=1e-5, atol=1e-7)
    _close("router wide two kernels vs the prefill launch", d[0], f[0], rtol=1e-5, atol=1e-7)
    for T, dt in ((6, torch.float32), (3, torch.bfloat16)):
        x, w, _, _ = _router_case(T, 40, 200, 8, dt)
        # the logits are rounded to dt (one bf16 ulp of a logit ~50 moves a weight by several %), and the
        # Triton 3.x interpreter's float32 -> bfloat16 cast truncates where the GPU rounds to nearest: the
        # reference rounds float32 sums the interpreter's way
        logits = x.float() @ w.float().t()
        if dt == torch.bfloat16:
            logits = (logits.view(torch.int32) & ~0xFFFF).view(torch.float32)
        ref_w, ref_ids = ref_softmax_router_topk(logits, torch.eye(40), 5)
        got_w, got_ids = M.fused_router_topk(x, None, w, None, 5, 0.0)
        assert torch.equal(got_ids.long(), ref_ids), (dt, got_ids, ref_ids)
        _close(f"softmax router fused {dt}", got_w, ref_w, rtol=1e-4, atol=1e-6)
    # every launch a batch size can take is built by JIT warm-up: two fused builds for Gemma 4's 1..64 tokens
    # (8-row blocks up to 8 tokens, then 16), Qwen3.5's softmax router four (1, 2 and 4 rows up to 16 tokens, then 16)
    for norm, E, H, k, inter, fused_builds in ((True, 128, 2816, 8, 704, 2), (False, 256, 2048, 8, 512, 4)):
        tokens = M.launch_variants(E, k, H, inter, 200, norm=norm)
        keys = {M.router_launch(t, H, E, norm=norm).build_key() for t in range(1, 201)}
        assert keys == {M.router_launch(t, H, E, norm=norm).build_key() for t in tokens}, tokens
        assert len({M.router_launch(t, H, E, norm=norm).build_key() for t in range(1, 65)}) == fused_builds
    assert [M.router_launch(T, 2048, 256, norm=False).block_t for T in (1, 2, 4, 5, 8, 16, 17, 64)] == \
        [1, 2, 2, 4, 4, 4, 16, 16]
    assert [M.router_launch(T, 2048, 256, norm=False).num_warps for T in (1, 8, 16, 17)] == [4, 4, 4, 8]
    for T in (1, 3, 8, 13):  # the small token blocks pick the experts the 16-row block picks
        x, w, _, _ = _router_case(T, 40, 200, 8, torch.float32)
        small = M.fused_router_topk(x, None, w, None, 5, 0.0)
        wide = M.fused_router_topk(x, None, w, None, 5, 0.0, launch=M.router_launch(T, 200, 40, norm=False,
                                                                                     block_t=16, splits=12))
        assert M.router_launch(T, 200, 40, norm=False).block_t == M.softmax_block_t(T) < 16
        assert torch.equal(small[1], wide[1]), T
        _close(f"softmax router block {T}", small[0], wide[0], rtol=1e-5, atol=1e-6)


def _check_skinny(M, N, K, dtype, launch=None, x_view=None, seed=0):
    """skinny_mm against torch's float32 matmul of the same (rounded) inputs. float32: tight. Half precision:
    the kernel sums in float32 and rounds once, and the Triton interpreter's float32 -> bfloat16 / float16 cast
    truncates (the GPU rounds to nearest), so the bound is one unit in the last place of the output."""
    import torch

    from compiled_llm.ops.triton.skinny_gemm import skinny_mm

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g).to(dtype)
    if x_view is None:
        x = torch.randn(M, K, generator=g).to(dtype)
    else:  # a strided view of a larger buffer: rows `step` apart, `offset` columns in
        step, offset = x_view
        x = torch.randn(M * step, K + offset + 3, generator=g).to(dtype)[::step, offset:offset + K]
        assert x.stride(0) != K and x.stride(1) == 1 and not x.is_contiguous()
    ref = x.float() @ w.float().t()
    got = skinny_mm(x, w, launch)
    assert got.dtype == dtype and got.shape == (M, N) and got.is_contiguous()
    ulp = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[dtype]
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (ulp * 1.01, 1e-4)
    _close(f"skinny {str(dtype)[6:]} M={M} N={N} K={K} {launch} view={x_view}", got, ref, rtol=rtol, atol=atol)
    return got


def check_skinny_gemm():
    import torch

    from compiled_llm.ops.triton.skinny_gemm import SkinnyLaunch, skinny_launch

    launches = [None,  # the default rule
                SkinnyLaunch(block_n=32, block_k=64, split_k=1, num_stages=2),
                SkinnyLaunch(block_n=16, block_k=32, split_k=3, num_stages=2),  # 3 slices of 96 columns (200)
                SkinnyLaunch(block_n=16, block_k=64, split_k=2, dot=False)]  # multiply-and-sum, 2 slices
    for dtype in (torch.float32, torch.bfloat16):
        for M in (1, 3, 8, 16):
            for lp in launches:  # N, K multiples of no block
                _check_skinny(M, 75, 200, dtype, lp, seed=M)
    _check_skinny(5, 75, 200, torch.float16, launches[2], seed=1)
    _check_skinny(19, 40, 96, torch.float32, launches[1], seed=2)  # past 16 rows: two M blocks
    _check_skinny(19, 40, 96, torch.bfloat16, launches[3], seed=2)
    for lp in launches:  # strided x (rows 3 apart, 5 columns in: no alignment)
        _check_skinny(4, 50, 130, torch.bfloat16, lp, x_view=(3, 5), seed=3)
    _check_skinny(8, 33, 256, torch.float32, SkinnyLaunch(block_n=16, block_k=64, split_k=4), x_view=(2, 0))
    _check_skinny(2, 1, 48, torch.bfloat16, seed=4)  # N = 1 (Qwen's shared expert gate), K below one block
    _check_skinny(3, 20, 7, torch.float32, seed=5)  # K below the smallest block
    _check_skinny(1, 64, 512, torch.bfloat16, SkinnyLaunch(block_n=32, block_k=128, split_k=2), seed=6)  # even K
    # split-K sums in a fixed order: two runs are bitwise equal
    a = _check_skinny(8, 75, 200, torch.bfloat16, launches[2], seed=7)
    b = _check_skinny(8, 75, 200, torch.bfloat16, launches[2], seed=7)
    assert torch.equal(a, b)
    # merge: each tile's last program sums the slices in slice order, bitwise the reduce kernel's result, and
    # leaves its counter at zero for the next launch (two M blocks, N and K multiples of no block)
    from compiled_llm.ops.triton._common import TICKETS

    for M, split in ((8, 3), (19, 2)):
        base = SkinnyLaunch(block_n=16, block_k=32, split_k=split, num_stages=2)
        merged = SkinnyLaunch(block_n=16, block_k=32, split_k=split, num_stages=2, merge=True)
        for seed in (8, 9):  # twice: the second launch finds the counters reset
            a = _check_skinny(M, 75, 200, torch.bfloat16, base, seed=seed)
            b = _check_skinny(M, 75, 200, torch.bfloat16, merged, seed=seed)
            assert torch.equal(a, b), (M, split)
        tickets = [t for k, t in TICKETS.items() if k[0] == "skinny" and k[2:] == (75, 200)]
        assert tickets and all(int(t.abs().sum()) == 0 for t in tickets)
    _check_skinny_mm_pass()
    # the default rule at decode shapes on 132 SMs
    assert skinny_launch(8, 262144, 2816) == SkinnyLaunch(64, 256, 1)  # LM head: plenty of N blocks
    lp = skinny_launch(8, 2816, 4096)  # o_proj: narrow N, long K: 16-row blocks and K split
    assert lp.block_n == 16 and lp.split_k > 1, lp
    assert skinny_launch(1, 32, 2048).split_k >= 2 and skinny_launch(4, 100, 100).split_k == 1
    assert skinny_launch(8, 1024, 2048, itemsize=4).block_k == 128


def _check_skinny_mm_pass():
    """passes/skinny_mm.py in a compiled graph: with the op's Triton provider, a decode batch's narrow projection
    (N < K, M <= 16) becomes skinny_mm (the merged split-K launch) and equals the float32 product within one bf16
    place; a wide one (N > K) and a static 32-row batch keep torch's mm. With a dynamic row count the op is put in
    and chooses per call (4 rows: the kernel; 32: torch's mm; both equal the product). On a GPU model whose
    measured table (ops/linear.py WIDE_MEASURED) lists the wide weight's shape, that product is rewritten too and
    runs the unsplit launch; the LM head's eager product (linear_rows) takes the kernel the same way. Counted in
    Inductor's counters."""
    from unittest import mock

    import torch
    from torch._dynamo.utils import counters

    from compiled_llm.models.parallel_layers import ParallelLMHead
    from compiled_llm.ops import OPS, linear
    from compiled_llm.ops.registry import Capabilities, preserved_choices
    from compiled_llm.ops.triton import skinny_gemm
    from compiled_llm.passes.manager import PassManager
    COUNTER = "compiled_llm.skinny_mm"  # the pass's total (passes/base.py count_matches)

    g = torch.Generator().manual_seed(11)
    narrow = (torch.randn(1024, 2048, generator=g) * 2048 ** -0.5).bfloat16()  # N < K, 2M elements
    wide = (torch.randn(2048, 1024, generator=g) * 1024 ** -0.5).bfloat16()
    assert skinny_gemm.decode_launch(1024, 2048).merge and skinny_gemm.decode_launch(2048, 1024).split_k == 1

    def f(x, x2, w_narrow, w_wide):
        return x @ w_narrow.t(), x2 @ w_wide.t()

    measured = dict(linear.WIDE_MEASURED, **{"Test GPU": frozenset({(2048, 1024)})})
    with preserved_choices():
        spec = OPS["skinny_mm"]
        spec.select(Capabilities.detect("cpu"), {}, force="triton")
        kernel, launches = spec.chosen[None][1], []
        spec.chosen[None] = ("triton", lambda x, w: launches.append((x.shape[0], w.shape[0])) or kernel(x, w))
        for gpu in (None, "Test GPU"):
            with mock.patch.object(linear, "WIDE_MEASURED", measured), \
                    mock.patch.object(linear, "device_name", lambda device=None: gpu), \
                    mock.patch.object(linear, "takes_device", lambda device: gpu), \
                    mock.patch("compiled_llm.passes.skinny_mm.takes_device", lambda device: gpu):  # a GPU's graph
                pm = PassManager(enabled=("skinny_mm",), dtype=torch.bfloat16, device="cpu")
                assert not pm.count_only() and pm.config[0] == ("skinny_mm",)
                assert pm.config[-1] == (((2048, 1024),) if gpu else ())  # the table is part of the cache key
                for rows, dynamic in ((4, False), (32, False), (4, True), (32, True)):
                    want = (rows <= 16 or dynamic) * (2 if gpu else 1)
                    torch._dynamo.reset()
                    before = counters["inductor"][COUNTER]
                    launches.clear()
                    compiled = torch.compile(f, options=pm.inductor_config(), dynamic=None if dynamic else False)
                    x = torch.randn(rows, 2048, generator=g).bfloat16()
                    x2 = torch.randn(rows, 1024, generator=g).bfloat16()
                    if dynamic:  # the row count symbolic, the weights' shapes static (as in the engine's dynamic compile)
                        torch._dynamo.mark_dynamic(x, 0)
                        torch._dynamo.mark_dynamic(x2, 0)
                    a, b = compiled(x, x2, narrow, wide)
                    assert counters["inductor"][COUNTER] - before == want, (gpu, rows, dynamic)
                    ran = [(rows, 1024)] + ([(rows, 2048)] if gpu else [])
                    assert sorted(launches) == (ran if rows <= 16 else []), (gpu, rows, dynamic, launches)
                    ref = x.float() @ narrow.float().t()
                    _close(f"skinny_mm pass gpu={gpu} rows={rows} dynamic={dynamic}", a, ref, rtol=2.0 ** -7 * 1.01,
                           atol=1e-4)
                    _close("  the wide product", b, x2.float() @ wide.float().t(), rtol=2.0 ** -7 * 1.01, atol=1e-4)
                # the LM head (eager): the kernel at a decode batch's rows where the table lists its shape
                head = ParallelLMHead(2048, 1024).bfloat16()
                with torch.no_grad():
                    head.weight.copy_(wide)
                for rows in (3, 17):
                    launches.clear()
                    x = torch.randn(rows, 1024, generator=g).bfloat16()
                    got = head.logits(x)
                    assert launches == ([(rows, 2048)] if gpu and rows <= 16 else []), (gpu, rows, launches)
                    _close(f"  LM head gpu={gpu} rows={rows}", got, x.float() @ wide.float().t(),
                           rtol=2.0 ** -7 * 1.01, atol=1e-4)
                with mock.patch.dict("os.environ", {linear.ENV: "0"}):  # the A/B switch: F.linear
                    launches.clear()
                    head.logits(torch.randn(3, 1024, generator=g).bfloat16())
                    assert launches == []
    torch._dynamo.reset()


def _check_allreduce_norm(world, rows, hidden, dtype, double, per_program=1, seed=0):
    """One rank's launches of the fused all-reduce + RMSNorm with its peers simulated in host memory: before
    each call the peers' rows are in their buffers (the half the call count picks, or the one buffer) and
    their flags are set in this rank's pad (the interpreter runs one rank at a time). Each output is the norm
    of the sum in rank order rounded to the dtype; this rank's flags (one per program of `per_program` rows)
    reach every peer's pad, its own pad ends clean, and with two halves each program's call count moves on by
    one a call."""
    import torch
    from compiled_llm.ops.norm import ref_rms_norm
    from compiled_llm.ops.triton.allreduce_norm import Workspace, launch

    g = torch.Generator().manual_seed(seed)
    rank, capacity = world - 1, rows + 3  # the last rank: its id is neither 0 nor 1
    phases = 1 if double else 2
    programs = -(-rows // per_program)
    bufs = [torch.zeros(2 * capacity, hidden, dtype=dtype) for _ in range(world)]
    pads = [torch.zeros(2 * capacity * world, dtype=torch.int32) for _ in range(world)]
    epochs = torch.zeros(capacity, dtype=torch.int32)
    ws = Workspace("g", rank, world, capacity, hidden, dtype, torch.tensor([b.data_ptr() for b in bufs]),
                   torch.tensor([p.data_ptr() for p in pads]), epochs, double=double, rows_per_program=per_program,
                   status=torch.zeros(1, dtype=torch.int32), spin_limit=300)
    w = (1 + 0.3 * torch.randn(hidden, generator=g)).to(dtype)
    for call in range(2):
        xs = [torch.randn(rows, hidden, generator=g).to(dtype) for _ in range(world)]
        half = (call % 2) * capacity if double else 0
        for r in range(world):
            if r != rank:
                bufs[r][half:half + rows] = xs[r]
                pads[r].zero_()
                for phase in range(phases):
                    pads[rank][(phase * capacity + torch.arange(programs)) * world + r] = 1
        y = launch(xs[rank], w, 1e-6, ws)
        total = xs[0].float()
        for x in xs[1:]:
            total = total + x.float()
        ref = ref_rms_norm(total.to(dtype), w, 1e-6)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(y, ref, **tol)
        assert torch.equal(bufs[rank][half:half + rows], xs[rank]), "this rank's rows were not published"
        assert int(pads[rank].abs().sum()) == 0, f"flags left in this rank's pad: {pads[rank].nonzero().flatten().tolist()}"
        for r in range(world):
            if r != rank:
                sent = pads[r].view(2, capacity, world)
                assert bool((sent[:phases, :programs, rank] == 1).all()), f"rank {r} did not get every flag"
                assert int(sent.sum()) == phases * programs, "flags where none belong"
        want = [call + 1 if double else 0] * programs + [0] * (capacity - programs)
        assert epochs.tolist() == want, (epochs.tolist(), want)
    assert int(ws.status) == 0
    # a peer that never comes (dead): each wait gives up after spin_limit tries and says so; once status is set
    # (that, or `abort` at shutdown) no wait spins, and every launch returns
    for r in range(world):
        pads[r].zero_()
    launch(xs[rank], w, 1e-6, ws)
    gave_up = int(ws.status)
    assert gave_up >= programs, gave_up
    ws.spin_limit = 1 << 30  # would spin for minutes if a later call still waited
    launch(xs[rank], w, 1e-6, ws)
    assert int(ws.status) > gave_up


def check_allreduce_norm():
    import torch
    for world, rows, hidden, dtype, double, per_program in [
            (2, 3, 96, torch.float32, True, 1), (2, 3, 96, torch.float32, False, 1), (4, 2, 80, torch.float32, True, 1),
            (2, 5, 64, torch.bfloat16, True, 1), (8, 1, 32, torch.float32, False, 1),
            (2, 5, 96, torch.float32, True, 2), (4, 7, 64, torch.float32, False, 4)]:
        _check_allreduce_norm(world, rows, hidden, dtype, double, per_program)

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(1)
    from interp_groups import main

    main(sys.argv[1:] or FAST, lambda g: globals()[f"check_{g}"]())


def test_d512_prefill_policy_reads_tma_tiles_unless_switched_off(monkeypatch):
    """The head_dim-512 prefill (Gemma 4's K=V global layers) takes the Gluon kernel by default (on sm_90:
    tests/test_kernel_check.py); COMPILED_LLM_PREFILL_GLUON=0, or a launch the Gluon kernel cannot take, the Triton
    tile: 32-key TMA tiles at two stages; COMPILED_LLM_PREFILL_TMA=0 gives the 64-key one-stage tile whose loads go
    through the registers, and so does a launch where TMA cannot run (a window, a GPU before sm_90, dense buffers
    past the limit)."""
    import torch

    from compiled_llm.ops.triton import paged_attention as PA

    assert PA.attention_launch_policy(1, 0, 512, prefill=True) == PA.PREFILL_D512_GLUON
    assert PA.attention_launch_policy(1, 0, 256, prefill=True).gluon is False
    monkeypatch.setenv(PA.PREFILL_GLUON_ENV, "0")
    pol = PA.attention_launch_policy(1, 0, 512, prefill=True)
    assert (pol.tma, pol.block_n, pol.num_stages, pol.split_d, pol.gluon) == (True, 32, 2, True, False)
    assert PA.attention_launch_policy(1, 0, 256, prefill=True).tma is False
    monkeypatch.setenv(PA.PREFILL_TMA_ENV, "0")
    pol = PA.attention_launch_policy(1, 0, 512, prefill=True)
    assert (pol.tma, pol.block_n, pol.num_stages, pol.split_d) == (False, 64, 1, True)
    monkeypatch.delenv(PA.PREFILL_TMA_ENV)
    q = torch.zeros(4, 2, 512)
    cache = torch.zeros(1, 1, 16, 1, 512)
    assert not PA._tma_fits(q, cache, None, 256, 256, 32, 1 << 20)  # no TMA on this CPU (not interpreted)
    monkeypatch.setattr(PA._common, "_INTERPRETED", True)
    assert PA._tma_fits(q, cache, None, 256, 256, 32, 1 << 20)
    assert not PA._tma_fits(q, cache, 1024, 256, 256, 32, 1 << 20)  # the rebuild writes only the window's rows
    assert not PA._tma_fits(q, cache, None, 256, 256, 32, 2 << 30)  # both dense buffers past the limit
    monkeypatch.setattr(PA._common, "_INTERPRETED", False)

    from compiled_llm.ops.rope import rope_inv_freq
    from compiled_llm.runtime.kernel_check import recorded_launches

    def launch():  # the kernel's arguments as an H100 would get them (recorded, not run)
        L = 64
        args = (torch.zeros(L, 16, 512, dtype=torch.bfloat16), torch.zeros(1, 4, 16, 2, 512, dtype=torch.bfloat16),
                torch.arange(4, dtype=torch.int32)[None], torch.tensor([0, L], dtype=torch.int32),
                torch.tensor([L], dtype=torch.int32))
        with recorded_launches(as_sm90=True) as launches:
            PA.paged_prefill(*args, scale=0.1, k_eq_v=True, num_kv_heads=2, head_dim=512,
                             k_norm_weight=torch.ones(512, dtype=torch.bfloat16),
                             inv_freq=rope_inv_freq(512, 1e6, "proportional", partial_rotary_factor=0.25))
        (kw,) = [lz.kwargs for lz in launches if lz.name == "_prefill_kernel"]
        return kw.get("TMA", False), kw["BLOCK_N"], kw["num_stages"]

    assert launch() == (True, 32, 2)
    monkeypatch.setattr(PA, "_tma_fits", lambda *a: False)
    assert launch() == (False, 64, 1)


@pytest.mark.parametrize("seqs,ctx,head_dim,kv_heads,window,splits", [
    (1, 1136, 512, 2, None, 32), (8, 1136, 512, 2, None, 16), (1, 8320, 512, 2, None, 64), (8, 4416, 512, 2, None, 16),
    (1, 1136, 256, 8, 1024, 16), (8, 1136, 256, 8, 1024, 4), (4, 8500, 256, 8, 1024, 8), (32, 1136, 256, 8, 1024, 2)])
def test_decode_split_policy_picks_the_sweeps_best(seqs, ctx, head_dim, kv_heads, window, splits):
    """The split counts the sweeps found fastest at Gemma 4 26B-A4B's decode shapes (benchmarks/NOTES.md: the
    H200's, 2026-12-01; the sliding layers' with the QK work inside, session 51 on an H100): short splits at batch 1,
    fewer as the batch fills the GPU; head_dim 256 at one to two waves of programs, not more."""
    import os
    from unittest import mock

    from compiled_llm.ops.triton import paged_attention as PA

    pol = PA.attention_launch_policy(seqs, ctx, head_dim, num_kv_heads=kv_heads, sliding_window=window,
                                     k_eq_v=head_dim == 512)
    assert pol.num_splits == splits
    with mock.patch.dict(os.environ, {PA.SPLIT_ROUND_ENV: "ceil"}):  # the A/B's other side: rounded up (until s51)
        up = PA.attention_launch_policy(seqs, ctx, head_dim, num_kv_heads=kv_heads, sliding_window=window,
                                        k_eq_v=head_dim == 512).num_splits
    assert up == splits if head_dim == 512 or seqs in (1, 32) else up == 2 * splits
    if head_dim == 512:  # Gemma 4's global layers rebuild 64 of 256 angles' keys: 32-key tiles, 2 stages; one
        # sequence: at most 32 splits of 64-key tiles, 8 warps (session 23's sweep)
        part = PA.attention_launch_policy(seqs, ctx, head_dim, num_kv_heads=kv_heads, k_eq_v=True, rotated_pairs=64)
        want = (min(splits, 32), 64, 2, 8) if seqs == 1 else (splits, 32, 2, 4)
        assert (part.num_splits, part.block_n, part.num_stages, part.num_warps) == want
        assert (pol.block_n, pol.num_stages) == (16, 3)
        # rows that keep the rotated keys (no rebuild): 64-key tiles at 4 warps, 2 stages at every batch (session 24's
        # sweep); COMPILED_LLM_DECODE_ROT_TILE=32 gives the rebuild's tiles back for an A/B
        kept = PA.attention_launch_policy(seqs, ctx, head_dim, num_kv_heads=kv_heads, k_eq_v=True, rotated_pairs=64,
                                          rot_keys=True)
        assert (kept.num_splits, kept.block_n, kept.num_stages, kept.num_warps) == (want[0], 64, 2, 4)
        with mock.patch.dict(os.environ, {PA.ROT_TILE_ENV: "32"}):
            assert PA.attention_launch_policy(seqs, ctx, head_dim, num_kv_heads=kv_heads, k_eq_v=True,
                                              rotated_pairs=64, rot_keys=True) == part
    else:  # the sliding layers: 64-key tiles at 2 stages (session 52's A/B), a window-less layer 32-key ones;
        # COMPILED_LLM_DECODE_KEY_TILE=32 gives the sliding layers the old tile, same splits
        assert (pol.block_n, pol.num_stages) == (64, 2)
        full = PA.attention_launch_policy(seqs, ctx, head_dim, num_kv_heads=kv_heads)
        assert full.block_n == 32
        with mock.patch.dict(os.environ, {PA.KEY_TILE_ENV: "32"}):
            narrow = PA.attention_launch_policy(seqs, ctx, head_dim, num_kv_heads=kv_heads, sliding_window=window)
        assert (narrow.num_splits, narrow.block_n) == (splits, 32)
