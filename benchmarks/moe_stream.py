"""Where the decode MoE's last 15% of bandwidth goes: the routed experts' time against how many experts a batch
touches, and against a kernel that only streams the same weights.

At batch 8 the grouped GEMMs read ~57 of Qwen3.5 35B-A3B's 256 experts (~50 of Gemma 4 26B-A4B's 128) at
3.6-4.0 TB/s of the expected touched bytes, against a 4.22 TB/s copy (sessions 17-21). The tile sweeps
(`prefill_kernels.py`) found every tile within 2%, so the loss is not the tile. This separates the rest:

- `moe`: the routed experts as the engine runs them at the decode policy (`fused_moe`, gate/up then down, each
  pick's weighted output left unsummed), for 8 tokens whose k picks cover D distinct experts, D from k to T x k.
  A line t(D) = a + b D over D: b is the time per expert (its bytes / b: the streaming bandwidth), a the fixed
  cost of the two launches (launch, pipeline fill, the self-routing prologue, the last wave).
- `stream`: a kernel with the gate/up kernel's grid and tiles (a program per picked expert and column block,
  stepping through K as the GEMM does) that loads the same gate and up tiles and adds them up, without the
  token rows, the dot or the activation: the bandwidth of that access pattern alone. `stream_dot`: the same
  summed by a dot with a block of ones, which Triton pipelines through shared memory as it does the GEMM
  (its occupancy too): the GEMM's weight stream without the self-routing, the token gather, the activation
  and the down kernel.
- `copy`: torch's copy of the touched experts' gate/up weights (read + write), the device's reference.

- `gate_up`, `down` (`--parts`): each of the two kernels alone (`moe_launches`; the down kernel on what the gate/up
  kernel recorded), fitted the same way: which kernel carries the fixed cost; `gate_up_aligned`: the gate/up
  kernel on blocks aligned beforehand (`moe_align`, not timed) instead of ranking the experts itself.

- `moe[...]` (`--launch "b_block_k=512;a_block_n=64,a_stages=3"`): the routed op at other MoELaunch fields (each
  `;`-separated set over the policy's), its output checked against the policy's; with --parts also its down
  kernels each alone (`gate_up[...]`, `down[...]`). At the operating point only: `--distinct 56`; at one token
  (`--tokens 1`, the unsorted pairs of a batch-1 step) `--distinct 8`.

--flush-mb 256: every timed call starts with the weights outside the L2 (a read of that size first, its time
taken off), as in a decode step; back-to-back calls of one op otherwise find part of the last call's weights
still in the L2 (H200, Qwen3.5 at 57 experts: gate/up 60.6 us back to back, 69.0 after a 256 MB write, whose
dirty lines' write-back the next call pays: --flush-write).

--layers 16: each op over 16 layers' copies of the weights in turn (a graph of 16 calls), against 16 calls on
one layer's: the cold pages of a decode step, which reads a layer's experts once per step.

    python3 benchmarks/moe_stream.py [--qwen] [--distinct 8,16,32,48,57,64] [--parts] [--launch ...]
                                     [--flush-mb 256] [--out F.json]
    python3 benchmarks/moe_stream.py [--qwen] --distinct 57 --layers 16
    TRITON_INTERPRET=1 python3 benchmarks/moe_stream.py --smoke   # a CPU dry run at toy shapes
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from compiled_llm.ops.triton import moe as M  # noqa: E402
from graph_timing import graph_time_us, kernel_timer  # noqa: E402

SHAPES = {
    "gemma": dict(E=128, H=2816, I=704, k=8, act="gelu_tanh"),  # Gemma 4 26B-A4B
    "qwen": dict(E=256, H=2048, I=512, k=8, act="silu"),  # Qwen3.5 35B-A3B
    "smoke": dict(E=16, H=64, I=32, k=4, act="silu"),
}


@triton.jit
def _stream_kernel(W, Experts, Out, N, K, stride_we, stride_wn,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    """Program (b, n): the gate and up tiles of expert Experts[b], columns [n BLOCK_N, +BLOCK_N), all of K, in
    BLOCK_K steps, as the gate/up kernel loads them; their sum goes to Out[b, n] (so nothing is optimised away).
    DOT: summed by a dot with a 16-row block of ones, so that Triton pipelines the loads through shared memory
    as it does the GEMM's (plain loads are not pipelined: their programs hide latency by occupancy instead)."""
    b = tl.program_id(0)
    n = tl.program_id(1)
    e = tl.load(Experts + b).to(tl.int64)
    cols = n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    g_ptr = W + e * stride_we + cols[None, :] * stride_wn + kk[:, None]
    u_ptr = g_ptr + N * stride_wn
    if DOT:
        ones = tl.full([16, BLOCK_K], 1.0, W.dtype.element_ty)
        acc2 = tl.zeros([16, BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([BLOCK_K, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        m = (kk < K - k0)[:, None] & (cols < N)[None, :]
        g = tl.load(g_ptr, mask=m, other=0.0)
        u = tl.load(u_ptr, mask=m, other=0.0)
        if DOT:
            acc2 += tl.dot(ones, g) + tl.dot(ones, u)
        else:
            acc += g.to(tl.float32) + u.to(tl.float32)
        g_ptr += BLOCK_K
        u_ptr += BLOCK_K
    if DOT:
        total = tl.sum(tl.sum(acc2, 1), 0) / 16
    else:
        total = tl.sum(tl.sum(acc, 1), 0)
    tl.store(Out + b * tl.num_programs(1) + n, total)


def stream_weights(gate_up: torch.Tensor, experts: torch.Tensor, out: torch.Tensor, pol, dot: bool) -> None:
    """_stream_kernel over the picked experts' gate/up weights, at the gate/up kernel's grid and tiles."""
    d, I, H = experts.numel(), gate_up.shape[1] // 2, gate_up.shape[2]
    _stream_kernel[(d, triton.cdiv(I, pol.a_block_n))](
        gate_up, experts, out, I, H, gate_up.stride(0), gate_up.stride(1),
        BLOCK_N=pol.a_block_n, BLOCK_K=pol.a_block_k, DOT=dot, num_warps=pol.a_warps, num_stages=pol.a_stages)


def picks(T: int, k: int, E: int, distinct: int, device) -> torch.Tensor:
    """[T, k] expert ids covering exactly `distinct` experts (k <= distinct <= T k), none twice in a row: pick j of
    token t is expert perm[(t k + j) mod distinct] of a fixed random permutation."""
    assert k <= distinct <= min(E, T * k), (k, distinct, T * k, E)
    perm = torch.randperm(E, generator=torch.Generator().manual_seed(distinct))[:distinct]
    idx = (torch.arange(T)[:, None] * k + torch.arange(k)[None, :]) % distinct
    return perm[idx].to(torch.int32).to(device)


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares (a, b) of t = a + b D."""
    n = len(points)
    mx = sum(d for d, _ in points) / n
    my = sum(t for _, t in points) / n
    sxx = sum((d - mx) ** 2 for d, _ in points)
    b = sum((d - mx) * (t - my) for d, t in points) / sxx if sxx else 0.0
    return my - b * mx, b


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--qwen", action="store_true", help="Qwen3.5 35B-A3B's experts (default: Gemma 4 26B-A4B's)")
    ap.add_argument("--smoke", action="store_true", help="toy shapes (for TRITON_INTERPRET=1 on the CPU)")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--distinct", default=None, help="distinct experts per call (default: k, 2k, ..., T k)")
    ap.add_argument("--parts", action="store_true", help="also time the gate/up and down kernels each alone")
    ap.add_argument("--launch", default="", help="MoELaunch field sets to time beside the policy's, e.g. "
                    "'b_block_k=512;b_block_n=128,b_stages=3'")
    ap.add_argument("--flush-mb", type=int, default=0, help="read this many MB before each timed call (its own "
                    "time taken off): the weights start outside the L2, as in a decode step, where the other "
                    "layers' weights pass through it between two calls of one layer's experts")
    ap.add_argument("--flush-write", action="store_true", help="flush by a write instead: the L2 is left full of "
                    "dirty lines, whose write-back the next call pays")
    ap.add_argument("--layers", type=int, default=1, help="time each op over this many layers' copies of the weights, "
                    "one after another (a graph of that many calls, each on the next layer's): the weights start cold "
                    "in the L2 and in the GPU's page-translation caches, as a decode step's do (at --distinct's "
                    "first D)")
    ap.add_argument("--sustain", type=float, default=0.0, help="with --layers: also time each op after this many "
                    "seconds of back-to-back replays of it (the clocks a long decode runs at)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.layers > 1:
        return layers(a)
    S = SHAPES["smoke" if a.smoke else "qwen" if a.qwen else "gemma"]
    E, H, I, k, T = S["E"], S["H"], S["I"], S["k"], a.tokens
    dev = torch.device("cpu" if a.smoke else "cuda")
    dt = torch.float32 if a.smoke else torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    gate_up = (torch.randn(E, 2 * I, H, device=dev, generator=g) * H ** -0.5).to(dt)
    down = (torch.randn(E, H, I, device=dev, generator=g) * I ** -0.5).to(dt)
    x = torch.randn(T, H, device=dev, generator=g).to(dt)
    wts = torch.softmax(torch.randn(T, k, device=dev, generator=g), -1)
    pol = M.moe_launch_policy(T, k, E, H, I)
    ds = [int(d) for d in a.distinct.split(",")] if a.distinct else sorted({*range(k, min(E, T * k) + 1, k),
                                                                             min(E, T * k)})
    time_fn = kernel_timer(a.smoke, calls=10)
    if a.flush_mb:  # each call after a pass over more than the L2 holds; the pass timed alone and taken off
        scratch = torch.ones(a.flush_mb << 18, dtype=torch.float32, device=dev)
        flush = scratch.zero_ if a.flush_write else scratch.amax
        flush_us = time_fn(flush)
        timer = time_fn
        time_fn = lambda fn: timer(lambda: (flush(), fn())) - flush_us  # noqa: E731
        print(f"L2 flush: {a.flush_mb} MB {'written' if a.flush_write else 'read'} before each call, "
              f"{flush_us:.2f} us taken off", flush=True)
    per_expert = {"gate_up": 2 * I * H * gate_up.element_size(), "down": H * I * down.element_size()}
    both = per_expert["gate_up"] + per_expert["down"]
    timed: dict[str, int] = {}  # every timed variant, in order, with the bytes it moves per distinct expert
    launches = [(spec, {k: int(v) for k, v in (f.split("=") for f in spec.split(","))})
                 for spec in a.launch.split(";") if spec]
    rows = []
    for d in ds:
        ids = picks(T, k, E, d, dev)
        experts = ids.unique().to(torch.int32)
        out = torch.empty(d, triton.cdiv(I, pol.a_block_n), dtype=torch.float32, device=dev)
        sel = torch.empty(d, 2 * I, H, dtype=dt, device=dev)

        def moe():
            return M.fused_moe(x, gate_up, down, wts, ids, activation=S["act"], sum_slots=False)

        def stream(dot=False):
            stream_weights(gate_up, experts, out, pol, dot)

        def copy():
            torch.index_select(gate_up, 0, experts.long(), out=sel)

        row = {"distinct": d, "touched_MB": round(d * both / 1e6, 1)}
        if d == ds[0]:  # the stream kernel reads what the GEMM reads: its sums equal the weights' own
            want = gate_up[experts.long()].float()
            want = want.view(d, 2, I, H).sum(1).view(d, -1, pol.a_block_n, H).sum((2, 3))
            for dot in (False, True):
                stream(dot)
                assert torch.allclose(out, want, rtol=1e-2, atol=0.5), (dot, out, want)
        # (name, call, bytes per distinct expert)
        variants = [("moe", moe, both)]
        if a.parts:
            up, dn = M.moe_launches(x, gate_up, down, wts, ids, activation=S["act"])
            up()  # the down kernel reads the blocks this recorded
            assert torch.equal(dn(), moe().reshape(T * k, H))
            variants += [("gate_up", up, per_expert["gate_up"]), ("down", dn, per_expert["down"])]
            if pol.self_routed:  # the gate/up kernel on blocks aligned beforehand: the self-routing prologue's cost
                aligned = dataclasses.replace(pol, self_routed=False)
                up_aligned, _ = M.moe_launches(x, gate_up, down, wts, ids, activation=S["act"], policy=aligned,
                                               alignment=M.moe_align(ids, E, pol.block_m))
                variants.append(("gate_up_aligned", up_aligned, per_expert["gate_up"]))
        for label, over in launches:
            lp = dataclasses.replace(pol, **over)
            try:
                got = M.fused_moe(x, gate_up, down, wts, ids, activation=S["act"], sum_slots=False, policy=lp)
            except Exception as exc:  # a tile that does not build (shared memory, registers): noted, not timed
                print(f"launch {label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                row[f"moe[{label}]_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                continue
            want = moe()
            assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.abs().max())), label
            variants.append((f"moe[{label}]", lambda lp=lp: M.fused_moe(x, gate_up, down, wts, ids, activation=S["act"],
                                                                        sum_slots=False, policy=lp), both))
            if a.parts:
                up_v, dn_v = M.moe_launches(x, gate_up, down, wts, ids, activation=S["act"], policy=lp)
                up_v()
                variants += [(f"gate_up[{label}]", up_v, per_expert["gate_up"]),
                             (f"down[{label}]", dn_v, per_expert["down"])]
        gu = per_expert["gate_up"]
        variants += [("stream", stream, gu), ("stream_dot", lambda: stream(True), gu), ("copy", copy, 2 * gu)]
        for name, fn, b_expert in variants:
            us = time_fn(fn)
            timed[name] = b_expert
            row[f"{name}_us"] = round(us, 2)
            row[f"{name}_TBps"] = round(d * b_expert / (us * 1e-6) / 1e12, 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = {}
    for name, b_expert in timed.items():
        a0, b1 = fit([(r["distinct"], r[f"{name}_us"]) for r in rows if f"{name}_us" in r])
        summary[name] = {"fixed_us": round(a0, 2), "us_per_expert": round(b1, 3),
                         "slope_TBps": round(b_expert / (b1 * 1e-6) / 1e12, 3) if b1 > 0 else None}
    print("\nt(D) = fixed + D x per expert, least squares over D =", ds)
    for name, s in summary.items():
        print(f"  {name:28s} fixed {s['fixed_us']:8.2f} us   per expert {s['us_per_expert']:7.3f} us   "
              f"streaming at {s['slope_TBps']} TB/s")
    if a.out:
        Path(a.out).write_text(json.dumps({"shape": S, "tokens": T, "policy": str(pol), "flush_mb": a.flush_mb,
                                           "flush_write": a.flush_write, "rows": rows,
                                           "fit": summary}, indent=1))
    print("ok")
    return 0


def layers(a) -> int:
    """The routed op, its two kernels, the weight stream and a copy, each timed over a.layers copies of the
    weights in turn: the access a decode step makes (a layer's experts last read one step ago, 40 layers of
    weights since), against the one-layer loop's repeated reads of the same pages."""
    S = SHAPES["smoke" if a.smoke else "qwen" if a.qwen else "gemma"]
    E, H, I, k, T, n = S["E"], S["H"], S["I"], S["k"], a.tokens, a.layers
    dev = torch.device("cpu" if a.smoke else "cuda")
    dt = torch.float32 if a.smoke else torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    gate_up = [(torch.randn(E, 2 * I, H, device=dev, generator=g) * H ** -0.5).to(dt) for _ in range(n)]
    down = [(torch.randn(E, H, I, device=dev, generator=g) * I ** -0.5).to(dt) for _ in range(n)]
    x = torch.randn(T, H, device=dev, generator=g).to(dt)
    wts = torch.softmax(torch.randn(T, k, device=dev, generator=g), -1)
    pol = M.moe_launch_policy(T, k, E, H, I)
    d = int(a.distinct.split(",")[0]) if a.distinct else min(E, T * k)
    ids = picks(T, k, E, d, dev)
    experts = ids.unique().to(torch.int32)
    out = torch.empty(d, triton.cdiv(I, pol.a_block_n), dtype=torch.float32, device=dev)
    sel = torch.empty(d, 2 * I, H, dtype=dt, device=dev)
    launches = [M.moe_launches(x, gate_up[i], down[i], wts, ids, activation=S["act"]) for i in range(n)]
    for up, _ in launches:
        up()

    def cycle(make):
        fns, at = [make(i) for i in range(n)], [0]

        def call():
            fns[at[0] % n]()
            at[0] += 1
        return call

    per_expert = {"gate_up": 2 * I * H * dt.itemsize, "down": H * I * dt.itemsize}
    variants = [
        ("moe", lambda i: lambda: M.fused_moe(x, gate_up[i], down[i], wts, ids, activation=S["act"], sum_slots=False),
         per_expert["gate_up"] + per_expert["down"]),
        ("gate_up", lambda i: launches[i][0], per_expert["gate_up"]),
        ("down", lambda i: launches[i][1], per_expert["down"]),
        ("stream_dot", lambda i: lambda: stream_weights(gate_up[i], experts, out, pol, True), per_expert["gate_up"]),
        ("copy", lambda i: lambda: torch.index_select(gate_up[i], 0, experts.long(), out=sel),
         2 * per_expert["gate_up"]),
    ]

    def sustained(fn) -> float:  # fn's time after a.sustain seconds of back-to-back replays of a graph of it
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                fn()

        def burn():
            end = time.perf_counter() + a.sustain
            while time.perf_counter() < end:
                for _ in range(8):
                    g.replay()
                torch.cuda.synchronize()
        return graph_time_us(fn, replays=20, calls=n, before=burn)

    row = {"distinct": d, "layers": n}
    for name, make, b_expert in variants:
        one = kernel_timer(a.smoke, calls=n)(make(0))  # the same layer n times: its pages warm after the first
        many = kernel_timer(a.smoke, calls=n)(cycle(make))
        row[name] = {"one_layer_us": round(one, 2), "layers_us": round(many, 2),
                     "layers_TBps": round(d * b_expert / (many * 1e-6) / 1e12, 3)}
        tail = ""
        if a.sustain and not a.smoke:
            row[name]["sustained_us"] = round(sustained(cycle(make)), 2)
            tail = f"   after {a.sustain:g} s of replays {row[name]['sustained_us']:8.2f} us"
        print(f"  {name:12s} one layer {one:8.2f} us   {n} layers in turn {many:8.2f} us "
              f"({row[name]['layers_TBps']} TB/s){tail}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"shape": S, "tokens": T, "policy": str(pol), "row": row}, indent=1))
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
