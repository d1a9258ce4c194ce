"""Prefill-sized kernel sweep at a released config's shapes (default Gemma 4 26B-A4B): the router's two-kernel
path, the grouped GEGLU MoE (gate/up and down tiles swept one kernel at a time) and paged prefill attention
(sliding d256 and global d512 K=V), at the token counts of the throughput shapes' prefill steps. Each
candidate is timed with CUDA-graph replays and checked against the policy's own output (router: the picked
ids; MoE and attention: the largest difference relative to the output's scale). The table says what the
policy picks and the best candidate, with achieved TFLOP/s.

    python3 benchmarks/prefill_kernels.py [--tokens 1024,8192] [--groups router,moe,attention] [--out F.json]
    TRITON_INTERPRET=1 python3 benchmarks/prefill_kernels.py --smoke   # a CPU dry run at toy shapes
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from compiled_llm.ops.rope import rope_inv_freq  # noqa: E402
from compiled_llm.ops.triton import moe as M  # noqa: E402
from compiled_llm.ops.triton import paged_attention as PA  # noqa: E402
from graph_timing import kernel_timer  # noqa: E402

SHAPES = {  # 26B-A4B; smoke: toy sizes for the interpreter
    "full": dict(E=128, H=2816, I=704, k=8, HQ=16, page=16,
                 sliding=dict(kv_heads=8, head_dim=256, window=1024, k_eq_v=False),
                 glob=dict(kv_heads=2, head_dim=512, window=None, k_eq_v=True)),
    "qwen": dict(E=256, H=2048, I=512, k=8, softmax=True),  # Qwen3.5 35B-A3B's router and experts (no attention)
    "smoke": dict(E=16, H=64, I=32, k=4, HQ=4, page=16,
                  sliding=dict(kv_heads=2, head_dim=32, window=24, k_eq_v=False),
                  glob=dict(kv_heads=1, head_dim=64, window=None, k_eq_v=True)),
}


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


SHARD: tuple[int, int] | None = None  # --compile-shard i/n: build every n-th candidate (from i), time nothing
_COUNT = [0]


def sweep(name: str, T: int, cands: list, run, check, flops: float, time_fn, rows: list) -> None:
    """cands[0] is the policy's choice; run(c) calls the kernel(s) with candidate c; check(out) -> (ok, detail)."""
    if SHARD is not None:  # fill Triton's cache from several processes, so that the timed run only loads kernels
        for c in cands:
            _COUNT[0] += 1
            if _COUNT[0] % SHARD[1] == SHARD[0]:
                try:
                    run(c)
                except Exception:  # reported by the timed run
                    pass
        return
    ref = run(cands[0])
    for i, c in enumerate(cands):
        row = dict(group=name, tokens=T, cand=dataclasses.asdict(c) if dataclasses.is_dataclass(c) else c,
                   default=i == 0)
        try:
            ok, detail = check(run(c), ref)
            row.update(ok=ok, check=detail)
            if ok:
                row["us"] = round(time_fn(lambda: run(c)), 2)
                row["TFLOPs"] = round(flops / (row["us"] * 1e-6) / 1e12, 1)
        except Exception as exc:  # a tile that does not build (registers, shared memory) is reported, not fatal
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:200])
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)


