"""GPU smoke test: what the CPU suite cannot check, in one device call.

    python3 scripts/gpu_smoke.py --sections tiny [--names dense32,moe32,...] [--out DIR]
    python3 scripts/gpu_smoke.py --sections big [--big gemma-4-26b-a4b --shape 1024x8x64]

tiny: every tiny model (Gemma 4 dense, MoE, PLE + shared KV, K=V, mixed head dims, all features; Qwen3.5 dense
and MoE, with head_dim 16 and 32: qwen_*32 must get whole-graph decode) runs eager and compiled (CUDA graphs; whole-graph decode forced on, and off for some), in float32
and bfloat16, 3 prompts x 16 greedy tokens. Compiled engines start with fusion_check=error and
jit_monitor=error, so a layer that misses a declared fusion or a kernel compiled after warm-up fails the row.
float32 must equal eager token for token. bfloat16 is judged against float32 eager: teacher-forced steps (each
prompt extended by the float32 continuation; a prefill and a decode step each) must be as close to float32
eager's logprobs as bfloat16 eager's are (BF16_ERR_RATIO, BF16_ERR_SLACK); token agreement and the top-2 gaps
at the first divergence are reported, since a random tiny model is full of near-ties.

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
from compiled_llm.ops.jit import MONITOR  # noqa: E402
from graph_timing import start_profiler  # noqa: E402

# bfloat16 rows pass when the compiled engine's logprobs are as close to float32 eager's (teacher-forced, top-5
# tokens of 18 steps) as bfloat16 eager's are, within this ratio and slack (nats): token agreement alone cannot
# tell rounding from a bug, since a random tiny model is full of near-ties
BF16_ERR_RATIO, BF16_ERR_SLACK = 2.0, 0.02
# float32 rows: the compiled engine's logprobs equal float32 eager's within this (nats): the sharp bug detector
# (session 20: 0.0000 on the GPU for tiny Qwen3.5; its bf16 error moved from 0.17 to 0.41 with roundings alone)
F32_ERR_MAX = 0.01
TINY = "dense32,moe32,all32,mixed_heads,ple,shared_kv,k_eq_v,qwen_dense,qwen_moe,qwen_dense32,qwen_moe32"
# also compiled with whole-graph decode off (moe32 agreed in both modes, sessions 3-4)
BOTH_DECODE_MODES = {"all32", "qwen_dense32"}
# must capture decode whole on a GPU (a row without whole-graph sizes fails): the Qwen3.5 models with head_dim 32,
# whose attention takes the Triton kernel, and whose state ops read their layout from static buffers
WHOLE_GRAPH_EXPECTED = {"qwen_dense32", "qwen_moe32"}
RESULTS: dict = {"tiny": [], "big": {}}
OUT: Path | None = None


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


def probes(llm: LLM, prompts: list[list[int]], ref_tokens: list[list[int]]) -> list[dict]:
    """Teacher-forced steps: each prompt extended by 0, 6 and 12 tokens of the float32 eager continuation,
    two greedy steps each (a prefill and a decode step); the top-20 logprobs of every step."""
    ext = [p + r[:j] for p, r in zip(prompts, ref_tokens) for j in (0, 6, 12)]
    outs = llm.generate([{"prompt_token_ids": p} for p in ext],
                        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=20))
    return [{t: lp.logprob for t, lp in step.items()} for o in outs for step in o.outputs[0].logprobs]


def logprob_error(got: list[dict], ref: list[dict]) -> float:
    """Mean over steps of the largest |logprob difference| over the reference's five likeliest tokens (a token
    missing from the other top-20 counts at the other's smallest listed logprob)."""
    errs = []
    for g, r in zip(got, ref):
        top = sorted(r, key=r.get, reverse=True)[:5]
        floor = min(g.values())
        errs.append(max(abs(g.get(t, floor) - r[t]) for t in top))
    return sum(errs) / len(errs)


