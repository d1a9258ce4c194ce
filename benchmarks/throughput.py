"""Offline throughput: fixed random token prompts, greedy, EOS ignored, prefix cache off.

    python benchmarks/throughput.py --config gemma-4-26b-a4b --shapes 1024x8x256,4096x8x512 --peer transformers
    python benchmarks/throughput.py --config qwen3.5-35b-a3b --shapes 1024x8x256

Each shape is input x batch x output; we report the median output tokens/s over the timed runs,
the shape's floor (see floor.py) and our share of it, and each peer's figure in the same run.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from configs import PRESETS, config_dict, write_checkpoint_folder  # noqa: E402
from floor import floor_seconds, measure_copy_bandwidth, measure_matmul_rate  # noqa: E402

from compiled_llm import LLM, SamplingParams  # noqa: E402


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    return [tuple(int(x) for x in s.lower().replace("k", "000").split("x")) for s in text.split(",")]


def random_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 1, (batch, length), generator=g).tolist()


def timed(fn, warmup: int, runs: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times


def run_ours(folder: str, shapes, args) -> tuple[dict, LLM]:
    longest = max(p + o for p, _, o in shapes)
    llm = LLM(folder, device=args.device, dtype=args.dtype, load_format=args.load_format, skip_tokenizer_init=True,
              enable_prefix_caching=False, max_model_len=longest + 16, max_num_seqs=max(b for _, b, _ in shapes),
              max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager,
              seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
              enable_expert_parallel=args.enable_expert_parallel, async_scheduling=args.async_scheduling,
              max_autotune=args.max_autotune, tp_allreduce=args.tp_allreduce, op_providers=args.op_providers,
              compile_cache=args.compile_cache, cudagraph_batch_sizes=args.cudagraph_batch_sizes)
    if llm.engine.executor.runner is not None and llm.engine.executor.runner.compiler is not None:
        c = llm.engine.executor.runner.compiler
        print(f"ours: compiled in {c.startup_seconds:.1f}s, compile cache {c.cache.status if c.cache else 'none'}, "
              f"forward ahead of time: {c.summary()['ahead_of_time']}", flush=True)
    vocab = llm.engine.executor.model_config.vocab_size
    out = {}
    for p, b, o in shapes:
        prompts = [{"prompt_token_ids": x} for x in random_prompts(b, p, vocab)]
        params = SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True)
        times = timed(lambda: llm.generate(prompts, params), args.warmup, args.runs)
        out[(p, b, o)] = b * o / statistics.median(times)
        print(f"ours {p}x{b}x{o}: {out[(p, b, o)]:.1f} tok/s (runs: {[round(t, 3) for t in times]})", flush=True)
    return out, llm


def hf_classes(cfg: dict) -> tuple[type, type]:
    """transformers' text model and config classes for a flat preset config (same parameter names as ours)."""
    import transformers

    if "Qwen3_5MoeForCausalLM" in cfg.get("architectures", []):
        return transformers.Qwen3_5MoeForCausalLM, transformers.Qwen3_5MoeTextConfig
    return transformers.Gemma4ForCausalLM, transformers.Gemma4TextConfig


def ours_as_checkpoint(model: torch.nn.Module, hf_state: dict) -> dict[str, torch.Tensor]:
    """Our weights under the checkpoint's names (views, no copies): the model's own loader mapping
    (`hf_to_ours`) read backwards, so merged projections (Gemma 4's qkv_proj, gate_up_proj) give each
    checkpoint tensor its rows. A name our loader skips keeps transformers' value (a tied head); any other
    name must be found."""
    ours = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    out = {}
    for name, value in hf_state.items():
        target = model.hf_to_ours(name)
        if target is None:
            out[name] = value
        elif isinstance(target, tuple):
            out[name] = ours[target[0]][target[1]]
        elif target in ours:
            out[name] = ours[target]
        elif name.startswith("lm_head.") and "model.embed_tokens.weight" in ours:
            out[name] = ours["model.embed_tokens.weight"]  # tied head
        else:
            raise KeyError(f"transformers' {name} has no counterpart in our model (mapped to {target!r})")
    return out