def router_group(S, T, dev, dt, time_fn, rows, smoke):
    E, H, k = S["E"], S["H"], S["k"]
    g = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(T, H, device=dev, generator=g) * 3).to(dt)
    w = torch.randn(E, H, device=dev, generator=g).to(dt)
    scale = None if S.get("softmax") else (torch.rand(H, device=dev, generator=g) + 0.5).to(dt)
    pes = None if S.get("softmax") else (torch.rand(E, device=dev, generator=g) + 0.5).to(dt)
    p0 = M.router_launch(T, H, E, norm=not S.get("softmax"))
    cands = [p0]
    prefill_one = p0.fused and T > M.ROUTER_FUSED_MAX_TOKENS  # Gemma 4's one-launch router at prefill sizes
    if prefill_one:  # its slices, warps and row blocks, and the two-kernel path it replaced
        cands.append(M.router_launch(T, H, E, fused=False))
        for bt, sp, nw in itertools.product((32, 64) if not smoke else (16,), (1, 2, 4, 8, 16), (4, 8)):
            cands.append(M.router_launch(T, H, E, fused=True, block_t=bt, splits=sp, num_warps=nw))
        grid_t = ()
    elif p0.fused:  # decode sizes: the one-launch kernel's tiles
        for be, sp, bh, nw, ns in itertools.product((16, 32), (4, 8, 16), (64, 128), (4, 8), (2, 3)):
            cands.append(M.router_launch(T, H, E, fused=True, block_e=be, splits=sp, block_h=bh, num_warps=nw,
                                         num_stages=ns))
        if T <= 8:  # token blocks of T rows (up to 8): less of the last program's softmax and top-k work
            for bt, be, sp, nw in itertools.product(sorted({triton.next_power_of_2(T), 8}), (16, 32), (4, 8), (4, 8)):
                cands.append(M.router_launch(T, H, E, fused=True, block_e=be, splits=sp, num_warps=nw, block_t=bt))
        grid_t = ()
    else:
        grid_t = (32, 64, 128) if not smoke else (16,)
    for bt, be, bh, nw, ns in itertools.product(grid_t, (128,) if not smoke else (16,), (64, 128) if not smoke
                                                else (32,), (4, 8), (2, 3) if not smoke else (2,)):
        n, sh = M._slices(H, 1, bh)
        cands.append(M.RouterLaunch(False, bt, min(be, max(16, E)), bh, n, sh, nw, ns))

    def run(c):
        return M.fused_router_topk(x, scale, w, pes, k, 1e-6, launch=c)

    def check(out, ref):
        same = float((out[1] == ref[1]).all(1).float().mean())
        return same >= 0.99, f"ids equal the policy's for {same:.4f} of rows"

    sweep("router", T, cands, run, check, 2.0 * T * H * E, time_fn, rows)


def moe_group(S, T, dev, dt, time_fn, rows, smoke, order_only=False, tma_only=False, persistent_only=False,
              half_tail_only=False):
    E, H, I, k = S["E"], S["H"], S["I"], S["k"]
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(T, H, device=dev, generator=g).to(dt)
    gate_up = (torch.randn(E, 2 * I, H, device=dev, generator=g) * H ** -0.5).to(dt)
    down = (torch.randn(E, H, I, device=dev, generator=g) * I ** -0.5).to(dt)
    ids = torch.rand(T, E, device=dev, generator=g).topk(k, dim=-1).indices.to(torch.int32)
    wts = torch.softmax(torch.randn(T, k, device=dev, generator=g), -1)
    p0 = M.moe_launch_policy(T, k, E, H, I)
    R = dataclasses.replace
    cands = [p0]
    if half_tail_only:  # MoELaunch.half_tail: the policy's (TMA) tiles with and without half-height tail blocks
        base = R(p0, tma=True, half_tail=False)
        cands = [base, R(base, half_tail=True)]
    elif persistent_only:  # MoELaunch.persistent: the policy's down tiles (with TMA) a program a tile and persistent
        base = R(p0, tma=True, persistent=0)
        cands = [base] + [R(base, persistent=n) for n in (1, 2)]
        cands += [R(base, persistent=1, b_block_n=384 - base.b_block_n), R(base, persistent=1, b_stages=4),
                  R(base, persistent=1, b_block_k=128, b_stages=2)]
    elif tma_only:  # MoELaunch.tma against the same tiles without it, and larger tiles that TMA may afford
        base = R(p0, tma=True)
        cands = [p0, R(p0, tma=not p0.tma)]
        cands += [R(base, a_block_n=128), R(base, a_block_k=128, a_stages=3), R(base, b_block_k=128),
                  R(base, a_stages=4), R(base, b_stages=4), R(base, a_warps=4 if base.a_warps == 8 else 8),
                  R(base, b_warps=4 if base.b_warps == 8 else 8), R(base, block_m=128, a_warps=8, b_warps=8)]
    elif order_only:  # the launch order alone (MoELaunch.n_fast), and larger column tiles in each order
        for fast in (p0.n_fast, not p0.n_fast):
            cands += [R(p0, n_fast=fast), R(p0, n_fast=fast, a_block_n=128), R(p0, n_fast=fast, b_block_n=256)]
    elif smoke:
        cands += [R(p0, block_m=32, a_block_n=16, a_block_k=32), R(p0, b_block_n=32, b_block_k=32)]
    elif T * k <= 2 * E:  # decode sizes: weight-streaming tiles
        for bn, bk, nw, ns in itertools.product((16, 32, 64), (64, 128, 256), (2, 4), (3, 4, 5)):
            cands.append(R(p0, a_block_n=bn, a_block_k=bk, a_warps=nw, a_stages=ns))
        for bn, bk, nw, ns in itertools.product((32, 64, 128), (64, 128, 256), (2, 4), (3, 4)):
            cands.append(R(p0, b_block_n=bn, b_block_k=bk, b_warps=nw, b_stages=ns))
    else:
        for bm in (64, 128):
            for bn, bk, nw, ns in itertools.product((64, 128), (64, 128), (4, 8), (3, 4)):
                cands.append(R(p0, block_m=bm, a_block_n=bn, a_block_k=bk, a_warps=nw, a_stages=ns))
            for bn, bk, nw, ns in itertools.product((64, 128, 256), (64, 128), (4, 8), (3, 4)):
                cands.append(R(p0, block_m=bm, b_block_n=bn, b_block_k=bk, b_warps=nw, b_stages=ns))
    cands = list(dict.fromkeys(cands))

    def run(c):
        return M.fused_geglu_moe(x, gate_up, down, wts, ids, policy=c)

    def check(out, ref):
        d = rel_diff(out, ref)
        return d < 2e-2, f"max diff / max |y| {d:.2e}"

    sweep("moe", T, cands, run, check, 2.0 * T * k * 3 * I * H, time_fn, rows)


