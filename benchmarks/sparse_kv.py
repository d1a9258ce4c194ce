"""Sparse KV (StreamingLLM, OmniKV) against dense attention at long inputs: throughput, KV memory, and
(with --eval) greedy agreement and perplexity.

GPU (Gemma 4 shapes, random weights; one method per call keeps each call under the device's 10 minutes):
    python benchmarks/sparse_kv.py --config gemma-4-26b-a4b --lengths 32k,64k,128k --output 64 --methods dense
CPU smoke test (a tiny random Gemma 4, seconds):
    python benchmarks/sparse_kv.py --tiny --device cpu --dtype float32 --lengths 512,1024 --output 8
Quality on a real checkpoint (e.g. the demo model), prompts >= 8x the budget:
    python benchmarks/sparse_kv.py --eval --model compiled_llm/demo_model --device cpu --dtype float32 \
        --lengths 768 --output 64 --sparse-window 60 --omnikv-budget 64

Per method and input length, one request (or --batch of them) of random token ids, greedy, EOS ignored,
prefix cache off: prefill seconds (to the first token), decode tokens/s (after it), the KV cache the
request held at its peak (bytes of the blocks in use, all groups) and the attended/cached token counts
the engine reports. Each method gets its own engine, built after the previous one is freed.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from configs import PRESETS, config_dict  # noqa: E402
from graph_timing import start_profiler  # noqa: E402

from compiled_llm import LLM, SamplingParams  # noqa: E402
from compiled_llm.runtime.memory import sequence_blocks  # noqa: E402

TINY = {
    "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
    "sliding_window": 32, "final_logit_softcapping": 30.0, "hidden_size_per_layer_input": 0,
    "layer_types": (["sliding_attention"] * 2 + ["full_attention"]) * 2, "tie_word_embeddings": True,
    "torch_dtype": "float32", "eos_token_id": 1, "bos_token_id": 2, "pad_token_id": 0,
}


def parse_lengths(text: str) -> list[int]:
    out = []
    for s in text.split(","):
        s = s.strip().lower()
        out.append(int(s[:-1]) * 1024 if s.endswith("k") else int(s))
    return out


def method_kwargs(name: str, args) -> dict:
    """dense, streamingllm, omnikv (its offload as the engine defaults: on for CUDA), omnikv-device (all KV on
    the device) or omnikv-offload (the offload asked for, e.g. on the CPU)."""
    if name == "dense":
        return {}
    base = name.split("-")[0]
    kw = dict(sparse_method=base, sparse_sink_tokens=args.sparse_sink_tokens)
    if base == "streamingllm":
        kw["sparse_window"] = args.sparse_window
    else:
        kw.update(omnikv_budget=args.omnikv_budget, omnikv_recent=args.omnikv_recent,
                  omnikv_filter_layers=args.omnikv_filter_layers)
        if name != base:
            kw["omnikv_offload"] = {"omnikv-device": False, "omnikv-offload": True}[name]
    return kw


def checkpoint(args, max_len: int) -> str:
    if args.model:
        return args.model
    folder = Path(tempfile.mkdtemp()) / ("tiny" if args.tiny else args.config)
    folder.mkdir(parents=True)
    cfg = dict(TINY) if args.tiny else config_dict(args.config)
    cfg["max_position_embeddings"] = max(max_len, cfg.get("max_position_embeddings", 0))
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return str(folder)


def make_llm(folder: str, name: str, max_len: int, args) -> LLM:
    kw = dict(device=args.device, dtype=args.dtype, enable_prefix_caching=False, max_model_len=max_len,
              max_num_seqs=max(args.batch, 1), max_num_batched_tokens=args.max_num_batched_tokens,
              enforce_eager=args.enforce_eager, seed=args.seed, block_size=args.block_size)
    kw["load_format"] = args.load_format or ("auto" if args.model else "dummy")
    if not (args.eval and args.model):  # token-id prompts: no tokenizer needed
        kw["skip_tokenizer_init"] = True
    if args.device == "cuda":
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    return LLM(folder, **kw, **method_kwargs(name, args))


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def kv_bytes_in_use(engine) -> int:
    bm = engine.block_manager
    return sum(p.num_used * bm.block_bytes[g] for g, p in bm.pools.items())


def kv_batch_limit(llm: LLM, tokens: int) -> int:
    """How many sequences of `tokens` tokens (prompt and output) the engine's KV memory holds: the bytes of
    every KV group's pool over the bytes one such sequence needs across the groups (runtime/memory.py
    sequence_blocks, the engine's own capacity rule: every block in a full-attention group, sinks and window
    in a windowed one). The batch a method fits with max_num_seqs raised to it: the planner sizes the sliding
    groups for max_num_seqs windows (runtime/kv_plan.py), so the pools' own smallest quotient follows
    max_num_seqs (47 at batch 16 and 79 at batch 32, the same 26B-A4B budget at 64K, session 15)."""
    bm = llm.engine.block_manager
    total = sum(pool.num_blocks * bm.block_bytes[g] for g, pool in bm.pools.items())
    one = sum(sequence_blocks(g, tokens, bm.block_size) * bm.block_bytes[g] for g in bm.pools)
    # OmniKV offload: block_bytes are the device's share; the host memory also bounds the offloaded groups
    host = getattr(llm.engine.executor.runner, "host_kv_blocks", {})
    return min([total // one] + [n // sequence_blocks(g, tokens, bm.block_size) for g, n in host.items()])


def skip_prefill_compute(llm: LLM) -> dict:
    """Decode-only timing (--synthetic-prefill): a step with any prompt token in it skips the forward pass
    and returns zero logits (each finishing row samples token 0), so a long prompt costs its scheduling,
    block allocation and release (all real) but not its compute; the KV cache holds random values instead
    of the prompt's keys. Steps whose rows all decode run the model as usual: the decode figures are those
    steps. For the batches whose real prefill would not fit a device call (64K x 32 took 210 s of
    prefill on the H200). OmniKV's picks then rank random keys: scattered positions, no worse for its
    reads than real attention's clustered ones. Returns the count of skipped steps (filled in as it runs)."""
    runner = llm.engine.executor.runner
    real, vocab = runner.execute, runner.model_config.vocab_size
    for cache in runner.kv_caches.values():
        cache.normal_()
    counts = {"skipped_prefill_steps": 0}

    def execute(batch, pending=None):
        if all(item.is_decode for item in batch):
            return real(batch, pending)
        counts["skipped_prefill_steps"] += 1
        rows = sum(item.seq.num_computed_tokens + item.num_tokens == len(item.seq) for item in batch)
        return torch.zeros(rows, vocab, dtype=torch.float32, device=runner.device)

    runner.execute = execute
    return counts