def run_transformers(llm: LLM, cfg: dict, shapes, args, static: bool) -> dict:
    """transformers' own generate on our weights (copied over), eager or with a static cache (compiled)."""
    model_cls, config_cls = hf_classes(cfg)
    if args.device == "cuda":  # our timings are done: our KV cache and CUDA graphs make room for the peer's copy
        llm.engine.executor.runner.release()
        print(f"peer {model_cls.__name__}: {torch.cuda.memory_allocated() / 2**30:.1f} GiB in use before it loads",
              flush=True)
    kw = {k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")}
    prev = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, args.dtype if args.dtype != "auto" else "bfloat16"))
    with torch.device(args.device):
        hf = model_cls(config_cls(**kw)).eval()
    torch.set_default_dtype(prev)
    hf.load_state_dict(ours_as_checkpoint(llm.engine.executor.runner.model, hf.state_dict()))
    hf.generation_config.eos_token_id = None
    out = {}
    for p, b, o in shapes:
        ids = torch.tensor(random_prompts(b, p, cfg["vocab_size"]), device=args.device)
        extra = {"cache_implementation": "static"} if static else {}
        t0 = time.perf_counter()
        fn = lambda: hf.generate(ids, max_new_tokens=o, min_new_tokens=o, do_sample=False, pad_token_id=0,  # noqa
                                 **extra)
        times = timed(fn, args.peer_warmup, args.peer_runs)
        out[(p, b, o)] = b * o / statistics.median(times)
        print(f"transformers{'-static' if static else ''} {p}x{b}x{o}: {out[(p, b, o)]:.1f} tok/s "
              f"(first call incl. warm-up {time.perf_counter() - t0:.1f}s)", flush=True)
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=sorted(PRESETS), default="gemma-4-26b-a4b")
    ap.add_argument("--model", default=None, help="a checkpoint folder instead of a preset config")
    ap.add_argument("--shapes", default="1024x8x256,4096x8x512,8192x4x512")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--enable-expert-parallel", action="store_true")
    ap.add_argument("--tp-allreduce", default="nccl", choices=["nccl", "symm-mem"])
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="default: the engine's (on for CUDA, one process or TP)")
    ap.add_argument("--op-providers", default=None, help="e.g. allreduce_rms_norm=reference (A/B of a fused op)")
    ap.add_argument("--max-autotune", default="off", choices=["off", "static", "all"])
    ap.add_argument("--cudagraph-batch-sizes", default=None, help="the engine's CUDA-graph sizes (default: its own)")
    ap.add_argument("--compile-cache", default=None, help="a compile-cache folder (built if missing; issue 15: "
                    "the fast start's throughput against a start without one)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--peer", action="append", default=[], choices=["transformers", "transformers-static"])
    ap.add_argument("--peer-warmup", type=int, default=1)
    ap.add_argument("--peer-runs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    return ap


def versions() -> dict:
    """The packages a run's figures depend on: the compile cache's key (torch, python, triton, flashinfer) and the
    peers' transformers (session 58: transformers' own tok/s on the GPU rose 104.7 -> 173.3 eager and 258 -> 279
    static-compile between sessions, and whether a package had changed had to be asked of the machine in a call of
    its own: it had not)."""
    import transformers

    from compiled_llm.compiler.cache import versions as cache_versions

    return dict(cache_versions(), transformers=transformers.__version__)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    shapes = parse_shapes(args.shapes)
    if args.model:
        folder = args.model
        cfg = json.loads((Path(folder) / "config.json").read_text())
    else:
        folder = str(write_checkpoint_folder(args.config, Path(tempfile.mkdtemp()) / args.config))
        cfg = config_dict(args.config)
    on_gpu = args.device == "cuda"
    bw = measure_copy_bandwidth() if on_gpu else None
    rate = measure_matmul_rate() if on_gpu else None
    t0 = time.perf_counter()
    ours, llm = run_ours(folder, shapes, args)
    startup_and_runs = time.perf_counter() - t0
    peers = {}
    peer_errors = {}
    for peer in args.peer:
        try:
            peers[peer] = run_transformers(llm, cfg, shapes, args, static=peer == "transformers-static")
        except Exception as e:  # a peer that cannot run this model (e.g. no static cache for it) is reported, and
            # our figures still stand
            peer_errors[peer] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            print(f"peer {peer} failed: {peer_errors[peer]}", flush=True)
            gc.collect()
            if on_gpu:
                torch.cuda.empty_cache()

    rows = []
    for s in shapes:
        p, b, o = s
        floor = b * o / floor_seconds(cfg, p, b, o, bw, rate) if on_gpu else None
        row = {"shape": f"{p}x{b}x{o}", "ours_tok_s": round(ours[s], 1),
               "floor_tok_s": round(floor, 1) if floor else None,
               "pct_of_floor": round(100 * ours[s] / floor, 1) if floor else None}
        for name, res in peers.items():
            row[f"{name}_tok_s"] = round(res[s], 1)
            row[f"ratio_vs_{name}"] = round(ours[s] / res[s], 2)
        rows.append(row)
    header = list(rows[0])
    print("\n" + " | ".join(header))
    for r in rows:
        print(" | ".join(str(r[h]) for h in header))
    result = {"config": args.model or args.config, "device": torch.cuda.get_device_name() if on_gpu else "cpu",
              "copy_bandwidth_TBps": bw / 1e12 if bw else None, "matmul_TFLOPs": rate / 1e12 if rate else None,
              "enforce_eager": args.enforce_eager, "tensor_parallel_size": args.tensor_parallel_size,
              "enable_expert_parallel": args.enable_expert_parallel, "async_scheduling": args.async_scheduling,
              "max_autotune": args.max_autotune, "tp_allreduce": args.tp_allreduce, "op_providers": args.op_providers, "rows": rows,
              "peer_errors": peer_errors, "ours_total_seconds": startup_and_runs, "versions": versions(),
              "date": time.strftime("%Y-%m-%d %H:%M")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"throughput_{(args.config if not args.model else Path(args.model).name)}_{time.strftime('%Y%m%d_%H%M%S')}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        names = ["ours_tok_s", "floor_tok_s"] + [f"{n}_tok_s" for n in peers]
        width = 0.8 / len(names)
        for i, n in enumerate(names):
            ax.bar([j + i * width for j in range(len(rows))], [r[n] or 0 for r in rows], width, label=n)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], [r["shape"] for r in rows])
        ax.set_ylabel("output tokens/s")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"{stem}.png")
    except ImportError:
        print("matplotlib missing: no plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
