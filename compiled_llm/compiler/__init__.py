"""The compiler: torch.compile with our backend (split at attention, piecewise Inductor compiles with our
fusion passes, CUDA Graphs per batch size), JIT warm-up and the compile cache. See docs/compiler.md.

The runtime uses one object: `ModelCompiler(model, config, ...)` replaces the model's forward, and
`warm_up(kv_caches, block_size)` compiles everything at start-up (from the compile cache if given).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import torch

from compiled_llm.compiler.backend import CompilerConfig
from compiled_llm.compiler.cache import CompileCache, compile_counters, count_cpp_builds
from compiled_llm.compiler.model import CompiledModel
from compiled_llm.compiler.verify import FusionCheckError, verify
from compiled_llm.compiler.warmup import precompile_kernels, warm_up
from compiled_llm.ops.registry import OPS

SPLIT_ENV = "COMPILED_LLM_SPLIT_GRAPH"  # on | off: what --split-graph auto means (the test suite: on)

log = logging.getLogger("compiled_llm")

DEFAULT_CUDA_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# Sizes above max_num_seqs take prompts only (and chunked-prefill steps): their pieces replay as CUDA graphs
# instead of launching ~500 kernels from Python. H200, 26B-A4B, session 27: TTFT 512 / 768 / 1K tokens
# 20.9 / 26.0 / 28.7 ms as graphs, 49-75 ms from Python on a busy host (31.8 ms at 1K on a quiet one); at 2K
# and above the GPU is the bound and graphs won on one machine and lost 1-2 ms on another, so they stop here.
PREFILL_CUDA_SIZES = (256, 512, 1024)


def parse_sizes(text: str | None, device: torch.device, max_num_seqs: int, max_tokens: int | None = None) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; None: powers of two up to max_num_seqs on CUDA, and the PREFILL_CUDA_SIZES above
    it up to max_tokens (the step's token budget), none on CPU; '' or 'none': none."""
    if text is None:
        if device.type != "cuda":
            return []
        prefill = {s for s in PREFILL_CUDA_SIZES if max_num_seqs < s <= (max_tokens or 0)}
        return sorted({s for s in DEFAULT_CUDA_SIZES if s <= max_num_seqs} | {max_num_seqs} | prefill)
    if text.strip().lower() in ("", "none"):
        return []
    sizes = sorted({int(s) for s in text.split(",") if s.strip()})
    if sizes and sizes[0] < 1:
        raise ValueError("cudagraph batch sizes must be positive")
    return sizes


def parse_autotune(text: str | None) -> str:
    value = str(text or "off").strip().lower()
    if value not in ("off", "static", "all"):
        raise ValueError(f"max_autotune must be off, static or all, not {text!r}")
    return value


def parse_compile_sizes(text: str | None, sizes: list[int]) -> list[int] | None:
    """None, 'none' or '': no bucket compiles statically (each replays the dynamic compile, padded); 'all':
    every bucket does (returns None); '1,8': those (each must be a bucket)."""
    value = (text or "").strip().lower()
    if value in ("", "none"):
        return []
    if value == "all":
        return None
    chosen = sorted({int(s) for s in text.split(",") if s.strip()})
    missing = [s for s in chosen if s not in sizes]
    if missing:
        raise ValueError(f"compile sizes {missing} are not batch sizes (--cudagraph-batch-sizes gives {sizes})")
    return chosen


def parse_passes(text: str | None) -> tuple[str, ...] | None:
    if text is None or text.strip().lower() == "all":
        return None
    if text.strip().lower() in ("", "none"):
        return ()
    return tuple(p.strip() for p in text.split(",") if p.strip())


def _tp_group_name() -> str | None:
    try:
        from compiled_llm.distributed.parallel_state import get_parallel_state
    except ImportError:
        return None
    ps = get_parallel_state()
    return ps.tp_group_name if ps.tp_size > 1 else None


