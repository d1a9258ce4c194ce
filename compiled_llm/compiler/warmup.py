"""Start-up warm-up: compile everything the server will need before it takes a request.

Work items, in order, behind one progress bar: the dynamic-token-count compile (a prefill-shaped
forward), each static batch size (a decode-shaped forward: static compile and, on CUDA, the per-piece
graph captures; then the whole-graph decode capture and its timing), on CUDA the largest step once more (the
caching allocator grown to its peak), then every key that the JIT kernels of the selected providers registered
and no forward has launched yet (`warmup_plan` orders the forwards). Afterwards the JIT
monitor (ops/jit.py) reports any compile as a key missing from the registry.
"""

from __future__ import annotations

import logging
import os
import time

import torch
from tqdm import tqdm

from compiled_llm.ops.context import AttentionMetadata, ForwardContext, GroupMetadata, set_forward_context
from compiled_llm.ops.jit import MONITOR, REGISTRY, serial_ast_parse
from compiled_llm.ops.registry import OPS

log = logging.getLogger("compiled_llm")

PEAK_STEP_ENV = "COMPILED_LLM_WARMUP_PEAK_STEP"  # 0: no max_num_batched_tokens step in warm-up (an A/B switch)


def dummy_context(specs: dict, kv_caches: dict, block_size: int, num_seqs: int, tokens_per_seq: int,
                  device: torch.device) -> ForwardContext:
    """num_seqs sequences of tokens_per_seq new tokens each, every block table pointing at block 0
    (the cache is empty at start-up; what warm-up writes there is overwritten before it is read)."""
    n = num_seqs * tokens_per_seq
    blocks = -(-tokens_per_seq // block_size)
    groups = {}
    for g in {s.kv_group for s in specs.values()}:
        tables = torch.zeros(num_seqs, blocks, dtype=torch.int32, device=device)
        slots = (torch.arange(n, device=device) % tokens_per_seq) % block_size
        groups[g] = GroupMetadata(tables, slots)
    meta = AttentionMetadata(query_start_loc=[i * tokens_per_seq for i in range(num_seqs + 1)],
                             seq_lens=[tokens_per_seq] * num_seqs, block_size=block_size, groups=groups,
                             positions=torch.arange(n, device=device) % tokens_per_seq)
    return ForwardContext(meta, kv_caches, specs)


def kernel_keys(facts: dict) -> list[tuple]:
    """(kernel, key) pairs the selected providers' JIT kernels registered for this model. For an op resolved
    per layer, a kernel sees only the layers that chose its provider (`layers`; every layer stays in
    `all_layers`): a head_dim-16 layer on the reference must not get a Triton build it cannot take."""
    out = []
    for kernel in REGISTRY.values():
        spec = OPS.get(kernel.op)
        chosen = {key for key, (name, _) in spec.chosen.items() if name == kernel.provider} if spec else set()
        if not chosen:
            continue
        view = facts
        if spec.per_layer:
            layers = facts.get("layers", {})
            view = dict(facts, layers={i: s for i, s in layers.items() if i in chosen}, all_layers=layers)
        out.extend((kernel, key) for key in kernel.keys(view))
    return out


@torch.inference_mode()
def precompile_kernels(facts: dict, device, workers: int | None = None) -> int:
    """Builds every Triton kernel the chosen providers registered, in parallel, before anything launches them:
    Triton takes about a second a kernel, and a cold start built 35 of ours one after another as each first
    launched (the eager profile step, the first forward, every batch size: about a third of a 67 s cold start on
    the H200). Each registered key's compile function runs with Triton's launches turned into its warm-ups
    (compile, no launch) under its AsyncCompileMode, whose thread pool builds them side by side; a later
    launch with the same specialisation finds its kernel built. Nothing runs, so the functions' outputs are
    never read. Returns how many kernel keys it went through (0 off CUDA, without Triton's async mode, or with
    COMPILED_LLM_KERNEL_BUILD_WORKERS=0: each kernel then builds at its first launch, as before)."""
    device = torch.device(device)
    workers = workers if workers is not None else int(os.environ.get("COMPILED_LLM_KERNEL_BUILD_WORKERS",
                                                                     min(32, os.cpu_count() or 1)))
    if device.type != "cuda" or workers < 1:
        return 0
    try:
        from triton.runtime import _async_compile
        from triton.runtime.jit import JITFunction
    except ImportError:
        return 0
    from concurrent.futures import ThreadPoolExecutor

    MONITOR.install_triton_hook()  # its builds and cache hits count with the rest
    keys = [(kernel, key) for kernel, key in kernel_keys(facts) if kernel.provider == "triton"]
    if not keys:
        return 0
    launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        return launch(self, *args, grid=grid, warmup=True, **kwargs)

    t0 = time.perf_counter()
    with serial_ast_parse(), ThreadPoolExecutor(workers) as pool:
        JITFunction.run = compile_only
        try:
            with _async_compile.AsyncCompileMode(pool):  # leaving it waits for every build, files it in its cache
                for kernel, key in keys:
                    kernel.compile(key, device)
        finally:
            JITFunction.run = launch
            _async_compile.active_mode.set(None)  # (a build that raised leaves the mode set when leaving it)
    log.info("built %d JIT kernel keys' Triton kernels in parallel in %.1fs", len(keys), time.perf_counter() - t0)
    return len(keys)


def warmup_plan(sizes, max_tokens: int, max_num_seqs: int | None, *, full_graph_ok: bool, lone_token_bucket: bool,
                cuda: bool) -> list[tuple[str, str, int]]:
    """Warm-up's forwards in order, as (name, kind, n): "prefill" one sequence of n new tokens, "decode" n
    sequences of one token, "whole" the whole-graph decode capture of batch n (timed against the pieces).
    First the dynamic-token-count compile, then every static size, largest first (later captures reuse the graph
    pool's memory); a size above max_num_seqs can only be a prefill (or a chunked-prefill step). On CUDA, last,
    the largest step (max_tokens) once more now that the KV cache exists: start-up's memory profile emptied
    the caching allocator, and without it the first full step a server ran grew it (cudaMalloc) while a user
    waited (H200, Gemma 4 26B-A4B: one 369 MB segment, the first wave of 8 x 1K prompts 6-10 ms slower)."""
    sizes = sorted(sizes, reverse=True)
    prefill = max(2, min(max_tokens, (sizes[0] + 1) if sizes else 16))
    plan = [(f"compile ({prefill}-token prefill, dynamic token count)", "prefill", prefill)]
    if not lone_token_bucket:  # no static bucket takes a lone decode token: its guard needs a compile
        plan.append(("compile (1-token decode)", "prefill", 1))
    for size in sizes:
        if max_num_seqs is not None and size > max_num_seqs:
            plan.append((f"prefill size {size}", "prefill", size))
            continue
        plan.append((f"batch size {size}", "decode", size))
        if full_graph_ok:
            plan.append((f"whole-graph decode {size}", "whole", size))
    if cuda and max_tokens > prefill and os.environ.get(PEAK_STEP_ENV, "1") != "0":
        plan.append((f"allocator ({max_tokens}-token step)", "prefill", max_tokens))
    return plan


@torch.inference_mode()
def warm_up(model, specs: dict, kv_caches: dict, block_size: int, max_tokens: int, facts: dict, device,
            mode: str = "off", progress: bool = True, context_factory=None, timings: dict | None = None,
            stage_inputs=None, max_num_seqs: int | None = None) -> float:
    """model: a CompiledModel. context_factory(num_seqs, tokens_per_seq) -> ForwardContext, for models
    whose ops need more than the KV cache (recurrent state); default: dummy_context. Returns seconds; each
    item's seconds go into `timings` (name -> seconds) when given. stage_inputs(num_tokens): a later pipeline
    stage's dummy inputs from the previous stage. The forwards run in `warmup_plan`'s order."""
    device = torch.device(device)
    make = context_factory or (lambda s, t: dummy_context(specs, kv_caches, block_size, s, t, device))

    def forward(num_seqs: int, tokens: int):
        n = num_seqs * tokens
        args = (torch.zeros(n, dtype=torch.long, device=device), torch.arange(n, device=device) % tokens)
        with set_forward_context(make(num_seqs, tokens)):
            model(*args) if stage_inputs is None else model(*args, stage_inputs(n))

    def decode_graph(size: int):
        with set_forward_context(make(size, 1)):
            model.choose_decode_graph(size)

    run = {"prefill": lambda n: forward(1, n), "decode": lambda n: forward(n, 1), "whole": decode_graph}
    plan = warmup_plan(model.sizes, max_tokens, max_num_seqs, full_graph_ok=model.full_graph_ok,
                       lone_token_bucket=model.bucket_for(1) is not None, cuda=device.type == "cuda")
    items = [(name, lambda kind=kind, n=n: run[kind](n)) for name, kind, n in plan]
    keys = kernel_keys(facts)
    for kernel, key in keys:
        items.append((f"{kernel.name} {key}", lambda k=kernel, key=key: (
            None if (k.name, key) in MONITOR.seen else k.compile(key, device))))

    t0 = time.perf_counter()
    MONITOR.begin_warmup(mode)
    try:
        with tqdm(total=len(items), desc="JIT warm-up", unit="item", disable=None if progress else True) as bar:
            for i, (name, fn) in enumerate(items, 1):  # a bar on a terminal; else a log line per item
                bar.set_postfix_str(name[:60])
                log.log(logging.DEBUG if not bar.disable else logging.INFO, "JIT warm-up %d/%d: %s (%.1fs)",
                        i, len(items), name, time.perf_counter() - t0)
                t_item = time.perf_counter()
                fn()
                if timings is not None:
                    timings[name] = round(time.perf_counter() - t_item, 2)
                bar.update()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        MONITOR.end_warmup()
    return time.perf_counter() - t0
