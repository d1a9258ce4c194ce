"""What every fusion pass shares: a PatternMatcherPass holding (pattern, replacement) pairs, traced from
the same functions the models call (ops/norm.py, ops/rope.py, ops/moe.py), and the matches it replaced,
counted per model layer.

Patterns are traced with `fwd_only` under a fake mode (so traced ops never run), in each dtype family the
model may use (float32 graphs carry no casts, half-precision graphs do). A pattern means what it says:
every constant in it (exponents, reduction and softmax dims, fill values, dtypes, split and slice steps)
must be equal in the real graph. Only sizes that follow from the input shapes (view and reshape sizes,
the size of a zeros/full, a split's chunk size, a slice's bounds) are wildcards, and where such a size
carries meaning (RoPE's rotate-half split, GEGLU's [gate, up] halves) the pass checks it on the match.
Scalars the replacement needs (eps, layer index, top-k, a norm's weight offset) are traced with sentinel values and become
pattern arguments through `scalar_workaround`.

Each replaced match is counted under `compiled_llm.<pass>` and `compiled_llm.<pass>@+<offset>` in
Inductor's counters (which its FX-graph cache replays on a hit); the offset is the first model layer any
matched node came from (Dynamo's nn_module_stack) minus the graph's first layer, which the compiled piece
turns back into a layer index, so the compiler can check every layer got the fusions the model declares
(compiler/verify.py).
"""

from __future__ import annotations

import inspect
import re
from collections import Counter
from typing import Callable

import torch
import torch._inductor.pattern_matcher as pm
from torch._dynamo.utils import counters
from torch._inductor.virtualized import V
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils._ordered_set import OrderedSet

aten = torch.ops.aten
_REGISTER_PARAMS = inspect.signature(pm.register_replacement).parameters  # differs across torch versions

# sentinel scalars: values that occur nowhere else in a traced pattern
EPS = 1.2345e-5
LAYER = 9973
TOP_K = 3
ROOT = 0.0123456
OFFSET = 0.7654321  # an RMSNorm's weight offset (scale by offset + w)

# argument positions that hold sizes derived from the input shapes: wildcards in a pattern
SHAPE_ARGS = {
    aten.reshape.default: (1,), aten.view.default: (1,), aten._unsafe_view.default: (1,),
    aten.expand.default: (1,), aten.full.default: (0,), aten.zeros.default: (0,), aten.ones.default: (0,),
    aten.empty.memory_format: (0,), aten.new_zeros.default: (1,), aten.new_empty.default: (1,),
    aten.new_full.default: (1,), aten.split.Tensor: (1,), aten.split_with_sizes.default: (1,),
    aten.slice.Tensor: (2, 3),
}

_LAYER_RE = re.compile(r"layers(?:\[|\.|\._modules\[')'?(\d+)")


class _Shape:
    """Marks a shape-derived argument of a traced pattern; fx_to_pattern turns it into a wildcard."""


# Inductor settings every compile that runs our passes uses, and the pattern tracing too. shape_padding off:
# on CUDA, Inductor's pad_mm joint-graph rewrite times padded against unpadded matmuls (while compiling, and
# while tracing a pattern) and may pad one (mm over 2 tokens -> pad to 4, mm, slice); then a pattern and a
# graph disagree in some compiles and not others, and a router or GEGLU MoE fusion is lost at random (seen
# on the H200). Off, the graphs are the same on every run and start-up spends no time on those timings.
INDUCTOR_SETTINGS = {"shape_padding": False}


def trace_fn(fn, args, **kwargs):
    """fwd_only, then what Inductor did to the real graph before our passes see it: the joint-graph
    canonicalisations (pointless permute pairs, views, converts) and views written as reshapes."""
    from torch._inductor import config as inductor_config
    from torch._inductor.fx_passes import joint_graph
    from torch._inductor.fx_passes.post_grad import view_to_reshape

    gm = pm.fwd_only(fn, args, **kwargs)
    joint_graph.lazy_init()
    for patterns in [getattr(joint_graph, "early_patterns", None), *joint_graph.pass_patterns]:
        if patterns is None:
            continue
        with inductor_config.patch(INDUCTOR_SETTINGS):
            patterns.apply(gm.graph)
    pm.stable_topological_sort(gm.graph)
    gm.graph.eliminate_dead_code()
    view_to_reshape(gm)
    gm.recompile()
    return gm


