"""A Gemma 4 MoE layer's two norm chains as Inductor compiles them, per token count: what the persistent rows of
compiler/codegen.py cost at prefill sizes against Inductor's own looped reductions.

    python3 benchmarks/norm_chain.py [--rows 1,8,1024,8192] [--out FILE.json]
    python3 benchmarks/norm_chain.py --dry-run   # CPU: the same chains compiled and checked, not timed

The chains (models/gemma4.py, hidden 2,816 of 26B-A4B): after attention, the post-attention norm, the residual add
and the two pre-feedforward norms (`attn`); after the feedforward, the sum of the 8 routed picks (the MoE's
[tokens, 8, hidden] slots), the two post-feedforward norms, their sum, the post-feedforward norm, the residual add,
the layer scalar and the next layer's input norm (`ffn`). Each is compiled
as the engine compiles its pieces (the token count dynamic, first run at 5 tokens: the warm-up's), under each
persistent-row limit (`COMPILED_LLM_PERSISTENT_ROWS`: ours, 8,192; 0, Inductor's own), and timed at each count in
CUDA-graph replays (us a call), with the bytes the chain must move at least and the rate that makes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).parent))
from graph_timing import graph_time_us  # noqa: E402

from compiled_llm.compiler import codegen  # noqa: E402
from compiled_llm.ops.norm import ref_rms_norm  # noqa: E402
from compiled_llm.passes.moe_overlap import UNROLL_SLOTS  # noqa: E402

EPS = 1e-6


def attn_chain(attn, residual, w_post, w_pre, w_pre2):
    x = residual + ref_rms_norm(attn, w_post, EPS)
    return x, ref_rms_norm(x, w_pre, EPS), ref_rms_norm(x, w_pre2, EPS)


def ffn_chain(dense, slots, residual, w1, w2, w_post, w_next, scalar):
    routed = slots.float().sum(1).to(slots.dtype)  # the k weighted picks of each token (ops/moe_overlap.py slots)
    y = ref_rms_norm(dense, w1, EPS) + ref_rms_norm(routed, w2, EPS)
    x = (residual + ref_rms_norm(y, w_post, EPS)) * scalar
    return x, ref_rms_norm(x, w_next, EPS)


TOP_K = 8  # 26B-A4B's picks a token
# fn, row inputs, weights, row outputs (the second ffn input is the [rows, k, hidden] picks: k rows a row)
CHAINS = {"attn": (attn_chain, 2, 3, 3), "ffn": (ffn_chain, 3, 4, 2)}


def inputs(name: str, rows: int, hidden: int, dev, dt, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    _, n_rows, n_w, _ = CHAINS[name]
    xs = [torch.randn(rows, hidden, generator=g).to(dev, dt) for _ in range(n_rows)]
    if name == "ffn":
        xs[1] = (torch.randn(rows, TOP_K, hidden, generator=g) / TOP_K).to(dev, dt)
    ws = [(1 + 0.1 * torch.randn(hidden, generator=g)).to(dev, dt) for _ in range(n_w)]
    return xs + ws + ([torch.full((1,), 0.5, device=dev, dtype=dt)] if name == "ffn" else [])


def compiled(name: str, limit: int, first: int, hidden: int, dev, dt):
    """The chain compiled with the token count dynamic under the given row limit, first run (so autotuned) at
    `first` tokens (the engine's warm-up: 5)."""
    torch._dynamo.reset()
    os.environ[codegen.ENV] = str(limit)
    fn = torch.compile(CHAINS[name][0], dynamic=False)
    args = inputs(name, first, hidden, dev, dt)
    for a in args[:CHAINS[name][1]]:
        torch._dynamo.mark_dynamic(a, 0)
    with codegen.heuristics():
        fn(*args)
    return fn


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,8,64,256,1024,4096,8192")
    ap.add_argument("--hidden", type=int, default=2816)
    ap.add_argument("--variants", default="8192@5,0@5,0@8192", help="LIMIT@FIRST: the persistent-row limit compiled "
                    "(8192: ours; 0: Inductor's own) and the token count of the first run (its autotuning)")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev, dt = ("cpu", torch.float32) if args.dry_run else ("cuda", torch.bfloat16)
    rows = [1, 8] if args.dry_run else [int(r) for r in args.rows.split(",")]
    variants = [tuple(int(v) for v in spec.split("@")) for spec in args.variants.split(",")]
    # each row limit compiles anew (the limit is not in these caches' keys; the engine's pass manager keys it)
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    torch._inductor.config.unroll_reductions_threshold = UNROLL_SLOTS  # the picks' sum unrolled, as the engine has it
    out = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "hidden": args.hidden, "rows": []}
    with mock.patch.dict(os.environ):  # compiled() sets the row limit; the environment as it was, after
        for name in CHAINS:
            fns = {v: compiled(name, *v, args.hidden, dev, dt) for v in variants}
            n_in, n_out = CHAINS[name][1], CHAINS[name][3]
            for r in rows:
                xs = inputs(name, r, args.hidden, dev, dt, seed=r)
                ref = CHAINS[name][0](*[x.float() for x in xs])
                nbytes = (n_in + n_out + (TOP_K - 1 if name == "ffn" else 0)) * r * args.hidden * xs[0].element_size()
                for (limit, first), fn in fns.items():
                    got = fn(*xs)
                    err = max(float((g.float() - e).abs().max()) for g, e in zip(got, ref))
                    us = None if args.dry_run else graph_time_us(lambda: fn(*xs), replays=20, calls=10)
                    row = dict(chain=name, rows=r, persistent_rows=limit, first_run=first, us=us and round(us, 2),
                               gbps=us and round(nbytes / us / 1e3, 1), max_err=round(err, 4))
                    out["rows"].append(row)
                    print(json.dumps(row), flush=True)
                    assert err < (0.1 if dt == torch.bfloat16 else 1e-3), row
    out["date"] = time.strftime("%Y-%m-%d %H:%M")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
