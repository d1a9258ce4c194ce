"""Decode projections on the GPU: cuBLAS (torch.mm(x, w.T), what the compiled graph runs now) against the Triton
skinny GEMM (compiled_llm/ops/triton/skinny_gemm.py), at the dense projection shapes of Gemma 4 26B-A4B and
Qwen3.5 35B-A3B (TP 1, bf16) and M = 1, 2, 4, 8, 16 token rows, timed with CUDA-graph replays (launch gaps do not
count; graph_time_us from benchmarks/moe_kernels.py). The 10 calls of a timed graph cycle through copies of the
weight (>= 120 MB, twice the L2) so each reads HBM; session 9's run reused one and saw up to 5.3 TB/s.

Shapes come from the model configs (benchmarks/configs.py through the models' config classes): Gemma's merged
[q; k; v] for sliding and global (K=V) layers, o_proj of each, the dense MLP's merged gate_up and down, the LM head
(tied embedding); Qwen's linear-attention input projection as one merged [qkv; z; b; a] (as the model runs it) and
as four GEMMs, out_proj, the full-attention [q (+gate); k; v] and o_proj, the shared expert's gate_up,
down and sigmoid gate, the LM head. The routers are left out (fused Triton kernels already). Each row reports the
weight's size, cuBLAS us and GB/s (weight bytes / time), the default Triton launch, the best Triton launch of the
sweep, the speed-up of the best over cuBLAS, and the engine's launch (`decode_launch`, what the compiled graph's
skinny_mm takes) with its time. `--try` times named launches instead of a grid. Per-step totals weigh each shape by how many times a decode step
runs it.

Every Triton launch is first checked against the float32 product of the same bf16 inputs (within one bf16 unit
in the last place); a launch that fails or does not compile is skipped (reported). Exit status 1 if the default
launch fails a check.

    python3 benchmarks/skinny_gemm.py [--models gemma,qwen] [--tokens 1,2,4,8,16] [--sweep] [--out FILE.json]
    python3 benchmarks/skinny_gemm.py --tokens 1,8 --try '64,128,4,4,4;32,256,4,4,3'   # these launches only
    python3 benchmarks/skinny_gemm.py --device cpu --dry-run   # shapes, and the whole path at tiny sizes on
                                                               # the CPU through the Triton interpreter
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

if "--dry-run" in sys.argv or "cpu" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from benchmarks.configs import config_dict  # noqa: E402
from compiled_llm.ops.linear import WIDE_MEASURED  # noqa: E402
from compiled_llm.ops.triton import skinny_gemm as S  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Shape:
    model: str
    name: str
    N: int
    K: int
    per_step: int  # calls per decode step (0: an alternative form, not in the step total)

    def weight_bytes(self, itemsize: int = 2) -> int:
        return self.N * self.K * itemsize


def gemma_shapes(preset: str = "gemma-4-26b-a4b") -> list[Shape]:
    from compiled_llm.models.gemma4_config import Gemma4TextConfig

    cfg = Gemma4TextConfig.from_dict(config_dict(preset))
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    counts: dict[tuple, int] = {}
    for i, ls in enumerate(cfg.layers):  # as models/gemma4.py Attention builds them
        kind = "sliding" if ls.sliding_window else "global"
        kv = 0 if ls.kv_source != i else (1 if ls.k_eq_v else 2)  # q alone where a layer reads another's cache
        for key in ((f"{kind} qkv", (heads + kv * ls.num_kv_heads) * ls.head_dim, h),
                    (f"{kind} o_proj", h, heads * ls.head_dim),
                    ("mlp gate_up", 2 * ls.intermediate_size, h), ("mlp down", h, ls.intermediate_size)):
            counts[key] = counts.get(key, 0) + 1
    out = [Shape(preset, name, N, K, c) for (name, N, K), c in counts.items()]
    return out + [Shape(preset, "lm_head", cfg.vocab_size, h, 1)]


def qwen_shapes(preset: str = "qwen3.5-35b-a3b") -> list[Shape]:
    from compiled_llm.models.qwen3_5_config import LINEAR, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig.from_dict(config_dict(preset), moe=True)
    h, d = cfg.hidden_size, cfg.head_dim
    n_lin = sum(t == LINEAR for t in cfg.layer_types)
    n_full = cfg.num_hidden_layers - n_lin
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    v_heads = cfg.linear_num_value_heads
    value_dim = v_heads * cfg.linear_value_head_dim
    qkv = 2 * key_dim + value_dim
    se = cfg.shared_expert_intermediate_size
    return [
        # the model runs the merged projection (one GEMM a layer); the four separate ones are the alternative
        Shape(preset, "linear in_proj_qkv", qkv, h, 0),
        Shape(preset, "linear in_proj_z", value_dim, h, 0),
        Shape(preset, "linear in_proj_b", v_heads, h, 0),
        Shape(preset, "linear in_proj_a", v_heads, h, 0),
        Shape(preset, "linear in_proj [qkv;z;b;a] merged", qkv + value_dim + 2 * v_heads, h, n_lin),
        Shape(preset, "linear out_proj", h, value_dim, n_lin),
        Shape(preset, "full qkv (q+gate)", cfg.num_attention_heads * 2 * d + 2 * cfg.num_key_value_heads * d, h,
              n_full),
        Shape(preset, "full o_proj", h, cfg.num_attention_heads * d, n_full),
        Shape(preset, "shared_expert gate_up", 2 * se, h, cfg.num_hidden_layers),
        Shape(preset, "shared_expert down", h, se, cfg.num_hidden_layers),
        Shape(preset, "shared_expert_gate", 1, h, cfg.num_hidden_layers),
        Shape(preset, "lm_head", cfg.vocab_size, h, 1),
    ]


MODELS = {"gemma": gemma_shapes, "qwen": qwen_shapes}


def sweep_launches(M: int, K: int, full: bool) -> list[S.SkinnyLaunch]:
    """Tensor-core launches over split 1/2/4/8 (those K allows). Quick (default): 16/32/64 rows x 256 columns and
    16/32 rows x 512 columns, 4 warps, 3 stages (20 launches; 5 tile shapes, 20 builds over the shapes here). --sweep: 16..128 rows x 128/256/512
    columns x (warps, stages) in (4, 3), (8, 3), (4, 4), (8, 2) (~190 builds: minutes), and for M <= 2 the multiply-and-sum path
    (16/32/64 rows x 256 columns, 4 warps, 3 stages)."""
    if full:
        grid = [(bn, bk, sk, nw, ns, True) for bn, bk, sk, (nw, ns) in itertools.product(
            (16, 32, 64, 128), (128, 256, 512), (1, 2, 4, 8), ((4, 3), (8, 3), (4, 4), (8, 2)))]
        if M <= 2:
            grid += itertools.product((16, 32, 64), (256,), (1, 2, 4, 8), (4,), (3,), (False,))
    else:
        grid = list(itertools.product((16, 32, 64), (256,), (1, 2, 4, 8), (4,), (3,), (True,)))
        grid += itertools.product((16, 32), (512,), (1, 2, 4, 8), (4,), (3,), (True,))
    seen, out = set(), []
    for bn, bk, sk, nw, ns, dot in grid:
        bk = max(16, min(bk, 1 << (K - 1).bit_length()))
        split = S._effective_split(K, bk, sk)
        if split != sk and sk > 1:
            continue  # K too short for this many slices (the smaller split is in the grid already)
        if bn * bk * 2 * ns > 200 * 1024:
            continue  # the weight tiles alone exceed shared memory
        for merge in ((False, True) if split > 1 else (False,)):  # the partials summed in the kernel, too
            lp = S.SkinnyLaunch(bn, bk, split, nw, ns, dot, merge)
            if lp not in seen:
                seen.add(lp)
                out.append(lp)
    return out


def parse_launch(spec: str) -> S.SkinnyLaunch:
    """'block_n,block_k,split_k,warps,stages[,merge]' (tensor-core dot; merge 1: the last program adds the slices)."""
    f = [int(v) for v in spec.split(",")]
    return S.SkinnyLaunch(f[0], f[1], f[2], f[3], f[4], True, bool(f[5]) if len(f) > 5 else f[2] > 1)


def cpu_time_us(fn, reps: int) -> float:
    reps = 2
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1e6 / reps


def check(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Worst error in units of the bound: one bf16 ulp of the reference (relative 2^-7) plus 1e-3 absolute
    (the inputs are scaled so outputs are ~N(0, 1)); <= 1 passes."""
    if not torch.isfinite(got).all():
        return float("inf")
    err = (got.float() - ref).abs()
    return float((err / (1e-3 + ref.abs() * 2.0 ** -7)).max())


