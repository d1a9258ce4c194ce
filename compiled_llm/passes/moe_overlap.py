"""MoE overlap: a layer's router + routed-op pair -> moe_start / moe_join (ops/moe_overlap.py), so that the
routed experts run on a side stream beside the layer's dense branch.

Not a pattern: it runs after the router and MoE fusions and rewires their ops. For each routed op (geglu_moe,
swiglu_moe) whose weights and ids come straight from one router op (router_topk, softmax_router_topk; the
weights through at most a dtype cast, the ids through at most the expert-parallel shift `ids - first`) and
whose router outputs feed nothing else:
- moe_start goes right after the last node its inputs need (the router's input, the experts' input), which
  is before the dense branch when the model computes the routed branch's inputs first (Gemma 4's layer does;
  Qwen3.5's router and experts read the layer's input, so its shared expert follows anyway);
- moe_join goes right before the first user of the routed op's output past its dtype casts (which move after
  the join), and takes the start's tensor inputs as `keep`, so that their memory outlives the side stream's
  reads; the routed op's users then read the start's output (the join is declared to write it, so they follow
  the join).
What Inductor then emits keeps that order (the pass's test reads the generated code). One match per MoE layer,
counted like a fusion (`compiled_llm.moe_overlap@+layer`). Off on the CPU, which has no streams, unless a
compile names it; on CUDA `COMPILED_LLM_MOE_OVERLAP=0` turns it off (an A/B of the saving).

The start returns each pick's weighted output [T, k, H] and the graph adds them after the join
(`float().sum(1).to(dtype)`, which Inductor unrolls into the loads of the norm kernel that reads the routed
output: `unroll_reductions_threshold` is raised past k), so the side stream has no top-k sum launch. Session 22
tried this form once and got a separate reduction kernel on the GPU (Inductor unrolls only reductions shorter
than its threshold, 8, and Gemma 4's and Qwen3.5's k is 8). H100, Gemma 4 26B-A4B (benchmarks/NOTES.md, session
45): batch 1 +1.0%, 1024x8x256 +0.2%, 8192x4x512 +0.6%. More than 8 picks a token, and
`COMPILED_LLM_MOE_SUM_IN_NORM=0` (an A/B), keep the start's own top-k sum.
"""

from __future__ import annotations

import operator
import os

import torch
from torch._inductor.virtualized import V
from torch.utils._pytree import tree_map

from compiled_llm.passes.base import count_matches, first_layer, node_layers

ENV = "COMPILED_LLM_MOE_OVERLAP"
SUM_ENV = "COMPILED_LLM_MOE_SUM_IN_NORM"
UNROLL_SLOTS = 9  # Inductor's unroll_reductions_threshold with the sum in the graph: sums over k <= 8 picks unrolled


def sum_in_graph() -> bool:
    return os.environ.get(SUM_ENV, "1") != "0"


def enabled_by_default(device: str) -> bool:
    return device == "cuda" and os.environ.get(ENV, "1") != "0"


def _getitem_of(node, index: int):
    """The node whose `index`-th output `node` is (getitem(src, index)), else None."""
    if isinstance(node, torch.fx.Node) and node.target is operator.getitem and node.args[1] == index:
        return node.args[0]
    return None


def _with_val(node: torch.fx.Node, near: list[torch.fx.Node]) -> torch.fx.Node:
    """A new node's fake value (what Inductor lowers from) and the module stack of the first node near it that has
    one (a fusion's replacement nodes may carry none; the graph audit names a tensor's layer from it)."""
    args = tree_map(lambda a: a.meta["val"] if isinstance(a, torch.fx.Node) else a, node.args)
    with V.fake_mode:
        node.meta["val"] = node.target(*args)
    for key in ("nn_module_stack", "stack_trace"):
        source = next((n for n in near if n.meta.get(key)), None)
        if source is not None:
            node.meta[key] = source.meta[key]
    return node


