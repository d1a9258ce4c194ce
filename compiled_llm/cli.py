"""`python -m compiled_llm {generate,serve,compile-cache}`."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from compiled_llm.config import add_engine_args, config_from_args
from compiled_llm.help_format import DefaultsOnceFormatter


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default: 64)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default: 0.8)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default: 0.95)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 is off")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="penalise tokens already seen (1 is off)")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    p.add_argument("--json", action="store_true", help="print results as JSON lines")


def _generate(args: argparse.Namespace) -> int:
    from compiled_llm.runtime.llm import LLM
    from compiled_llm.sampling_params import SamplingParams

    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            min_p=args.min_p, repetition_penalty=args.repetition_penalty, stop=args.stop,
                            seed=args.sample_seed, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    llm = LLM.from_config(config_from_args(args))
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outs = llm.generate(args.prompts, params)
    for prompt, out in zip(args.prompts, outs):
        for c in out.outputs:
            if args.json:
                print(json.dumps({"prompt": prompt, "index": c.index, "text": c.text,
                                  "finish_reason": c.finish_reason, "token_ids": c.token_ids}))
            else:
                print(prompt + c.text if not args.chat else c.text)
    return 0


def _hf_config_and_dtype(config) -> tuple[dict, "torch.dtype"]:
    """The checkpoint's config.json and the dtype the engine would run it in (--dtype, else the checkpoint's)."""
    from pathlib import Path

    from compiled_llm.models.loader import resolve_dtype
    from compiled_llm.models.registry import resolve_model_class
    from compiled_llm.runtime.model_runner import read_hf_config

    hf = read_hf_config(Path(config.resolved_model()))
    return hf, resolve_dtype(config.dtype, resolve_model_class(hf).config_from_hf(hf).torch_dtype)


def _kernel_check(config, tokens: int | None) -> int:
    """compile-cache --dry-run --kernels: every Triton kernel start-up would build on an H100/H200, built for
    sm_90 here (runtime/kernel_check.py); exit status 1 when one fails to build or needs more shared memory
    than a block gets."""
    from compiled_llm.config import default_batched_tokens
    from compiled_llm.runtime.kernel_check import SMEM_LIMIT, check_model

    hf, dtype = _hf_config_and_dtype(config)
    built = check_model(hf, dtype, block_size=config.block_size,
                        max_num_batched_tokens=tokens or default_batched_tokens("cuda"))
    bad = [b for b in built if b.error or b.shared > SMEM_LIMIT]
    print(f"{len(built)} Triton kernels built for sm_90 (shared memory, registers and spills from ptxas):")
    for b in built:
        print("  " + b.row())
    print(f"{len(bad)} failed" if bad else "all built")
    return 1 if bad else 0


def _audit(config, target: str, tokens: int | None) -> int:
    """compile-cache --dry-run: the graph audit (runtime/audit.py) of the checkpoint's config, no weights,
    no GPU; exit status 1 when some layer misses a fusion its model declares. target: the --device flag as
    given, naming the graph to audit (auto: the GPU's), not a device this machine must have."""
    import torch

    from compiled_llm.compiler import parse_passes, parse_sizes
    from compiled_llm.config import default_batched_tokens
    from compiled_llm.runtime.audit import audit

    hf, dtype = _hf_config_and_dtype(config)
    device = torch.device("cuda" if target in ("auto", "cuda") else target)  # the GPU's graph by default
    tokens = tokens or default_batched_tokens(device.type)  # the target's default when not given
    sizes = parse_sizes(config.cudagraph_batch_sizes, device, config.max_num_seqs, tokens)
    report = audit(hf, device=device, dtype=dtype, tokens=tokens, batch_sizes=sizes,
                   passes=parse_passes(config.compile_passes), block_size=config.block_size)
    print(report.text())
    return 1 if report.mismatches else 0


def _compile_cache(args: argparse.Namespace) -> int:
    """Builds (or checks) the compile cache in --out: starts the engine once, which warms up everything."""
    from compiled_llm.runtime.engine import LLMEngine

    if args.dry_run:  # fake tensors: the config is not resolved against this machine's devices
        if args.kernels:
            return _kernel_check(config_from_args(args, device="cpu"), args.max_num_batched_tokens)
        return _audit(config_from_args(args, device="cpu"), args.device, args.max_num_batched_tokens)
    config = config_from_args(args)
    if not args.out:
        print("error: compile-cache needs --out DIR (or --dry-run)", file=sys.stderr)
        return 2
    config.compile_cache, config.enforce_eager = args.out, False
    compiler = LLMEngine(config).executor.runner.compiler
    if compiler is None:
        print("error: this model runs eager (the compiler is off for it); nothing to cache", file=sys.stderr)
        return 2
    cache = compiler.cache
    print(f"compile cache {cache.dir}: {cache.status}"
          + (f" (was {cache.problem})" if cache.problem else "") + f", start-up {compiler.startup_seconds:.1f}s")
    if args.report:
        print(compiler.report())
        print("compiles this run: " + ", ".join(f"{k}={v}" for k, v in compiler.summary()["counters"].items()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m compiled_llm",
                                     description="LLM inference and serving engine built on torch.compile")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts given on the command line",
                         formatter_class=DefaultsOnceFormatter)
    gen.add_argument("prompts", nargs="+", help="one or more prompts")
    add_engine_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=_generate)

    from compiled_llm.server.cli import add_serve_args, run_server

    serve = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API", formatter_class=DefaultsOnceFormatter)
    add_serve_args(serve)
    serve.set_defaults(func=run_server)

    cc = sub.add_parser("compile-cache", help="precompile everything into a folder that `serve --compile-cache` "
                        "and LLM(compile_cache=...) start from", formatter_class=DefaultsOnceFormatter)
    cc.add_argument("--out", metavar="DIR", help="the cache folder (created or rebuilt); required unless --dry-run")
    cc.add_argument("--dry-run", action="store_true",
                    help="build nothing: print the graph audit (per layer, the fusions that matched against those the "
                         "model declares; graph pieces; the largest tensor of a max-num-batched-tokens prefill) for "
                         "the GPU's graph, from config.json alone, on any machine; exit 1 on a missing fusion")
    cc.add_argument("--kernels", action="store_true",
                    help="with --dry-run: instead of the audit, build every Triton kernel start-up would build on an "
                         "H100/H200 for sm_90 on this machine (no GPU) and print each one's shared memory, registers and "
                         "spills; exit 1 when one fails to build")
    cc.add_argument("--report", action="store_true", help="print per-pass matches, graph pieces and captured graphs")
    add_engine_args(cc)
    cc.set_defaults(func=_compile_cache)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command in ("generate", "serve"):
            from compiled_llm.runtime.executor import is_engine_process, run_node

            config = config_from_args(args)
            if not is_engine_process(config):  # another node's ranks, or a torchrun rank other than 0
                return run_node(config)
        return args.func(args) or 0
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