def bench_shape(shape: Shape, tokens: list[int], launches_for, dev, dt, timer, gen) -> tuple[list[dict], bool]:
    """Rows for one weight at each M. launches_for(M): the launches to try besides the default."""
    w = (torch.randn(shape.N, shape.K, device=dev, generator=gen) * shape.K ** -0.5).to(dt)
    wf = w.float()
    rows, failed = [], False
    mb = shape.weight_bytes(w.element_size()) / 1e6
    # the timed graph holds 10 calls; they cycle through copies of the weight, >= 120 MB in all (twice the H200's
    # L2), so a call reads its weight from HBM as in a decode step, not from the L2 the previous call filled
    copies = [w] + [w.clone() for _ in range(min(9, math.ceil(120 / max(mb, 1e-3))) - 1)]
    for M in tokens:
        x = torch.randn(M, shape.K, device=dev, generator=gen).to(dt)
        ref = x.float() @ wf.t()
        row = dict(model=shape.model, name=shape.name, M=M, N=shape.N, K=shape.K, weight_mb=round(mb, 3),
                   per_step=shape.per_step, cublas_err=round(check(torch.mm(x, w.t()), ref), 3))
        reps = max(5, min(50, int(0.02 / (10 * shape.weight_bytes(w.element_size()) / 3e12))))  # ~20 ms a timing
        ws = itertools.cycle(copies)
        row["cublas_us"] = round(timer(lambda: torch.mm(x, next(ws).t()), reps), 2)
        default = S.skinny_launch(M, shape.N, shape.K, S.num_sms(x.device), x.element_size())
        engine = S.decode_launch(shape.N, shape.K)  # what decode_mm (the compiled graph's skinny_mm) launches
        results = []
        for lp in [default] + [lp for lp in [engine, *launches_for(M)] if lp != default]:
            r = dict(launch=dataclasses.asdict(lp), default=lp == default)
            try:
                r["err"] = round(check(S.skinny_mm(x, w, lp), ref), 3)
                r["ok"] = r["err"] <= 1.0
                if r["ok"]:
                    r["us"] = round(timer(lambda: S.skinny_mm(x, next(ws), lp), reps), 2)
            except Exception as exc:  # a sweep shape that does not compile (shared memory, registers)
                r.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:200])
            if lp == default and not r["ok"]:
                failed = True
                print(f"FAIL default launch {lp} on {shape.name} M={M}: {r}", flush=True)
            results.append(r)
        good = [r for r in results if r.get("us") is not None]
        row["default_us"] = results[0].get("us")
        row["default_launch"] = results[0]["launch"]
        row["engine_us"] = next(r.get("us") for r in results if r["launch"] == dataclasses.asdict(engine))
        row["engine_launch"] = dataclasses.asdict(engine)
        best = min(good, key=lambda r: r["us"], default=None)
        row["best_us"] = best and best["us"]
        row["best_launch"] = best and best["launch"]
        row["skipped"] = [r for r in results if not r["ok"]]
        row["launches"] = results
        rows.append(row)
    return rows, failed