class MoEOverlapPass:
    name = "moe_overlap"
    fusion = "routed experts on a side stream beside the dense branch"
    op = "moe_start"
    count_only_on_reference = False
    count_only_while_reference = False

    def __init__(self, dtypes: tuple[torch.dtype, ...] = (), device: str = "cpu"):
        self.count_only = False  # set per graph by the pass manager
        self.sum_in_graph = True  # set per graph by the pass manager (COMPILED_LLM_MOE_SUM_IN_NORM)

    def _match(self, routed: torch.fx.Node):
        """(router node, start args) for a routed op this pass can split, else None."""
        ops = torch.ops.compiled_llm
        x, weights, ids, gate_up, down = routed.args
        cast = weights.target is torch.ops.prims.convert_element_type.default if isinstance(weights, torch.fx.Node) else False
        w_src = weights.args[0] if cast else weights
        first = 0
        if isinstance(ids, torch.fx.Node) and ids.target is torch.ops.aten.sub.Tensor and type(ids.args[1]) is int:
            ids, first = ids.args[0], ids.args[1]
        router = _getitem_of(w_src, 0)
        if router is None or _getitem_of(ids, 1) is not router:
            return None
        if router.target is ops.router_topk.default:
            rx, proj, scale, pes, top_k, eps, root = router.args
        elif router.target is ops.softmax_router_topk.default:
            (rx, proj, top_k), scale, pes, eps, root = router.args, None, None, 0.0, 1.0
        else:
            return None
        inner = {w_src, ids} | ({weights} if cast else set()) | ({routed.args[2]} if first else set())
        if any(set(n.users) - inner - {routed} for n in inner | {router}):
            return None  # the router's picks feed something else too
        activation = "gelu_tanh" if routed.target is ops.geglu_moe.default else "silu"
        return router, (rx, proj, scale, pes, x, gate_up, down, top_k, eps, root, first, activation, cast)

    def __call__(self, graph: torch.fx.Graph) -> int:
        ops = torch.ops.compiled_llm
        order = {n: i for i, n in enumerate(graph.nodes)}
        base = first_layer(graph)
        layers = []
        for routed in [n for n in graph.nodes if n.target in (ops.geglu_moe.default, ops.swiglu_moe.default)]:
            found = self._match(routed)
            if found is None or not routed.users:
                continue
            router, args = found
            # the layer: a fusion's replacement nodes may carry no module stack, the graph's own nodes do
            near = [routed, router, *routed.users, *(a for a in args if isinstance(a, torch.fx.Node))]
            layers.append(min(set().union(*(node_layers(n) for n in near)), default=None))
            if self.count_only:
                continue
            tensors = [a for a in args if isinstance(a, torch.fx.Node)]
            after = max((a for a in tensors if a.op != "placeholder"), key=order.get, default=None)
            where = graph.inserting_after(after) if after is not None else graph.inserting_before(router)
            with where:
                # k picks Inductor would not unroll stay summed by the start (a reduction kernel of their own is slower)
                slots = self.sum_in_graph and args[7] < UNROLL_SLOTS
                start = graph.call_function(ops.moe_start.default, args + ((True,) if slots else ()))
            _with_val(start, near)
            # the routed output's dtype casts follow the join wherever it lands: the join goes before the first
            # node past them (a fusion's replacement sits early in the graph, where the casts follow it at once)
            casts, tail = [], routed
            while len(tail.users) == 1 and next(iter(tail.users)).target is torch.ops.prims.convert_element_type.default:
                tail = next(iter(tail.users))
                casts.append(tail)
            first_user = min(tail.users, key=order.get)
            keep = [a for a in dict.fromkeys((args[0], args[4])) if a.op != "placeholder"]
            with graph.inserting_before(first_user):
                _with_val(graph.call_function(ops.moe_join.default, (start, keep)), near)
                out = start
                if slots:  # the picks added in float32, in pick order, rounded to the routed dtype
                    convert, dtype = torch.ops.prims.convert_element_type.default, routed.meta["val"].dtype
                    out = _with_val(graph.call_function(convert, (start, torch.float32)), near)
                    out = _with_val(graph.call_function(torch.ops.aten.sum.dim_IntList, (out, [1])), near)
                    out = _with_val(graph.call_function(convert, (out, dtype)), near)
            routed.replace_all_uses_with(out)
            for cast_node in casts:
                first_user.prepend(cast_node)
            order = {n: i for i, n in enumerate(graph.nodes)}
        if not layers:
            return 0
        count_matches(self.name, len(layers), layers, base)
        if not self.count_only:
            graph.eliminate_dead_code()
        return len(layers)
