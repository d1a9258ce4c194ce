"""Programmatic dependent launch (PDL) on a decode step's dense chain, on the GPU (issue 14; an experiment, not
engine code).

A decode step at batch 1-8 is ~550 kernels; the dense projections (62% of copy bandwidth at 26B-A4B) each
spend their first microseconds ramping up their weight stream. With PDL a kernel may launch while the one
before it finishes: it waits (griddepcontrol.wait) before reading anything the previous kernel writes, but
the weights do not depend on it, so a GEMM can ask L2 for its weight slice first. Session 13 measured
Inductor's own PDL (TORCHINDUCTOR_ENABLE_PDL=1) end to end: no gain, as only Inductor's kernels took part.
This times the same chain four ways, 30 layers of Gemma 4 26B-A4B's dense shapes, each layer

    norm (x -> 2816) -> qkv GEMM (8192 x 2816) -> rows (-> 4096) -> o GEMM (2816 x 4096)
    -> norm (-> 2816) -> gate_up GEMM (4224 x 2816) -> rows (-> 2112) -> down GEMM (2816 x 2112)

where "norm"/"rows" is a small Triton RMS-norm over the first columns (the step's small kernels), captured in
one CUDA graph with distinct weights per layer (3.1 GB, read from HBM):

  cublas        torch.mm for the GEMMs (what the compiled graph runs), the small kernels plain
  triton        ops/triton/skinny_gemm.py for the GEMMs, the small kernels plain
  pdl           every kernel launched with PDL: waits first, lets the next launch after its loads
  pdl+prefetch  pdl, and each GEMM prefetches its weight slice into L2 before its wait

The triton variants' outputs must be bitwise equal (PDL changes when, not what); cublas is compared within
bf16 rounding. Prints per-step and per-layer microseconds and the weights' floor at 4.2 TB/s.

    python3 benchmarks/pdl_chain.py [--tokens 1,8] [--layers 30] [--out FILE.json]
    python3 benchmarks/pdl_chain.py --dry-run     # CPU, Triton interpreter, tiny shapes, no PDL variants
"""

from __future__ import annotations

import argparse
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
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.graph_timing import graph_time_us  # noqa: E402
from compiled_llm.ops.triton.skinny_gemm import (  # noqa: E402
    TARGET_PROGRAMS_PER_SM, SkinnyLaunch, skinny_launch, skinny_mm)

H, QKV, O_IN, GU, DOWN_IN = 2816, 8192, 4096, 4224, 2112  # 26B-A4B sliding layer, TP 1
COPY_BW = 4.2e12


