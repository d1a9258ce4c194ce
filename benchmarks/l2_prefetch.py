"""L2 prefetch of the output projection's weight during decode attention, on the GPU (issue 14; an experiment,
rejected in session 25: every variant was slower, benchmarks/NOTES.md).

A decode step's attention phase (QK-norm, paged decode, combine: 10-20 us a layer) leaves HBM mostly idle, and
the output projection after it (Gemma 4 26B-A4B: 2,816 x 4,096, 23 MB) streams its weight at 2.3-2.8 TB/s in
cuBLAS's split-K kernels. This times a chain of `layers` decode layers (distinct weights and KV caches, one
CUDA graph) with and without asking L2 for the o weight (the kernels below) just before attention:

    norm -> qkv GEMM (8,192 x 2,816) -> q copy -> paged decode (sliding: 8 KV heads, d 256, window 1,024)
    -> o GEMM (2,816 x 4,096) -> norm -> gate/up GEMM (4,224 x 2,816) -> down GEMM (2,816 x 2,112)
    -> expert stand-in: [8 x 1,408, 2,816] then [2,816, 8 x 704] GEMMs (the 8 routed experts' bytes at batch 1)

Variants: none; bulk (Hopper's bulk L2 prefetch, main stream, before the q copy); bulk_side (the same on a side
stream forked after the qkv GEMM); line (128-byte line prefetches); bulk_gu (o and the dense gate/up weights);
bulk_16k (16 KB chunks). Outputs must be bitwise equal to none's (a prefetch changes when, not what).

    python3 benchmarks/l2_prefetch.py [--tokens 1,4,8] [--layers 30] [--out FILE.json]
    python3 benchmarks/l2_prefetch.py --dry-run   # CPU, Triton interpreter, tiny shapes, the chain without prefetch
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.graph_timing import graph_time_us  # noqa: E402
from compiled_llm.ops.triton import paged_attention as PA  # noqa: E402

H, QKV, QW, O_IN, GU, DOWN_IN, EXP_GU, EXP_IN = 2816, 8192, 4096, 4096, 4224, 2112, 8 * 1408, 8 * 704
PAGE, KV_HEADS, D, WINDOW = 16, 8, 256, 1024
COPY_BW = 4.2e12
VARIANTS = ["none", "bulk", "bulk_side", "line", "bulk_gu", "bulk_16k"]

# The prefetch kernels: Hopper's bulk L2 prefetch (`cp.async.bulk.prefetch.L2.global`, one instruction per chunk,
# a few one-warp programs, nothing written) or one 128-byte line per lane (`prefetch.global.L2::evict_last`).
BULK_CHUNK = 64 << 10  # bytes a bulk-prefetch instruction asks for
LINE = 128


@triton.jit(do_not_specialize=["nbytes"])
def _prefetch_bulk_kernel(P, nbytes, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    # lane i of program p asks L2 for bytes [(p * BLOCK + i) * CHUNK, +CHUNK) of P (the last chunk cut at nbytes)
    off = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - off, CHUNK).to(tl.int32)
    live = (size > 0).to(tl.int32)
    tl.inline_asm_elementwise(
        "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $3, 0;\n\t@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\t}\n\t"
        "mov.u32 $0, 0;",
        "=r,l,r,r", [P + off, size, live], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["nbytes"])
def _prefetch_line_kernel(P, nbytes, LINES: tl.constexpr, BLOCK: tl.constexpr):
    # lane i of program p prefetches LINES lines, BLOCK lines apart
    base = tl.program_id(0).to(tl.int64) * BLOCK * LINES
    for j in tl.static_range(LINES):
        off = (base + j * BLOCK + tl.arange(0, BLOCK)) * 128
        live = (off < nbytes).to(tl.int32)
        tl.inline_asm_elementwise(
            "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $2, 0;\n\t@p prefetch.global.L2::evict_last [$1];\n\t}\n\t"
            "mov.u32 $0, 0;",
            "=r,l,r", [P + off, live], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_l2(t: torch.Tensor, mode: str = "bulk", chunk: int = BULK_CHUNK) -> None:
    """Ask L2 for t's bytes (t contiguous, on a CUDA device of compute capability 9.0+). Returns at once."""
    assert t.is_contiguous() and t.is_cuda
    raw = t.view(torch.uint8).view(-1) if t.dtype != torch.uint8 else t.view(-1)
    nbytes = raw.numel() // 16 * 16  # bulk sizes are multiples of 16 bytes; a tail under 16 bytes is skipped
    if nbytes == 0:
        return
    if mode == "bulk":
        block = 32
        _prefetch_bulk_kernel[(triton.cdiv(triton.cdiv(nbytes, chunk), block),)](
            raw, nbytes, CHUNK=chunk, BLOCK=block, num_warps=1)
    else:
        block, lines = 128, 8
        _prefetch_line_kernel[(triton.cdiv(triton.cdiv(nbytes, LINE), block * lines),)](
            raw, nbytes, LINES=lines, BLOCK=block, num_warps=4)


