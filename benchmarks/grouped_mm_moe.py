"""The routed experts at prefill sizes: our Triton grouped kernels (`fused_moe`, one gate/up kernel that gathers
the token rows and applies GEGLU in its epilogue, one down kernel that applies the routing weight) against torch's
grouped GEMM (`torch._grouped_mm`, CUTLASS on sm_90) around an explicit sort, gather and activation.

    python3 benchmarks/grouped_mm_moe.py [--config gemma|qwen] [--tokens 1024,4096,8192,16384] [--out F.json]

Each variant returns every pick's weighted output [T, k, H] (what `moe_start` hands to the join), is checked
against ours, and is timed with CUDA-graph replays. `gemms only` times the two grouped GEMMs on rows already
sorted: what torch's kernels would cost if the sort, gather and scatter were free. The last columns split ours
into its two kernels and time torch's grouped GEMM for the down projection alone, on our padded layout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from compiled_llm.ops.triton import moe as M  # noqa: E402

SHAPES = {"gemma": dict(E=128, H=2816, I=704, k=8, act="gelu"), "qwen": dict(E=256, H=2048, I=512, k=8, act="silu")}


def grouped_mm_moe(x, gate_up, down, wts, ids, act: str, parts: dict | None = None):
    """[T, k, H]: each pick's weighted expert output, through torch._grouped_mm."""
    T, k = ids.shape
    E, two_i, _ = gate_up.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat)
    ends = torch.searchsorted(flat[order].contiguous(), torch.arange(E, device=x.device, dtype=flat.dtype),
                              right=True).to(torch.int32)
    xs = x.index_select(0, order // k)
    h = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=ends)
    g, u = h[:, : two_i // 2], h[:, two_i // 2:]
    a = (F.gelu(g, approximate="tanh") if act == "gelu" else F.silu(g)) * u
    y = torch._grouped_mm(a, down.transpose(1, 2), offs=ends)
    y = y * wts.reshape(-1)[order, None].to(y.dtype)
    out = torch.empty_like(y)
    out[order] = y
    if parts is not None:
        parts.update(xs=xs, a=a, ends=ends)
    return out.view(T, k, -1)


def kernel_times_us(fn, calls: int = 5) -> dict:
    """Mean GPU time of each kernel fn launches, by name (torch.profiler)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.key] = round(e.device_time_total / calls, 1)
    return out


def down_alone(x, gate_up, down, wts, ids, act: str, graph_time_us) -> dict:
    """The down projection alone: ours (the kernel's share of fused_moe, profiled) against torch's grouped GEMM
    over the same expert-sorted, padded rows (segment ends as its offsets), which the weights would then go
    with into the join's sum: what keeping our gather-fused gate/up kernel and swapping only the down one saves."""
    T, k = ids.shape
    E, two_i, _ = gate_up.shape
    pol = M.moe_launch_policy(T, k, E, x.shape[1], two_i // 2)
    times = kernel_times_us(lambda: M.fused_moe(x, gate_up, down, wts, ids, sum_slots=False,
                                                activation="gelu_tanh" if act == "gelu" else "silu"))
    sorted_ids, expert_ids, num_padded = M.moe_align(ids, E, pol.block_m)
    counts = torch.zeros(E, dtype=torch.int64, device=x.device)
    used = expert_ids[expert_ids >= 0].long()
    counts.scatter_add_(0, used, torch.full_like(used, pol.block_m))
    ends = counts.cumsum(0).to(torch.int32)
    rows = int(ends[-1])
    a = torch.randn(rows, two_i // 2, device=x.device).to(x.dtype)
    theirs = graph_time_us(lambda: torch._grouped_mm(a, down.transpose(1, 2), offs=ends), replays=10, calls=3)
    # the down kernel is _down_kernel, or _down_persistent_kernel past 256 pairs an expert (MoELaunch.persistent)
    down_us = [us for name, us in times.items() if name.startswith("_down") and name.endswith("kernel")]
    return {"ours_gate_up_kernel_us": times.get("_gate_up_kernel"),
            "ours_down_kernel_us": sum(down_us) if down_us else None, "ours_down_persistent": pol.persistent > 0,
            "down_grouped_mm_us": round(theirs, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=sorted(SHAPES), default="gemma")
    ap.add_argument("--tokens", default="1024,4096,8192,16384")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from graph_timing import graph_time_us

    S = SHAPES[a.config]
    E, H, I, k = S["E"], S["H"], S["I"], S["k"]
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(1)
    gate_up = (torch.randn(E, 2 * I, H, device=dev, generator=g) * H ** -0.5).to(dt)
    down = (torch.randn(E, H, I, device=dev, generator=g) * I ** -0.5).to(dt)
    rows = []
    for T in [int(t) for t in a.tokens.split(",")]:
        x = torch.randn(T, H, device=dev, generator=g).to(dt)
        ids = torch.rand(T, E, device=dev, generator=g).topk(k, dim=-1).indices.to(torch.int32)
        wts = torch.softmax(torch.randn(T, k, device=dev, generator=g), -1)
        ours = lambda: M.fused_moe(x, gate_up, down, wts, ids, activation="gelu_tanh" if S["act"] == "gelu" else "silu",
                                   sum_slots=False)
        parts: dict = {}
        theirs = lambda: grouped_mm_moe(x, gate_up, down, wts, ids, S["act"])
        ref = ours().float()
        got = grouped_mm_moe(x, gate_up, down, wts, ids, S["act"], parts).float()
        diff = float((got - ref).abs().max() / ref.abs().max())
        xs, act, ends = parts["xs"], parts["a"], parts["ends"]
        gemms = lambda: (torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=ends),
                         torch._grouped_mm(act, down.transpose(1, 2), offs=ends))
        flops = 2.0 * T * k * 3 * I * H
        row = {"tokens": T, "rel_diff": round(diff, 5)}
        for name, fn in (("ours", ours), ("grouped_mm", theirs), ("gemms_only", gemms)):
            us = graph_time_us(fn, replays=10, calls=3)
            row[name + "_us"] = round(us, 1)
            row[name + "_tflops"] = round(flops / us / 1e6, 1)
        row.update(down_alone(x, gate_up, down, wts, ids, S["act"], graph_time_us))
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"{'tokens':>7} {'ours us':>9} {'TF/s':>6} {'grouped_mm':>11} {'TF/s':>6} {'gemms only':>11} {'TF/s':>6} "
          f"{'our gate/up':>11} {'our down':>9} {'their down':>10} diff")
    for r in rows:
        print(f"{r['tokens']:>7} {r['ours_us']:>9} {r['ours_tflops']:>6} {r['grouped_mm_us']:>11} "
              f"{r['grouped_mm_tflops']:>6} {r['gemms_only_us']:>11} {r['gemms_only_tflops']:>6} "
              f"{r['ours_gate_up_kernel_us']!s:>11} {r['ours_down_kernel_us']!s:>9} {r['down_grouped_mm_us']:>10} "
              f"{r['rel_diff']}")
    if a.out:
        Path(a.out).write_text(json.dumps({"config": a.config, "device": torch.cuda.get_device_name(), "rows": rows},
                                          indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