def to_pattern(gm: torch.fx.GraphModule, argnames: list[str], scalars: dict) -> pm.PatternExpr:
    """The traced graph as a pattern whose constants must match exactly, except shape-derived sizes."""
    sentinels = set(scalars.values())
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in SHAPE_ARGS:
            continue
        args = list(node.args)
        for i in SHAPE_ARGS[node.target]:
            if i < len(args) and not (isinstance(args[i], (int, float)) and args[i] in sentinels):
                args[i] = _Shape()
        node.args = tuple(args)
    return pm.fx_to_pattern(gm, ignore_types=(torch.device, _Shape), argnames=argnames, scalar_workaround=scalars)


class _LayerAnchored(pm.MultiOutputPattern):
    """A multi-output pattern whose outputs past the first are taken from the model layers of the first output's
    match. Inductor looks for them by walking from the nodes the outputs share and takes the first that matches:
    where those nodes serve several layers (Qwen3.5's M-RoPE table, built once a step, in a graph not split at the
    attention ops) every layer's cache write paired with the first layer's query; where the outputs share no node
    (Gemma 4's K=V layers: the query's norm and RoPE, and the value's norm and cache write, two branches of one
    split) it found nothing. So the walk's candidates from other layers are skipped, and where it finds nothing,
    the candidates are the graph's nodes of the output's target traced in the same layers."""

    def _match_from_anchors(self, pattern, ctx):
        taken = set(ctx.pattern_to_node.values())
        layers = set().union(*(node_layers(n) for n in taken if isinstance(n, torch.fx.Node)))
        prior = dict(ctx.pattern_to_node)
        m = pm.FailedMatch("no anchor found")
        for node in self._candidates(pattern, ctx, taken, layers):
            m = ctx.match(pattern, node)
            if pm.is_match(m):
                return m
            ctx.pattern_to_node = dict(prior)
        return m

    @staticmethod
    def _candidates(pattern, ctx, taken: set, layers: set[int]):
        """Inductor's walk from the shared nodes, less other layers' nodes; then the layers' own nodes of the
        output's target (asked for only if no walk candidate matched)."""
        for node in pattern.find_anchor_nodes(ctx, OrderedSet()):
            if not (layers and node_layers(node) - layers):
                yield node
        if ctx.graph is not None and layers:
            yield from (n for n in ctx.graph.nodes
                        if n not in taken and pattern._match_fns(n) and node_layers(n) == layers)


def node_layers(node: torch.fx.Node) -> set[int]:
    """The model layers (`...layers[i]...` in Dynamo's module stack) a node was traced in."""
    return {int(m) for path, _ in (node.meta.get("nn_module_stack") or {}).values() for m in _LAYER_RE.findall(str(path))}


def layer_of(match) -> int | None:
    """The first model layer any matched node came from."""
    return min(set().union(*(node_layers(n) for n in match.nodes)), default=None)


def first_layer(graph: torch.fx.Graph) -> int:
    """The first model layer a graph's nodes came from (0 for a graph outside the layers). Match counts
    are kept relative to it: Inductor's FX-graph cache replays a compile's counts for any structurally
    identical graph, and the model's look-alike layers give exactly such graphs at other layer indices."""
    return min(set().union(*(node_layers(n) for n in graph.nodes if n.op != "placeholder")), default=0)


def count_matches(name: str, n: int, layers: list[int | None], base: int) -> None:
    """A pass's n matches in Inductor's counters: `compiled_llm.<name>`, and per first model layer relative to the
    graph's (`@+offset`, `@-` outside any layer), which the compiled piece turns back into layer indices."""
    counters["inductor"][f"compiled_llm.{name}"] += n
    for layer, k in Counter(layers).items():
        counters["inductor"][f"compiled_llm.{name}@{'-' if layer is None else f'+{layer - base}'}"] += k


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _last_dim_cuts(match: pm.Match, target):
    """(size of the last dim, args) of each `target` node (slice or split) of the match that cuts a last
    dim; size None where the node carries no shape (the caller then refuses the match)."""
    dim_arg = 2 if target == aten.split.Tensor else 1
    for node in match.nodes:
        if node.op != "call_function" or node.target != target:
            continue
        x = _val(node.args[0])
        if x is None:
            yield None, node.args
            continue
        dim = node.args[dim_arg] if len(node.args) > dim_arg else 0
        if dim in (-1, x.dim() - 1):
            yield x.shape[-1], node.args


