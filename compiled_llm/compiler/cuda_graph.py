"""CUDA graphs at both granularities through one wrapper: a compiled piece captured per batch size
(piecewise: the attention ops between pieces run eagerly) and the whole forward of a decode batch captured per
size (whole-graph: attention included, when every split op's provider is capturable). Each capture is keyed by
a BatchDescriptor; the wrapper owns the captures of one call site and replays them.

A call made while the stream is already capturing belongs to an outer capture (a piece inside the whole-graph
capture of its forward): it runs its function inline, so the outer graph records its kernels; no flag passes
between the two levels. Every capture of an engine shares one memory pool (RunState.graph_pool), as the
graphs replay one at a time.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from compiled_llm.ops.context import whole_capture
from compiled_llm.ops.jit import MONITOR


@dataclass(frozen=True)
class BatchDescriptor:
    """What a capture is for: the padded token count it runs at, and whether it is the whole forward of a
    decode batch (one token per sequence) or one compiled piece."""
    tokens: int
    whole: bool = False

    def __str__(self) -> str:
        return f"{'whole decode' if self.whole else 'piece'}, {self.tokens} tokens"


class CapturedGraph:
    """fn(*args) captured once. Replays copy in the tensor arguments whose address differs from the captured
    ones (attention outputs, made fresh each step); parameters and the previous piece's captured outputs keep
    their address and are not copied. The captured output is returned (the same tensors every replay)."""

    def __init__(self, fn: Callable, args: list, pool):
        self.static_args = list(args)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = fn(*self.static_args)

    def replay(self, args=()) -> Any:
        for static, arg in zip(self.static_args, args):
            if isinstance(arg, torch.Tensor) and arg.data_ptr() != static.data_ptr():
                static.copy_(arg)
        self.graph.replay()
        return self.out


class CUDAGraphWrapper:
    """The captures of one call site, one per BatchDescriptor. `run` replays a descriptor's capture, capturing
    it on first use (after one run outside the graph: lazy initialisation, autotuning, static compiles);
    `capture` makes one explicitly (whole-graph decode times it against the pieces before keeping it)."""

    def __init__(self, name: str, pool: Callable[[], Any]):
        self.name = name
        self.pool = pool
        self.graphs: dict[BatchDescriptor, CapturedGraph] = {}
        self.replays: Counter[BatchDescriptor] = Counter()  # explicit replays (replay()), by descriptor

    def run(self, desc: BatchDescriptor, fn: Callable, args=()) -> Any:
        if torch.cuda.is_current_stream_capturing():  # inside an outer capture: it records these kernels
            return fn(*args)
        graph = self.graphs.get(desc)
        if graph is None:
            graph = self.capture(desc, fn, args)
        return graph.replay(args)

    def capture(self, desc: BatchDescriptor, fn: Callable, args=()) -> CapturedGraph:
        fn(*args)  # outside the graph first
        MONITOR.compile_event("cudagraph", f"{self.name} ({desc})")
        with whole_capture() if desc.whole else contextlib.nullcontext():  # ops/context.py later_op_runs_with_this
            graph = self.graphs[desc] = CapturedGraph(fn, list(args), self.pool())
        return graph

    def replay(self, desc: BatchDescriptor, args=()) -> Any:
        self.replays[desc] += 1
        return self.graphs[desc].replay(args)

    def drop(self, desc: BatchDescriptor) -> None:
        self.graphs.pop(desc, None)

    def clear(self) -> None:
        self.graphs.clear()

    def __contains__(self, desc: BatchDescriptor) -> bool:
        return desc in self.graphs

    def __len__(self) -> int:
        return len(self.graphs)

    def __iter__(self) -> Iterator[BatchDescriptor]:
        return iter(self.graphs)
