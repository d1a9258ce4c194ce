"""Latency: batch-1 decode milliseconds per token, and time to first token at given prompt lengths.

    python benchmarks/latency.py --config gemma-4-26b-a4b --ttft-lengths 1024,8192 --decode-tokens 128

Fixed random token prompts, greedy, EOS ignored, prefix cache off. Decode ms/token is measured as the
difference between a run of N+1 tokens and a run of 1 token, over N, so prefill drops out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).parent))
from configs import PRESETS, write_checkpoint_folder  # noqa: E402
from throughput import random_prompts, timed  # noqa: E402

from compiled_llm import LLM, SamplingParams  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=sorted(PRESETS), default="gemma-4-26b-a4b")
    ap.add_argument("--model", default=None, help="a checkpoint folder instead of a preset config")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ttft-lengths", default="1024,8192")
    ap.add_argument("--decode-context", type=int, default=1024, help="prompt length for the decode measurement")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--cudagraph-batch-sizes", default=None, help="the engine's buckets (token counts captured as "
                    "CUDA graphs); e.g. '1,1024,8192' gives those prompt lengths piecewise graphs")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the result JSON here")
    ap.add_argument("--profile-dir", default=None, help="profile one prefill per length (torch.profiler): the "
                    "kernel table goes to prefill_<n>.txt here, wall and GPU-busy times into the JSON")
    ap.add_argument("--host-profile", action="store_true", help="with --profile-dir: where one prefill's host time "
                    "goes (cProfile to host_<n>.txt, device-to-host syncs with their stacks to syncs_<n>.txt, "
                    "Python's GC pauses in every timed run)")
    ap.add_argument("--alternate-env", default=None, help="NAME=V1,V2: TTFT also with the environment variable NAME "
                    "at each value in turn, run by run in this one engine (an A/B of a setting read at each launch, "
                    "e.g. COMPILED_LLM_ROUTER_PREFILL=one,two; prompts past the CUDA-graph sizes)")
    args = ap.parse_args(argv)

    lengths = [int(x) for x in args.ttft_lengths.split(",")]
    folder = args.model or str(write_checkpoint_folder(args.config, Path(tempfile.mkdtemp()) / args.config))
    longest = max(lengths + [args.decode_context + args.decode_tokens + 1])
    llm = LLM(folder, device=args.device, dtype=args.dtype, load_format=args.load_format, skip_tokenizer_init=True,
              enable_prefix_caching=False, max_model_len=longest + 16, max_num_seqs=1,
              max_num_batched_tokens=max(lengths + [args.decode_context]), enforce_eager=args.enforce_eager,
              cudagraph_batch_sizes=args.cudagraph_batch_sizes)
    vocab = llm.engine.executor.runner.model_config.vocab_size

    def run(prompt: list[int], n: int):
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))

    result = {"config": args.model or args.config, "device": args.device, "ttft_ms": {}}
    for n in lengths:
        prompt = random_prompts(1, n, vocab, seed=n)[0]
        with GCPauses() as gcp:
            times = timed(lambda: run(prompt, 1), args.warmup, args.runs)
        t = statistics.median(times)
        result["ttft_ms"][n] = round(1000 * t, 2)
        result.setdefault("ttft_runs_ms", {})[n] = [round(1000 * x, 2) for x in times]
        result.setdefault("gc_pauses", {})[n] = gcp.summary()
        print(f"TTFT {n} tokens: {1000 * t:.2f} ms (runs {result['ttft_runs_ms'][n]}; GC {gcp.summary()})", flush=True)
        if args.alternate_env:
            result.setdefault("ttft_alternating", {})[n] = alternate_env(args.alternate_env, lambda: run(prompt, 1),
                                                                         args.warmup, args.runs)
        if args.profile_dir:
            result.setdefault("prefill_profile", {})[n] = profile_prefill(lambda: run(prompt, 1), n, args.profile_dir)
            if args.host_profile:
                result.setdefault("host_profile", {})[n] = profile_host(lambda: run(prompt, 1), n, args.profile_dir)
    prompt = random_prompts(1, args.decode_context, vocab, seed=1)[0]
    one = statistics.median(timed(lambda: run(prompt, 1), args.warmup, args.runs))
    many = statistics.median(timed(lambda: run(prompt, args.decode_tokens + 1), args.warmup, args.runs))
    result["decode_ms_per_token"] = round(1000 * (many - one) / args.decode_tokens, 3)
    print(f"batch-1 decode at {args.decode_context} context: {result['decode_ms_per_token']:.3f} ms/token", flush=True)
    if args.alternate_env:  # the decode too, its prompt's time (`one`, at the variable's first value) taken off
        alt = alternate_env(args.alternate_env, lambda: run(prompt, args.decode_tokens + 1), args.warmup, args.runs,
                            what=f"{args.decode_tokens + 1} tokens")
        result["decode_alternating_ms_per_token"] = {
            v: round((r["median_ms"] - 1000 * one) / args.decode_tokens, 4) for v, r in alt.items()}
        print(f"batch-1 decode alternating: {result['decode_alternating_ms_per_token']} ms/token", flush=True)
    result["date"] = time.strftime("%Y-%m-%d %H:%M")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


def alternate_env(spec: str, fn, warmup: int, runs: int, what: str = "TTFT") -> dict:
    """fn timed with the variable NAME of spec "NAME=V1,V2,..." at each value in turn, one run each per round (so
    the values share the machine's clock and heat); the variable's prior value is restored. Medians in ms."""
    name, values = spec.split("=", 1)
    values = values.split(",")
    times = {v: [] for v in values}
    with mock.patch.dict(os.environ):  # the environment as it was, after
        for i in range(warmup + runs):
            for v in values:
                os.environ[name] = v
                t = time.perf_counter()
                fn()
                if i >= warmup:
                    times[v].append(1000 * (time.perf_counter() - t))
    res = {v: {"median_ms": round(statistics.median(ts), 2), "runs_ms": [round(x, 2) for x in ts]}
           for v, ts in times.items()}
    print(f"{what} with {name} alternating: {json.dumps(res)}", flush=True)
    return res


def profile_prefill(fn, n: int, folder: str) -> dict:
    """Where a time to first token goes: one call under torch.profiler; the kernels by GPU time (a table in
    FOLDER/prefill_N.txt), the wall time against the time the GPU was busy, and the kernel count."""
    import torch

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    sync()
    with torch.profiler.profile(activities=acts) as prof:
        t = time.perf_counter()
        fn()
        sync()
        wall = time.perf_counter() - t
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
    table = prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=30,
                                      max_name_column_width=90)
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / f"prefill_{n}.txt").write_text(table)
    # the kernels in launch order (start from the first, duration, stream): which layer's kernel costs what, e.g.
    # the sliding and the global layers' prefill attention apart
    seq = sorted(kernels, key=lambda e: e.time_range.start)
    t0 = seq[0].time_range.start if seq else 0
    (Path(folder) / f"prefill_{n}_sequence.txt").write_text("".join(
        f"{e.time_range.start - t0:10.1f} +{e.time_range.elapsed_us():9.2f} us  s{getattr(e, 'device_resource_id', 0)}  "
        f"{e.name[:100]}\n" for e in seq))
    res = {"wall_ms": round(1e3 * wall, 2), "gpu_busy_ms": round(busy, 2), "kernels": len(kernels),
           "attention_us": [round(e.time_range.elapsed_us(), 1) for e in seq if e.name == "_prefill_kernel"]}
    print(f"prefill {n} tokens profiled: {res}", flush=True)
    return res


class GCPauses:
    """Python's garbage collections while the block runs: count and milliseconds by generation."""

    def __enter__(self):
        import gc

        self.pauses: list[tuple[int, float]] = []
        self._t0 = 0.0

        def cb(phase, info):
            if phase == "start":
                self._t0 = time.perf_counter()
            else:
                self.pauses.append((info["generation"], time.perf_counter() - self._t0))

        self._cb = cb
        gc.callbacks.append(cb)
        return self

    def __exit__(self, *exc):
        import gc

        gc.callbacks.remove(self._cb)

    def summary(self) -> dict:
        out: dict[str, list] = {}
        for g, d in self.pauses:
            c = out.setdefault(f"gen{g}", [0, 0.0])
            c[0] += 1
            c[1] = round(c[1] + 1e3 * d, 3)
        return out


def profile_host(fn, n: int, folder: str) -> dict:
    """Where one call's host time goes: cProfile (FOLDER/host_N.txt, by own time and by cumulative time) and,
    on CUDA, every operation that waits for the device (torch's sync debug mode), with its Python stack
    (FOLDER/syncs_N.txt)."""
    import cProfile
    import io
    import pstats
    import traceback
    import warnings

    import torch

    cuda = torch.cuda.is_available()
    syncs: list[str] = []
    if cuda:
        torch.cuda.synchronize()

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchronizing" in str(message):  # not the mode's own "prototype feature" notice
                syncs.append(f"{message}\n" + "".join(traceback.format_stack()[:-2][-14:]))

        with warnings.catch_warnings():  # restores showwarning and the filters after
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    fn()
    prof.disable()
    wall = time.perf_counter() - t
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(45)
    st.sort_stats("cumulative").print_stats(60)
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / f"host_{n}.txt").write_text(buf.getvalue())
    (Path(folder) / f"syncs_{n}.txt").write_text("\n\n".join(syncs))
    res = {"wall_ms_under_cprofile": round(1e3 * wall, 2), "device_syncs": len(syncs)}
    print(f"prefill {n} tokens, host: {res}", flush=True)
    return res


if __name__ == "__main__":
    main()