def attention_case(S, layer, lens, dev, dt, seed):
    """A paged bf16 cache (blocks in shuffled order) holding whole prompts that are prefilled in one step."""
    g = torch.Generator(device=dev).manual_seed(seed)
    page, d, kvh = S["page"], layer["head_dim"], layer["kv_heads"]
    nblk = [-(-L // page) for L in lens]
    perm = torch.randperm(sum(nblk), device=dev, generator=g).int()
    bt = torch.zeros(len(lens), max(nblk), dtype=torch.int32, device=dev)
    off = 0
    for i, n in enumerate(nblk):
        bt[i, :n] = perm[off:off + n]
        off += n
    cache = torch.randn(1 if layer["k_eq_v"] else 2, sum(nblk), page, kvh, d, device=dev, generator=g).to(dt)
    q = torch.randn(sum(lens), S["HQ"], d, device=dev, generator=g).to(dt)
    qsl = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=dev)
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    opts = dict(scale=d ** -0.5, sliding_window=layer["window"], k_eq_v=layer["k_eq_v"], num_kv_heads=kvh, head_dim=d)
    if layer["k_eq_v"]:
        opts["k_norm_weight"] = (1.0 + 0.2 * torch.randn(d, device=dev, generator=g)).to(dt)
        opts["inv_freq"] = rope_inv_freq(d, 1e6, "proportional", partial_rotary_factor=0.25).to(dev)
    W = layer["window"]
    pairs = sum(sum(min(p + 1, W or p + 1) for p in range(L)) for L in lens)
    return (q, cache, bt, qsl, sl), opts, 4.0 * S["HQ"] * d * pairs


def flashinfer_prefill(S, layer, args, opts, backend):
    """FlashInfer's paged prefill (issue 14 item 3) on the same cache and block tables: planned once here (the
    engine would plan once a step for all layers of a kind), returns the call to time. K and V are the cache's
    two [blocks, page, kv_heads, head_dim] halves (NHD); the window as window_left = W - 1 (a query at p sees
    p - W < j <= p). Built on first use by FlashInfer's JIT (nvcc)."""
    import flashinfer

    q, cache, bt, qsl, sl = args
    page = S["page"]
    nblk = (sl + page - 1) // page
    indptr = torch.zeros(len(sl) + 1, dtype=torch.int32, device=q.device)
    indptr[1:] = torch.cumsum(nblk, 0)
    indices = torch.cat([bt[i, :int(n)] for i, n in enumerate(nblk.tolist())]).contiguous()
    last = ((sl - 1) % page + 1).int()
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device=q.device),
                                                      "NHD", backend=backend)
    window = opts["sliding_window"]
    w.plan(qsl, indptr, indices, last, q.shape[1], layer["kv_heads"], layer["head_dim"], page, causal=True,
           window_left=-1 if window is None else window - 1, q_data_type=q.dtype, kv_data_type=q.dtype,
           sm_scale=opts["scale"])
    k, v = cache[0], cache[1]
    return lambda: w.run(q, (k, v))


