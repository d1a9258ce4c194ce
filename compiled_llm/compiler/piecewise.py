"""One compiled piece of the split graph: an Inductor compile for the dynamic token count, one per static
batch size named in compile_sizes (compiled on first use; warm-up makes that first use happen at start-up;
other batch sizes run the dynamic compile), and on CUDA one captured CUDA Graph per batch size
(compiler/cuda_graph.py), replayed with the inputs copied into the captured buffers."""

from __future__ import annotations

import copy
import logging
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import torch
import torch.fx
from torch._dynamo.utils import counters

from compiled_llm.compiler import codegen
from compiled_llm.compiler.cuda_graph import BatchDescriptor, CUDAGraphWrapper
from compiled_llm.compiler.inspect import piece_signature
from compiled_llm.ops.context import set_layer_base
from compiled_llm.ops.jit import MONITOR
from compiled_llm.passes.base import first_layer

log = logging.getLogger("compiled_llm")


def absolute_layers(delta: Counter, base: int) -> Counter:
    """Our passes' counter deltas ('compiled_llm.geglu_moe@+1') as pass -> matches ('geglu_moe@4' at base 3)."""
    out = Counter()
    for key, n in delta.items():
        if key.startswith("compiled_llm."):
            name, sep, offset = key.removeprefix("compiled_llm.").partition("@")
            out[name if not sep else f"{name}@{offset}" if offset == "-" else f"{name}@{base + int(offset)}"] += n
    return out


def relative_layer_args(gm: torch.fx.GraphModule, base: int) -> int:
    """Rewrites the `layer_idx` argument of our ops inside a piece to be relative to the piece's first layer
    (the op adds the base back at run time: ops/context.py absolute_layer). Then the pieces of look-alike
    layers are the same graph: they compile once (PieceRunner) and hit Inductor's FX-graph cache on disk.
    Returns how many arguments it rewrote."""
    n = 0
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not str(target).startswith("compiled_llm."):
            continue
        schema = (target.default if isinstance(target, torch._ops.OpOverloadPacket) else target)._schema
        names = [a.name for a in schema.arguments]
        if "layer_idx" not in names:
            continue
        i = names.index("layer_idx")
        if i < len(node.args):
            node.args = (*node.args[:i], node.args[i] - base, *node.args[i + 1:])
        else:
            node.kwargs = {**node.kwargs, "layer_idx": node.kwargs["layer_idx"] - base}
        n += 1
    if n:
        gm.recompile()
    return n


