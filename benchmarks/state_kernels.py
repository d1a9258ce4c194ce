"""Decode-step sweep of Qwen3.5's recurrent-state kernels at 35B-A3B's shapes: the causal conv (window of
K - 1 inputs per channel) and the gated delta rule's recurrent kernel in the op's form (gating and output norm; a 128 x 128 float32 state per value
head), each over its tiles, at several decode batch sizes; the two in one launch against two (conv_gdr); also the MoE's top-k sum (group topk_sum, at
Qwen3.5's hidden size 2,048 and Gemma 4 26B-A4B's 2,816: a latency-bound launch of both models' decode steps). Each candidate is checked against the policy's
output and new state (bitwise for the conv; within float32 rounding for the delta rule, whose reduction
order depends on the tile), then timed with CUDA-graph replays that cycle through several states (more bytes
than the L2 holds), with the bytes each call moves and the bandwidth that makes.

    python3 benchmarks/state_kernels.py [--batches 1,8,32] [--groups conv,gdr,conv_gdr,topk_sum] [--out F.json]
    TRITON_INTERPRET=1 python3 benchmarks/state_kernels.py --smoke   # a CPU dry run at toy shapes
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from compiled_llm.ops.state import StateLayout  # noqa: E402
from compiled_llm.ops.triton import conv1d as C  # noqa: E402
from compiled_llm.ops.triton import delta_rule as D  # noqa: E402
from compiled_llm.ops.triton import moe as M  # noqa: E402
from graph_timing import kernel_timer  # noqa: E402

SHAPES = {
    "qwen": dict(hk=16, hv=32, dk=128, dv=128, K=4, extra=4096 + 64),  # 35B-A3B; extra: z, b, a after [q; k; v]
    "smoke": dict(hk=2, hv=4, dk=16, dv=32, K=4, extra=8),
}
COPIES = 8  # states cycled through by the timed calls


def sweep(group: str, batch: int, cands: list, run, nbytes: float, time_fn, rows: list, exact: bool) -> None:
    """cands[0] is the policy's; run(c, copy) -> (out, state) of one call on that state copy (copy None: a
    fresh copy of the first, for the check)."""
    ref = run(cands[0], None)
    for i, c in enumerate(cands):
        row = dict(group=group, batch=batch, cand=c, default=i == 0)
        try:
            out = run(c, None)
            err = max(float((a.float() - b.float()).abs().max()) for a, b in zip(out, ref))
            ok = err == 0.0 if exact else err <= 1e-3
            row.update(ok=ok, max_diff=err)
            if ok:
                it = itertools.count()
                row["us"] = round(time_fn(lambda: run(c, next(it) % COPIES)), 2)
                row["TBps"] = round(nbytes / (row["us"] * 1e-6) / 1e12, 2)
        except Exception as exc:  # a tile that does not build is reported, not fatal
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:200])
        rows.append(row)
        print(json.dumps(row), flush=True)


def conv_group(S, B, dev, dt, time_fn, rows, smoke):
    key, value = S["hk"] * S["dk"], S["hv"] * S["dv"]
    dim, K = 2 * key + value, S["K"]
    g = torch.Generator(device=dev).manual_seed(0)
    proj = torch.randn(B, dim + S["extra"], device=dev, generator=g).to(dt)
    x = proj[:, :dim]  # the [q; k; v] columns of the projection's output, read in place
    w = torch.randn(dim, K, device=dev, generator=g).to(dt)
    caches = [torch.randn(B, dim, K - 1, device=dev, generator=g).to(dt) for _ in range(COPIES)]
    first = caches[0].clone()  # the checks start from this (the timed calls move the windows)
    layout = StateLayout.build(list(range(B)), [True] * B, list(range(B + 1)), dev)
    policy = C.conv_tiles(True)
    cands = [policy] + [c for c in itertools.product((8, 16), (32, 64, 128, 256) if not smoke else (32, 128),
                                                     (1, 2, 4) if not smoke else (2,)) if c != policy]

    def run(c, copy):
        cache = first.clone() if copy is None else caches[copy]
        return C.causal_conv1d_varlen(x, w, cache, layout, tiles=c), cache

    nbytes = B * dim * (2 + 2 * (K - 1)) * dt.itemsize  # x read, y written, the window read and written
    sweep("conv", B, cands, run, nbytes, time_fn, rows, exact=True)


def gdr_group(S, B, dev, dt, time_fn, rows, smoke):
    """The delta rule's decode launch in the op's form (gating from [b; a], the gated output norm: in the kernel
    when a value block holds the head, else the norm kernel after), on the model's strided views."""
    hk, hv, dk, dv = S["hk"], S["hv"], S["dk"], S["dv"]
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, z, ba = D.model_views(B, hk, hv, dk, dv, dt, dev)
    for x in (q, k, v, z, ba):
        x.copy_(torch.randn(x.shape, device=dev, generator=g))
    a_log, dt_bias = (torch.rand(hv, device=dev, generator=g) - 0.5).to(dt), torch.randn(hv, device=dev).to(dt)
    norm_w = torch.ones(dv, device=dev, dtype=dt)
    states = [torch.randn(B, hv, dk, dv, device=dev, generator=g) * 0.1 for _ in range(COPIES)]
    first = states[0].clone()
    layout = StateLayout.build(list(range(B)), [True] * B, list(range(B + 1)), dev)
    policy = D.recurrent_tiles_policy(B, dv, True)
    cands = [policy] + [c for c in itertools.product((16, 32, 64, 128) if not smoke else (16, 32),
                                                     (2, 4, 8) if not smoke else (4,)) if c != policy]

    def run(c, copy):
        state = first.clone() if copy is None else states[copy]
        return D.gated_delta_rule_varlen(q, k, v, None, None, state, layout, recurrent_tiles=c,
                                         gating=(ba, a_log, dt_bias), out_norm=(z, norm_w, 1e-6)), state

    nbytes = B * hv * dk * dv * 4 * 2 + B * (2 * hk * dk + 3 * hv * dv) * dt.itemsize  # state in and out, q k v z o
    sweep("gdr_recurrent", B, cands, run, nbytes, time_fn, rows, exact=False)