def _slice(node) -> tuple | None:
    """(input, size of the cut dim, start, end) of a slice node whose bounds are plain ints, else None."""
    x = _val(node.args[0])
    if x is None:
        return None
    dim = node.args[1] if len(node.args) > 1 else 0
    size = x.shape[dim]
    start = node.args[2] if len(node.args) > 2 else 0
    end = node.args[3] if len(node.args) > 3 and node.args[3] is not None else size
    if not all(type(v) is int for v in (size, start, end)):
        return None
    return node.args[0], size, start, end


def _is_slice(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.target == aten.slice.Tensor


def _rotations(match: pm.Match, rd: int | None) -> bool:
    """Checked node by node, since the slice bounds are wildcards: each rotation is cat([-r[..., h:], r[..., :h]])
    of one tensor r, h half its last dim (rd when given); with rd, r is the first rd channels of the head
    ([0, rd)) and the outer cat appends the channels past them ([rd, end)); every other slice is a no-op."""
    approved: set = set()
    heads: list = []  # slice nodes r was cut as
    rests: set = set()  # the heads whose channels past rd were appended
    for node in match.nodes:
        if node.op != "call_function" or node.target != aten.cat.default:
            continue
        parts = node.args[0]
        if len(parts) != 2 or not all(isinstance(p, torch.fx.Node) for p in parts):
            return False
        first, second = parts
        if first.target == aten.neg.default:  # a rotate-half cat
            a, b = first.args[0], second
            sa, sb = (_slice(a), _slice(b)) if _is_slice(a) and _is_slice(b) else (None, None)
            if sa is None or sb is None or sa[0] is not sb[0] or sa[1] % 2 or (rd is not None and sa[1] != rd):
                return False
            h = sa[1] // 2
            if (sa[2], sb[2], sb[3]) != (h, 0, h) or sa[3] < sa[1]:
                return False
            approved |= {a, b}
            if _is_slice(sa[0]) and sa[0] in match.nodes:
                heads.append(sa[0])
        elif any(_is_slice(p) for p in parts):  # the outer cat of a partial rotation: [rotated, the rest]
            sr = _slice(second) if rd is not None and _is_slice(second) and not _is_slice(first) else None
            if sr is None or sr[2] != rd or sr[3] < sr[1]:
                return False
            approved.add(second)
            rests.add(sr[0])
    for r in heads:  # r = head[..., :rd] with the rest of that head appended (or r is the whole head)
        sr = _slice(r)
        full = sr is not None and sr[3] >= sr[1]
        if sr is None or sr[2] != 0 or not full and (rd is None or sr[3] != rd or sr[0] not in rests):
            return False
        approved.add(r)
    for node in match.nodes:
        if node.op == "call_function" and node.target == aten.slice.Tensor and node not in approved:
            s = _slice(node)
            if s is None or s[2] != 0 or s[3] < s[1]:
                return False
    return True


def rotate_half(match: pm.Match) -> bool:
    """RoPE as ops/rope.py computes it: every rotation cat([-x[..., h:], x[..., :h]]), h = half the head."""
    return _rotations(match, None)


def partial_rotate_half(match: pm.Match) -> bool:
    """Partial rotary as ops/mrope.py computes it: the first R channels rotate-half, R the width of the cos/sin
    table (the pattern's `cos` input), the channels past R passed through."""
    cos = _val(match.kwargs.get("cos"))
    return cos is not None and type(cos.shape[-1]) is int and _rotations(match, cos.shape[-1])


def halves(match: pm.Match) -> bool:
    """GEGLU's [gate, up]: every split of a last dim cuts it into two equal halves."""
    return all(type(size) is int and type(args[1]) is int and args[1] * 2 == size
               for size, args in _last_dim_cuts(match, aten.split.Tensor))


class FusionPass:
    name = ""  # short id, used in counters and the report
    fusion = ""  # human-readable name of the fusion
    # When the fused op can only run its PyTorch reference (the CPU), an opaque call to it runs op by op,
    # slower than what Inductor generates for the unfused graph. Passes that allow it then only count their
    # matches (the fusion check still sees every layer) and leave the graph to Inductor (`count_only`).
    count_only_on_reference = False
    # `op`: the fused op the replacement calls. Where it resolves to Inductor's own kernel (the "inductor"
    # provider, ops/registry.py INDUCTOR), the pass only counts. With count_only_while_reference, the same on
    # every device while it has only its reference there: an opaque reference call would be slower than no
    # pass at all (all-reduce + RMSNorm before a fused kernel exists for the device).
    op: str | None = None
    count_only_while_reference = False

    def __init__(self, dtypes: tuple[torch.dtype, ...], device: str = "cpu"):
        self.dtypes = dtypes
        self.device = torch.device(device)
        # stages run in order: patterns that contain others (q, k and v) go before them (q alone)
        self.stages = [pm.PatternMatcherPass(pass_name=f"compiled_llm.{self.name}") for _ in range(2)]
        self._layers: list[int | None] = []  # layer of each match accepted in the current apply
        self.count_only = False  # set per graph by the pass manager
        self._registered = False  # patterns are traced on the first graph: a warm start (every compile an
        # FX-cache hit) never runs a pass, so it need not trace them (a few seconds at start-up)

    def _register_once(self) -> None:
        if self._registered:
            return
        self._registered = True
        # example inputs on the model's device: some canonicalisations Inductor applies first are device-specific.
        # Traced outside the running compile's fake mode, tracing context and counters (as Inductor's own lazily
        # built patterns are): the canonicalisations trace_fn applies would otherwise count as this compile's
        kept = counters["inductor"].copy()
        with unset_fake_temporarily(), torch._guards.tracing(None), FakeTensorMode() as mode, V.set_fake_mode(mode), \
                torch.device(self.device):
            self.register()
        counters["inductor"] = kept

    def register(self) -> None:
        raise NotImplementedError

    def add(self, search: Callable, replace: Callable, example_inputs: list, scalars: dict | None = None,
            stage: int = 0, check: Callable[[pm.Match], bool] | None = None, tokens: int | None = None) -> None:
        """check(match): what the pattern's wildcard sizes must satisfy for the match to mean the fusion.
        tokens: the token count of the example inputs (those whose first dim it is); the pattern is then
        traced a second time at one token, since Inductor canonicalises size-1 dims differently (a bmm
        over one token becomes an mm), and a static batch size of 1 compiles exactly that graph."""
        variants = [example_inputs]
        if tokens is not None:
            variants.append([empty(1, *x.shape[1:], dtype=x.dtype) if x.dim() and x.shape[0] == tokens else x
                             for x in example_inputs])
        for inputs in variants:
            self._add(search, replace, inputs, scalars or {}, stage, check)

    def _add(self, search, replace, example_inputs, scalars, stage, check) -> None:
        argnames = [*inspect.signature(search).parameters]  # tensors first, the scalars last
        tensors = iter(example_inputs)
        args = [scalars[name] if name in scalars else next(tensors) for name in argnames]
        pattern = to_pattern(trace_fn(search, args), argnames, scalars)
        if isinstance(pattern, pm.MultiOutputPattern):  # its outputs paired within a model layer
            pattern = _LayerAnchored(pattern.outputs)

        def accept(match: pm.Match) -> bool:
            if check is not None and not check(match):
                return False
            if self.count_only and any(id(n) in self._seen for n in match.nodes):
                return False  # already counted (a stage that contains another's pattern comes first)
            self._layers.append(layer_of(match))
            if self.count_only:
                self._seen.update(id(n) for n in match.nodes)
                return False
            return True

        extra = {"skip_duplicates": True} if "skip_duplicates" in _REGISTER_PARAMS else {}
        pm.register_replacement(search, replace, example_inputs, trace_fn, self.stages[stage], extra_check=accept,
                                scalar_workaround=scalars, search_fn_pattern=pattern, **extra)

    def __call__(self, graph: torch.fx.Graph) -> int:
        self._register_once()
        self._layers, self._seen = [], set()
        base = first_layer(graph)
        n = sum(stage.apply(graph) for stage in self.stages)
        if self.count_only:
            n = len(self._layers)
        if n:
            count_matches(self.name, n, self._layers, base)
            pm.stable_topological_sort(graph)  # a multi-output replacement can land before its inputs
            graph.eliminate_dead_code()
        return n


def empty(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype)