def _gbs(mb: float, us) -> str:
    return f"{mb * 1e6 / (us * 1e-6) / 1e9:7.0f}" if us else "      -"


def _launch_str(lp: dict | None) -> str:
    if not lp:
        return "-"
    return (f"n{lp['block_n']} k{lp['block_k']} s{lp['split_k']} w{lp['num_warps']} st{lp['num_stages']}"
            + ("" if lp["dot"] else " fma"))


def print_table(rows: list[dict]) -> None:
    head = (f"{'M':>3} {'N':>7} {'K':>5} {'MB':>8} | {'cuBLAS us':>9} {'GB/s':>7} | {'default us':>10} {'GB/s':>7} | "
            f"{'best us':>8} {'GB/s':>7} {'best launch':<28} | {'speed-up':>8}")
    for key in dict.fromkeys((r["model"], r["name"]) for r in rows):
        rs = [r for r in rows if (r["model"], r["name"]) == key]
        print(f"\n{key[0]}: {key[1]}  (x{rs[0]['per_step']} per step)\n{head}")
        for r in rs:
            sp = f"{r['cublas_us'] / r['best_us']:8.2f}" if r["best_us"] else "       -"
            if r.get("engine_us") is not None:
                sp += f"   engine ({_launch_str(r['engine_launch'])}) {r['engine_us']:.2f}"
            print(f"{r['M']:>3} {r['N']:>7} {r['K']:>5} {r['weight_mb']:>8.2f} | {r['cublas_us']:>9.2f} "
                  f"{_gbs(r['weight_mb'], r['cublas_us'])} | {r['default_us'] or 0:>10.2f} "
                  f"{_gbs(r['weight_mb'], r['default_us'])} | {r['best_us'] or 0:>8.2f} "
                  f"{_gbs(r['weight_mb'], r['best_us'])} {_launch_str(r['best_launch']):<28} | {sp}", flush=True)