def compiled_summary(llm: LLM) -> dict:
    """The compiler's report (whole-graph decode sizes and replays); {} when the model runs eager."""
    compiler = llm.engine.executor.runner.compiler
    return compiler.summary() if compiler is not None else {}


def run_one(llm: LLM, prompts: list[list[int]], output: int, profile: tuple[int, Path] | None = None) -> dict:
    """The batch from submission to its last token. Prefill seconds: until every request has its first token.
    Decode tokens/s: over the steps in which every request of the batch decodes (after the last prefill
    chunk and before the first request finishes): chunked prefill staggers the requests, so with long
    prompts the first ones decode while the last ones still prefill, and only those steps run the whole
    batch (output must exceed the prefill steps for there to be any: None otherwise). profile (steps,
    file stem): those many whole-batch steps under torch.profiler, the kernels by time into stem.txt and one
    step's kernels in launch order into stem_sequence.txt."""
    eng = llm.engine
    before = eng.get_stats()
    replays0 = compiled_summary(llm).get("whole_graph_replays", 0)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}-{time.monotonic_ns()}", p, params)
    sync()
    t0 = time.perf_counter()
    t_first = None
    started: set[str] = set()
    full_steps, full_tokens, full_s = 0, 0, 0.0
    peak_kv = 0
    prof, prof_steps = None, 0
    steps, finished, t_note = 0, 0, t0
    while eng.has_unfinished_requests():
        if profile and prof is None and t_first is not None and prof_steps == 0:
            sync()
            prof = start_profiler()
        t_a = time.perf_counter()
        outs = eng.step()
        t_b = time.perf_counter()
        if (prof is None and t_first is not None and len(outs) == len(prompts)
                and not any(o.finished for o in outs)):  # (profiled steps not timed)
            full_steps, full_tokens, full_s = full_steps + 1, full_tokens + len(outs), full_s + (t_b - t_a)
        if prof is not None:
            prof_steps += 1
            if prof_steps == profile[0]:
                sync()
                prof.__exit__(None, None, None)
                write_profile(prof, prof_steps, profile[1])
                prof = None
        peak_kv = max(peak_kv, kv_bytes_in_use(eng))
        started.update(o.request_id for o in outs if o.outputs[0].token_ids)
        steps, finished = steps + 1, finished + sum(o.finished for o in outs)
        if t_b - t_note >= 20:  # progress, so a run cut short by a time limit still says where it was
            t_note = t_b
            print(json.dumps({"progress": {"s": round(t_b - t0, 1), "steps": steps, "started": len(started),
                                           "finished": finished, "full_batch_steps": full_steps}}), flush=True)
        if t_first is None and len(started) == len(prompts):
            sync()
            t_first = time.perf_counter()
    if prof is not None:  # the run ended inside the window
        prof.__exit__(None, None, None)
    sync()
    after = eng.get_stats()
    summary = compiled_summary(llm)
    row = {"prefill_s": round(t_first - t0, 3) if t_first is not None else None,
           "decode_tok_s": round(full_tokens / full_s, 2) if full_steps else None, "full_batch_steps": full_steps,
           "peak_kv_MiB": round(peak_kv / 2 ** 20, 2),
           # decode steps that replayed one CUDA graph of the whole forward (sparse attention included)
           "whole_graph_steps": summary.get("whole_graph_replays", 0) - replays0,
           "whole_graph_sizes": summary.get("whole_graph_decode_sizes")}
    if torch.cuda.is_available():
        row["peak_gpu_alloc_GiB"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)
    if after.get("omnikv_offloaded_kv_bytes"):  # allocated in pinned host memory (peak_kv_MiB: the device's)
        row["offloaded_kv_GiB"] = round(after["omnikv_offloaded_kv_bytes"] / 2 ** 30, 2)
    if "sparse_attended_tokens" in after:
        att = after["sparse_attended_tokens"] - before["sparse_attended_tokens"]
        cached = after["sparse_cached_tokens"] - before["sparse_cached_tokens"]
        row["attended_per_cached"] = round(att / cached, 4) if cached else None
    return row


