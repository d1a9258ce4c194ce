"""Decode attention on the GPU at Gemma 4 26B-A4B's layer shapes: the launch policy the engine picks against
the alternatives, each call reading its KV from HBM as a decode step does (issue 14).

A decode step reads each layer's KV once; a benchmark that replays one call reads it from the 60 MB L2 after the
first time and flatters short contexts. Here one timed call walks `layers` distinct caches (at least 256 MB in
all, 64 at most) in a CUDA graph, and the time per launch is the graph's time over `layers`. Pages are the
engine's: 16 tokens, one sequence's pages in allocation order.

Cases: the sliding layer (8 KV heads, head_dim 256, GQA 2, window 1024) and the global one (2 KV heads,
head_dim 512, GQA 8, K=V with the key rebuilt in the kernel), at 1 and 8 sequences of ~1.1K tokens and at the
long shapes (1 x 8.5K, 8 x 4.4K, 4 x 8.5K); with --layers qwen_full, Qwen3.5 35B-A3B's full-attention layer
(2 KV heads, head_dim 256, GQA 8, no window). Per case:
  engine      attention_launch_policy with the engine's bound (the block-table width: --max-len, default the
              config's 131,072), keys rebuilt on the rotated dims only (global): what a decode step runs now
  every key   (global) the same launch rebuilding every key dim, as session 12's kernel did
  sweep       split count, warps, stages and key tile
  no-rebuild  (global) the K!=V path over the same bytes (K and V the same tensor): what any key rebuild
              costs (its output is not attention of this layer; not checked)
  rot keys    (global) the rows as the engine keeps them now (AttentionSpec.rot_keys: the rotated keys after
              each value, read instead of rebuilt), the engine's launch and, unless --no-sweep, other tiles
  flashinfer  (sliding, when installed: WITH_FLASHINFER=1 and the carried wheels) FlashInfer's paged decode,
              CUDA-core and tensor-core kernels, over the same caches (issue 14 item 3)
  qk          (--qk, sliding) the kernel with the step's QK-norm + RoPE + KV write inside, as a decode step runs
              it (DecodeQK): the write-back form (the default), the in-register form, and the write-back form
              with every slot -1 (the owner program skips the new key and value: timing only, what that work
              costs), against the engine row's plain kernel on normed queries
              (--qk-sweep: the write-back form at other split counts, warps and key tiles too)
  stream      (--stream) the engine launch's bytes streamed at its grid and tiles by a kernel that only loads
              and sums them, through the block table and with the pages computed: what the access pattern
              itself reaches, against which the attention's time (its combine launch included) is judged
Every candidate's output is compared with the engine policy's (max abs difference, bf16).

    python3 benchmarks/decode_attention.py [--out FILE.json] [--quick | --no-sweep] [--stream] [--cases 4x8500,8x1100]
    python3 benchmarks/decode_attention.py --dry-run   # CPU, Triton interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

if "--dry-run" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.graph_timing import graph_time_us  # noqa: E402
from compiled_llm.ops.rope import rope_inv_freq  # noqa: E402
from compiled_llm.ops.triton import paged_attention as PA  # noqa: E402

PAGE = 16
SLIDING = dict(name="sliding", kv_heads=8, head_dim=256, group=2, window=1024, k_eq_v=False)
GLOBAL = dict(name="global", kv_heads=2, head_dim=512, group=8, window=None, k_eq_v=True, rotated_pairs=64)
# Qwen3.5 35B-A3B's full-attention layers (2 KV heads, head_dim 256, GQA 8; their decode is the plain kernel)
QWEN_FULL = dict(name="qwen_full", kv_heads=2, head_dim=256, group=8, window=None, k_eq_v=False)
CASES = [(1, 1100), (1, 8500), (8, 1100), (8, 4400), (4, 8500)]


def make_layers(layer: dict, seqs: int, ctx: int, n: int, dev, dtype, seed: int):
    """n caches of one layer kind holding `seqs` sequences of `ctx` tokens, their block tables, the query."""
    g = torch.Generator(device=dev).manual_seed(seed)
    per_seq = triton.cdiv(ctx, PAGE)
    kv, d = layer["kv_heads"], layer["head_dim"]
    caches = [torch.randn(1 if layer["k_eq_v"] else 2, seqs * per_seq, PAGE, kv, d, device=dev, dtype=dtype,
                          generator=g) for _ in range(n)]
    tables = torch.arange(seqs * per_seq, device=dev, dtype=torch.int32).view(seqs, per_seq)
    q = torch.randn(seqs, kv * layer["group"], d, device=dev, dtype=dtype, generator=g)
    seq_lens = torch.full((seqs,), ctx, dtype=torch.int32, device=dev)
    opts = dict(scale=d ** -0.5, sliding_window=layer["window"], k_eq_v=layer["k_eq_v"], num_kv_heads=kv,
                head_dim=d)
    if layer["k_eq_v"]:
        opts["k_norm_weight"] = (1.0 + 0.2 * torch.randn(d, device=dev, generator=g)).to(dtype)
        # Gemma 4's global layers: 64 of 256 angles rotate (--layers' rotated_pairs must agree)
        opts["inv_freq"] = rope_inv_freq(d, 1e6, "proportional", partial_rotary_factor=0.25).to(dev)
    return caches, tables, q, seq_lens, opts


def candidates(layer: dict, seqs: int, max_len: int, quick: bool) -> list[tuple[str, PA.AttnLaunch, int | None]]:
    """(name, launch, rotated_pairs): the engine's choice first, then the alternatives."""
    R = dataclasses.replace
    base = PA.attention_launch_policy(seqs, max_len, layer["head_dim"], num_kv_heads=layer["kv_heads"],
                                      sliding_window=layer["window"], k_eq_v=layer["k_eq_v"],
                                      rotated_pairs=layer.get("rotated_pairs"))
    rot = layer.get("rotated_pairs")
    out = [("engine", base, rot)]
    if layer["k_eq_v"] and rot is not None:
        full = PA.attention_launch_policy(seqs, max_len, layer["head_dim"], num_kv_heads=layer["kv_heads"],
                                          k_eq_v=True)
        out.append(("every key rebuilt (session 12)", full, None))
    if quick is None:  # --no-sweep: the engine's launch (and its merge alternative) only
        return out
    splits = (8, 16, 32) if quick else (4, 8, 16, 32, 64)
    for n in splits:
        for w in (4, 8):
            for st in (2, 3):
                for bn in {base.block_n, 2 * base.block_n}:
                    p = R(base, num_splits=n, num_warps=w, num_stages=st, block_n=bn)
                    if p != base:
                        out.append((f"splits={n} w={w} st={st} bn={bn}", p, rot))
    return out


