"""Inductor up to and including our fusion passes, and no further: the compile function the graph audit
(runtime/audit.py) and the pass tests give the backend. Nothing is generated, so it runs on fake tensors of
any device, a GPU's included, on a machine without one. Each inspected piece reports the largest tensor
it materialises; a piece that repeats an inspected one for other layers is not compiled again.
"""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass, replace

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils._pytree import tree_leaves

from compiled_llm.passes.base import first_layer, node_layers


@dataclass(frozen=True)
class Tensor:
    """The largest tensor a compile materialises, at the audited token count."""

    bytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    op: str
    layer: int | None

    def __str__(self) -> str:
        where = "" if self.layer is None else f" in layer {self.layer}"
        return f"{list(self.shape)} {str(self.dtype).removeprefix('torch.')} ({self.bytes / 2**20:.1f} MiB) from {self.op}{where}"


def _size(x, tokens: int) -> int:
    """A size that may be symbolic (the token count) evaluated at `tokens`."""
    if isinstance(x, int):
        return x
    expr = x.node.expr
    return int(expr.subs({s: tokens for s in expr.free_symbols}))


def largest_tensor(graph: torch.fx.Graph, tokens: int) -> Tensor | None:
    """The largest output of a node Inductor has to materialise (not a view, not an elementwise op)."""
    best = None
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or target is operator.getitem:
            continue
        if isinstance(target, torch._ops.OpOverload) and (target.is_view or torch.Tag.pointwise in target.tags):
            continue
        for val in tree_leaves(node.meta.get("val")):
            if not isinstance(val, torch.Tensor):
                continue
            shape = tuple(_size(d, tokens) for d in val.shape)
            nbytes = val.element_size() * int(torch.Size(shape).numel())
            if best is None or nbytes > best.bytes:
                best = Tensor(nbytes, shape, val.dtype, str(target), min(node_layers(node), default=None))
    return best


class _Inspected:
    """What a piece 'compiles' to in the audit: its own graph (run on fake tensors), and what Inductor's
    post-grad graph held."""

    def __init__(self, gm: torch.fx.GraphModule, largest: Tensor | None):
        self.gm, self.largest = gm, largest

    def __call__(self, *args):
        return self.gm(*args)


class _Stop(Exception):
    pass


def piece_signature(gm: torch.fx.GraphModule, args: list, strict: bool = False) -> tuple[tuple, int]:
    """(key, first layer) of a Dynamo graph piece. Our ops' layer indices are already relative to the first
    layer (piecewise.relative_layer_args). strict: the key is the graph itself with its inputs' shapes,
    strides and dtypes, so two pieces with one key run the same compiled code (the compiler shares it).
    Otherwise (the audit, which only replays match counts) an integer index into a tensor enters relative to
    the first layer too (Gemma's per-layer input `ple[:, i]`), so those pieces count as look-alikes."""
    layers = {n: set() if n.op == "placeholder" else node_layers(n) for n in gm.graph.nodes}
    base = first_layer(gm.graph)
    pos: dict = {}

    def norm(a, layer_int: bool = False):
        if isinstance(a, torch.fx.Node):
            return ("n", pos[a])
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(norm(x, layer_int) for x in a))
        if isinstance(a, dict):
            return tuple((k, norm(v, layer_int)) for k, v in a.items())
        if isinstance(a, slice):
            return ("slice", norm(a.start), norm(a.stop), norm(a.step))
        if layer_int and type(a) is int:
            return ("layer", a - base)
        return repr(a)

    def placeholder(a):
        if not isinstance(a, torch.Tensor):
            return ("p", repr(a))
        if strict:
            return ("p", tuple(map(str, a.shape)), tuple(map(str, a.stride())), str(a.dtype), str(a.device))
        return ("p", tuple(map(str, a.shape)), str(a.dtype))

    rows = [placeholder(a) for a in args]  # the shapes this compile is for (static or symbolic)
    for i, node in enumerate(gm.graph.nodes):
        pos[node] = i
        if node.op == "placeholder":
            continue
        if node.target is operator.getitem and isinstance(node.args[1], tuple):
            args = (norm(node.args[0]), norm(node.args[1], layer_int=not strict))
        else:
            args = norm(node.args)
        rows.append((node.op, str(node.target), args, norm(node.kwargs), tuple(sorted(x - base for x in layers[node]))))
    return tuple(rows), base


def inspect_compile(tokens: int, stats: dict | None = None, dedupe: bool = True):
    """A compile function for the backend: Inductor up to and including our passes, then stop. A piece
    whose signature matches one inspected before is not compiled again: its matches and largest tensor
    are replayed for its own layers. stats (optional) counts 'inspected' and 'replayed' pieces."""
    from torch._dynamo.utils import counters
    from torch._inductor.compile_fx import compile_fx

    seen_pieces: dict[tuple, tuple[int, Counter, Tensor | None]] = {}
    stats = stats if stats is not None else {}

    def compile_fn(gm, args, config_patches):
        key, base = piece_signature(gm, args)
        hit = seen_pieces.get(key) if dedupe else None
        if hit is not None:  # the counts are relative to the graph's first layer, as an FX-cache hit replays them
            first, delta, largest = hit
            counters["inductor"].update(delta)
            if largest is not None and largest.layer is not None:
                largest = replace(largest, layer=largest.layer + base - first)
            stats["replayed"] = stats.get("replayed", 0) + 1
            return _Inspected(gm, largest)
        passes = config_patches["post_grad_custom_pre_pass"]
        seen = {}

        class Inspect(CustomGraphPass):
            def __call__(self, graph):
                passes(graph)
                seen["largest"] = largest_tensor(graph, tokens)
                raise _Stop

            def uuid(self):
                return None

        before = counters["inductor"].copy()
        try:
            # uniform-value constant folding evaluates constants on the real device, which the audit may lack;
            # it never touches what our patterns match
            compile_fx(gm, args, config_patches={**config_patches, "post_grad_custom_pre_pass": Inspect(),
                                                 "fx_graph_cache": False, "joint_graph_constant_folding": False})
        except Exception:
            if "largest" not in seen:
                raise
        delta = Counter({k: v for k, v in (counters["inductor"] - before).items() if k.startswith("compiled_llm.")})
        seen_pieces[key] = (base, delta, seen["largest"])
        stats["inspected"] = stats.get("inspected", 0) + 1
        return _Inspected(gm, seen["largest"])

    return compile_fn
