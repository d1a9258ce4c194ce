"""The torch.compile backend: split the Dynamo graph at the attention ops, compile each piece between
them with Inductor (our fusion passes hooked in as its post-grad custom pass), and return the split
module, whose pieces dispatch on the token count (see piecewise.py).

The attention ops stay outside the compiled pieces: they read per-step metadata through the forward
context, which CUDA Graphs cannot replay, so on CUDA each piece is captured on its own and attention
runs eagerly between replays. Without CUDA Graphs (a CPU engine) the graph need not split: one piece, the
attention ops called from Inductor's code like any other custom op, saves each piece's call path
(Inductor's wrapper, its input checks, AOT's runtime wrappers) six times a step on a 6-layer model.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from compiled_llm.compiler.piecewise import PieceRunner
from compiled_llm.ops.jit import MONITOR
from compiled_llm.passes.manager import PassManager

log = logging.getLogger("compiled_llm")


def split_ops() -> set:
    """Ops that read per-step metadata through the forward context (attention, recurrent-state ops):
    they run eagerly between the compiled pieces."""
    from compiled_llm.ops.registry import OPS

    ops = set()
    for name, spec in OPS.items():
        packet = getattr(torch.ops.compiled_llm, name, None) if spec.splits_graph else None
        if packet is not None:  # the spec names its custom op: compiled_llm::<name>
            ops |= {packet, packet.default}
    return ops


def is_split_node(node: torch.fx.Node, ops: set | None = None) -> bool:
    return node.op == "call_function" and node.target in (ops if ops is not None else split_ops())


@dataclass
class CompilerConfig:
    batch_sizes: list[int] = field(default_factory=list)  # buckets: padded token counts (CUDA graphs on CUDA)
    compile_sizes: list[int] | None = None  # buckets with their own static compile (None: every bucket)
    cudagraphs: bool = False  # capture each piece per batch size (CUDA only)
    full_graph_decode: str = "auto"  # auto: measure piecewise vs whole-graph capture of decode; on; off
    split: bool = True  # compile the pieces between the split ops; False: one graph, the split ops called from it
    autotune: str = "off"  # off | static | all: Inductor's max_autotune_gemm for those compiles
    passes: tuple[str, ...] | None = None  # None: every pass that applies
    dtype: torch.dtype = torch.float32
    tp_group: str | None = None  # process-group name of tensor parallelism (all-reduce fusion)
    symm_mem_allreduce: bool = False  # small all-reduces as symmetric-memory one-shot kernels (CUDA, TP)
    jit_monitor: str = "off"  # what a compile after warm-up does while this model runs: off | warn | error


def split_at_attention(gm: torch.fx.GraphModule, split: bool = True) -> tuple[torch.fx.GraphModule, list[str],
                                                                                list[str]]:
    """Each attention call becomes its own submodule; the nodes between them form the compute pieces.
    Returns (split module, compute piece names, attention piece names). split=False: the whole graph is one
    compute piece, the split ops inside it (Inductor calls them as it calls any custom op)."""
    ops = split_ops() if split else set()
    part, ids = 0, {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_split_node(node, ops):
            part += 1
            ids[node] = part
            part += 1
        else:
            ids[node] = part
    split = split_module(gm, None, lambda n: ids[n], keep_original_order=True)
    compute, attn = [], []
    for node in split.graph.nodes:
        if node.op == "call_module":
            sub = getattr(split, node.target)
            (attn if any(is_split_node(n, ops) for n in sub.graph.nodes) else compute).append(node.target)
    return split, compute, attn


def outputs_from_meta(sub: torch.fx.GraphModule):
    """A piece's outputs as Dynamo recorded them (each node's fake `example_value`, which the split keeps),
    made again as empty fake tensors of the running fake mode (Dynamo's is another one with the same shape
    environment, so the symbolic sizes carry over); None where a value is missing. Running every piece on
    fake tensors only to learn what it returns was most of our backend's time on a warm start (a second fake
    trace of the whole model)."""
    out = next(n for n in reversed(sub.graph.nodes) if n.op == "output")

    def value(a):
        if not isinstance(a, torch.fx.Node):
            return a
        if "example_value" not in a.meta:
            raise LookupError(a.name)
        v = a.meta["example_value"]
        if isinstance(v, torch.Tensor):
            return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
        return v

    try:
        return torch.fx.node.map_aggregate(out.args[0], value)
    except LookupError:
        return None


class _PieceCompiler(torch.fx.Interpreter):
    """Runs the split module on Dynamo's fake inputs; each compute piece is compiled for the dynamic
    token count with the fake (symbolic) inputs it sees, and swapped for its PieceRunner."""

    def __init__(self, split: torch.fx.GraphModule, compute: list[str], backend: "Backend"):
        super().__init__(split)
        self.compute = set(compute)
        self.backend = backend

    def call_module(self, target, args, kwargs):
        sub = self.fetch_attr(target)
        out = outputs_from_meta(sub) if target in self.compute else None
        if out is None:
            out = super().call_module(target, args, kwargs)
        if target in self.compute:
            runner = PieceRunner(target, sub, self.backend, graph=self.backend.graph_count - 1)
            runner.compile_dynamic(list(args))
            self.module.__dict__[target] = runner  # the split module now calls the runner
            self.backend.pieces.append(runner)
        return out


class Backend:
    """One per compiled model. Dynamo calls it with the whole forward graph (once; a second call is a
    recompile, which the JIT monitor reports)."""

    def __init__(self, config: CompilerConfig, pass_manager: PassManager, state):
        self.config = config
        self.pass_manager = pass_manager
        self.state = state  # compiler.model.RunState: the bucket this call runs at, capture flags
        self.pieces: list[PieceRunner] = []  # every graph's (a recompile's pieces join the first graph's, which stay live)
        self.attention_pieces: list[str] = []
        self.split_gm: torch.fx.GraphModule | None = None
        self.graph_count = 0
        self.compile_fn = None  # None: Inductor's compile_fx; the graph audit sets its own
        # (piece signature, shape) -> (compiled fn, relative match counts): look-alike pieces compile once
        # (piecewise.PieceRunner); None turns the sharing off (the audit inspects every piece itself)
        self.shared_compiles: dict | None = {}
        self.shared_hits = 0
        self.call_started: float | None = None  # the first forward's start (set by CompiledModel): its phases
        self.backend_span: tuple[float, float] | None = None  # (start, end) of the first graph's pieces
        self.traced_nodes = 0
        self.aot = False  # compiling ahead of time (compiler/aot.py): return a SplitArtifact, pieces as artifacts

    def phases(self, now: float) -> tuple[float, int, float, float]:
        """(Dynamo's trace seconds, its graph's nodes, our pieces' seconds, the run's seconds) of the first forward."""
        start, end = self.backend_span or (now, now)
        began = self.call_started if self.call_started is not None else start
        return start - began, self.traced_nodes, end - start, now - end

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        MONITOR.compile_event("dynamo", f"graph {self.graph_count}")
        self.graph_count += 1
        t0 = time.perf_counter()
        hits_before = self.shared_hits
        split, compute, attn = split_at_attention(gm, self.config.split)
        self.split_gm, self.attention_pieces = split, attn  # of the latest graph; `pieces` keeps every graph's
        fake_mode = torch._guards.detect_fake_mode(example_inputs)
        fake_args = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
        with fake_mode:
            _PieceCompiler(split, compute, self).run(*fake_args)
        what = f"{len(compute)} pieces around {len(attn)} attention ops" if self.config.split else \
            "one graph (not split at the attention ops)"
        log.info("compiled %s for a dynamic token count in %.1fs", what, time.perf_counter() - t0)
        if self.backend_span is None:
            self.backend_span, self.traced_nodes = (t0, time.perf_counter()), len(gm.graph.nodes)
        if self.aot:
            from compiled_llm.compiler.aot import SplitArtifact

            # (this graph's own counts: a loaded forward adds each saved graph's)
            return SplitArtifact(split, {"shared_hits": self.shared_hits - hits_before,
                                         "traced_nodes": len(gm.graph.nodes)})
        return split