def run_case(layer, seqs, ctx, args, dev, dtype) -> list[dict]:
    seen = ctx if layer["window"] is None else min(ctx, layer["window"])  # keys a query reads
    per_layer = seqs * seen * layer["kv_heads"] * layer["head_dim"] * (1 if layer["k_eq_v"] else 2) * 2
    n = 2 if args.dry_run else max(4, min(64, triton.cdiv(256 << 20, per_layer)))
    caches, tables, q, seq_lens, opts = make_layers(layer, seqs, ctx, n, dev, dtype, seed=seqs * 7 + ctx)
    rows = []
    ref = None
    cands = candidates(layer, seqs, args.max_len, None if args.no_sweep else args.quick)
    for name, pol, rot in cands[:4] if args.dry_run else cands:  # (dry run: the code paths, not the sweep)
        row, out = timed_row(dict(layer=layer["name"], seqs=seqs, ctx=ctx, candidate=name), pol, caches, n,
                             per_layer, ref, args,
                             lambda c, pol=pol, rot=rot: PA.paged_decode(q, c, tables, seq_lens, policy=pol,
                                                                         rotated_pairs=rot, **opts),
                             rotated_pairs=rot)
        rows.append(row)
        ref = out if ref is None else ref
    if args.stream:
        rows += stream_rows(layer, seqs, ctx, caches, tables, seq_lens, opts, n, per_layer, args)
    if args.ladder and (not layer["k_eq_v"] or layer.get("rotated_pairs")):
        rows += ladder_rows(layer, seqs, ctx, caches, tables, q, seq_lens, opts, n, per_layer, ref, args)
    if not layer["k_eq_v"] and not args.dry_run:
        rows += flashinfer_rows(layer, seqs, ctx, caches, tables, q, opts, n, per_layer, ref, args)
    if layer["k_eq_v"] and layer.get("rotated_pairs"):
        rows += rot_keys_rows(layer, seqs, ctx, caches, tables, q, seq_lens, opts, n, per_layer, ref, args)
    if layer["k_eq_v"]:  # the same bytes through the K!=V path: what the key rebuild costs
        kv_opts = {k: v for k, v in opts.items() if k not in ("k_norm_weight", "inv_freq")} | dict(k_eq_v=False)
        pairs = [c.expand(2, *c.shape[1:]) for c in caches]
        pol = candidates(layer, seqs, args.max_len, True)[0][1]  # the engine's launch

        def plain(pol=pol):
            for c in pairs:
                out = PA.paged_decode(q, c, tables, seq_lens, policy=dataclasses.replace(pol, block_n=32), **kv_opts)
            return out

        plain()
        us = float("nan") if args.dry_run else graph_time_us(plain, replays=args.replays, calls=1) / n
        rows.append(dict(layer=layer["name"], seqs=seqs, ctx=ctx, candidate="no-rebuild (K!=V path, same bytes)",
                         us=us, gbps=per_layer / us / 1e3 if us == us else None))
    if args.qk and not layer["k_eq_v"]:  # last: its kernels write the new keys and values into the caches
        rows += qk_rows(layer, seqs, ctx, caches, tables, q, seq_lens, opts, n, per_layer, cands[0][1], args)
    return rows