def release(device: str) -> None:
    """Frees what a dropped engine held (its KV cache takes most of the device) before the next one starts."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def cast_emulated_error(folder: Path, prompts, ref32, probe32, decode: str, kw: dict) -> float:
    """The bf16 logprob error of the same engine compiled with Inductor's emulate_precision_casts (every op's
    result rounded to bfloat16 as eager rounds it). A row whose error is over the bound only because a fused
    kernel kept float32 intermediates comes back within it here; a wrong graph does not (its float32 row fails
    too)."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    try:
        with inductor_config.patch(emulate_precision_casts=True):
            again = LLM(str(folder), enforce_eager=False, full_graph_decode=decode,
                        cudagraph_batch_sizes="1,2,4" if kw["device"] == "cuda" else None, **kw)
            return logprob_error(probes(again, prompts, ref32), probe32)
    finally:
        again = None  # noqa: F841
        torch._dynamo.reset()
        release(kw["device"])


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
                if dtype == "bfloat16" and time.monotonic() > deadline:  # the budget is checked per dtype too
                    print(f"tiny {name} bfloat16: SKIPPED (time budget)", flush=True)
                    RESULTS["tiny"].append({"model": name, "dtype": dtype, "skipped": True})
                    continue
                kw = dict(device=device, dtype=dtype, block_size=16, max_model_len=128, max_num_seqs=4,
                          max_num_batched_tokens=64)
                eager = LLM(str(folder), enforce_eager=True, **kw)
                ref = greedy(eager, prompts)
                if dtype == "float32":
                    ref32 = [t for t, _ in ref]
                    probe32 = probes(eager, prompts, ref32)
                    err_eager = None
                else:
                    err_eager = logprob_error(probes(eager, prompts, ref32), probe32)
                del eager
                for decode in (["on", "off"] if name in BOTH_DECODE_MODES else ["on"]):
                    t = time.perf_counter()
                    llm = LLM(str(folder), enforce_eager=False, cudagraph_batch_sizes="1,2,4", full_graph_decode=decode,
                              fusion_check="error", jit_monitor="error", **kw)
                    start = time.perf_counter() - t
                    got = greedy(llm, prompts)
                    one = greedy(llm, prompts[:1])  # a lone sequence: batch 1 decode
                    s = llm.engine.executor.runner.compiler.summary()
                    agree, gap_e, gap_c = compare(ref, got)
                    same_one = one[0][0] == ref[0][0]
                    err, err_cast = logprob_error(probes(llm, prompts, ref32), probe32), None
                    if dtype == "float32":
                        good = agree == 16 and same_one and err <= F32_ERR_MAX
                    else:  # as close to float32 eager as bfloat16 eager is (token agreement is reported only)
                        good = err <= BF16_ERR_RATIO * err_eager + BF16_ERR_SLACK
                        if not good:  # rounding, or a bug? compiled again with eager's roundings (each op's
                            # result cast to bfloat16, as eager stores it, instead of float32 inside a fused kernel)
                            llm = None
                            release(device)
                            err_cast = cast_emulated_error(folder, prompts, ref32, probe32, decode, kw)
                            good = err_cast <= BF16_ERR_RATIO * err_eager + BF16_ERR_SLACK
                    if decode == "on" and device == "cuda" and name in WHOLE_GRAPH_EXPECTED:
                        good &= bool(s["whole_graph_decode_sizes"])
                    ok &= good
                    row = {"model": name, "dtype": dtype, "decode": decode, "agree": agree, "gap_eager": gap_e,
                           "gap_compiled": gap_c, "logprob_err": err, "logprob_err_eager": err_eager,
                           "logprob_err_casts_emulated": err_cast,
                           "lone_ok": same_one, "startup_s": round(start, 1),
                           "whole_graph": s["whole_graph_decode_sizes"], "graphs": s["captured_graphs"],
                           "matches": {k: v["matches"] for k, v in s["passes"].items()}, "ok": good}
                    RESULTS["tiny"].append(row)
                    gaps = "" if agree == 16 else f" first divergence: top-2 gap eager {gap_e:.3f} compiled {gap_c:.3f}"
                    if err_eager is None:
                        gaps += f" | logprob error vs float32 eager: {err:.4f}"
                    else:
                        gaps += f" | logprob error vs float32 eager: compiled {err:.4f}, bf16 eager {err_eager:.4f}"
                    if err_cast is not None:
                        gaps += f", compiled with eager's casts {err_cast:.4f}"
                    print(f"tiny {name:12s} {dtype:9s} decode={decode:3s} agree={agree:2d}/16 lone={same_one} "
                          f"{'ok' if good else 'FAIL'} start {start:.1f}s whole-graph={s['whole_graph_decode_sizes']}"
                          f"{gaps}", flush=True)
                    del llm
                    release(device)
        except Exception as e:  # report and go on with the next model
            traceback.print_exc()
            print(f"tiny {name}: EXCEPTION {e!r}"[:2000], flush=True)
            RESULTS["tiny"].append({"model": name, "error": repr(e)[:2000], "ok": False})
            ok = False
            eager = llm = None  # the failed model's engine would otherwise hold its memory through the next one
            release(device)
    return ok


