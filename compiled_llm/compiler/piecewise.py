"""One compiled piece of the split graph: an Inductor compile for the dynamic token count, one per static
batch size named in compile_sizes (compiled on first use; warm-up makes that first use happen at start-up;
other batch sizes run the dynamic compile), and on CUDA one captured CUDA Graph per batch size, replayed
with the inputs copied into the captured buffers."""

from __future__ import annotations

import copy
import logging
import time
from collections import Counter
from typing import Any, Callable

import torch
import torch.fx
from torch._dynamo.utils import counters

from compiled_llm.ops.jit import MONITOR

log = logging.getLogger("compiled_llm")


class CudaGraphEntry:
    """A piece captured for one batch size. Tensor inputs whose address differs from the captured one
    (attention outputs, made fresh each step) are copied in before replay; parameters and the outputs
    of the previous captured piece keep their address and are not copied."""

    def __init__(self, fn: Callable, args: list, pool):
        self.static_args = list(args)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = fn(*self.static_args)

    def replay(self, args) -> Any:
        for static, arg in zip(self.static_args, args):
            if isinstance(arg, torch.Tensor) and arg.data_ptr() != static.data_ptr():
                static.copy_(arg)
        self.graph.replay()
        return self.out


class PieceRunner:
    def __init__(self, name: str, gm: torch.fx.GraphModule, backend, graph: int = 0):
        self.name = name
        self.graph = graph  # which Dynamo graph of the model (1, 2, ...: recompiles after a guard failed)
        self.gm = gm
        self.backend = backend
        self.dynamic: Callable | None = None
        self.static: dict[int, Callable] = {}
        self.graphs: dict[int, CudaGraphEntry] = {}
        self.matches: dict[str, Counter] = {}  # compile ('dynamic', '8'; '/g1' after a recompile) -> pass -> matches
        self.compile_seconds = 0.0

    def _compile(self, args: list, shape: str) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        MONITOR.compile_event("inductor", f"{self.name} ({shape} tokens)")
        gm = torch.fx.GraphModule(self.gm, copy.deepcopy(self.gm.graph))
        before = counters["inductor"].copy()
        t0 = time.perf_counter()
        compile_fn = self.backend.compile_fn or compile_fx  # the audit stops after our passes (compiler/audit.py)
        fn = compile_fn(gm, args, config_patches=self.backend.pass_manager.inductor_config())
        self.compile_seconds += time.perf_counter() - t0
        # our passes count into counters["inductor"]; Inductor's FX cache replays those counts on a hit
        delta = counters["inductor"] - before
        self.matches[shape if self.graph == 0 else f"{shape}/g{self.graph}"] = Counter({k[len("compiled_llm."):]: v for k, v in delta.items()
                                       if k.startswith("compiled_llm.")})
        return fn

    def compile_dynamic(self, fake_args: list) -> None:
        self.dynamic = self._compile(fake_args, "dynamic")

    def __call__(self, *args):
        state = self.backend.state
        size = state.bucket
        if size is None:
            return self.dynamic(*args)
        fn = self.static.get(size)
        if fn is None:
            sizes = self.backend.config.compile_sizes
            static = sizes is None or size in sizes
            fn = self.static[size] = self._compile(list(args), str(size)) if static else self.dynamic
        if not state.cudagraphs or state.capturing_full_graph:
            return fn(*args)
        entry = self.graphs.get(size)
        if entry is None:
            fn(*args)  # first run outside the graph: lazy initialisation, autotuning
            MONITOR.compile_event("cudagraph", f"{self.name} ({size} tokens)")
            entry = self.graphs[size] = CudaGraphEntry(fn, list(args), state.graph_pool())
        return entry.replay(args)