def qk_rows(layer, seqs, ctx, caches, tables, q, seq_lens, opts, n, per_layer, pol, args) -> list[dict]:
    """--qk: the engine's launch with the decode's QK work inside (see the module's docstring); outputs compared
    with the write-back form's (the forms are bitwise equal; the timing-only row writes nothing, but runs after
    the others have written the new keys and values into every cache, so it reads them too)."""
    g = torch.Generator(device=q.device).manual_seed(seqs * 11 + ctx)
    kv, d = layer["kv_heads"], layer["head_dim"]
    k_new, v_new = (torch.randn(seqs, kv, d, device=q.device, dtype=q.dtype, generator=g) for _ in range(2))
    w = (1.0 + 0.2 * torch.randn(d, device=q.device, generator=g)).to(q.dtype)
    last = seq_lens.long() - 1
    slots = tables.long().gather(1, (last // PAGE)[:, None])[:, 0] * PAGE + last % PAGE
    inv = rope_inv_freq(d, 10000.0).to(q.device)
    rows, ref = [], None
    for name, back, write in (("qk write-back (default)", True, True), ("qk in-register (=1)", False, True),
                              ("qk write-back, no new row (timing)", True, False)):
        qk = PA.DecodeQK(k_new, v_new, last, inv, w, w, slots if write else torch.full_like(slots, -1), 1e-6, True,
                         torch.empty_like(q) if back else None)
        row, out = timed_row(dict(layer=layer["name"], seqs=seqs, ctx=ctx, candidate=name), pol, caches, n, per_layer,
                             ref, args, lambda c, qk=qk: PA.paged_decode(q, c, tables, seq_lens, policy=pol, qk=qk,
                                                                         **opts))
        rows.append(row)
        ref = out if ref is None else ref
    if args.qk_sweep:  # the write-back form at other splits and tiles: its per-program prologue favours fewer splits?
        R = dataclasses.replace
        qk = PA.DecodeQK(k_new, v_new, last, inv, w, w, slots, 1e-6, True, torch.empty_like(q))
        grid = [(n_, wp, bn) for n_ in (2, 4, 8, 16, 32) for wp in (4, 8) for bn in (32, 64)]
        for n_, wp, bn in grid[:2] if args.dry_run else grid:
            p = R(pol, num_splits=n_, num_warps=wp, block_n=bn)
            if p == pol:
                continue
            rows.append(timed_row(dict(layer=layer["name"], seqs=seqs, ctx=ctx,
                                       candidate=f"qk write-back: splits={n_} w={wp} bn={bn}"), p, caches, n, per_layer,
                                  ref, args, lambda c, p=p: PA.paged_decode(q, c, tables, seq_lens, policy=p, qk=qk,
                                                                            **opts))[0])
    return rows


def rot_rows(cache: torch.Tensor, opts: dict, rot: int, per_seq: int) -> torch.Tensor:
    """The cache as the engine keeps it with AttentionSpec.rot_keys: rows [v | k1 | k2] with the keys of the first
    rot dims of each half rotated at each slot's position (one sequence's pages in order), as the value view."""
    from types import SimpleNamespace

    from compiled_llm.ops.attention import keys_from_values

    _, blocks, page, kv, d = cache.shape
    full = torch.empty(1, blocks, page, kv, d + 2 * rot, dtype=cache.dtype, device=cache.device)
    full[..., :d] = cache
    pos = ((torch.arange(blocks, device=cache.device) % per_seq)[:, None] * page
           + torch.arange(page, device=cache.device)[None, :]).reshape(-1)
    src = SimpleNamespace(k_norm_weight=opts["k_norm_weight"], inv_freq=opts["inv_freq"])
    keys = keys_from_values(cache[0].reshape(-1, kv, d), pos, src).view(blocks, page, kv, d)
    full[0, ..., d:d + rot] = keys[..., :rot]
    full[0, ..., d + rot:] = keys[..., d // 2:d // 2 + rot]
    return full[..., :d]


def rot_keys_rows(layer, seqs, ctx, caches, tables, q, seq_lens, opts, n, per_layer, ref, args) -> list[dict]:
    """(global) The rows keeping the rotated keys (AttentionSpec.rot_keys): the engine's launch reading them
    instead of rebuilding, and (unless --no-sweep) other tiles, as the kernel needs fewer registers then."""
    R = dataclasses.replace
    rot = PA.rotated_block(layer["rotated_pairs"], layer["head_dim"] // 2)
    rcaches = [rot_rows(c, opts, rot, triton.cdiv(ctx, PAGE)) for c in caches]
    # the launch the engine gives these rows (rot_keys: its own tiles), not the rebuilding layer's (until session 34
    # this row timed the rebuilding layer's launch over the kept keys, so "engine" read 43 us at 4 x 8.5K where the
    # engine takes the 40-us row of the sweep)
    base = PA.attention_launch_policy(seqs, args.max_len, layer["head_dim"], num_kv_heads=layer["kv_heads"],
                                      k_eq_v=True, rotated_pairs=layer["rotated_pairs"], rot_keys=True)
    cands = [("rot keys cached: engine", base)]
    grid = [(n_, w, st, bn) for n_ in (8, 16, 32, 64) for w in (4, 8) for st in (2, 3) for bn in (32, 64)]
    if args.no_sweep:
        grid = [(base.num_splits, 4, 3, 32), (base.num_splits, 4, 2, 64), (base.num_splits, 8, 2, 64),
                (max(1, base.num_splits // 2), 4, 2, 64)]
    for n_, w, st, bn in grid:
        p = R(base, num_splits=n_, num_warps=w, num_stages=st, block_n=bn)
        if p != base:
            cands.append((f"rot keys cached: splits={n_} w={w} st={st} bn={bn}", p))
    rows = []
    for name, pol in cands[:3] if args.dry_run else cands:
        rows.append(timed_row(dict(layer=layer["name"], seqs=seqs, ctx=ctx, candidate=name), pol, rcaches, n,
                              per_layer * (1 + 2 * rot / layer["head_dim"]), ref, args,
                              lambda c, pol=pol: PA.paged_decode(q, c, tables, seq_lens, policy=pol, rot_keys=rot,
                                                                 rotated_pairs=layer["rotated_pairs"], **opts),
                              rotated_pairs=layer["rotated_pairs"], rot_keys=rot)[0])
    return rows


def timed_row(head: dict, pol, caches, n: int, nbytes: float, ref, args, launch, **fields) -> tuple[dict, object]:
    """One candidate: launch(cache) over every cache in a CUDA graph, per launch; its row (or the error: a candidate
    that does not build is reported, not fatal) and its output (None on an error), compared with ref."""
    def call():
        for c in caches:
            out = launch(c)
        return out

    try:
        out = launch(caches[0])
        diff = 0.0 if ref is None else (out.float() - ref.float()).abs().max().item()
        us = float("nan") if args.dry_run else graph_time_us(call, replays=args.replays, calls=1) / n
    except Exception as e:
        return dict(head, error=f"{type(e).__name__}: {e}"[:200]), None
    return dict(head, us=us, max_diff=diff, gbps=nbytes / us / 1e3 if us == us else None, splits=pol.num_splits,
                warps=pol.num_warps, stages=pol.num_stages, block_n=pol.block_n, **fields), out


def flashinfer_rows(layer, seqs, ctx, caches, tables, q, opts, n, per_layer, ref, args) -> list[dict]:
    """FlashInfer's paged decode (issue 14 item 3) on the same caches, when it is installed: the CUDA-core
    kernel and the tensor-core one, each given the window's pages only (what the engine keeps) and the window
    as window_left; compared with our kernel's output. Built on first use by FlashInfer's JIT (nvcc)."""
    try:
        import flashinfer
    except ImportError:
        return []
    dev = q.device
    w = layer["window"]
    first_page = max(0, ctx - w) // PAGE if w is not None else 0
    pages = tables.shape[1] - first_page
    indptr = torch.arange(seqs + 1, dtype=torch.int32, device=dev) * pages
    indices = tables[:, first_page:].reshape(-1).contiguous()
    last = torch.full((seqs,), (ctx - 1) % PAGE + 1, dtype=torch.int32, device=dev)
    rows = []
    for tensor_cores in (False, True):
        name = f"flashinfer {flashinfer.__version__} ({'tensor' if tensor_cores else 'CUDA'} cores)"
        try:
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                torch.empty(128 << 20, dtype=torch.uint8, device=dev), "NHD", use_cuda_graph=True,
                use_tensor_cores=tensor_cores, paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last)
            wrapper.plan(indptr, indices, last, q.shape[1], layer["kv_heads"], layer["head_dim"], PAGE,
                         window_left=-1 if w is None else w - 1, q_data_type=q.dtype, kv_data_type=q.dtype,
                         sm_scale=opts["scale"])

            def call(wrapper=wrapper):
                for c in caches:
                    out = wrapper.run(q, (c[0], c[1]))
                return out

            out = wrapper.run(q, (caches[0][0], caches[0][1]))
            diff = (out.float() - ref.float()).abs().max().item()
            us = graph_time_us(call, replays=args.replays, calls=1) / n
            rows.append(dict(layer=layer["name"], seqs=seqs, ctx=ctx, candidate=name, us=us, max_diff=diff,
                             gbps=per_layer / us / 1e3))
        except Exception as e:  # noqa: BLE001 - reported, not fatal (a JIT build or an API difference)
            rows.append(dict(layer=layer["name"], seqs=seqs, ctx=ctx, candidate=name,
                             error=f"{type(e).__name__}: {e}"[:300]))
    return rows


@triton.jit(do_not_specialize=["num_splits", "window"])
def _stream_kernel(K, V, BlockTables, SeqLens, Out, stride_kb, stride_ks, stride_kh, stride_bt, window, num_splits,
                   per_seq, W1: tl.constexpr, W2: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                   SLIDING: tl.constexpr, TWO: tl.constexpr, PAGED: tl.constexpr):
    """Program (seq, KV head, split) walks the key range the decode kernel's program of the same ids reads and
    loads the same rows (W1 elements, then W2 more; V too where TWO), summed by a dot with a block of ones (so
    Triton pipelines the loads through shared memory as the attention's dots make it do); no scores, no softmax,
    no partial outputs. PAGED: each key's page from the block table, as the kernel does; else computed (the
    benchmark's tables hold one sequence's pages in order, so the addresses are the same without the lookup)."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    start, end = PA.split_range(SeqLens, seq, split, window, num_splits, BLOCK_N, SLIDING)
    n = tl.arange(0, BLOCK_N)
    d1 = tl.arange(0, W1)
    bt_row = BlockTables + seq.to(tl.int64) * stride_bt
    ones = tl.full([16, BLOCK_N], 1.0, K.dtype.element_ty)
    acc = tl.zeros([16, W1], tl.float32)
    if W2 > 0:
        d2 = tl.arange(0, W2)
        acc2 = tl.zeros([16, W2], tl.float32)
    for kstart in range(start, end, BLOCK_N):
        pos = kstart + n
        pmask = pos < end
        if PAGED:
            page = tl.load(bt_row + pos // PAGE, mask=pmask, other=0).to(tl.int64)
        else:
            page = (seq * per_seq + pos // PAGE).to(tl.int64)
        row = page * stride_kb + (pos % PAGE) * stride_ks + kvh * stride_kh
        acc += tl.dot(ones, tl.load(K + row[:, None] + d1[None, :], mask=pmask[:, None], other=0.0))
        if TWO:
            acc += tl.dot(ones, tl.load(V + row[:, None] + d1[None, :], mask=pmask[:, None], other=0.0))
        if W2 > 0:
            acc2 += tl.dot(ones, tl.load(K + row[:, None] + W1 + d2[None, :], mask=pmask[:, None], other=0.0))
    total = tl.sum(tl.sum(acc, 1), 0)
    if W2 > 0:
        total += tl.sum(tl.sum(acc2, 1), 0)
    tl.store(Out + (seq * tl.num_programs(1) + kvh) * tl.num_programs(2) + split, total)


@triton.jit(do_not_specialize=["num_splits"])
def _ladder_kernel(Q, K, V, KNorm, BlockTables, SeqLens, MidO, MidLse, Out, stride_qs, stride_qh, stride_kb,
                   stride_ks, stride_kh, stride_bt, stride_ms, stride_mh, stride_ls, stride_lh, scale, window,
                   num_splits, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr,
                   BLOCK_N: tl.constexpr, SLIDING: tl.constexpr, LEVEL: tl.constexpr, ROT: tl.constexpr = 0):
    """--ladder: the decode kernel's program (seq, KV head, split) rebuilt one piece at a time, at its grid, tiles
    and loads (each half of K and V a [BLOCK_N, HALF] load through the block table). ROT > 0: a global K=V layer's
    rows that keep their rotated keys ([v | k1 | k2], AttentionSpec.rot_keys), read as the kernel reads them: the
    values' halves, then ROT rotated key dims of each half; the query times k_norm_weight on the other dims.
    LEVEL 0: the loads only, summed by dots with a block of ones ([BLOCK_H, BLOCK_N], the scores' shape);
    1: + the query and the scores (QK^T of both halves; their maximum kept); 2: + the online softmax (its sums kept);
    3: + the PV products (the whole loop); 4: + the partial results' stores (the engine's kernel; MidO/MidLse as
    its split launch writes them). Levels 0-3 store one number a program, so nothing they compute is dropped."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    start, end = PA.split_range(SeqLens, seq, split, window, num_splits, BLOCK_N, SLIDING)
    h = tl.arange(0, BLOCK_H)
    hmask = h < GROUP
    head = kvh * GROUP + h
    d = tl.arange(0, HALF)
    n = tl.arange(0, BLOCK_N)
    bt_row = BlockTables + seq.to(tl.int64) * stride_bt
    q_ptr = Q + seq * stride_qs + head[:, None] * stride_qh + d[None, :]
    q1 = tl.load(q_ptr, mask=hmask[:, None], other=0.0)
    q2 = tl.load(q_ptr + HALF, mask=hmask[:, None], other=0.0)
    if ROT > 0:
        r = tl.arange(0, ROT)
        plain = d >= ROT
        w1 = tl.load(KNorm + d, mask=plain, other=0.0).to(tl.float32)
        w2 = tl.load(KNorm + HALF + d, mask=plain, other=0.0).to(tl.float32)
        q1 = (q1.to(tl.float32) * w1[None, :]).to(q1.dtype)
        q2 = (q2.to(tl.float32) * w2[None, :]).to(q2.dtype)
        qr_ptr = Q + seq * stride_qs + head[:, None] * stride_qh + r[None, :]
        q1r = tl.load(qr_ptr, mask=hmask[:, None], other=0.0)
        q2r = tl.load(qr_ptr + HALF, mask=hmask[:, None], other=0.0)
        accr = tl.zeros([BLOCK_H, ROT], tl.float32)
    ones = tl.full([BLOCK_H, BLOCK_N], 1.0, K.dtype.element_ty)
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc1 = tl.zeros([BLOCK_H, HALF], tl.float32)
    acc2 = tl.zeros([BLOCK_H, HALF], tl.float32)
    for kstart in range(start, end, BLOCK_N):
        pos = kstart + n
        pmask = pos < end
        page = tl.load(bt_row + pos // PAGE, mask=pmask, other=0).to(tl.int64)
        off = page[:, None] * stride_kb + ((pos % PAGE) * stride_ks + kvh * stride_kh)[:, None] + d[None, :]
        v1 = tl.load(V + off, mask=pmask[:, None], other=0.0)
        v2 = tl.load(V + off + HALF, mask=pmask[:, None], other=0.0)
        if ROT > 0:
            roff = page[:, None] * stride_kb + ((pos % PAGE) * stride_ks + kvh * stride_kh)[:, None] + r[None, :]
            k1r = tl.load(V + roff + 2 * HALF, mask=pmask[:, None], other=0.0)
            k2r = tl.load(V + roff + 2 * HALF + ROT, mask=pmask[:, None], other=0.0)
        else:
            k1 = tl.load(K + off, mask=pmask[:, None], other=0.0)
            k2 = tl.load(K + off + HALF, mask=pmask[:, None], other=0.0)
        if LEVEL == 0:
            if ROT > 0:
                acc1 += tl.dot(ones, v1)
                acc2 += tl.dot(ones, v2)
                accr += tl.dot(ones, k1r) + tl.dot(ones, k2r)
            else:
                acc1 += tl.dot(ones, k1) + tl.dot(ones, v1)
                acc2 += tl.dot(ones, k2) + tl.dot(ones, v2)
        else:
            if ROT > 0:
                qk = tl.dot(q1, tl.trans(v1)) + tl.dot(q2, tl.trans(v2))
                qk += tl.dot(q1r, tl.trans(k1r))
                qk += tl.dot(q2r, tl.trans(k2r))
            else:
                qk = tl.dot(q1, tl.trans(k1)) + tl.dot(q2, tl.trans(k2))
            s = qk * (scale * 1.4426950408889634)
            s = tl.where(pmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            if LEVEL == 1:
                acc1 += tl.dot(ones, v1)
                acc2 += tl.dot(ones, v2)
            else:
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                if LEVEL == 2:
                    acc1 = acc1 * alpha[:, None] + tl.dot(ones, v1)
                    acc2 = acc2 * alpha[:, None] + tl.dot(ones, v2)
                else:
                    pv = p.to(v1.dtype)
                    acc1 = acc1 * alpha[:, None] + tl.dot(pv, v1)
                    acc2 = acc2 * alpha[:, None] + tl.dot(pv, v2)
            m_i = m_new
    if LEVEL < 4:
        total = tl.sum(tl.sum(acc1, 1) + tl.sum(acc2, 1), 0) + tl.sum(tl.where(hmask, m_i + l_i, 0.0), 0)
        if ROT > 0:
            total += tl.sum(tl.sum(accr, 1), 0)
        tl.store(Out + (seq * tl.num_programs(1) + kvh) * tl.num_programs(2) + split, total)
    else:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o_ptr = MidO + seq * stride_ms + head[:, None] * stride_mh + split * (2 * HALF) + d[None, :]
        tl.store(o_ptr, acc1 / l_safe[:, None], mask=hmask[:, None])
        tl.store(o_ptr + HALF, acc2 / l_safe[:, None], mask=hmask[:, None])
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(MidLse + seq * stride_ls + head * stride_lh + split, lse, mask=hmask)


def ladder_rows(layer, seqs, ctx, caches, tables, q, seq_lens, opts, n, per_layer, ref, args) -> list[dict]:
    """--ladder: _ladder_kernel at each level, at the engine launch's grid and tiles (a K=V layer: over the rows
    keeping their rotated keys, at the engine's launch for them); the top level's partial results, merged by the
    engine's combine, equal the engine's output (checked)."""
    d, kv = layer["head_dim"], layer["kv_heads"]
    rot = 0
    if layer["k_eq_v"]:
        rot = PA.rotated_block(layer["rotated_pairs"], d // 2)
        caches = [rot_rows(c, opts, rot, triton.cdiv(ctx, PAGE)) for c in caches]
        pol = PA.attention_launch_policy(seqs, args.max_len, d, num_kv_heads=kv, k_eq_v=True,
                                         rotated_pairs=layer["rotated_pairs"], rot_keys=True)
        ref = PA.paged_decode(q, caches[0], tables, seq_lens, policy=pol, rot_keys=rot,
                              rotated_pairs=layer["rotated_pairs"], **opts)
        per_layer = per_layer * (1 + 2 * rot / d)
    else:
        pol = candidates(layer, seqs, args.max_len, None)[0][1]
    heads = q.shape[1]
    group = heads // kv
    splits = pol.num_splits
    mid_o = torch.empty(seqs, heads, splits, d, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(seqs, heads, splits, dtype=torch.float32, device=q.device)
    out = torch.empty(seqs * kv * splits, dtype=torch.float32, device=q.device)
    names = ["loads only", "+ scores", "+ softmax", "+ PV products", "+ partial stores (the engine's kernel)"]
    rows = []
    for level, name in enumerate(names):
        def launch(c, level=level):
            k, v = c[0], c[-1]
            _ladder_kernel[(seqs, kv, splits)](
                q, k, v, opts.get("k_norm_weight", q), tables, seq_lens, mid_o, mid_lse, out, q.stride(0), q.stride(1),
                k.stride(0), k.stride(1),
                k.stride(2), tables.stride(0), mid_o.stride(0), mid_o.stride(1), mid_lse.stride(0),
                mid_lse.stride(1), float(opts["scale"]), int(layer["window"] or 0), splits, GROUP=group,
                BLOCK_H=max(16, triton.next_power_of_2(group)), HALF=d // 2, PAGE=PAGE, BLOCK_N=pol.block_n,
                SLIDING=layer["window"] is not None, LEVEL=level, ROT=rot, num_warps=pol.num_warps,
                num_stages=pol.num_stages)
            return out

        launch(caches[0])
        diff = None
        if level == 4:  # the engine's combine over these partial results: the engine's output
            got = PA.combine_splits(mid_o, mid_lse, torch.empty_like(ref))
            diff = (got.float() - ref.float()).abs().max().item()
            assert diff < 2e-2, ("ladder top level against the engine", diff)
        us = float("nan") if args.dry_run else graph_time_us(lambda: [launch(c) for c in caches][-1],
                                                            replays=args.replays, calls=1) / n
        rows.append(dict(layer=layer["name"], seqs=seqs, ctx=ctx, candidate=f"ladder {level}: {name}", us=us,
                         gbps=per_layer / us / 1e3 if us == us else None, splits=splits, warps=pol.num_warps,
                         stages=pol.num_stages, block_n=pol.block_n, **({} if diff is None else dict(max_diff=diff))))
    return rows


def stream_rows(layer, seqs, ctx, caches, tables, seq_lens, opts, n, per_layer, args) -> list[dict]:
    """--stream: the bytes the engine's launch reads, streamed by _stream_kernel at the same grid and tiles (no
    combine launch), through the block table and without it: the access pattern's own bandwidth, against which
    the attention's time is judged."""
    pol = candidates(layer, seqs, args.max_len, None)[0][1]
    d, kv, rot = layer["head_dim"], layer["kv_heads"], 0
    if layer["k_eq_v"] and layer.get("rotated_pairs"):  # the rows as the engine keeps them: [v | k1 | k2]
        rot = PA.rotated_block(layer["rotated_pairs"], d // 2)
        views = [rot_rows(c, opts, rot, triton.cdiv(ctx, PAGE))[0] for c in caches]
        ks = [(v, v) for v in views]
    else:
        ks = [(c[0], c[1] if not layer["k_eq_v"] else c[0]) for c in caches]
    two = not layer["k_eq_v"]
    nbytes = per_layer * (1 + 2 * rot / d)
    per_seq = tables.shape[1]
    out = torch.empty(seqs * kv * pol.num_splits, dtype=torch.float32, device=tables.device)
    rows = []
    for paged in (True, False):
        def launch(pair, paged=paged):
            k, v = pair
            _stream_kernel[(seqs, kv, pol.num_splits)](
                k, v, tables, seq_lens, out, k.stride(0), k.stride(1), k.stride(2), tables.stride(0),
                int(layer["window"] or 0), pol.num_splits, per_seq, W1=d, W2=2 * rot, PAGE=PAGE, BLOCK_N=pol.block_n,
                SLIDING=layer["window"] is not None, TWO=two, PAGED=paged, num_warps=pol.num_warps,
                num_stages=pol.num_stages)
            return out

        launch(ks[0])
        first = out.clone()
        # the stream's sums cover exactly the rows the attention reads: every program's key range, both tensors
        # (and the kept keys after each value), each row 16 times (the block of ones)
        lo = max(0, ctx - layer["window"]) if layer["window"] else 0
        k0, v0 = ks[0]
        k0 = torch.as_strided(k0, (*k0.shape[:-1], d + 2 * rot), k0.stride())  # the whole row
        ref = 0.0
        for s_ in range(seqs):
            pages = tables[s_].long()
            ref += 16 * float(k0[pages].reshape(-1, kv, d + 2 * rot)[lo:ctx].float().sum())
            if two:
                ref += 16 * float(v0[pages].reshape(-1, kv, d)[lo:ctx].float().sum())
        got = float(first.sum())
        assert abs(got - ref) <= 1e-2 * (abs(ref) + float(first.abs().sum()) + 1.0), (paged, got, ref)
        us = float("nan") if args.dry_run else graph_time_us(lambda: [launch(p) for p in ks][-1], replays=args.replays,
                                                            calls=1) / n
        rows.append(dict(layer=layer["name"], seqs=seqs, ctx=ctx, us=us, gbps=nbytes / us / 1e3 if us == us else None,
                         candidate=f"stream ({'block table' if paged else 'pages computed'}, engine grid)",
                         splits=pol.num_splits, warps=pol.num_warps, stages=pol.num_stages, block_n=pol.block_n))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-len", type=int, default=131072, help="the engine's block-table bound (tokens)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-sweep", action="store_true", help="only the engine's launch (and, global, the key-rebuild comparisons)")
    ap.add_argument("--layers", default="sliding,global", help="of sliding, global, qwen_full")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--stream", action="store_true", help="also stream the engine launch's bytes without the "
                    "attention (the access pattern's bandwidth), through the block table and without it")
    ap.add_argument("--ladder", action="store_true", help="the decode kernel rebuilt one piece at a time "
                    "(loads, scores, softmax, PV, partial stores) at the engine's grid: where its time over the stream goes")
    ap.add_argument("--qk", action="store_true", help="the sliding layers' decode with its QK-norm + RoPE + KV "
                    "write inside: both forms, and without the new row (timing only)")
    ap.add_argument("--qk-sweep", action="store_true", help="with --qk: the write-back form at other split counts, "
                    "warps and key tiles (the engine's stages)")
    ap.add_argument("--cases", default=None, help="seqs x context pairs, e.g. 4x8500,8x1100 (default: all five)")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev, dtype = ("cpu", torch.float32) if args.dry_run else ("cuda", torch.bfloat16)
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")] if args.cases else CASES
    layers = [lay for lay in (SLIDING, GLOBAL, QWEN_FULL) if lay["name"] in args.layers.split(",")]
    if args.dry_run:  # tiny shapes, the same code paths
        layers = [dict(SLIDING, kv_heads=2, head_dim=32, window=24),
                  dict(GLOBAL, kv_heads=1, head_dim=64, rotated_pairs=8)]
        cases = [(1, 40), (2, 70)]
        args.max_len = 256
    t0 = time.time()
    rows = []
    for layer in layers:
        for seqs, ctx in cases:
            rows += run_case(layer, seqs, ctx, args, dev, dtype)
            best = min((r for r in rows if r["layer"] == layer["name"] and r["seqs"] == seqs and r["ctx"] == ctx
                        and r.get("us") == r.get("us") and "us" in r and "rebuild" not in r["candidate"]
                        and not r["candidate"].startswith(("stream", "ladder", "qk"))),
                       key=lambda r: r["us"], default=None)
            for r in rows:
                if r["layer"] == layer["name"] and r["seqs"] == seqs and r["ctx"] == ctx and \
                        (r["candidate"] in ("engine", "every key rebuilt (session 12)", "rot keys cached: engine")
                         or r is best
                         or "rebuild" in r["candidate"] or "flashinfer" in r["candidate"] or "error" in r
                         or r["candidate"].startswith(("qk", "stream", "ladder"))):
                    print(f"{r['layer']:8} S={seqs} ctx={ctx:5}  {r['candidate']:36} "
                          + (f"{r['us']:8.2f} us  {r['gbps'] or 0:7.0f} GB/s  diff {r.get('max_diff') or 0:.1e}"
                             if "us" in r else r["error"]) + ("  <- best" if r is best else ""), flush=True)
    print(f"done in {time.time() - t0:.0f}s")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(date=time.strftime("%Y-%m-%d %H:%M"), device=(
            torch.cuda.get_device_name() if dev == "cuda" else "cpu"), max_len=args.max_len, rows=rows), indent=1))


if __name__ == "__main__":
    main()
