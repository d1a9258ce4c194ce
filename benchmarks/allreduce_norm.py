"""All-reduce + RMSNorm at decode sizes on 2+ GPUs of one host: NCCL's all-reduce then the Triton norm,
torch's symmetric-memory one-shot all-reduce then the norm, and the fused Triton kernel
(ops/triton/allreduce_norm.py). Each is captured in a CUDA graph of `--calls` back-to-back calls (as a
decode step replays them) and timed per call; the fused output is checked against the NCCL path and
across ranks (every rank must hold the same bits).

    python benchmarks/allreduce_norm.py --world 2 --hidden 2816 --rows 1,8,16,32,64 --out results/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from graph_timing import graph_time_us  # noqa: E402


def timed_graph(fn, calls: int, replays: int) -> float:
    return graph_time_us(fn, replays, calls, before=dist.barrier)


def worker(rank: int, args) -> None:
    from torch.distributed._symmetric_memory import empty as symm_empty
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group, rendezvous

    from compiled_llm.ops.triton.allreduce_norm import launch, setup
    from compiled_llm.ops.triton.norm import rms_norm

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=args.world, init_method=f"tcp://127.0.0.1:{args.port}",
                            device_id=torch.device("cuda", rank))
    group = dist.group.WORLD.group_name
    dtype, d, eps = torch.bfloat16, args.hidden, 1e-6
    ws = setup(group, args.world, d, dtype, torch.device("cuda", rank))
    try:
        enable_symm_mem_for_group(group)
    except Exception:  # noqa: BLE001 (torch >= 2.11 enables every group itself)
        pass
    rows_list = [int(r) for r in args.rows.split(",")]
    sym = symm_empty(max(rows_list), d, dtype=dtype, device="cuda")
    rendezvous(sym, group)
    w = (1 + 0.3 * torch.randn(d, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7))).to(dtype)
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)  # each rank its own partial sums
    variants = [(v.split(":") + ["1"])[:3] for v in args.variants.split(",")]  # barriers, warps, rows a program
    out = {"world": args.world, "hidden": d, "dtype": str(dtype), "capacity": ws.capacity, "rows": {}}
    for m in rows_list:
        x = torch.randn(m, d, device="cuda", generator=g).to(dtype)

        def nccl():
            y = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", group))
            return rms_norm(y, w, eps)

        def one_shot():
            y = torch.ops.symm_mem.one_shot_all_reduce_copy(sym[:m], x, "sum", group)
            return rms_norm(y, w, eps)

        def fused():
            return launch(x, w, eps, ws)

        ref = nccl()
        row = {"nccl_then_norm_us": round(timed_graph(nccl, args.calls, args.replays), 2)}
        try:
            row["one_shot_then_norm_us"] = round(timed_graph(one_shot, args.calls, args.replays), 2)
        except Exception as e:  # noqa: BLE001 (reported, the others still run)
            row["one_shot_then_norm_us"] = f"failed: {type(e).__name__}: {e}"[:200]
        for double, warps, per_program in variants:
            ws.double, ws.num_warps, ws.rows_per_program = double == "double", int(warps), int(per_program)
            name = f"fused_{double}_w{warps}_r{per_program}"
            got = fused()
            for _ in range(200):  # many calls back to back: the flags and halves must stay in step
                again = fused()
            torch.cuda.synchronize()
            gathered = [torch.empty_like(got) for _ in range(args.world)]
            dist.all_gather(gathered, got)
            us = timed_graph(fused, args.calls, args.replays)
            row[name] = {"us": round(us, 2), "max_abs_diff_vs_nccl": float((got.float() - ref.float()).abs().max()),
                         "ranks_equal": all(torch.equal(gathered[0], t) for t in gathered),
                         "repeat_equal": bool(torch.equal(got, again)),
                         "speedup_vs_nccl_then_norm": round(row["nccl_then_norm_us"] / us, 2)}
        out["rows"][m] = row
        if rank == 0:
            print(m, json.dumps(row), flush=True)
    if rank == 0 and args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2816)
    ap.add_argument("--rows", default="1,8,16,32,64")
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--port", type=int, default=29533)
    ap.add_argument("--variants", default="single:16,double:16,double:8,double:4,double:8:4,single:8:4",
                    help="fused kernel variants, barriers:warps[:rows a program] (single: two barriers a call; "
                         "double: two buffer halves, one barrier)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if torch.cuda.device_count() < args.world:
        raise SystemExit(f"needs {args.world} GPUs, this machine has {torch.cuda.device_count()}")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    mp.spawn(worker, args=(args,), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