ABLATE = None  # --ablate: a timing-only change of the model (wrong tokens), named in the results


def big(config: str, shape: str, compile_sizes: str | None = None, max_autotune: str = "off", tp: int = 1,
        tp_allreduce: str = "nccl", compile_passes: str | None = None) -> bool:
    from configs import write_checkpoint_folder

    p, b, o = (int(x) for x in shape.split("x"))
    folder = write_checkpoint_folder(config, Path(tempfile.mkdtemp()) / config)
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    llm = LLM(str(folder), device="cuda", dtype="bfloat16", load_format="dummy", skip_tokenizer_init=True,
              enable_prefix_caching=False, max_model_len=p + o + 16, max_num_seqs=b,
              fusion_check="warn" if ABLATE else "error",
              compile_sizes=compile_sizes, max_autotune=max_autotune, tensor_parallel_size=tp,
              tp_allreduce=tp_allreduce, compile_passes=compile_passes, jit_monitor="warn",
              async_scheduling=False)  # synchronous first; async_run then flips the same engine over
    start = time.perf_counter() - t
    comp = llm.engine.executor.runner.compiler  # rank 0's (the driver runs rank 0 in this process)
    s = comp.summary()
    vocab = llm.engine.executor.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, vocab - 1, (p,), generator=g).tolist()} for _ in range(b)]
    params = SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True)
    ref = llm.generate(prompts, params)  # warm; async scheduling's tokens must equal these
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
        "config": config, "shape": shape, "ablate": ABLATE, "compile_sizes": compile_sizes, "max_autotune": max_autotune, "tp": tp, "tp_allreduce": tp_allreduce,
        "tok_s": round(tok_s, 1), "runs_s": [round(x, 3) for x in times],
        "startup_s": round(start, 1), "compile_s": round(comp.startup_seconds, 1),
        "matches": {k: v["matches"] for k, v in s["passes"].items()}, "pieces": s["pieces"],
        "shared_compiles": s.get("shared_compiles"),
        "captured_graphs": s["captured_graphs"], "whole_graph": s["whole_graph_decode_sizes"],
        "decode_timings_ms": s["decode_timings_ms"], "counters": s.get("counters"),
        "warmup_seconds": s.get("warmup_seconds"),
        "peak_memory_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 1),
        "kv_blocks": stats.get("num_total_blocks"), "memory_profile": getattr(llm.engine.executor.runner, "memory_profile", None),
        # kernels compiled after warm-up, in the timed runs (a prompt size whose build warm-up missed)
        "late_jit_compiles": list(MONITOR.late)}
    RESULTS["big"]["profile"] = profile(llm, prompts, o)
    print(f"big {config} {shape}: {tok_s:.1f} tok/s (runs {RESULTS['big']['runs_s']}), start-up {start:.1f}s "
          f"(compile {comp.startup_seconds:.1f}s), peak {RESULTS['big']['peak_memory_GiB']} GiB", flush=True)
    if llm.engine.executor.supports_async_scheduling:  # the same engine, async scheduling on: side by side
        RESULTS["big"]["async"] = async_run(llm, prompts, params, o, ref)
    print(comp.report(), flush=True)
    return True