def make_layers(n: int, seqs: int, ctx: int, dev, dtype):
    g = torch.Generator(device=dev).manual_seed(0)

    def w(*s):
        return (torch.randn(*s, device=dev, dtype=torch.float32, generator=g) * 0.02).to(dtype)
    per_seq = triton.cdiv(ctx, PAGE)
    layers = []
    for _ in range(n):
        layers.append(dict(qkv=w(QKV, H), o=w(H, O_IN), gu=w(GU, H), down=w(H, DOWN_IN), egu=w(EXP_GU, H),
                           edown=w(H, EXP_IN), cache=w(2, seqs * per_seq, PAGE, KV_HEADS, D)))
    tables = torch.arange(seqs * per_seq, device=dev, dtype=torch.int32).view(seqs, per_seq)
    seq_lens = torch.full((seqs,), ctx, dtype=torch.int32, device=dev)
    return layers, tables, seq_lens


def norm(x: torch.Tensor) -> torch.Tensor:
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def chain(h, layers, tables, seq_lens, policy, variant: str, side: torch.cuda.Stream):
    m = h.shape[0]
    main = torch.cuda.current_stream() if side is not None else None
    for L in layers:
        qkv = norm(h) @ L["qkv"].t()
        if variant in ("bulk", "bulk_gu", "bulk_16k", "line"):
            prefetch_l2(L["o"], mode="line" if variant == "line" else "bulk",
                        **({"chunk": 16 << 10} if variant == "bulk_16k" else {}))
            if variant == "bulk_gu":
                prefetch_l2(L["gu"])
        elif variant == "bulk_side":
            side.wait_stream(main)
            with torch.cuda.stream(side):
                prefetch_l2(L["o"])
        q = qkv[:, :QW].contiguous().view(m, QW // D, D)
        a = PA.paged_decode(q, L["cache"], tables, seq_lens, scale=D ** -0.5, sliding_window=WINDOW,
                            num_kv_heads=KV_HEADS, head_dim=D, policy=policy)
        o = a.view(m, O_IN) @ L["o"].t()
        x = norm(o + h)
        d = torch.nn.functional.gelu((x @ L["gu"].t())[:, :DOWN_IN], approximate="tanh") @ L["down"].t()
        e = (x @ L["egu"].t())[:, :EXP_IN] @ L["edown"].t()
        h = x + d + e
        if variant == "bulk_side":
            main.wait_stream(side)
    return h


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,4,8")
    ap.add_argument("--ctx", type=int, default=1100)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.dry_run:
        global H, QKV, QW, O_IN, GU, DOWN_IN, EXP_GU, EXP_IN, KV_HEADS, D, WINDOW
        H, QKV, QW, O_IN, GU, DOWN_IN, EXP_GU, EXP_IN, KV_HEADS, D, WINDOW = 64, 128, 64, 64, 96, 48, 128, 64, 2, 16, 8
        tokens = "1,4"
        y = {}
        for m in (1, 4):
            layers, tables, seq_lens = make_layers(2, m, 20, "cpu", torch.float32)
            policy = PA.attention_launch_policy(m, 64, D, num_kv_heads=KV_HEADS, sliding_window=WINDOW)
            y[m] = chain(torch.randn(m, H), layers, tables, seq_lens, policy, "none", None)
            assert torch.isfinite(y[m]).all()
        print("dry run: chain ok", {m: tuple(v.shape) for m, v in y.items()}, tokens)
        return
    dev, dtype = "cuda", torch.bfloat16
    side = torch.cuda.Stream()
    t0 = time.time()
    out = {"device": torch.cuda.get_device_name(), "layers": args.layers, "ctx": args.ctx, "rows": []}
    for m in [int(t) for t in args.tokens.split(",")]:
        layers, tables, seq_lens = make_layers(args.layers, m, args.ctx, dev, dtype)
        wbytes = sum(t.numel() * 2 for L in layers for k, t in L.items() if k != "cache")
        kvbytes = args.layers * m * min(args.ctx, WINDOW) * KV_HEADS * D * 2 * 2
        floor_us = (wbytes + kvbytes) / COPY_BW * 1e6
        policy = PA.attention_launch_policy(m, 131072, D, num_kv_heads=KV_HEADS, sliding_window=WINDOW)
        h = torch.randn(m, H, device=dev, dtype=dtype)
        ref = None
        for v in args.variants.split(","):
            try:
                y = chain(h, layers, tables, seq_lens, policy, v, side)
                torch.cuda.synchronize()
                us = graph_time_us(lambda v=v: chain(h, layers, tables, seq_lens, policy, v, side),
                                   replays=args.replays, calls=1)
            except Exception as e:  # a variant that does not build or capture is reported, not fatal
                out["rows"].append(dict(tokens=m, variant=v, error=f"{type(e).__name__}: {e}"[:300]))
                print(f"M={m} {v:10} ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            same = None if ref is None else bool(torch.equal(y, ref))
            ref = y if ref is None else ref
            row = dict(tokens=m, variant=v, step_us=us, layer_us=us / args.layers, pct_of_floor=floor_us / us * 100,
                       equal_to_none=same)
            out["rows"].append(row)
            print(f"M={m} {v:10} {us:9.1f} us a step ({us / args.layers:6.2f} a layer; floor {floor_us:7.1f}: "
                  f"{floor_us / us * 100:5.1f}%)  equal to none: {same}", flush=True)
        # the prefetch launches alone, 30 of them (their own cost on the stream)
        pf = graph_time_us(lambda: [prefetch_l2(L["o"]) for L in layers], replays=args.replays, calls=1)
        print(f"M={m} prefetch launches alone: {pf / args.layers:.2f} us each", flush=True)
        out["rows"].append(dict(tokens=m, variant="prefetch_alone", us_each=pf / args.layers))
        del layers
        torch.cuda.empty_cache()
    print(f"done in {time.time() - t0:.0f}s")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