def enable_symm_mem(group_name: str | None) -> None:
    """Lets Inductor lower the TP group's small all-reduces to symmetric-memory one-shot kernels."""
    import warnings

    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    if group_name is None:
        raise ValueError("tp_allreduce symm-mem needs a tensor-parallel group")
    with warnings.catch_warnings():  # torch >= 2.11 enables every group itself and says so (FutureWarning)
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(group_name)


def whole_graph_decode_ok(stateful: bool, sparse: bool = False, pipeline: bool = False) -> bool:
    """Whether decode may be captured as one CUDA graph (with CUDA; CompiledModel adds that and the config):
    every split op the model runs has a capturable provider chosen (attention; for a model with recurrent
    state also the state ops, which read the step's layout from static buffers; with sparse KV the sparse
    attention op, whose decode rows read only static buffers: steps with a row that is not a decode row
    run piecewise, CompiledModel asks the step's extras). A later pipeline stage's inputs have no static
    buffers: not for it."""
    if pipeline:
        return False
    ops = [OPS["attention"]] + ([spec for spec in OPS.values() if spec.recurrent_state] if stateful else [])
    ops += [OPS["sparse_attention"]] if sparse else []
    return all(spec.capturable() for spec in ops)


def check_graph_safe_providers(device: torch.device, batch_sizes) -> None:
    """With CUDA graphs, every chosen provider of an op inside the compiled pieces must run without reading
    device values on the host (Provider.syncs): a capture fails at the first such read, with CUDA's own
    message. Refuses them here, by name (split ops run between the graphs, unless whole-graph decode, which
    asks them to be capturable)."""
    if device.type != "cuda" or not batch_sizes:
        return
    bad = [f"{op}={p}" for op, spec in OPS.items() if not spec.splits_graph and (p := spec.syncing_choice())]
    if bad:
        raise ValueError(f"op providers {', '.join(bad)} read device values on the host and cannot run inside a "
                         "CUDA graph: choose another provider (--op-providers) or turn the graphs off "
                         "(--cudagraph-batch-sizes none)")


def split_graph(setting: str, device: torch.device, batch_sizes) -> bool:
    """Whether the forward splits at the attention and state ops (--split-graph): auto splits on CUDA (where CUDA
    Graphs capture the pieces; without them too, the path the GPU's tests cover) and compiles one graph on the CPU.
    The test suite sets COMPILED_LLM_SPLIT_GRAPH=on, so that its CPU engines run the pieces a GPU runs; an explicit
    on/off wins."""
    if setting == "auto":
        setting = os.environ.get(SPLIT_ENV) or ("on" if device.type == "cuda" else "off")
    if setting not in ("on", "off"):
        raise ValueError(f"{SPLIT_ENV}={setting!r}: expected on or off")
    if setting == "off" and device.type == "cuda" and batch_sizes:
        raise ValueError("split_graph off needs --cudagraph-batch-sizes none on CUDA: CUDA Graphs capture the "
                         "pieces between the attention ops, which read each step's metadata on the host")
    return setting == "on"


def aot_possible() -> bool:
    """Whether a compile cache also keeps the traced forward (compiler/aot.py): torch >= 2.11, one process (the
    ranks of a parallel engine would share one cache key, and their graphs differ)."""
    from compiled_llm.compiler import aot

    dist = torch.distributed
    return aot.supported() and not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