def write_profile(prof, steps: int, stem: Path) -> None:
    cuda = torch.cuda.is_available()
    table = prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                                      row_limit=40, max_name_column_width=90)
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    events = sorted((e for e in prof.events() if e.device_type == kind), key=lambda e: e.time_range.start)
    busy = sum(e.time_range.elapsed_us() for e in events) / 1e3 / steps
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".txt").write_text(f"{steps} steps, {busy:.2f} ms of kernels a step\n{table}")
    stem.with_name(stem.name + "_sequence.txt").write_text("".join(
        f"{e.time_range.elapsed_us():9.2f} us  {e.name[:110]}\n" for e in events[: len(events) // steps]))
    print(f"profile: {busy:.2f} ms of kernels a step -> {stem}.txt", flush=True)


def bench(args) -> list[dict]:
    lengths = parse_lengths(args.lengths)
    max_len = max(lengths) + args.output + 64
    folder = checkpoint(args, max_len)
    rows = []
    for name in args.methods.split(","):
        t_build = time.perf_counter()
        llm = make_llm(folder, name, max_len, args)
        print(json.dumps({"engine_built_s": round(time.perf_counter() - t_build, 1), "method": name}), flush=True)
        vocab = llm.engine.executor.runner.model_config.vocab_size
        g = torch.Generator().manual_seed(args.seed)
        run_one(llm, [torch.randint(10, vocab - 1, (min(lengths[0], 512),), generator=g).tolist()], 4)  # warm-up
        skipped = skip_prefill_compute(llm) if args.synthetic_prefill else None
        for n in lengths:
            prompts = torch.randint(10, vocab - 1, (args.batch, n), generator=g).tolist()
            stem = Path(args.out) / f"sparse_kv_profile_{name}_{n}"
            row = {"method": name, "input": n, "batch": args.batch, "output": args.output,
                   "kv_batch_limit": kv_batch_limit(llm, n + args.output),
                   **run_one(llm, prompts, args.output, (args.profile_steps, stem) if args.profile_steps else None)}
            if skipped is not None:  # prefill_s is then scheduling only, not a prefill time
                row.update(synthetic_prefill=True, **skipped)
                skipped["skipped_prefill_steps"] = 0
            rows.append(row)
            print(json.dumps(row), flush=True)
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def eval_text_tokens(llm: LLM, need: int) -> list[int]:
    """Real English text for a real checkpoint: Python's pydoc topics, concatenated."""
    from pydoc_data.topics import topics

    ids: list[int] = []
    for key in sorted(topics):
        ids += llm.engine.tokenize(topics[key], add_special_tokens=not ids)
        if len(ids) >= need:
            break
    return ids[:need]


def evaluate(args) -> list[dict]:
    from compiled_llm.runtime.sparse_eval import agreement, greedy, perplexity, teacher_forced_logprobs

    lengths = parse_lengths(args.lengths)
    max_len = max(lengths) + args.output + 64
    folder = checkpoint(args, max_len)
    llms = {name: make_llm(folder, name, max_len, args) for name in ["dense"] + args.methods.split(",")
            if name}
    rows = []
    for n in lengths:
        if llms["dense"].engine.tokenizer is not None and args.model:
            text = eval_text_tokens(llms["dense"], n * args.batch + args.output * args.batch)
            prompts = [text[i * n:(i + 1) * n] for i in range(args.batch)]
            targets = [text[args.batch * n + i * args.output:args.batch * n + (i + 1) * args.output]
                       for i in range(args.batch)]
        else:
            g = torch.Generator().manual_seed(args.seed)
            vocab = llms["dense"].engine.executor.runner.model_config.vocab_size
            prompts = torch.randint(10, vocab - 1, (args.batch, n), generator=g).tolist()
            targets = None
        ref = greedy(llms["dense"], prompts, args.output)
        targets = targets or ref
        ppl = {name: perplexity([lp for p, t in zip(prompts, targets) for lp in teacher_forced_logprobs(llm, p, t)])
               for name, llm in llms.items()}
        for name, llm in llms.items():
            toks = greedy(llm, prompts, args.output)
            agree = [agreement(t, r) for t, r in zip(toks, ref)]
            row = {"method": name, "input": n, "output": args.output,
                   "greedy_match_rate": round(sum(a["match_rate"] for a in agree) / len(agree), 4),
                   "first_divergence": [a["first_divergence"] for a in agree],
                   "perplexity": round(ppl[name], 4), "dense_perplexity": round(ppl["dense"], 4)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=sorted(PRESETS), default="gemma-4-26b-a4b")
    ap.add_argument("--model", default=None, help="a checkpoint folder instead of a preset config")
    ap.add_argument("--tiny", action="store_true", help="a tiny random Gemma 4 (CPU smoke test)")
    ap.add_argument("--eval", action="store_true", help="greedy agreement and perplexity instead of speed")
    ap.add_argument("--methods", default="dense,streamingllm,omnikv")
    ap.add_argument("--lengths", default="32k,64k,128k")
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--sparse-sink-tokens", type=int, default=4)
    ap.add_argument("--sparse-window", type=int, default=2044)
    ap.add_argument("--omnikv-budget", type=int, default=2048)
    ap.add_argument("--omnikv-recent", type=int, default=64)
    ap.add_argument("--omnikv-filter-layers", default=None)
    ap.add_argument("--load-format", default=None, help="default: dummy for a preset, auto for --model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="prefill chunk: the PyTorch attention paths hold [heads, chunk, context] scores")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                    help="fraction of the GPU's total memory the engine may use; the start-up profile run "
                         "measures what the PyTorch attention paths' scores take and leaves room for them")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--synthetic-prefill", action="store_true",
                    help="decode figures only: prompt steps skip the forward pass (random KV; skip_prefill_compute)")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="profile this many whole-batch decode steps (torch.profiler): kernels by time, and one "
                         "step's kernels in launch order, into --out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    if args.eval and args.methods.startswith("dense"):
        args.methods = ",".join(m for m in args.methods.split(",") if m != "dense")
    if args.synthetic_prefill and not args.eval:  # the whole batch decodes together only after the last prompt
        chunks = -(-max(parse_lengths(args.lengths)) // args.max_num_batched_tokens)
        need = args.batch * chunks + 1
        if args.output <= need:
            ap.error(f"--synthetic-prefill at batch {args.batch}: the last prompt's chunks end about {need} steps in, "
                     f"so --output {args.output} leaves no step with the whole batch decoding; use --output "
                     f"{need + 256} (256 steps to measure)")

    t0 = time.perf_counter()
    rows = evaluate(args) if args.eval else bench(args)
    header = list(dict.fromkeys(k for r in rows for k in r))
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(str(r.get(h)) for h in header) + " |")
    on_gpu = args.device == "cuda" and torch.cuda.is_available()
    result = {"mode": "eval" if args.eval else "bench", "config": args.model or ("tiny" if args.tiny else args.config),
              "device": torch.cuda.get_device_name() if on_gpu else "cpu", "args": vars(args), "rows": rows,
              "seconds": round(time.perf_counter() - t0, 1), "date": time.strftime("%Y-%m-%d %H:%M")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = Path(args.model).name if args.model else ("tiny" if args.tiny else args.config)
    stem = f"sparse_kv_{'eval_' if args.eval else ''}{name}_{time.strftime('%Y%m%d_%H%M%S')}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out / stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
