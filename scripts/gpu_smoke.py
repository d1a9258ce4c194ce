"""GPU smoke test: what the CPU suite cannot check, in one device call.

    python3 scripts/gpu_smoke.py --sections tiny [--names dense32,moe32,...] [--out DIR]
    python3 scripts/gpu_smoke.py --sections big [--big gemma-4-26b-a4b --shape 1024x8x64]

tiny: every tiny model (Gemma 4 dense, MoE, PLE + shared KV, K=V, mixed head dims, all features; Qwen3.5 dense
and MoE) runs eager and compiled (CUDA graphs; whole-graph decode forced on, and off for some), in float32
and bfloat16, 3 prompts x 16 greedy tokens. Compiled engines start with fusion_check=error and
jit_monitor=error, so a layer that misses a declared fusion or a kernel compiled after warm-up fails the row.
float32 must equal eager token for token. bfloat16 may diverge only at a near-tie: the row reports the first
divergence with the top-2 logprob gap of both runs at that step (a gap under NEAR_TIE is a tie that rounding
may flip, anything larger is a bug).

big: a released config with dummy weights, compiled with the defaults of `serve` (plus the given batch):
start-up time split into model build and compile, the fusion report, memory, then the throughput of one
shape (output tokens/s, median of 3 runs).

Prints one row per check and a final table; writes gpu_smoke.json to --out. Exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from compiled_llm import LLM, SamplingParams  # noqa: E402

NEAR_TIE = 0.1  # nats between the two most likely tokens
TINY = "dense32,moe32,all32,mixed_heads,ple,shared_kv,k_eq_v,qwen_dense,qwen_moe"
BOTH_DECODE_MODES = {"moe32", "all32"}  # also compiled with whole-graph decode off
RESULTS: dict = {"tiny": [], "big": {}}


def make_tiny(root: Path, name: str) -> Path:
    folder = root / name
    if name.startswith("qwen_"):
        from qwen3_5_tiny import make_qwen_checkpoint

        make_qwen_checkpoint(folder, name.removeprefix("qwen_"))
        return folder
    from tiny_models import CONFIGS, make_checkpoint

    for base in ("dense", "moe", "all"):  # head_dim 32: the Triton attention kernels and whole-graph decode engage
        CONFIGS[f"{base}32"] = dict(CONFIGS[base], head_dim=32, global_head_dim=32)
    make_checkpoint(folder, name)
    return folder


def greedy(llm: LLM, prompts: list[list[int]], n: int = 16):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2))
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def top2_gap(step: dict) -> float:
    top = sorted((lp.logprob for lp in step.values()), reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


def compare(ref, got) -> tuple[int, float | None, float | None]:
    """(tokens agreeing before the first divergence over all prompts, eager gap, compiled gap there)."""
    worst = (min(len(t) for t, _ in ref), None, None)
    for (rt, rl), (gt, gl) in zip(ref, got):
        i = next((i for i, (a, b) in enumerate(zip(rt, gt)) if a != b), len(rt))
        if i < worst[0]:
            worst = (i, top2_gap(rl[i]), top2_gap(gl[i]))
    return worst


def tiny(names: list[str], deadline: float, device: str = "cuda") -> bool:
    ok = True
    root = Path(tempfile.mkdtemp())
    g = torch.Generator().manual_seed(0)
    for name in names:
        if time.monotonic() > deadline:
            print(f"tiny {name}: SKIPPED (time budget)", flush=True)
            RESULTS["tiny"].append({"model": name, "skipped": True})
            continue
        try:
            folder = make_tiny(root, name)
            vocab = json.loads((folder / "config.json").read_text())
            vocab = (vocab.get("text_config") or vocab)["vocab_size"]
            prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 17, 30)]
            for dtype in ("float32", "bfloat16"):
                kw = dict(device=device, dtype=dtype, block_size=16, max_model_len=128, max_num_seqs=4,
                          max_num_batched_tokens=64)
                eager = LLM(str(folder), enforce_eager=True, **kw)
                ref = greedy(eager, prompts)
                del eager
                for decode in (["on", "off"] if name in BOTH_DECODE_MODES else ["on"]):
                    t = time.perf_counter()
                    llm = LLM(str(folder), enforce_eager=False, cudagraph_batch_sizes="1,2,4", full_graph_decode=decode,
                              fusion_check="error", jit_monitor="error", **kw)
                    start = time.perf_counter() - t
                    got = greedy(llm, prompts)
                    one = greedy(llm, prompts[:1])  # a lone sequence: batch 1 decode
                    s = llm.engine.runner.compiler.summary()
                    agree, gap_e, gap_c = compare(ref, got)
                    same_one = one[0][0] == ref[0][0]
                    if dtype == "float32":
                        good = agree == 16 and same_one
                    else:
                        good = agree == 16 or min(gap_e, gap_c) < NEAR_TIE
                    ok &= good
                    row = {"model": name, "dtype": dtype, "decode": decode, "agree": agree, "gap_eager": gap_e,
                           "gap_compiled": gap_c, "lone_ok": same_one, "startup_s": round(start, 1),
                           "whole_graph": s["whole_graph_decode_sizes"], "graphs": s["captured_graphs"],
                           "matches": {k: v["matches"] for k, v in s["passes"].items()}, "ok": good}
                    RESULTS["tiny"].append(row)
                    gaps = "" if agree == 16 else f" first divergence: top-2 gap eager {gap_e:.3f} compiled {gap_c:.3f}"
                    print(f"tiny {name:12s} {dtype:9s} decode={decode:3s} agree={agree:2d}/16 lone={same_one} "
                          f"{'ok' if good else 'FAIL'} start {start:.1f}s whole-graph={s['whole_graph_decode_sizes']}"
                          f"{gaps}", flush=True)
                    del llm
                    gc.collect()
                    torch.cuda.empty_cache()
        except Exception as e:  # report and go on with the next model
            traceback.print_exc()
            print(f"tiny {name}: EXCEPTION {e!r}"[:2000], flush=True)
            RESULTS["tiny"].append({"model": name, "error": repr(e)[:2000], "ok": False})
            ok = False
    return ok


def big(config: str, shape: str) -> bool:
    from configs import write_checkpoint_folder

    p, b, o = (int(x) for x in shape.split("x"))
    folder = write_checkpoint_folder(config, Path(tempfile.mkdtemp()) / config)
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    llm = LLM(str(folder), device="cuda", dtype="bfloat16", load_format="dummy", skip_tokenizer_init=True,
              enable_prefix_caching=False, max_model_len=p + o + 16, max_num_seqs=b, fusion_check="error")
    start = time.perf_counter() - t
    comp = llm.engine.runner.compiler
    s = comp.summary()
    vocab = llm.engine.runner.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, vocab - 1, (p,), generator=g).tolist()} for _ in range(b)]
    params = SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True)
    llm.generate(prompts, params)  # warm
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(prompts, params)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    tok_s = b * o / statistics.median(times)
    stats = llm.engine.get_stats()
    RESULTS["big"] = {
        "config": config, "shape": shape, "tok_s": round(tok_s, 1), "runs_s": [round(x, 3) for x in times],
        "startup_s": round(start, 1), "compile_s": round(comp.startup_seconds, 1),
        "matches": {k: v["matches"] for k, v in s["passes"].items()}, "pieces": s["pieces"],
        "captured_graphs": s["captured_graphs"], "whole_graph": s["whole_graph_decode_sizes"],
        "decode_timings_ms": s["decode_timings_ms"], "counters": s.get("counters"),
        "peak_memory_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 1),
        "kv_blocks": stats.get("num_total_blocks"), "memory_profile": getattr(llm.engine.runner, "memory_profile", None)}
    print(f"big {config} {shape}: {tok_s:.1f} tok/s (runs {RESULTS['big']['runs_s']}), start-up {start:.1f}s "
          f"(compile {comp.startup_seconds:.1f}s), peak {RESULTS['big']['peak_memory_GiB']} GiB", flush=True)
    print(comp.report(), flush=True)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="tiny,big")
    ap.add_argument("--names", default=TINY)
    ap.add_argument("--big", default="gemma-4-26b-a4b")
    ap.add_argument("--shape", default="1024x8x64")
    ap.add_argument("--budget", type=float, default=480, help="seconds for the tiny section before it skips the rest")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the tiny section's logic before a GPU call")
    args = ap.parse_args()
    t0 = time.monotonic()
    ok = True
    RESULTS.update(torch=torch.__version__, date=time.strftime("%Y-%m-%d %H:%M"),
                   device=torch.cuda.get_device_name() if args.device == "cuda" else args.device)
    for section in args.sections.split(","):
        try:
            if section == "tiny":
                ok &= tiny(args.names.split(","), t0 + args.budget, args.device)
            else:
                ok &= big(args.big, args.shape)
        except Exception as e:
            traceback.print_exc()
            print(f"{section}: EXCEPTION {e!r}"[:3000], flush=True)
            RESULTS[section + "_error"] = repr(e)[:3000]
            ok = False
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_smoke.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    print("\nmodel        dtype     decode agree lone  ok   start  whole-graph")
    for r in RESULTS["tiny"]:
        if "agree" in r:
            print(f"{r['model']:12s} {r['dtype']:9s} {r['decode']:6s} {r['agree']:5d} {str(r['lone_ok']):5s} "
                  f"{str(r['ok']):5s} {r['startup_s']:5.1f}s {r['whole_graph']}")
        else:
            print(f"{r['model']:12s} {'skipped' if r.get('skipped') else 'ERROR ' + r.get('error', '')[:80]}")
    if RESULTS["big"]:
        b = RESULTS["big"]
        print(f"{b['config']} {b['shape']}: {b['tok_s']} tok/s, start-up {b['startup_s']}s (compile {b['compile_s']}s), "
              f"matches {b['matches']}, peak {b['peak_memory_GiB']} GiB")
    print("GPU SMOKE", "PASS" if ok else "FAIL", f"({time.monotonic() - t0:.0f}s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
