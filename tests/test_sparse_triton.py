"""The sparse_attention op's Triton provider (ops/triton/sparse_attention.py) against the reference
(ops/sparse.py), on the CPU through the Triton interpreter, float32 and bfloat16, at Gemma 4's head dims
(256; 512 with K=V keys and partial rotary), GQA and soft-capping: StreamingLLM decode and prefill chunks,
OmniKV filter picks and sparse layers, decode batches and mixed batches, padding rows. TRITON_INTERPRET must
be set before triton is imported, so the checks run as this file in a subprocess (as in
test_triton_kernels.py: the default groups in one, tests/interp_groups.py). Unused cache slots hold NaN: a kernel that reads one fails the finiteness check.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from interp_groups import check, run_groups

ROOT = Path(__file__).resolve().parents[1]
GROUPS = ["omnikv", "streaming"]
SLOW = ["engine"]  # ~1 min: the engine with every attention kernel interpreted


def _run_group(group: str):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), group], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"group {group} failed:\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}"


@pytest.fixture(scope="module")
def group_results(request):
    """Both groups in one interpreter subprocess (tests/interp_groups.py)."""
    return run_groups(request, __file__, "test_sparse_triton_kernels")


@pytest.mark.parametrize("group", GROUPS)
def test_sparse_triton_kernels(group_results, group):
    check(group_results, group)


@pytest.mark.slow
@pytest.mark.parametrize("group", SLOW)
def test_sparse_triton_engine(group):
    _run_group(group)


# ------------------------------------------------------------------------------------------------------
# checks (in the subprocess)


def _close(name, got, ref, dtype):
    import torch

    tol = (2e-4, 1e-3) if dtype == torch.float32 else (3e-2, 3e-2)
    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    assert torch.isfinite(got).all(), f"{name}: non-finite output"
    err = (got.float() - ref.float()).abs()
    ok = bool((err <= tol[0] + tol[1] * ref.float().abs()).all())
    print(f"  {name}: max err {err.max().item():.2e} {'ok' if ok else 'FAIL'}", flush=True)
    assert ok, f"{name}: max err {err.max().item():.3e}"


def _cache(seq_lens, *, page, kv_heads, head_dim, k_eq_v, gen, released=None):
    """Random paged cache: each sequence's blocks in a random order; unused slots NaN, except physical
    block 0 (the reference reads it for masked keys), which no sequence owns. released(i, b): block b of
    sequence i is released (-1 in its table)."""
    import torch

    nblk = [-(-L // page) for L in seq_lens]
    num_blocks = sum(nblk) + 3
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.full((len(seq_lens), max(nblk) + 1), -1, dtype=torch.int32)
    cache = torch.full((1 if k_eq_v else 2, num_blocks, page, kv_heads, head_dim), float("nan"))
    cache[:, 0] = torch.randn(cache.shape[0], page, kv_heads, head_dim, generator=gen)
    for i, L in enumerate(seq_lens):
        for b in range(nblk[i]):
            blk = perm.pop()
            if released is not None and released(i, b):
                continue
            tables[i, b] = blk
            for s in range(page):
                if b * page + s < L:
                    cache[:, blk, s] = torch.randn(cache.shape[0], kv_heads, head_dim, generator=gen)
    return cache, tables


def _spec(idx, *, heads, kv_heads, head_dim, softcap, k_eq_v, gen, window=None, sinks=0, omnikv=None, cache_layer=None):
    import torch

    from compiled_llm.ops.attention import AttentionSpec
    from compiled_llm.ops.rope import rope_inv_freq, rotated_pairs

    spec = AttentionSpec(layer_idx=idx, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                         sliding_window=window, cache_layer=idx if cache_layer is None else cache_layer,
                         scale=head_dim ** -0.5 * 1.7, softcap=softcap, k_eq_v=k_eq_v, sink_tokens=sinks,
                         omnikv=omnikv)
    # partial rotary (Gemma 4's global layers): a quarter of the angles rotate
    spec.inv_freq = rope_inv_freq(head_dim, 10000.0, "proportional", partial_rotary_factor=0.25)
    if k_eq_v:
        spec.k_norm_weight = 1.0 + 0.3 * torch.randn(head_dim, generator=gen)
        if head_dim >= 512:  # the dense kernel (OmniKV filter layers) rebuilds only the rotated dims
            spec.rotated_pairs = rotated_pairs(head_dim, "proportional", 0.25)
    return spec


def _context(specs, caches, tables, seq_lens, q_lens, page, sm, pad_rows=0):
    import torch

    from compiled_llm.ops.context import AttentionMetadata, ForwardContext, GroupMetadata
    from compiled_llm.ops.sparse import SPARSE_KEY

    qsl = [0]
    for m in q_lens:
        qsl.append(qsl[-1] + m)
    groups = {s.kv_group: GroupMetadata(tables, torch.zeros(0, dtype=torch.long)) for s in specs.values()}
    meta = AttentionMetadata(query_start_loc=qsl, seq_lens=list(seq_lens), block_size=page, groups=groups)
    if pad_rows:  # a padded static batch (CUDA graphs): sequence lengths 0 past the real rows
        meta.seq_lens_tensor = torch.tensor(list(seq_lens) + [0] * pad_rows, dtype=torch.int32)
        tables = torch.cat([tables, torch.zeros(pad_rows, tables.shape[1], dtype=torch.int32)])
        for g in groups:
            groups[g] = GroupMetadata(tables, torch.zeros(0, dtype=torch.long))
    return ForwardContext(meta, caches, specs, {SPARSE_KEY: sm} if sm is not None else {})


def _force_splits(T, splits):
    """Short contexts get one split from the launch policy; force split-K (and 16-key tiles) to test it."""
    from compiled_llm.ops.triton import paged_attention as PA

    T.attention_launch_policy = (PA.attention_launch_policy if splits is None else
                                 lambda *a, **k: PA.AttnLaunch(num_splits=splits, block_n=16))


def _as(dtype, *tensors):
    return [t.to(dtype) for t in tensors]


def _omnikv_case(dtype, *, seq_lens, q_lens, page, kv_heads, group, head_dim, k_eq_v, softcap, budget, sink, recent,
                 pad_rows=0, seed=0, splits=None, offloaded=False):
    """A filter layer then a sparse layer reading its own cache; kernel vs reference, outputs and picks.
    offloaded: the sparse layer's cache is marked as OmniKV's offloaded (host) cache, so a prefill chunk
    gathers its context's blocks first (gather_blocks), and a step of decode rows reads the picks the
    filter layer staged (stage_picks): the sparse layer's cache then holds stale values at each row's
    own position until after the filter layer, as in the engine, where the sparse layer writes its
    token's KV after the staging (stage_current must bring the new values)."""
    import torch

    from compiled_llm.ops import sparse as R
    from compiled_llm.ops.context import set_forward_context
    from compiled_llm.ops.sparse import SparseMetadata
    from compiled_llm.ops.triton import sparse_attention as T

    gen = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    kw = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, softcap=softcap, k_eq_v=k_eq_v, gen=gen)
    specs = {0: _spec(0, omnikv="filter", **kw), 1: _spec(1, omnikv="sparse", **kw)}
    specs[1].offloaded = offloaded
    c0, tables = _cache(seq_lens, page=page, kv_heads=kv_heads, head_dim=head_dim, k_eq_v=k_eq_v, gen=gen)
    # the same block tables for both layers (one KV group): layer 1 has its own values in the same slots
    c1 = c0.clone().normal_(generator=gen).where(~c0.isnan(), c0)
    q = torch.randn(sum(q_lens) + pad_rows, heads * head_dim, generator=gen)
    q, c0, c1 = _as(dtype, q, c0, c1)
    for s in specs.values():
        if s.k_norm_weight is not None:
            s.k_norm_weight = s.k_norm_weight.to(dtype)
    decode = [m == 1 and L > 2 for m, L in zip(q_lens, seq_lens)]
    name = (f"omnikv {str(dtype)[6:]} lens={seq_lens} q={q_lens} d={head_dim} kv={kv_heads} g={group} "
            f"k=v:{k_eq_v} cap={softcap} pad={pad_rows} splits={splits}{' offloaded' if offloaded else ''}")
    _force_splits(T, splits)

    own = [(i, L - 1) for i, (m, L) in enumerate(zip(q_lens, seq_lens)) if m == 1 and decode[i]]
    staged_step = offloaded and all(decode)

    def run(fn, caches, qq, index=None):
        sm = SparseMetadata(decode=decode, budget=budget, sink=sink, recent=recent,
                            index=torch.full((len(seq_lens) + pad_rows, budget), -1, dtype=torch.int32))
        ctx = _context(specs, caches, tables, seq_lens, q_lens, page, sm, pad_rows)
        fresh = []
        if staged_step and fn is T.attention:  # the rows' own tokens are written after the filter layer
            for i, pos in own:
                at = (slice(None), int(tables[i, pos // page]), pos % page)
                fresh.append((at, caches[1][at].clone()))
                caches[1][at] = caches[1][at] * -3.0 + 1.0
        with set_forward_context(ctx):
            f = fn(qq, 0)
            picks = sm.index.clone()
            if index is not None:
                sm.index.copy_(index)
                if sm.staged_picks:  # the test swapped in the reference's picks: stage those
                    T._stage_after_filter(ctx, 0, ctx.attn_metadata.seq_lens_tensor, sm)
            for at, v in fresh:  # the sparse layer writes its token's KV
                caches[1][at] = v
            if fn is T.attention:
                assert bool(sm.staged_picks) == staged_step, sm.staged_picks
            s = fn(qq, 1)
        return f, picks, s

    ref_caches = {0: c0.float(), 1: c1.float()}
    f_ref, p_ref, s_ref = run(R.sparse_attention, ref_caches, q.float()[:sum(q_lens)])
    f, p, s = run(T.attention, {0: c0, 1: c1}, q, index=p_ref)
    n = sum(q_lens)
    _close(name + " filter", f[:n], f_ref, dtype)
    _close(name + " sparse", s[:n], s_ref, dtype)
    if pad_rows:
        assert (f[n:] == 0).all() and (s[n:] == 0).all(), "padding rows must come back as zeros"
    rows = [i for i, d in enumerate(decode) if d]
    for i in rows:
        a, b = set(p[i].tolist()) - {-1}, set(p_ref[i].tolist()) - {-1}
        assert p[i].tolist() == sorted(p[i].tolist(), key=lambda x: (x < 0, x)), p[i]
        forced = set(range(min(sink, seq_lens[i]))) | set(range(max(0, seq_lens[i] - recent), seq_lens[i]))
        assert forced <= a, (forced - a)
        if dtype == torch.float32:
            assert a == b, (name, i, sorted(a ^ b))
        else:  # bfloat16 scores may swap near-ties
            assert len(a & b) >= len(b) - 2, (name, i, sorted(a ^ b))
        assert len(a) == min(budget, seq_lens[i])
    for i, d in enumerate(decode):
        if not d:
            assert (p[i] == -1).all(), "a prefill row has no pick"
    print(f"  {name} picks: {'equal' if dtype == torch.float32 else 'overlap ok'} for rows {rows}", flush=True)


def _streaming_case(dtype, *, seq_lens, q_lens, page, kv_heads, group, head_dim, k_eq_v, softcap, sinks, window,
                    seed=0, splits=None):
    import torch

    from compiled_llm.ops import sparse as R
    from compiled_llm.ops.context import set_forward_context
    from compiled_llm.ops.triton import sparse_attention as T

    gen = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    spec = _spec(0, heads=heads, kv_heads=kv_heads, head_dim=head_dim, softcap=softcap, k_eq_v=k_eq_v, gen=gen,
                 window=window, sinks=sinks)
    sink_blocks = -(-sinks // page)

    def released(i, b):  # blocks no query of this step can see: between the sinks and the first window
        first = max(0, seq_lens[i] - q_lens[i] - window + 1)
        return b >= sink_blocks and (b + 1) * page <= first

    cache, tables = _cache(seq_lens, page=page, kv_heads=kv_heads, head_dim=head_dim, k_eq_v=k_eq_v, gen=gen,
                           released=released)
    q = torch.randn(sum(q_lens), heads * head_dim, generator=gen)
    q, cache = _as(dtype, q, cache)
    if k_eq_v:
        spec.k_norm_weight = spec.k_norm_weight.to(dtype)
    name = (f"streaming {str(dtype)[6:]} lens={seq_lens} q={q_lens} d={head_dim} kv={kv_heads} g={group} "
            f"k=v:{k_eq_v} cap={softcap} S={sinks} W={window} splits={splits}")
    _force_splits(T, splits)
    with set_forward_context(_context({0: spec}, {0: cache.float()}, tables, seq_lens, q_lens, page, None)):
        ref = R.sparse_attention(q.float(), 0)
    with set_forward_context(_context({0: spec}, {0: cache}, tables, seq_lens, q_lens, page, None)):
        out = T.attention(q, 0)
    _close(name, out, ref, dtype)


def check_engine():
    """The engine end to end with the Triton providers (interpreted): chunked prefill beside decode rows
    (mixed batches), decode batches, the index buffer across steps. On the retrieval model of
    test_sparse_quality, OmniKV answers every needle and picks it at every step, StreamingLLM keeps only
    the needle inside its window, as the reference does."""
    import tempfile

    sys.path.insert(0, str(ROOT / "tests"))
    import test_sparse_quality as Q

    from compiled_llm.ops.triton import sparse_attention as T

    tmp = Path(tempfile.mkdtemp())
    needles, length, budget = [(0, 6), (2, 30), (3, 58)], 64, 16
    omnikv = dict(sparse_sink_tokens=2, omnikv_budget=budget, omnikv_recent=4)
    methods = {"omnikv": omnikv, "omnikv-offload": dict(omnikv, omnikv_offload=True),
               "streamingllm": dict(sparse_sink_tokens=2, sparse_window=budget - 2)}
    for label, kw in methods.items():
        name = label.split("-")[0]
        llm = Q.build(tmp, name, max_num_batched_tokens=40, **kw)
        runner = llm.engine.executor.runner
        assert set(runner.op_providers["sparse_attention"].values()) == {"triton"}, runner.op_providers
        if label == "omnikv-offload":
            assert runner.sparse.offloaded and runner.sparse.staging_bytes > 0, runner.sparse.describe()
        before = T.STAGED_READS
        r = Q.run_checks(llm, name, needles=needles, length=length, n_out=3, text_len=72, target_len=6)
        assert (T.STAGED_READS > before) == (label == "omnikv-offload"), (label, T.STAGED_READS - before)
        print(f"  engine {label}: {r}", flush=True)
        if name == "omnikv":
            assert all(r["retrieved"]) and all(all(v) and v for v in r["pick_held_needle"].values()), r
            assert r["ppl"] < 3.3, r
        else:
            assert r["retrieved"] == [pos >= length - (budget - 2) for _, pos in needles], r


def _filter_f16_scores_case():
    """filter_decode with its raw scores stored as float16 (the benchmark's A/B of the store): the attention
    output is the float32 store's, and the head-summed probabilities agree to float16's rounding."""
    import torch

    from compiled_llm.ops.triton import sparse_attention as T

    gen = torch.Generator().manual_seed(11)
    seq_lens = [90, 41]
    spec = _spec(0, heads=4, kv_heads=1, head_dim=512, softcap=None, k_eq_v=True, gen=gen, omnikv="filter")
    cache, tables = _cache(seq_lens, page=4, kv_heads=1, head_dim=512, k_eq_v=True, gen=gen)
    cache = cache.nan_to_num(0.0).to(torch.bfloat16)
    q = torch.randn(2, 4 * 512, generator=gen).to(torch.bfloat16)
    kw = dict(scale=spec.scale, num_kv_heads=1, head_dim=512, k_eq_v=True, k_norm_weight=spec.k_norm_weight,
              inv_freq=spec.inv_freq, rotated_pairs=spec.rotated_pairs)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out32, s32 = T.filter_decode(q, cache, tables, lens, **kw)
    out16, s16 = T.filter_decode(q, cache, tables, lens, raw_dtype=torch.float16, **kw)
    assert torch.equal(out32, out16)
    err = ((s16 - s32).abs() / (s32.abs() + 1e-6)).max().item()
    assert 0 < err < 2e-2, err  # rounded (not the float32 path by mistake), within float16's rounding
    print(f"  filter scores stored as float16: head-summed probabilities within {err:.1e} of float32", flush=True)


def check_omnikv():
    import torch

    _filter_f16_scores_case()

    for dtype in (torch.float32, torch.bfloat16):
        # decode batch, head_dim 256, GQA 2, soft-cap, padded to a static batch of 4
        _omnikv_case(dtype, seq_lens=[70, 9, 45], q_lens=[1, 1, 1], page=16, kv_heads=2, group=2, head_dim=256,
                     k_eq_v=False, softcap=30.0, budget=16, sink=2, recent=4, pad_rows=1, splits=3)
        # Gemma 4's global layers: head_dim 512, K=V keys rebuilt at each picked position, GQA 4
        _omnikv_case(dtype, seq_lens=[90, 33], q_lens=[1, 1], page=4, kv_heads=1, group=4, head_dim=512,
                     k_eq_v=True, softcap=None, budget=24, sink=4, recent=4, seed=1)
    # a mixed batch: a prefill chunk (dense) beside decode rows (sparse)
    _omnikv_case(torch.float32, seq_lens=[40, 64, 20], q_lens=[1, 12, 1], page=4, kv_heads=2, group=2, head_dim=64,
                 k_eq_v=False, softcap=20.0, budget=12, sink=2, recent=3, seed=2)
    _omnikv_case(torch.float32, seq_lens=[90, 33], q_lens=[1, 1], page=4, kv_heads=1, group=4, head_dim=512,
                 k_eq_v=True, softcap=None, budget=24, sink=4, recent=4, seed=3, splits=4)
    # offload: two prefill chunks (their contexts' blocks gathered from the host cache) beside decode rows
    _omnikv_case(torch.float32, seq_lens=[40, 64, 20, 37], q_lens=[1, 12, 1, 5], page=4, kv_heads=1, group=4,
                 head_dim=512, k_eq_v=True, softcap=None, budget=12, sink=2, recent=3, seed=4, offloaded=True)
    _omnikv_case(torch.bfloat16, seq_lens=[33, 50], q_lens=[9, 1], page=4, kv_heads=2, group=2, head_dim=64,
                 k_eq_v=False, softcap=20.0, budget=12, sink=2, recent=3, seed=5, offloaded=True)
    # offload, a step of decode rows: the sparse layer reads the picks the filter layer staged
    for dtype in (torch.float32, torch.bfloat16):
        _omnikv_case(dtype, seq_lens=[90, 33, 7], q_lens=[1, 1, 1], page=4, kv_heads=1, group=4, head_dim=512,
                     k_eq_v=True, softcap=None, budget=24, sink=4, recent=4, seed=6, offloaded=True, splits=2)
    _omnikv_case(torch.float32, seq_lens=[70, 19], q_lens=[1, 1], page=16, kv_heads=2, group=2, head_dim=256,
                 k_eq_v=False, softcap=30.0, budget=16, sink=2, recent=1, pad_rows=1, seed=7, offloaded=True)


def check_streaming():
    import torch

    for dtype in (torch.float32, torch.bfloat16):
        # decode rows: one long (sinks shifted, middle released), one short enough to be dense
        _streaming_case(dtype, seq_lens=[77, 9, 30], q_lens=[1, 1, 1], page=4, kv_heads=2, group=2, head_dim=256,
                        k_eq_v=False, softcap=30.0, sinks=3, window=20, splits=2)
        _streaming_case(dtype, seq_lens=[100], q_lens=[1], page=16, kv_heads=1, group=4, head_dim=512, k_eq_v=True,
                        softcap=None, sinks=4, window=40, seed=1)
    # prefill chunks and a decode row in one step: every new token with its own window and shift
    _streaming_case(torch.float32, seq_lens=[60, 25, 31], q_lens=[20, 25, 1], page=4, kv_heads=2, group=2, head_dim=64,
                    k_eq_v=False, softcap=20.0, sinks=3, window=10, seed=2, splits=3)
    _streaming_case(torch.float32, seq_lens=[50], q_lens=[17], page=4, kv_heads=1, group=4, head_dim=512, k_eq_v=True,
                    softcap=None, sinks=4, window=9, seed=3)


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(1)
    from interp_groups import main

    main(sys.argv[1:] or GROUPS, lambda g: globals()[f"check_{g}"]())


def test_cuda_resolves_sparse_layers_to_the_capturable_kernel():
    """On a CUDA device the sparse layers' attention is the Triton kernel (declared capturable, so the
    attention op stays capturable too); dense layers keep theirs; on the CPU the reference serves them."""
    import torch

    from compiled_llm.compiler import whole_graph_decode_ok
    from compiled_llm.ops.attention import AttentionSpec
    from compiled_llm.ops.registry import OPS, Capabilities, preserved_choices, select_providers

    mk = lambda i, w=None, **kw: AttentionSpec(layer_idx=i, num_heads=8, num_kv_heads=2, head_dim=256 if w else 512,
                                               sliding_window=w, cache_layer=i, **kw)
    specs = {0: mk(0, 512), 1: mk(1, omnikv="filter"), 2: mk(2, 512), 3: mk(3, omnikv="sparse")}
    cuda = Capabilities("cuda", (9, 0), frozenset({"triton"}))
    with preserved_choices():
        table = select_providers("cpu", torch.bfloat16, specs, {"block_size": 16}, caps=cuda)
        assert table["sparse_attention"] == {1: "triton", 3: "triton"}
        assert table["attention"] == {i: "triton" for i in specs}
        assert OPS["sparse_attention"].capturable() and OPS["attention"].capturable()
        assert whole_graph_decode_ok(stateful=False, sparse=True)  # decode captured whole, sparse layers in it
        assert not whole_graph_decode_ok(stateful=False, sparse=True, pipeline=True)
        cpu = Capabilities("cpu", None, frozenset({"triton"}))
        table = select_providers("cpu", torch.float32, specs, {"block_size": 16}, caps=cpu)
        assert table["sparse_attention"] == {1: "reference", 3: "reference"}
        assert not OPS["sparse_attention"].capturable()
        assert not whole_graph_decode_ok(stateful=False, sparse=True)


def test_whole_graph_decode_only_for_steps_of_decode_rows(monkeypatch):
    """A step replays the whole-forward graph only when every row is a decode row: a one-token row that
    ends a prompt (OmniKV attends it densely; the capture attended sparsely) runs the pieces. The decision
    reads the step's extras (SparseMetadata.whole_graph_ok); CUDA graphs faked, the replay recorded."""
    import torch

    from compiled_llm.compiler.backend import CompilerConfig
    from compiled_llm.compiler.cuda_graph import BatchDescriptor
    from compiled_llm.compiler.model import CompiledModel, RunState
    from compiled_llm.compiler.warmup import dummy_context
    from compiled_llm.ops.attention import AttentionSpec
    from compiled_llm.ops.context import set_forward_context
    from compiled_llm.ops.sparse import SPARSE_KEY, SparseMetadata

    monkeypatch.setattr("compiled_llm.compiler.model.RunState", lambda cudagraphs: RunState(cudagraphs=True))
    cm = CompiledModel(torch.nn.Linear(2, 2), CompilerConfig(batch_sizes=[2], cudagraphs=True), "cpu", whole_graph=True)
    ran = []
    whole = BatchDescriptor(2, whole=True)
    cm.full.graphs[whole] = object()  # as if captured
    monkeypatch.setattr(cm.full, "replay", lambda desc, args=(): ran.append("whole") or torch.zeros(2, 2))
    monkeypatch.setattr(cm, "_forward", lambda ids, pos, size, inter=None: ran.append("pieces") or torch.zeros(2, 2))
    spec = AttentionSpec(layer_idx=0, num_heads=2, num_kv_heads=1, head_dim=8, sliding_window=None, cache_layer=0)
    for decode, want in (([True, True], "whole"), ([True, False], "pieces")):
        ctx = dummy_context({0: spec}, {}, 16, 2, 1, "cpu")
        ctx.extra[SPARSE_KEY] = SparseMetadata(decode=decode)
        with set_forward_context(ctx):
            cm(torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long))
        assert ran[-1] == want, (decode, ran)


def test_reference_filter_scores_block_by_block(monkeypatch):
    """The reference OmniKV filter layer (the CPU's path) gathers the context a chunk of positions at a
    time, never [rows, ctx, kv_heads, head_dim], and gives the output and pick of the one-chunk run."""
    import torch

    from compiled_llm.ops import sparse as R
    from compiled_llm.ops.context import set_forward_context
    from compiled_llm.ops.sparse import SparseMetadata

    gen = torch.Generator().manual_seed(5)
    seq_lens, page, budget = [200, 61, 130], 8, 24
    kw = dict(heads=4, kv_heads=2, head_dim=32, softcap=30.0, gen=gen)
    real = R._gather_chunk
    for k_eq_v in (False, True):
        specs = {0: _spec(0, omnikv="filter", k_eq_v=k_eq_v, **kw)}
        cache, tables = _cache(seq_lens, page=page, kv_heads=2, head_dim=32, k_eq_v=k_eq_v, gen=gen)
        q = torch.randn(3, 4 * 32, generator=gen)
        runs = {}
        for chunk_bytes in (1 << 30, 3 * 2 * 32 * 4 * 16):  # everything at once; 16 positions at a time
            monkeypatch.setattr(R, "FILTER_CHUNK_BYTES", chunk_bytes)
            widths = []
            monkeypatch.setattr(R, "_gather_chunk", lambda *a, **k: widths.append(a[3].shape[1]) or real(*a, **k))
            for vec in (True, False):
                monkeypatch.setattr(R, "VECTORIZED", vec)
                sm = SparseMetadata(decode=[True] * 3, budget=budget, sink=2, recent=4,
                                    index=torch.full((3, budget), -1, dtype=torch.int32))
                with set_forward_context(_context(specs, {0: cache}, tables, seq_lens, [1, 1, 1], page, sm)):
                    runs[chunk_bytes, vec] = (R.sparse_attention(q, 0), sm.index.clone())
            if chunk_bytes > 1 << 20:
                assert max(widths) == tables.shape[1] * page
            else:  # 16 positions for 3 rows, 48 for one (the per-sequence path)
                assert max(widths) <= 48 < tables.shape[1] * page and 16 in widths, widths
        ref_out, ref_pick = runs[1 << 30, True]
        for key, (out, pick) in runs.items():
            torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
            assert torch.equal(pick, ref_pick), key