def step_totals(rows: list[dict]) -> list[dict]:
    """Per model and M, with and without the LM head: sum over shapes of per_step x time (us), cuBLAS / default /
    best launch, and the weight bytes at 4.2 TB/s (the copy bandwidth measured on the H200)."""
    out = []
    for (model, M), lm in itertools.product(dict.fromkeys((r["model"], r["M"]) for r in rows), (False, True)):
        rs = [r for r in rows if r["model"] == model and r["M"] == M and r["per_step"]
              and (lm or r["name"] != "lm_head")]
        tot = dict(model=model, M=M, lm_head=lm, cublas_us=0.0, default_us=0.0, best_us=0.0, at_bandwidth_us=0.0)
        for r in rs:
            n = r["per_step"]
            tot["cublas_us"] += n * r["cublas_us"]
            tot["default_us"] += n * (r["default_us"] or r["cublas_us"])
            tot["best_us"] += n * min(r["best_us"] or r["cublas_us"], r["cublas_us"])
            tot["at_bandwidth_us"] += n * r["weight_mb"] * 1e6 / 4.2e12 * 1e6
        out.append({k: round(v, 1) if isinstance(v, float) else v for k, v in tot.items()})
    return out


WIDE_MARGIN = 0.03  # a wide shape enters ops/linear.py's table when WIDE_LAUNCH beats cuBLAS by this at every M