def conv_gdr_group(S, B, dev, dt, time_fn, rows, smoke):
    """A decode step's whole Gated DeltaNet op: the conv launch then the recurrent launch ("split", the op before
    session 29 and under COMPILED_LLM_GDR_CONV=0) against the conv inside the recurrent launch ("fused"), on
    in_proj's strided output; the outputs, the windows and the states must be bitwise equal."""
    from compiled_llm.ops.delta_rule import split_qkv

    hk, hv, dk, dv, K = S["hk"], S["hv"], S["dk"], S["dv"], S["K"]
    dim = 2 * hk * dk + hv * dv
    g = torch.Generator(device=dev).manual_seed(0)
    _, _, _, z, ba = D.model_views(B, hk, hv, dk, dv, dt, dev)
    y = ba.as_strided((B, ba.stride(0)), (ba.stride(0), 1), 0)  # in_proj's output [q; k; v; z; b; a]
    y.copy_(torch.randn(y.shape, device=dev, generator=g))
    qkv = y[:, :dim]
    w = (torch.randn(dim, K, device=dev, generator=g) * 0.5).to(dt)
    a_log, dt_bias = (torch.rand(hv, device=dev, generator=g) - 0.5).to(dt), torch.randn(hv, device=dev).to(dt)
    norm_w = torch.ones(dv, device=dev, dtype=dt)
    states = [torch.randn(B, hv, dk, dv, device=dev, generator=g) * 0.1 for _ in range(COPIES)]
    windows = [torch.randn(B, dim, K - 1, device=dev, generator=g).to(dt) for _ in range(COPIES)]
    first = (states[0].clone(), windows[0].clone())
    layout = StateLayout.build(list(range(B)), [True] * B, list(range(B + 1)), dev)
    gating, out_norm = (ba, a_log, dt_bias), (z, norm_w, 1e-6)

    def run(c, copy):
        state, window = (first[0].clone(), first[1].clone()) if copy is None else (states[copy], windows[copy])
        if c != "split":  # "fused": the policy's tiles; (value block, warps): those
            out = D.gated_delta_rule_varlen(None, None, None, None, None, state, layout, gating=gating,
                                            out_norm=out_norm, conv=(qkv, w, window, hk),
                                            recurrent_tiles=None if c == "fused" else c)
        else:
            q, k, v = split_qkv(C.causal_conv1d_varlen(qkv, w, window, layout), hk, hv, dv)
            out = D.gated_delta_rule_varlen(q, k, v, None, None, state, layout, gating=gating, out_norm=out_norm)
        return out, state, window

    nbytes = B * hv * dk * dv * 4 * 2 + B * dim * (1 + 2 * (K - 1)) * dt.itemsize + B * 2 * hv * dv * dt.itemsize
    sweep("conv_gdr", B, ["split", "fused"], run, nbytes, time_fn, rows, exact=True)
    # the fused launch's tiles (a value block below the head takes the norm kernel after it; the reductions over
    # the keys may then run in another order: checked within float32 rounding)
    policy = D.recurrent_tiles_policy(B, S["dv"], True)
    tiles = [(bv, nw) for bv in ((128, 64, 32) if not smoke else (32, 16)) for nw in ((4, 8) if not smoke else (4,))]
    sweep("conv_gdr_tiles", B, ["fused"] + [t for t in tiles if t != policy], run, nbytes, time_fn, rows, exact=False)