def async_run(llm: LLM, prompts: list[dict], params: SamplingParams, out_tokens: int, ref) -> dict:
    """Throughput with async scheduling on (the engine as it is, the flag flipped), its greedy tokens against
    the synchronous run's, its step profile, and the host syncs left in a decode step (torch's sync debug
    mode: each blocking copy or .item() in the step path is a place the overlap stops)."""
    import warnings
    from collections import Counter

    engine = llm.engine
    engine.async_scheduling = True
    try:
        got = llm.generate(prompts, params)
        equal = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(ref, got))
        times = []
        for _ in range(3):
            sync()
            t = time.perf_counter()
            llm.generate(prompts, params)
            sync()
            times.append(time.perf_counter() - t)
        tok_s = len(prompts) * out_tokens / statistics.median(times)
        prof = profile(llm, prompts, out_tokens, tag="_async")
        short = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        llm.generate(prompts, short)
        gpu = torch.cuda.is_available()
        rpc = getattr(engine.executor, "collective_rpc", None)  # tensor parallel: the workers' syncs too
        if rpc and gpu:
            rpc("sync_debug", True)
        if gpu:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                llm.generate(prompts, short)
        finally:
            if gpu:
                torch.cuda.set_sync_debug_mode(0)
        where = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught)
        workers = rpc("sync_debug", False)[1:] if rpc and gpu else []
    finally:
        engine.async_scheduling = False
    res = {"tok_s": round(tok_s, 1), "runs_s": [round(x, 3) for x in times], "tokens_equal": f"{equal}/{len(ref)}",
           "async_steps": engine.async_steps, "profile": prof, "syncs_in_24_steps": len(caught),
           "sync_sites": where.most_common(12), "worker_sync_sites": workers}
    print(f"big async scheduling: {tok_s:.1f} tok/s (runs {res['runs_s']}), tokens equal {res['tokens_equal']}, "
          f"{len(caught)} host syncs in a 24-token generate: {where.most_common(6)}"
          + (f"; workers' (rank 1..): {workers}" if workers else ""), flush=True)
    return res


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_report(host, tag: str = "") -> None:
    """The host functions of the profiled decode steps by cumulative time (profile_host.txt in --out)."""
    import io
    import pstats

    buf = io.StringIO()
    pstats.Stats(host, stream=buf).sort_stats("cumulative").print_stats(45)
    text = buf.getvalue()
    if OUT:
        (OUT / f"profile_host{tag}.txt").write_text(text)
    print(text[:5000], flush=True)