def attention_group(S, lens, dev, dt, time_fn, rows, smoke, quick=False, extra=False, tma=False):
    R = dataclasses.replace
    for kind in ("glob",) if tma else ("sliding", "glob"):
        layer = S[kind]
        args, opts, flops = attention_case(S, layer, lens, dev, dt, seed=2)
        p0 = PA.attention_launch_policy(len(lens), 0, layer["head_dim"], prefill=True)
        cands = [p0, R(p0, interior=not p0.interior)]  # the interior tiles without masks, and every tile masked
        calls = {}
        if tma:  # the K=V layer's Gluon kernel (AttnLaunch.gluon), and the Triton tiles through TMA or the registers
            split = PA.PREFILL_D512_TMA
            cands = [p0, split, R(split, tma=False), PA.PREFILL_D512,
                     PA.AttnLaunch(block_m=64, block_n=32, num_warps=4, num_stages=3, split_d=True, tma=True)]
            if p0.gluon:  # its 32-key two-stage tile
                cands.append(R(p0, block_n=32, num_stages=2))
        elif extra:  # one stage for the unsplit d512 tiles (never swept: two stages do not fit), and FlashInfer
            cands = [p0]
            if layer["head_dim"] >= 512:
                cands += [PA.AttnLaunch(block_m=64, block_n=bn, num_warps=8, num_stages=1) for bn in (32, 64)]
                cands += [R(p0, block_n=32, num_stages=3)]
            elif not smoke and (SHARD is None or SHARD[0] == 0):  # one builder process: FlashInfer's JIT
                for backend in ("fa2", "fa3"):
                    try:
                        calls[f"flashinfer {backend}"] = flashinfer_prefill(S, layer, args, opts, backend)
                    except Exception as exc:  # not installed, or no build for this shape: reported
                        rows.append(dict(group=f"attention {kind}", tokens=f"{len(lens)}x{lens[0]}",
                                         cand=f"flashinfer {backend}", default=False, ok=False,
                                         error=f"{type(exc).__name__}: {exc}"[:300]))
                        print(json.dumps(rows[-1]), flush=True)
                cands += list(calls)
        elif smoke and not quick:
            cands += [R(p0, block_m=32, block_n=16), R(p0, num_warps=4), R(p0, split_d=True)]
        elif not quick:
            bns = (16, 32, 64) if layer["head_dim"] >= 512 else (32, 64, 128)
            for bm, bn, nw, ns in itertools.product((64, 128), bns, (4, 8), (2, 3)):
                cands.append(PA.AttnLaunch(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns))
            if layer["head_dim"] >= 512:  # one program per output half: half the accumulator, twice the QK^T
                for bm, bn, nw, ns in itertools.product((64, 128), (32, 64), (4, 8), (1, 2, 3)):
                    cands.append(PA.AttnLaunch(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns, split_d=True))
        cands = list(dict.fromkeys(cands))

        def run(c):
            return calls[c]() if isinstance(c, str) else PA.paged_prefill(*args, policy=c, **opts)

        def check(out, ref):
            d = rel_diff(out, ref)
            return d < 2e-2, f"max diff / max |o| {d:.2e}"

        sweep(f"attention {'global d512 K=V' if kind == 'glob' else 'sliding d256'}",
              f"{len(lens)}x{lens[0]}", cands, run, check, flops, time_fn, rows)