class ModelCompiler:
    def __init__(self, model: torch.nn.Module, config, device: torch.device, dtype: torch.dtype, specs: dict,
                 hf_config: dict, facts: dict | None = None, stateful: bool = False, sparse: bool = False,
                 stage_inputs=None):
        """stateful: the model has recurrent-state ops; sparse: sparse KV is on (no whole-graph decode for it,
        whole_graph_decode_ok). stage_inputs: on
        a pipeline stage after the first, num_tokens -> dummy tensors of what the previous stage hands over
        (for warm-up); the stage's forward takes them as `intermediate`."""
        self.config = config
        self.model = model
        self.device = torch.device(device)
        self.dtype = dtype
        self.specs = specs
        self.hf_config = {k: v for k, v in hf_config.items() if k != "_name_or_path"}  # no paths in the key
        self.facts = dict(facts or {}, dtype=dtype, layers=specs)
        sizes = parse_sizes(config.cudagraph_batch_sizes, self.device, config.max_num_seqs,
                            config.max_num_batched_tokens)
        check_graph_safe_providers(self.device, sizes)
        split = split_graph(config.split_graph, self.device, sizes)
        ccfg = CompilerConfig(
            batch_sizes=sizes, compile_sizes=parse_compile_sizes(config.compile_sizes, sizes),
            cudagraphs=self.device.type == "cuda", full_graph_decode=config.full_graph_decode, split=split,
            autotune=parse_autotune(config.max_autotune),
            passes=parse_passes(config.compile_passes), dtype=dtype, tp_group=_tp_group_name(),
            jit_monitor=config.jit_monitor, symm_mem_allreduce=config.tp_allreduce == "symm-mem")
        if ccfg.symm_mem_allreduce:
            enable_symm_mem(ccfg.tp_group)
        pipeline = config.pipeline_parallel_size > 1
        self.stage_inputs = stage_inputs
        self.compiled = CompiledModel(model, ccfg, self.device, whole_graph_decode_ok(stateful, sparse, pipeline))
        self.cache: CompileCache | None = None
        self._session: contextlib.ExitStack | None = None  # begin() to the end of warm_up
        self.begin_seconds = 0.0
        self.startup_seconds = 0.0
        self.warmup_seconds: dict[str, float] = {}  # warm-up item -> seconds (the start-up's phases)
        count_cpp_builds()

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate=None):
        return self.compiled(input_ids, positions, intermediate)

    def release_graphs(self) -> None:
        self.compiled.release_graphs()

    def cache_flags(self) -> dict:
        c = self.config
        providers = {op: sorted({name for name, _ in spec.chosen.values()}) for op, spec in OPS.items()}
        return {"dtype": str(self.dtype), "block_size": c.block_size, "max_num_seqs": c.max_num_seqs,
                "max_num_batched_tokens": c.max_num_batched_tokens, "max_model_len": c.max_model_len,
                "batch_sizes": self.compiled.sizes, "compile_sizes": self.compiled.config.compile_sizes, "passes": self.compiled.pass_manager.config,
                "full_graph_decode": c.full_graph_decode, "max_autotune": c.max_autotune, "providers": providers, "tp": self.compiled.config.tp_group,
                "tp_allreduce": c.tp_allreduce, "split": self.compiled.config.split}

    def begin(self) -> None:
        """Opens start-up's compiling: the compile cache (when given) is in use from here to the end of warm_up
        (the eager profile step's kernels are read from it or saved in it too), and the model's JIT kernels
        build in parallel (warmup.precompile_kernels). The runtime calls it before its profile step; warm_up
        calls it if nobody did."""
        if self._session is not None:
            return
        t0 = time.perf_counter()
        self._session = contextlib.ExitStack()
        if self.config.compile_cache:
            self.cache = CompileCache(self.config.compile_cache, self.hf_config, self.cache_flags(), self.device)
            self._session.enter_context(self.cache.session(self.summary))
            if aot_possible():
                self.compiled.use_aot(self.cache.root / "aot", save=self.cache.status != "hit")
        try:
            precompile_kernels(self.facts, self.device)
        except Exception as e:  # noqa: BLE001 - each kernel still builds at its first launch
            log.warning("building the JIT kernels in parallel failed (%s: %s); each builds at its first launch",
                        type(e).__name__, e)
        self.begin_seconds = time.perf_counter() - t0

    def abandon(self) -> None:
        """Start-up failed between begin() and warm_up (e.g. the KV cache does not fit): the compile cache's
        session ends as on an error (a build is dropped, the cache variables restored)."""
        session, self._session = self._session, None
        if session is not None:
            err = RuntimeError("start-up failed before warm-up")
            session.__exit__(type(err), err, None)

    def warm_up(self, kv_caches: dict, block_size: int, context_factory=None, progress: bool = True) -> None:
        """Compiles everything before the first request: from the compile cache when one is given."""
        self.begin()
        t0 = time.perf_counter()
        max_len = self.config.max_model_len or 0
        self.compiled.max_blocks = -(-max_len // block_size) + 1
        session, self._session = self._session, None
        with session:  # the compile cache's session ends here: installed if built, dropped on an error
            warm_up(self.compiled, self.specs, kv_caches, block_size, self.config.max_num_batched_tokens, self.facts,
                    self.device, self.config.jit_monitor, progress, context_factory, self.warmup_seconds,
                    self.stage_inputs, self.config.max_num_seqs)
        self.verify()
        self.startup_seconds = self.begin_seconds + time.perf_counter() - t0  # (the profile step between: not)
        if self.cache is not None and self.cache.status == "hit":
            self._warn_compiled_despite_cache()
        # The per-pass report at DEBUG: `compile-cache --report` prints it, and printing it here too showed it twice.
        log.info("compiled in %.1fs%s", self.startup_seconds,
                 f" (compile cache: {self.cache.status})" if self.cache else "")
        log.debug("compile report:\n%s", self.report())

    def _warn_compiled_despite_cache(self) -> None:
        """A start from a valid compile cache should compile nothing; say what it compiled if it did."""
        from compiled_llm.ops.jit import MONITOR

        c = compile_counters()
        what = []
        if c["fxgraph_cache_miss"] or c["fxgraph_cache_bypass"]:
            what.append(f"{c['fxgraph_cache_miss'] + c['fxgraph_cache_bypass']} Inductor graphs "
                        f"({c['fxgraph_cache_bypass']} not cacheable)")
        if c["triton_builds"]:
            names = ", ".join(f"{k} x{n}" if n > 1 else k for k, n in MONITOR.triton_builds.most_common(8))
            what.append(f"{c['triton_builds']} Triton kernels in {MONITOR.triton_build_seconds:.1f}s ({names})")
        if what:
            log.warning("the compile cache %s was a hit, yet this start compiled %s", self.cache.dir, "; ".join(what))

    def verify(self) -> list:
        """Each layer's fusions against the model's declaration, in every compile (compiler/verify.py)."""
        return verify(self.model.expected_fusions(), self.compiled.matches_by_shape(),
                      set(self.compiled.pass_manager.fusions()), self.config.fusion_check,
                      self.facts.get("num_experts", 0))

    def summary(self) -> dict:
        out = self.compiled.summary()
        out["counters"] = compile_counters()
        out["warmup_seconds"] = dict(self.warmup_seconds)
        return out

    def report(self) -> str:
        """Per pass, the matches it replaced; the graph pieces and captured graphs."""
        s = self.summary()
        lines = ["passes (matches replaced in the dynamic-shape compile):"]
        counted = self.compiled.pass_manager.count_only()
        for name, p in s["passes"].items():
            what = p["fusion"] + (f" [counted; Inductor computes it: {self.compiled.pass_manager.why_counted(name)}]"
                                  if name in counted else "")
            lines.append(f"  {name:<24} {what:<34} {p['matches']}")
        lines.append(f"graph pieces: {s['pieces']} compiled, {s['attention_ops']} attention ops between them"
                     + (f"; {s['shared_compiles']} compiles reused from look-alike pieces" if s.get("shared_compiles")
                        else ""))
        lines.append(f"static batch sizes: {s['static_sizes'] or 'none'}; captured CUDA graphs: {s['captured_graphs']}"
                     + (f" (whole-graph decode at {s['whole_graph_decode_sizes']})" if s["whole_graph_decode_sizes"]
                        else ""))
        if s.get("ahead_of_time"):
            lines.append(f"forward compiled ahead of time: {s['ahead_of_time']} (compile cache; no Dynamo trace when loaded)")
        return "\n".join(lines)


__all__ = ["ModelCompiler", "whole_graph_decode_ok", "CompilerConfig", "CompiledModel", "CompileCache",
           "FusionCheckError", "parse_sizes"]