def static_fakes(args: list) -> list:
    """A static compile's example inputs as fake tensors of a fake mode with a shape env (their own shapes,
    no symbols). Inductor's FX-graph and AOT caches bypass a compile whose inputs have no shape env ("No shape
    env"): given the real tensors, every static batch size compiled again on each start, compile cache or not.
    Dynamo's fake inputs (the dynamic compile) pass through."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    if not any(isinstance(a, torch.Tensor) and not isinstance(a, FakeTensor) for a in args):
        return args
    mode = FakeTensorMode(shape_env=ShapeEnv())
    return [mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a for a in args]


class PieceRunner:
    """One compute piece. Its graph's layer indices are relative to its first layer (`base`), and a piece
    whose graph and inputs equal an earlier piece's (piece_signature, strict) reuses that piece's compiles
    for every shape instead of compiling again: Gemma 4 26B-A4B's 31 pieces are a handful of distinct graphs."""

    def __init__(self, name: str, gm: torch.fx.GraphModule, backend, graph: int = 0):
        self.name = name
        self.graph = graph  # which Dynamo graph of the model (1, 2, ...: recompiles after a guard failed)
        self._gm, self._load_gm = gm, None
        self.base = first_layer(gm.graph)
        relative_layer_args(gm, self.base)
        self.backend = backend
        self.dynamic: Callable | None = None
        self.static: dict[int, Callable] = {}
        self.graphs = CUDAGraphWrapper(name, backend.state.graph_pool)
        self.matches: dict[str, Counter] = {}  # compile ('dynamic', '8'; '/g1' after a recompile) -> pass -> matches
        self.inputs: dict[str, str | None] = {}  # compile -> the graph our passes received (None: FX-cache hit)
        self.compile_seconds = 0.0

    @classmethod
    def restored(cls, name: str, backend, base: int, graph: int, dynamic: Callable, load_gm: Callable,
                 matches: dict) -> "PieceRunner":
        """A piece saved by an ahead-of-time compile (compiler/aot.py): its dynamic compile loaded, its graph
        (already relative to `base`) unpickled by `load_gm` only if a static compile needs it."""
        self = cls.__new__(cls)
        self.name, self.graph, self.base, self.backend = name, graph, base, backend
        self._gm, self._load_gm = None, load_gm
        self.dynamic = dynamic
        self.static, self.inputs = {}, {self.label("dynamic"): None}
        self.graphs = CUDAGraphWrapper(name, backend.state.graph_pool)
        self.matches = {self.label("dynamic"): Counter(matches)}
        self.compile_seconds = 0.0
        return self

    @property
    def gm(self) -> torch.fx.GraphModule:
        if self._gm is None:
            self._gm = self._load_gm()
        return self._gm

    def _compile(self, args: list, shape: str) -> Callable:
        shared = self.backend.shared_compiles
        key = None
        if shared is not None:
            key = (piece_signature(self.gm, args, strict=True)[0], self.label(shape))
            hit = shared.get(key)
            if hit is not None:  # a look-alike piece compiled this already: its code, our layers' counts
                fn, delta = hit
                self.inputs[self.label(shape)] = None
                self.matches[self.label(shape)] = absolute_layers(delta, self.base)
                self.backend.shared_hits += 1
                return fn
        fn, delta = self._inductor(args, shape)
        if key is not None:
            shared[key] = (fn, delta)
        return fn

    def _inductor(self, args: list, shape: str) -> tuple[Callable, Counter]:
        MONITOR.compile_event("inductor", f"{self.name} ({shape} tokens)")
        gm = torch.fx.GraphModule(self.gm, copy.deepcopy(self.gm.graph))
        before = counters["inductor"].copy()
        passes = self.backend.pass_manager
        calls = passes.calls
        t0 = time.perf_counter()
        # our Inductor code-generation choices; no repro script saved in the compiled code (compiler/codegen.py)
        with codegen.heuristics(), codegen.without_repro_script():
            fn = self._run_inductor(gm, args, shape)
        self.inputs[self.label(shape)] = passes.last_input if passes.calls != calls else None
        self.compile_seconds += time.perf_counter() - t0
        # our passes count into counters["inductor"], per layer relative to the graph's first one; Inductor's
        # FX cache replays those counts on a hit, also for an identical piece of another layer
        delta = Counter({k: v for k, v in (counters["inductor"] - before).items() if k.startswith("compiled_llm.")})
        self.matches[self.label(shape)] = absolute_layers(delta, self.base)
        return fn, delta

    def _run_inductor(self, gm: torch.fx.GraphModule, args: list, shape: str) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        if self.backend.aot and shape == "dynamic" and self.backend.compile_fn is None:
            from compiled_llm.compiler.aot import compile_artifact  # saved with the forward (compiler/aot.py)

            return compile_artifact(gm, args, self._inductor_config(shape))
        compile_fn = self.backend.compile_fn or compile_fx  # the audit stops after our passes (compiler/inspect.py)
        fakes = static_fakes(args)
        if self._load_gm is not None:  # a loaded piece's graph has no fake values (compiler/aot.py)
            from compiled_llm.compiler.aot import add_example_values

            add_example_values(gm, fakes)
        return compile_fn(gm, fakes, config_patches=self._inductor_config(shape))

    def _inductor_config(self, shape: str) -> dict:
        """Our passes and settings; GEMM autotuning for the compiles the config names (static: the batch sizes)."""
        patches = self.backend.pass_manager.inductor_config()
        if codegen.inductor_pdl(self.backend.pass_manager.device_type):  # compiler/codegen.py: Inductor's kernels' PDL
            patches = {**patches, "triton.enable_pdl": True}
        autotune = self.backend.config.autotune
        if autotune == "all" or (autotune == "static" and shape != "dynamic"):
            patches = {**patches, "max_autotune_gemm": True}
        if self.backend.config.symm_mem_allreduce and shape != "dynamic":
            # decode sizes: all-reduces <= 128 KB as symm_mem.one_shot_all_reduce. Not in the dynamic-shape
            # compile: Inductor's size check cannot decide `5632 * tokens <= 131072` for a symbolic token
            # count (LoweringException on the H200, torch 2.11), and prefill all-reduces are large anyway
            patches = {**patches, "_collective.auto_select": True}
        return patches

    def label(self, shape: str) -> str:
        return shape if self.graph == 0 else f"{shape}/g{self.graph}"

    def _keep_fusions(self, fn: Callable, shape: str) -> Callable:
        """A static compile that missed a fusion this piece's dynamic compile got is not used: the batch size
        replays the dynamic compile instead (as with --compile-sizes none), with a warning, and the graph our
        passes saw is written out. Seen on the H200 at batch sizes 1 and 2 (router, GEGLU MoE): Inductor's pad_mm
        had padded those static matmuls, now off (passes/base.py INDUCTOR_SETTINGS); the guard stays for the
        next rewrite of that kind (benchmarks/NOTES.md, 2026-11-30 sessions 3 and 4)."""
        label, dynamic = self.label(shape), self.label("dynamic")
        got, want = self.matches[label], self.matches.get(dynamic, Counter())
        missed = sorted(p for p, n in want.items() if "@" not in p and got[p] < n)
        if not missed:
            return fn
        path = None
        if self.inputs.get(label):
            folder = Path(tempfile.gettempdir()) / "compiled_llm_missed_fusions"
            folder.mkdir(exist_ok=True)
            path = folder / f"{self.name}_{label.replace('/', '_')}.txt"
            path.write_text(self.inputs[label])
        log.warning("%s: the static compile for %s tokens missed %s, which its dynamic compile got; that batch size "
                    "replays the dynamic compile instead%s", self.name, shape, ", ".join(missed),
                    f" (the graph the passes saw: {path})" if path else "")
        self.matches[label] = Counter(want)
        return self.dynamic

    def compile_dynamic(self, fake_args: list) -> None:
        self.dynamic = self._compile(fake_args, "dynamic")

    def __call__(self, *args):
        prev = set_layer_base(self.base)
        try:
            return self._run(args)
        finally:
            set_layer_base(prev)

    def _run(self, args: tuple):
        state = self.backend.state
        size = state.bucket
        if size is None:
            return self.dynamic(*args)
        fn = self.static.get(size)
        if fn is None:
            sizes = self.backend.config.compile_sizes
            static = sizes is None or size in sizes
            fn = self.static[size] = self._keep_fusions(self._compile(list(args), str(size)), str(size)) if static \
                else self.dynamic
        if not state.cudagraphs:
            return fn(*args)
        return self.graphs.run(BatchDescriptor(size), fn, args)