def summary(rows: list) -> list[str]:
    out = []
    for key in dict.fromkeys((r["group"], str(r["tokens"])) for r in rows):
        rs = [r for r in rows if (r["group"], str(r["tokens"])) == key and r.get("us")]
        if not rs:
            continue
        d = next((r for r in rs if r["default"]), None)
        b = min(rs, key=lambda r: r["us"])
        out.append(f"{key[0]:<28} T={key[1]:<8} policy {d and d['us']} us ({d and d['TFLOPs']} TFLOP/s)  "
                   f"best {b['us']} us ({b['TFLOPs']} TFLOP/s) {json.dumps(b['cand'])}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1024,8192", help="router and MoE token counts")
    ap.add_argument("--attention", default="1x8192,8x1024", help="prompts x length, prefilled in one step")
    ap.add_argument("--groups", default="router,moe,attention")
    ap.add_argument("--smoke", action="store_true", help="toy shapes (for TRITON_INTERPRET=1 on the CPU)")
    ap.add_argument("--qwen", action="store_true", help="Qwen3.5 35B-A3B's router and MoE shapes (no attention)")
    ap.add_argument("--compile-shard", default=None, help="i/n: only build every n-th candidate (parallel warm-up)")
    ap.add_argument("--moe-order", action="store_true",
                    help="MoE: only the launch order (MoELaunch.n_fast) and two larger column tiles in each order")
    ap.add_argument("--moe-tma", action="store_true",
                    help="MoE: the policy's tiles with and without TMA (MoELaunch.tma), and a few TMA tiles")
    ap.add_argument("--moe-persistent", action="store_true",
                    help="MoE: the policy's TMA down tiles a program a tile against persistent programs (MoELaunch.persistent)")
    ap.add_argument("--moe-half-tail", action="store_true",
                    help="MoE: the policy's TMA tiles against the same with half-height tail blocks (MoELaunch.half_tail)")
    ap.add_argument("--attn-quick", action="store_true",
                    help="attention: the policy's launch and the same with every key tile masked (no sweep)")
    ap.add_argument("--attn-tma", action="store_true",
                    help="attention: the d512 K=V layer's tiles with and without TMA (AttnLaunch.tma)")
    ap.add_argument("--attn-extra", action="store_true",
                    help="attention: the policy, one-stage unsplit d512 tiles, and FlashInfer's paged prefill (sliding)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    global SHARD
    if a.compile_shard:
        i, n = (int(v) for v in a.compile_shard.split("/"))
        SHARD = (i, n)
    S = SHAPES["smoke" if a.smoke else "qwen" if a.qwen else "full"]
    dev = torch.device("cpu" if a.smoke and not torch.cuda.is_available() else "cuda")
    dt = torch.bfloat16
    # (--smoke: 24 tokens unless --tokens names others, e.g. 100 for the router's prefill launch)
    tokens = [24] if a.smoke and a.tokens == ap.get_default("tokens") else [int(t) for t in a.tokens.split(",")]
    att = [[40, 40]] if a.smoke else [[int(L)] * int(n) for n, L in (s.split("x") for s in a.attention.split(","))]
    time_fn, rows, groups = kernel_timer(a.smoke, calls=5), [], a.groups.split(",")
    for T in tokens:
        if "router" in groups:
            router_group(S, T, dev, dt, time_fn, rows, a.smoke)
        if "moe" in groups:
            moe_group(S, T, dev, dt, time_fn, rows, a.smoke, a.moe_order, a.moe_tma, a.moe_persistent, a.moe_half_tail)
    if "attention" in groups and "glob" in S:
        for lens in att:
            attention_group(S, lens, dev, dt, time_fn, rows, a.smoke, a.attn_quick, a.attn_extra, a.attn_tma)
    if SHARD is not None:
        return 0
    lines = summary(rows)
    print("\nsummary (CUDA-graph replay, us a call):\n" + "\n".join(lines))
    bad = [r for r in rows if r["default"] and not r.get("ok")]
    if a.out:
        Path(a.out).write_text(json.dumps({"device": str(dev) if a.smoke else torch.cuda.get_device_name(),
                                           "torch": torch.__version__, "rows": rows, "summary": lines}, indent=1,
                                          default=str))
    print("FAILED: the policy's own launch" if bad else "ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