@triton.jit
def _rows_kernel(X, Y, n_out, stride_x, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # y[m, :n_out] = rmsnorm(x[m, :n_out]) (the step's small kernels); PDL: wait first, release after loads
    if PDL:
        gdc_wait()
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    mask = c < n_out
    x = tl.load(X + row.to(tl.int64) * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    if PDL:
        gdc_launch_dependents()
    r = tl.rsqrt(tl.sum(x * x, 0) / n_out + eps)
    tl.store(Y + row.to(tl.int64) * n_out + c, (x * r).to(Y.dtype.element_ty), mask=mask)


def rows(x: torch.Tensor, n_out: int, pdl: bool) -> torch.Tensor:
    y = torch.empty(x.shape[0], n_out, dtype=x.dtype, device=x.device)
    _rows_kernel[(x.shape[0],)](x, y, n_out, x.stride(0), 1e-6, BLOCK=triton.next_power_of_2(n_out), PDL=pdl,
                                num_warps=4, **({"launch_pdl": True} if pdl else {}))
    return y


def make_layers(n: int, dev, dtype, scale: float = 0.02):
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = [(QKV, H), (H, O_IN), (GU, H), (H, DOWN_IN)]
    return [[(torch.randn(s, device=dev, dtype=torch.float32, generator=g) * scale).to(dtype) for s in shapes]
            for _ in range(n)]


def tile_launch(tile: str, M: int, N: int, K: int) -> SkinnyLaunch | None:
    """"default" (skinny_launch's choice) or "<block_n>x<block_k>w<warps>", with skinny_launch's K split rule
    for that block_n (ptxas on sm_90a: the default 64 x 256 / 4 warps spills 256 bytes at 255 registers;
    64 x 128 / 8 warps, 32 x 256 / 8 and 32 x 128 / 4 do not)."""
    if tile == "default":
        return None
    bn, rest = tile.split("x")
    bk, warps = (int(t) for t in rest.split("w"))
    bn = int(bn)
    target = TARGET_PROGRAMS_PER_SM * 132
    n_blocks = triton.cdiv(N, bn) * triton.cdiv(M, 16)
    split, steps = 1, triton.cdiv(K, bk)
    while split < 8 and 2 * n_blocks < target and n_blocks * split < target and steps // (2 * split) >= 2:
        split *= 2
    return SkinnyLaunch(block_n=bn, block_k=bk, split_k=triton.cdiv(K, triton.cdiv(triton.cdiv(K, split), bk) * bk),
                        num_warps=warps, num_stages=3, dot=True)


def chain(h: torch.Tensor, layers, variant: str) -> torch.Tensor:
    variant, _, tile = variant.partition("@")
    pdl = variant.startswith("pdl")
    level = 2 if variant == "pdl+prefetch" else (1 if pdl else 0)

    def mm(x, w):
        if variant == "cublas":
            return x @ w.t()
        return skinny_mm(x, w, tile_launch(tile or "default", x.shape[0], w.shape[0], w.shape[1]), pdl=level)

    for wqkv, wo, wgu, wdown in layers:
        q = mm(rows(h, H, pdl), wqkv)
        o = mm(rows(q, O_IN, pdl), wo)
        gu = mm(rows(o, H, pdl), wgu)
        h = mm(rows(gu, DOWN_IN, pdl), wdown)
    return h


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--tiles", default="default,64x128w8,32x256w8,32x128w4",
                    help="skinny GEMM tiles for the triton/pdl variants (each variant once per tile)")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    global H, QKV, O_IN, GU, DOWN_IN
    if args.dry_run:
        dev, dtype, variants = "cpu", torch.float32, ["cublas", "triton", "triton@32x128w4"]
        H, QKV, O_IN, GU, DOWN_IN = 64, 96, 48, 80, 40
        args.layers = 2
    else:
        dev, dtype = "cuda", torch.bfloat16
        variants = ["cublas"] + [f"{v}@{t}" if t != "default" else v for t in args.tiles.split(",")
                                 for v in ("triton", "pdl", "pdl+prefetch")]
    layers = make_layers(args.layers, dev, dtype)
    weight_bytes = sum(w.numel() * w.element_size() for layer in layers for w in layer)
    floor_us = weight_bytes / COPY_BW * 1e6
    t0 = time.time()
    out = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "layers": args.layers,
           "weight_gb": weight_bytes / 1e9, "floor_us": floor_us, "rows": []}
    for m in [int(t) for t in args.tokens.split(",")]:
        h = torch.randn(m, H, device=dev, dtype=dtype)
        ref = {}
        for v in variants:
            try:
                y = chain(h, layers, v)
                ref[v] = y
                us = float("nan") if args.dry_run else graph_time_us(lambda v=v: chain(h, layers, v),
                                                                      replays=args.replays, calls=1)
            except Exception as e:  # a variant that does not build or capture is reported, not fatal
                out["rows"].append(dict(tokens=m, variant=v, error=f"{type(e).__name__}: {e}"[:300]))
                print(f"M={m} {v:13} ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            same = None
            base = "triton" + ("@" + v.partition("@")[2] if "@" in v else "")
            if v != "cublas" and base in ref:
                same = bool(torch.equal(y, ref[base]))
            diff = (y.float() - ref["cublas"].float()).abs().max().item() if "cublas" in ref else None
            tile = v.partition("@")[2] or "default"
            launches = {k: tile_launch(tile, m, n_, k_) or skinny_launch(m, n_, k_) for k, (n_, k_) in
                        {"qkv": (QKV, H), "o": (H, O_IN), "gate_up": (GU, H), "down": (H, DOWN_IN)}.items()}
            row = dict(tokens=m, variant=v, step_us=us, layer_us=us / args.layers, pct_of_floor=floor_us / us * 100,
                       bitwise_equal_triton=same, max_diff_vs_cublas=diff,
                       split_k={k: lp.split_k for k, lp in launches.items()})
            out["rows"].append(row)
            print(f"M={m} {v:24} {us:9.1f} us a step ({us / args.layers:6.1f} a layer, floor {floor_us:7.1f}: "
                  f"{floor_us / us * 100 if us == us else 0:5.1f}%)  equal to triton: {same}  vs cublas {diff:.2e}",
                  flush=True)
    print(f"done in {time.time() - t0:.0f}s")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