def profile(llm: LLM, prompts: list[dict], out_tokens: int, tag: str = "") -> dict:
    """Where one generate call's time goes: the wall time of each engine step (prefill chunks, then decode),
    the GPU-busy share of decode steps and the kernels that take it (torch.profiler over 16 decode steps;
    the table goes to profile_decode.txt in --out)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=out_tokens, ignore_eos=True)
    for i, pr in enumerate(prompts):
        engine.add_request(f"prof-{i}", pr["prompt_token_ids"], params)
    steps, kinds = [], []
    prof_at, prof_n, prof = 8, 16, None
    host_at, host_n, host, host_done = 40, 32, None, False  # a Python profile of the host side of 32 decode steps
    decode_seen = 0
    while engine.has_unfinished_requests():
        if decode_seen == host_at and host is None:
            import cProfile

            host = cProfile.Profile()
            host.enable()
        elif decode_seen == host_at + host_n and host is not None and not host_done:
            host.disable()
            host_report(host, tag)
            host_done = True
        if decode_seen == prof_at and prof is None:
            sync()
            prof = start_profiler()
            prof_t = time.perf_counter()
        t = time.perf_counter()
        outs = engine.step()
        steps.append(time.perf_counter() - t)
        n_out = sum(len(o.outputs[0].token_ids) for o in outs) if outs else 0
        kinds.append(n_out)
        if n_out and any(kinds[:-1]):
            decode_seen += 1
        if prof is not None and decode_seen == prof_at + prof_n and not getattr(prof, "_done", False):
            sync()
            prof_wall = time.perf_counter() - prof_t
            prof.__exit__(None, None, None)
            prof._done = True
    if host is not None and not host_done:  # the run ended inside the profiled window
        host.disable()
    if prof is not None and not getattr(prof, "_done", False):
        prof.__exit__(None, None, None)
        prof = None
    first_token = next(i for i, k in enumerate(kinds) if k)
    prefill = steps[:first_token + 1]
    decode = steps[first_token + 1:]
    res = {"steps": len(steps), "prefill_steps_s": [round(x, 4) for x in prefill],
           "decode_step_ms_median": round(1e3 * statistics.median(decode), 2),
           "decode_step_ms_p90": round(1e3 * sorted(decode)[int(0.9 * len(decode))], 2),
           "decode_total_s": round(sum(decode), 3), "prefill_total_s": round(sum(prefill), 3)}
    if prof is not None and getattr(prof, "_done", False):
        ka = prof.key_averages()
        table = ka.table(sort_by="self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total",
                         row_limit=40, max_name_column_width=90)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy_us = sum(e.time_range.elapsed_us() for e in kernels)
        res.update(profiled_steps=prof_n, profiled_wall_ms=round(1e3 * prof_wall, 1),
                   gpu_busy_ms=round(busy_us / 1e3, 1), gpu_kernels=len(kernels),
                   gpu_busy_share=round(busy_us / 1e6 / prof_wall, 3))
        if OUT:
            (OUT / f"profile_decode{tag}.txt").write_text(table)
            # one decode step's kernels in launch order (which kernels a layer runs, and what each costs)
            # with each kernel's start from the step's first and its stream: the critical path across the
            # main and side streams (the routed experts run beside the dense branch)
            seq = sorted(kernels, key=lambda e: e.time_range.start)[len(kernels) // prof_n: 2 * len(kernels) // prof_n]
            t0 = seq[0].time_range.start if seq else 0
            (OUT / f"kernel_sequence{tag}.txt").write_text("".join(
                f"{e.time_range.start - t0:9.1f} +{e.time_range.elapsed_us():8.2f} us  s{getattr(e, 'device_resource_id', 0)}  "
                f"{e.name[:100]}\n" for e in seq))
        print(table[:6000], flush=True)
    print("profile:", json.dumps(res), flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="tiny,big")
    ap.add_argument("--names", default=TINY)
    ap.add_argument("--big", default="gemma-4-26b-a4b")
    ap.add_argument("--shape", default="1024x8x64")
    ap.add_argument("--budget", type=float, default=480, help="seconds for the tiny section before it skips the rest")
    ap.add_argument("--out", default=None)
    ap.add_argument("--max-autotune", default="off", help="big: off | static | all (Inductor GEMM autotuning)")
    ap.add_argument("--compile-sizes", default=None, help="big: `all` gives each batch size its own static compile (default: none, every size replays the dynamic compile)")
    ap.add_argument("--tp", type=int, default=1, help="big: tensor-parallel size (the profile is rank 0's; sync "
                    "and async scheduling side by side, with every rank's host syncs)")
    ap.add_argument("--compile-passes", default=None, help="big: the fusion passes to run (default: all that apply)")
    ap.add_argument("--tp-allreduce", default="nccl", help="big, --tp 2: nccl or symm-mem")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the tiny section's logic before a GPU call")
    ap.add_argument("--ablate", default=None, choices=["gated_mlp"],
                    help="big, timing only (the tokens are wrong): gated_mlp makes every GatedMLP (Gemma 4's dense "
                         "MLP, Qwen3.5's shared expert) return zeros, which bounds what any work on that branch saves")
    args = ap.parse_args()
    global OUT, ABLATE
    if args.ablate == "gated_mlp":
        from compiled_llm.models.layers import mlp

        mlp.GatedMLP.forward = lambda self, x: x * 0.0
        ABLATE = args.ablate
    OUT = Path(args.out) if args.out else None
    if OUT:
        OUT.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    ok = True
    RESULTS.update(torch=torch.__version__, date=time.strftime("%Y-%m-%d %H:%M"),
                   device=torch.cuda.get_device_name() if args.device == "cuda" else args.device)
    for section in args.sections.split(","):
        try:
            if section == "tiny":
                ok &= tiny(args.names.split(","), t0 + args.budget, args.device)
            else:
                ok &= big(args.big, args.shape, args.compile_sizes, args.max_autotune, args.tp, args.tp_allreduce,
                          args.compile_passes)
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
