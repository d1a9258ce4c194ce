"""What running the MoE branch beside the dense branch would save, before building it into the compiler.

A Gemma 4 26B-A4B MoE layer has two independent branches after attention: the dense MLP (GEMM, GEGLU, GEMM)
and the router + routed experts (router, alignment, grouped gate/up, grouped down, top-k sum); Qwen3.5's has
the shared expert beside the routed ones. In a decode step they run one after the other on one stream. Here
both orders are captured in one CUDA graph over `--layers` layers with distinct weights (so weights come from
HBM, as in a step): `serial` (one stream) and `overlap` (router + experts on a side stream, forked and joined
with events inside the graph, each layer waiting for the previous one as the residual stream would make it).
Also the two branches alone. Outputs of both orders are compared.

    python3 benchmarks/ffn_overlap.py [--tokens 1,4,8] [--qwen] [--out F.json]
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


def make_layers(n, H, I_dense, E, I, dev, dt, g, qwen):
    layers = []
    for _ in range(n):
        layers.append(dict(
            gu=(torch.randn(2 * I_dense, H, device=dev, generator=g) * H ** -0.5).to(dt),
            dn=(torch.randn(H, I_dense, device=dev, generator=g) * I_dense ** -0.5).to(dt),
            sg=(torch.randn(1, H, device=dev, generator=g) * H ** -0.5).to(dt) if qwen else None,
            wr=torch.randn(E, H, device=dev, generator=g).to(dt),
            scale=None if qwen else (torch.rand(H, device=dev, generator=g) + 0.5).to(dt),
            pes=None if qwen else (torch.rand(E, device=dev, generator=g) + 0.5).to(dt),
            egu=(torch.randn(E, 2 * I, H, device=dev, generator=g) * H ** -0.5).to(dt),
            edn=(torch.randn(E, H, I, device=dev, generator=g) * I ** -0.5).to(dt),
        ))
    return layers


def dense(x, L, qwen):
    h = x @ L["gu"].t()
    g, u = h.chunk(2, dim=-1)
    a = (F.silu(g) if qwen else F.gelu(g, approximate="tanh")) * u
    y = a @ L["dn"].t()
    if qwen:  # the shared expert's sigmoid gate
        y = y * torch.sigmoid(x @ L["sg"].t())
    return y


def routed(x, L, k, qwen):
    w, ids = M.fused_router_topk(x, L["scale"], L["wr"], L["pes"], k, 1e-6)
    if qwen:
        return M.fused_swiglu_moe(x, L["egu"], L["edn"], w.to(x.dtype), ids)
    return M.fused_geglu_moe(x, L["egu"], L["edn"], w, ids)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,4,8")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--qwen", action="store_true", help="Qwen3.5 35B-A3B: the shared expert beside the routed ones")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from graph_timing import graph_time_us

    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    H, I_dense, E, I, k = (2048, 512, 256, 512, 8) if a.qwen else (2816, 2112, 128, 704, 8)
    layers = make_layers(a.layers, H, I_dense, E, I, dev, dt, g, a.qwen)
    side = torch.cuda.Stream()
    rows = []
    for T in (int(t) for t in a.tokens.split(",")):
        x = torch.randn(T, H, device=dev, generator=g).to(dt)
        out = {}

        def serial():
            out["y"] = [(dense(x, L, a.qwen), routed(x, L, k, a.qwen)) for L in layers]

        def overlap():
            res = []
            main = torch.cuda.current_stream()
            for L in layers:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    r = routed(x, L, k, a.qwen)
                d = dense(x, L, a.qwen)
                main.wait_stream(side)
                res.append((d, r))
            out["y"] = res

        serial()
        ref = [(d.clone(), r.clone()) for d, r in out["y"]]
        overlap()
        torch.cuda.synchronize()
        equal = all(torch.equal(d, d2) and torch.equal(r, r2) for (d, r), (d2, r2) in zip(ref, out["y"]))
        n = len(layers)
        row = dict(tokens=T, outputs_equal=equal,
                   dense_us=graph_time_us(lambda: [dense(x, L, a.qwen) for L in layers]) / n,
                   routed_us=graph_time_us(lambda: [routed(x, L, k, a.qwen) for L in layers]) / n,
                   serial_us=graph_time_us(serial) / n, overlap_us=graph_time_us(overlap) / n)
        row["saved_us_a_layer"] = row["serial_us"] - row["overlap_us"]
        rows.append({key: round(v, 2) if isinstance(v, float) else v for key, v in row.items()})
        print(json.dumps(rows[-1]), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                           "model": "qwen3.5-35b-a3b" if a.qwen else "gemma-4-26b-a4b",
                                           "layers": a.layers, "rows": rows}, indent=1))
    return 0 if all(r["outputs_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