def topk_sum_group(B, dev, dt, time_fn, rows, smoke):
    for hidden in ((2048, 2816) if not smoke else (96,)):
        g = torch.Generator(device=dev).manual_seed(hidden)
        ys = [torch.randn(B, 8, hidden, device=dev, generator=g).to(dt) for _ in range(COPIES)]
        policy = M.topk_sum_tiles(hidden)
        cands = [policy] + [c for c in itertools.product((128, 256, 512, 1024) if not smoke else (32, 128),
                                                         (1, 2, 4) if not smoke else (1, 4)) if c != policy]

        def run(c, copy):
            return (M.topk_sum(ys[0 if copy is None else copy], tiles=c),)

        sweep(f"topk_sum H={hidden}", B, cands, run, B * hidden * 9 * dt.itemsize, time_fn, rows, exact=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--groups", default="conv,gdr,conv_gdr,topk_sum")
    ap.add_argument("--smoke", action="store_true", help="toy shapes (for TRITON_INTERPRET=1 on the CPU)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    S = SHAPES["smoke" if a.smoke else "qwen"]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dt = torch.bfloat16
    batches = [2] if a.smoke else [int(b) for b in a.batches.split(",")]
    time_fn, rows = kernel_timer(a.smoke, calls=COPIES), []
    for B in batches:
        if "conv" in a.groups.split(","):
            conv_group(S, B, dev, dt, time_fn, rows, a.smoke)
        if "gdr" in a.groups.split(","):
            gdr_group(S, B, dev, dt, time_fn, rows, a.smoke)
        if "conv_gdr" in a.groups.split(","):
            conv_gdr_group(S, B, dev, dt, time_fn, rows, a.smoke)
        if "topk_sum" in a.groups.split(","):
            topk_sum_group(B, dev, dt, time_fn, rows, a.smoke)
    lines = []
    for key in dict.fromkeys((r["group"], r["batch"]) for r in rows):
        rs = [r for r in rows if (r["group"], r["batch"]) == key and r.get("us")]
        d = next((r for r in rs if r["default"]), None)
        b = min(rs, key=lambda r: r["us"]) if rs else None
        if b:
            lines.append(f"{key[0]:<18} batch {key[1]:<3} policy {d and d['us']} us ({d and d['TBps']} TB/s)  "
                         f"best {b['us']} us ({b['TBps']} TB/s) {b['cand']}")
    print("\nsummary (CUDA-graph replay, us a call):\n" + "\n".join(lines))
    bad = [r for r in rows if r["default"] and not r.get("ok")]
    if a.out:
        Path(a.out).write_text(json.dumps({"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                                           "torch": torch.__version__, "rows": rows, "summary": lines}, indent=1))
    print("FAILED: the policy's own launch" if bad else "ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