def wide_table(rows: list[dict], margin: float = WIDE_MARGIN) -> list[tuple[int, int]]:
    """The wide weights (N >= K) whose products ran at least `margin` faster with skinny_gemm.WIDE_LAUNCH than with
    cuBLAS at every row count measured: the entry for this GPU in ops/linear.py WIDE_MEASURED."""
    wide = dataclasses.asdict(S.WIDE_LAUNCH)
    by_shape: dict[tuple[int, int], list[bool]] = {}
    for r in rows:
        if r["N"] < r["K"]:
            continue
        us = next((lr.get("us") for lr in r["launches"] if lr["launch"] == wide), None)
        by_shape.setdefault((r["N"], r["K"]), []).append(us is not None and us * (1 + margin) <= r["cublas_us"])
    return sorted(shape for shape, wins in by_shape.items() if all(wins))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gemma,qwen")
    ap.add_argument("--tokens", default="1,2,4,8,16")
    ap.add_argument("--only", default=None, help="comma-separated substrings of shape names to keep")
    ap.add_argument("--sweep", action="store_true", help="the full launch grid (slow: minutes)")
    ap.add_argument("--quick", action="store_true", help="the small launch grid (the default)")
    ap.add_argument("--try", dest="try_", default=None, help="only these launches besides the defaults, ';'-separated "
                    "block_n,block_k,split_k,warps,stages[,merge] (e.g. '64,128,4,4,4,1;32,256,4,4,3,1')")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dry-run", action="store_true",
                    help="list the shapes, then run the whole path at tiny sizes (CPU: Triton interpreter)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev, dt = torch.device(a.device), torch.bfloat16
    shapes = [s for m in a.models.split(",") for s in MODELS[m]()]
    if a.only:
        shapes = [s for s in shapes if any(o in s.name for o in a.only.split(","))]
    tokens = [int(t) for t in a.tokens.split(",")]
    print("shapes (N x K, bf16 MB, calls per step):")
    for s in shapes:
        print(f"  {s.model:16} {s.name:34} {s.N:>7} x {s.K:<5} {s.weight_bytes() / 1e6:9.2f} MB  x{s.per_step}")
    if a.dry_run:  # the same code path at tiny sizes: two shapes shrunk, M 1 and 3, a few launches
        shapes = [dataclasses.replace(s, N=min(s.N, 40), K=min(s.K, 96)) for s in shapes[:2]]
        tokens = [1, 3]
    if dev.type == "cuda":
        from benchmarks.moe_kernels import graph_time_us

        torch.backends.cuda.matmul.allow_tf32 = False

        def timer(fn, reps):
            return graph_time_us(fn, reps)
    else:
        timer = cpu_time_us
    gen = torch.Generator(device=dev).manual_seed(0)
    rows, failed, t0 = [], False, time.time()
    tried = [parse_launch(spec) for spec in (a.try_ or "").split(";") if spec]
    for s in shapes:
        def launches_for(M, K=s.K):
            if a.dry_run:
                return [S.SkinnyLaunch(16, 32, 1, 4, 2), S.SkinnyLaunch(16, 32, 2, 4, 2, dot=False)]
            if a.try_:
                return tried
            return sweep_launches(M, K, a.sweep and not a.quick)

        r, f = bench_shape(s, tokens, launches_for, dev, dt, timer, gen)
        rows += r
        failed |= f
    print_table(rows)
    totals = step_totals(rows)
    print("\nper decode step (us, shapes x calls per step; best: the faster of cuBLAS and the best launch per shape):")
    for t in totals:
        print(f"  {t['model']:16} M={t['M']:>2} {'with' if t['lm_head'] else 'w/o '} lm_head: cuBLAS {t['cublas_us']:8.1f}  Triton default {t['default_us']:8.1f}  "
              f"best {t['best_us']:8.1f}  weights at 4.2 TB/s {t['at_bandwidth_us']:8.1f}")
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    wide = wide_table(rows)
    print(f"\nwide shapes (N >= K; WIDE_LAUNCH {WIDE_MARGIN:.0%} faster than cuBLAS at every M) on {name}: {wide}"
          f"\n  (ops/linear.py WIDE_MEASURED has {sorted(WIDE_MEASURED.get(name, ()))})")
    print(f"\n{len(rows)} rows in {time.time() - t0:.0f} s")
    if a.out:
        info = dict(device=name, torch=torch.__version__, sms=S.num_sms(dev), sweep=a.sweep, dry_run=a.dry_run)
        Path(a.out).write_text(json.dumps(dict(info, rows=rows, step_totals=totals, wide_shapes=wide), indent=1,
                                          default=str))
    print("FAILED: the default launch failed a check" if failed else "all default-launch checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
