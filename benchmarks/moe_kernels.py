"""Micro-benchmark of the MoE kernels at a released config's shapes (default Gemma 4 26B-A4B): router + top-k,
expert alignment and the whole fused GEGLU MoE, per batch size, with CUDA-graph replays (so launch gaps do
not count). --old FILE: a copy of an earlier ops/triton/moe.py to time and check against (same outputs).

    python3 benchmarks/moe_kernels.py [--tokens 1,8,64,512,2048] [--old benchmarks/_old_moe.py] [--out F.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from compiled_llm.ops.triton import moe as new  # noqa: E402
from graph_timing import graph_time_us  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,32,64,512,2048,8192")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2816)
    ap.add_argument("--inter", type=int, default=704)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--old", default=None)
    ap.add_argument("--unsorted", action="store_true", help="1-2 tokens: pairs left unsorted against aligned")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    old = None
    if a.old:
        spec = importlib.util.spec_from_file_location("old_moe", a.old)
        old = importlib.util.module_from_spec(spec)
        sys.modules["old_moe"] = old
        spec.loader.exec_module(old)
    dev, dt = torch.device("cuda"), torch.bfloat16
    E, H, I, k = a.experts, a.hidden, a.inter, a.top_k
    g = torch.Generator(device=dev).manual_seed(0)
    w_router = torch.randn(E, H, device=dev, dtype=dt, generator=g)
    scale = torch.rand(H, device=dev, dtype=dt, generator=g) + 0.5
    pes = torch.rand(E, device=dev, dtype=dt, generator=g) + 0.5
    gate_up = torch.randn(E, 2 * I, H, device=dev, dtype=dt, generator=g) * H ** -0.5
    down = torch.randn(E, H, I, device=dev, dtype=dt, generator=g) * I ** -0.5
    rows = []
    for T in (int(t) for t in a.tokens.split(",")):
        x = torch.randn(T, H, device=dev, dtype=dt, generator=g)
        w, ids = new.fused_router_topk(x, scale, w_router, pes, k, 1e-6)
        row = {"tokens": T, "router_splits": new.router_launch(T, H, E).splits}
        row["router_us"] = graph_time_us(lambda: new.fused_router_topk(x, scale, w_router, pes, k, 1e-6))
        bm = new.moe_launch_policy(T, k, E, H, I).block_m
        row["align_us"] = graph_time_us(lambda: new.moe_align(ids, E, bm))
        if T * k >= 1024:  # the three alignments (moe_align picks by align_kind), the parallel one checked too
            row["align_program_us"] = graph_time_us(lambda: new.moe_align_program(ids, E, bm))
            row["align_sorted_us"] = graph_time_us(lambda: new.moe_align_sorted(ids, E, bm))
            par, srt = new.moe_align_parallel(ids, E, bm), new.moe_align_sorted(ids, E, bm)
            row["align_parallel_us"] = graph_time_us(lambda: new.moe_align_parallel(ids, E, bm))
            row["align_parallel_equal"] = all(torch.equal(x, y) for x, y in zip(par, srt))
        row["moe_us"] = graph_time_us(lambda: new.fused_geglu_moe(x, gate_up, down, w, ids))
        distinct = int(torch.unique(ids).numel())
        row["experts_read"] = distinct
        row["moe_GBps"] = round(distinct * 3 * I * H * 2 / (row["moe_us"] * 1e-6) / 1e9, 0)
        if a.unsorted and T <= 2:  # pairs left unsorted (one block each, no alignment launch) vs aligned
            aligned = new.MoELaunch(16, 32, 128, 4, 4, 64, 128, 4, 4)
            unsorted = new.MoELaunch(16, 32, 128, 4, 4, 64, 128, 4, 4, unsorted=True)
            y_a = new.fused_geglu_moe(x, gate_up, down, w, ids, policy=aligned)
            y_u = new.fused_geglu_moe(x, gate_up, down, w, ids, policy=unsorted)
            row["aligned_us"] = graph_time_us(lambda: new.fused_geglu_moe(x, gate_up, down, w, ids, policy=aligned))
            row["unsorted_us"] = graph_time_us(lambda: new.fused_geglu_moe(x, gate_up, down, w, ids, policy=unsorted))
            row["unsorted_equal"] = bool(torch.equal(y_a, y_u))
        if old is not None:
            w0, ids0 = old.fused_router_topk(x, scale, w_router, pes, k, 1e-6)
            row["router_ids_equal"] = bool(torch.equal(ids0, ids))
            row["router_w_maxdiff"] = float((w0 - w).abs().max())
            row["old_router_us"] = graph_time_us(lambda: old.fused_router_topk(x, scale, w_router, pes, k, 1e-6))
            row["old_align_us"] = graph_time_us(lambda: old.moe_align(ids, E, bm))
            y0 = old.fused_geglu_moe(x, gate_up, down, w, ids)
            y1 = new.fused_geglu_moe(x, gate_up, down, w, ids)
            row["moe_maxdiff"] = float((y0.float() - y1.float()).abs().max())
            row["old_moe_us"] = graph_time_us(lambda: old.fused_geglu_moe(x, gate_up, down, w, ids))
        rows.append({k2: (round(v, 2) if isinstance(v, float) else v) for k2, v in row.items()})
        print(json.dumps(rows[-1]), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                           "shape": dict(E=E, H=H, I=I, k=k), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
