"""Gemma 4 router on the GPU: the two-kernel path (logits + top-k, what decode ran through session 7) against
the one-launch fused kernel (decode sizes), at the 26B-A4B shape (E 128, H 2816, k 8, bf16), with CUDA-graph
replays (launch gaps do not count). Every configuration is first checked against the exact math
(ops/moe.py `ref_router_topk` in float64 on the same bf16 inputs): the fused kernel's ids must equal the exact
ids (its products are float32-grade), its weights within 1e-4; the two-kernel path rounds the normed row to
bf16, so it is reported (ids equal to exact, worst pick margin in logits) but not failed. Also checked: two
launches give bitwise-equal results, and the fused kernel's ticket counters are zero after graph replays.
--sweep also times the fused kernel's other tile shapes (block_e, splits, block_h, warps, stages), to pick
router_launch's defaults from. --parts times the fused kernel's stages instead (RouterLaunch.parts: the slice
dots and partial stores; + the ticket; + the last program's sums; everything), for Gemma 4's normed
router or, with --softmax, Qwen3.5's (no norm, no scales; e.g. --experts 256 --hidden 2048 --softmax); with
--sweep, the whole launch at other slices, expert blocks, warps and token blocks, each one's picks checked
against the default's.

    python3 benchmarks/router_kernel.py [--tokens 1,8,32,64] [--sweep | --parts [--softmax]]
                                        [--out results/router_kernel.json]
    TRITON_INTERPRET=1 python3 benchmarks/router_kernel.py --smoke --experts 32 --hidden 256 --tokens 1,3 --sweep

Exit status 1 if a correctness check failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from benchmarks.graph_timing import kernel_timer  # noqa: E402
from benchmarks.moe_kernels import graph_time_us  # noqa: E402
from compiled_llm.ops.moe import ref_router_topk  # noqa: E402
from compiled_llm.ops.triton import moe as M  # noqa: E402
from compiled_llm.ops.triton._common import TICKETS  # noqa: E402

PARTS_SWEEP = [dict(block_e=be, splits=s, num_warps=nw) for s in (1, 2, 4, 8) for be in (8, 16, 32) for nw in (4, 8)]
# token blocks smaller than the batch: several last programs, each picking for fewer rows (each block reads the
# whole weight again, mostly from L2), at the policy's other tiles and at 4 warps
TOKEN_BLOCKS = (1, 2, 4)
SWEEP = [dict(block_e=be, splits=s, block_h=bh, num_warps=nw, num_stages=ns)
         for be in (16, 32) for s in (4, 6, 11, 22) for bh in (64, 128) for nw in (4, 8) for ns in (2, 3)]


def check(x, w, scale, pes, k, launch, exact_w, exact_ids, logits) -> dict:
    w1, ids1 = M.fused_router_topk(x, scale, w, pes, k, 1e-6, launch=launch)
    w2, ids2 = M.fused_router_topk(x, scale, w, pes, k, 1e-6, launch=launch)
    if x.is_cuda:
        torch.cuda.synchronize()
    top = logits.topk(k, dim=-1).values
    margin = float((top - logits.gather(1, ids1.long())).max())
    same = (ids1.long() == exact_ids).all(1)
    wdiff = float((w1.double() - exact_w).abs()[same].max()) if bool(same.any()) else float("nan")
    r = dict(ids_equal_exact=round(float(same.float().mean()), 4), worst_pick_margin=margin, w_maxdiff=wdiff,
             bitwise_repeat=bool(torch.equal(w1, w2) and torch.equal(ids1, ids2)))
    r["ok"] = r["bitwise_repeat"] and (not launch.fused or (r["ids_equal_exact"] == 1.0 and wdiff < 1e-4))
    return r, (w1, ids1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,32,64")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2816)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--parts", action="store_true")
    ap.add_argument("--softmax", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="--parts on the CPU under TRITON_INTERPRET=1 (a dry run)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.smoke:
        return parts(a, "cpu", kernel_timer(True))
    if a.parts:
        return parts(a)
    dev, dt = torch.device("cuda"), torch.bfloat16
    E, H, k = a.experts, a.hidden, a.top_k
    g = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(E, H, device=dev, dtype=dt, generator=g)
    scale = (torch.rand(H, device=dev, generator=g) + 0.5).to(dt)
    pes = (torch.rand(E, device=dev, generator=g) + 0.5).to(dt)
    rows, failed = [], False
    for T in (int(t) for t in a.tokens.split(",")):
        x = (torch.randn(T, H, device=dev, generator=g) * 3).to(dt)
        exact_w, exact_ids = ref_router_topk(x.double(), w.double(), scale.double(), pes.double(), k, 1e-6, H ** -0.5)
        xd = x.double()
        logits = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * scale.double() * H ** -0.5) @ w.double().t()
        bf_w, bf_ids = ref_router_topk(x, w, scale, pes, k, 1e-6, H ** -0.5)  # the model's own bf16 run
        base = {"tokens": T, "model_bf16_ids_equal_exact": round(float((bf_ids == exact_ids).all(1).float().mean()), 4)}
        launches = [("two_kernel", M.router_launch(T, H, E, fused=False))]
        if T <= M.ROUTER_FUSED_MAX_TOKENS or a.sweep:
            launches.append(("fused_default", M.router_launch(T, H, E, fused=True)))
        if a.sweep:
            launches += [(f"fused {c}", M.router_launch(T, H, E, fused=True, **c)) for c in SWEEP]
        for name, lp in launches:
            row = dict(base, path=name, launch=dataclasses.asdict(lp))
            try:
                checks, (w1, ids1) = check(x, w, scale, pes, k, lp, exact_w, exact_ids, logits)
                row.update(checks)
                row["us"] = round(graph_time_us(lambda: M.fused_router_topk(x, scale, w, pes, k, 1e-6, launch=lp)), 2)
                torch.cuda.synchronize()
                if lp.fused:
                    row["tickets_clean"] = int(TICKETS[("router", x.device)].abs().sum()) == 0
                    w3, ids3 = M.fused_router_topk(x, scale, w, pes, k, 1e-6, launch=lp)  # after 500+ replays
                    row["after_replays_equal"] = bool(torch.equal(w3, w1) and torch.equal(ids3, ids1))
                    row["ok"] = row["ok"] and row["tickets_clean"] and row["after_replays_equal"]
            except Exception as exc:  # a sweep shape that does not compile (e.g. registers) is reported, not fatal
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
            failed |= not row["ok"] and (name in ("two_kernel", "fused_default"))
            rows.append(row)
            print(json.dumps(row, default=str), flush=True)
    print("\nsummary (us per router call, CUDA-graph replay):")
    for T in sorted({r["tokens"] for r in rows}):
        rs = [r for r in rows if r["tokens"] == T and "us" in r and r["ok"]]
        old = next((r["us"] for r in rs if r["path"] == "two_kernel"), None)
        new = next((r["us"] for r in rs if r["path"] == "fused_default"), None)
        best = min((r for r in rs if r["path"].startswith("fused")), key=lambda r: r["us"], default=None)
        print(f"  T={T}: two-kernel {old}  fused default {new}  best fused {best and best['us']} "
              f"({best and best['path']})")
    if a.out:
        Path(a.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                           "shape": dict(E=E, H=H, k=k), "rows": rows}, indent=1, default=str))
    print("FAILED" if failed else "all checks passed")
    return 1 if failed else 0


def parts(a, dev: str = "cuda", time_us=graph_time_us) -> int:
    """The fused launch's stages, each timed as its own build (CUDA-graph replay): where its microseconds go.
    (dev, time_us: a dry run under the Triton interpreter.)"""
    dev, dt = torch.device(dev), torch.bfloat16
    E, H, k = a.experts, a.hidden, a.top_k
    g = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(E, H, device=dev, dtype=dt, generator=g)
    scale = None if a.softmax else (torch.rand(H, device=dev, generator=g) + 0.5).to(dt)
    pes = None if a.softmax else (torch.rand(E, device=dev, generator=g) + 0.5).to(dt)
    eps = 0.0 if a.softmax else 1e-6
    names = ["partial stores", "+ ticket", "+ sums", "all (top-k, stores)"]
    rows, failed = [], False
    staged = "parts" in {f.name for f in dataclasses.fields(M.RouterLaunch)}  # (an older tree: the whole launch)
    for T in (int(t) for t in a.tokens.split(",")):
        x = (torch.randn(T, H, device=dev, generator=g) * 3).to(dt)
        base = M.router_launch(T, H, E, norm=not a.softmax)
        want = M.fused_router_topk(x, scale, w, pes, k, eps)
        runs = ([(n, names[n], dataclasses.replace(base, parts=n)) for n in range(4)] if staged
                else [(3, names[3], base)])
        if a.sweep:  # the whole launch at other tiles: fewer hidden slices leave the last program fewer partials
            runs += [(3, f"all {c}", M.router_launch(T, H, E, norm=not a.softmax, **c)) for c in PARTS_SWEEP]
            runs += [(3, f"all {c}", M.router_launch(T, H, E, norm=not a.softmax, **c))
                     for bt in TOKEN_BLOCKS if bt < base.block_t and bt < T
                     for c in (dict(block_t=bt), dict(block_t=bt, num_warps=4))]
        for n, stage, lp in runs:
            try:
                got = M.fused_router_topk(x, scale, w, pes, k, eps, launch=lp)
                us = time_us(lambda: M.fused_router_topk(x, scale, w, pes, k, eps, launch=lp))
            except Exception as exc:  # a tile that does not compile is reported, not fatal
                rows.append(dict(tokens=T, stage=stage, error=f"{type(exc).__name__}: {exc}"[:200]))
                print(json.dumps(rows[-1]), flush=True)
                continue
            row = dict(tokens=T, parts=n, stage=stage, us=round(us, 2), launch=dataclasses.asdict(lp),
                       tickets_clean=int(TICKETS[("router", x.device)].abs().sum()) == 0)
            if n == 3:  # the default's picks; other tiles sum the slices in another order (weights within 1e-5)
                row["ids_equal_default"] = bool(torch.equal(got[1], want[1]))
                row["w_maxdiff_default"] = float((got[0].float() - want[0].float()).abs().max())
                ok = row["ids_equal_default"] and row["w_maxdiff_default"] <= (0.0 if lp == base else 1e-5)
                failed |= not ok and lp == base
                row["ok"] = ok
            failed |= not row["tickets_clean"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\nstages (us, CUDA-graph replay), E {E} H {H} k {k} {'softmax' if a.softmax else 'normed'} router:")
    for T in sorted({r["tokens"] for r in rows}):
        print(f"  T={T}: " + "  ".join(f"{r['stage']} {r['us']}" for r in rows
                                         if r["tokens"] == T and r["stage"] in names))
        tiles = [r for r in rows if r["tokens"] == T and r.get("ok") and r["stage"] not in names]
        if tiles:
            best = min(tiles, key=lambda r: r["us"])
            print(f"        best other tile {best['us']} us: {best['stage']}")
    if a.out:
        Path(a.out).write_text(json.dumps({"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                                           "torch": torch.__version__,
                                           "shape": dict(E=E, H=H, k=k, softmax=a.softmax), "rows": rows}, indent=1))
    print("FAILED" if failed else "all checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
