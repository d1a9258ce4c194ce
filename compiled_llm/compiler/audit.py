"""Graph audit: what the compiler does with a model at its real shapes, on the CPU in seconds, with no
weights and no GPU.

The model is built under a fake-tensor mode on the target device (CUDA by default: some of Inductor's
canonicalisations are device-specific, so this is the graph a GPU compiles), Dynamo traces it with our
backend, and every piece goes through Inductor up to and including our fusion passes, for the dynamic
token count and for each static batch size; no kernel is generated. The report gives, per layer, the
fusions that matched against those the model declares, the graph pieces, and the largest tensor a
prefill of `max_num_batched_tokens` tokens materialises (the output of a matmul, a reduction or a fused
op; elementwise chains Inductor fuses are not counted).

`python -m compiled_llm compile-cache --dry-run --model DIR` prints it for any checkpoint.
"""

from __future__ import annotations

import contextlib
import operator
from collections import Counter
from dataclasses import dataclass, field, replace

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves

from compiled_llm.compiler.backend import CompilerConfig, is_split_node
from compiled_llm.compiler.model import CompiledModel
from compiled_llm.compiler.verify import compare, judged, per_layer
from compiled_llm.ops.registry import OPS, Capabilities, model_facts, preserved_choices, select_providers
from compiled_llm.passes.base import layer_of, node_layers

GPU = Capabilities("cuda", (9, 0), frozenset({"triton"}))  # an H100/H200 with Triton, without FlashInfer


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


@dataclass
class AuditReport:
    architecture: str
    device: str
    dtype: torch.dtype
    tokens: int
    layers: dict[int, str]  # layer -> kind ("sliding d256", "full d512 k=v", ...)
    expected: dict[int, dict[str, int]]
    matches: dict[str, Counter]  # compile ('dynamic' or a batch size) -> 'pass@layer' counts
    enabled: set[str]
    pieces: int
    graphs: int  # Dynamo graphs (more than one: a guard failed and the model was traced again)
    attention_ops: int
    largest: dict[str, Tensor | None]  # compile -> its largest tensor
    num_experts: int = 0
    inspected: int = 0  # piece compiles run through Inductor
    replayed: int = 0  # piece compiles that repeated an inspected one for other layers
    mismatches: list = field(default_factory=list)

    def layer_matches(self, shape: str = "dynamic") -> dict[int | None, Counter]:
        return per_layer(self.matches.get(shape, Counter()))

    def text(self) -> str:
        got = self.layer_matches()
        names = sorted(self.enabled)
        lines = [f"graph audit: {self.architecture}, {len(self.layers)} layers, {str(self.dtype).removeprefix('torch.')} "
                 f"on {self.device} (fake tensors, torch {torch.__version__}), {self.tokens}-token prefill",
                 "layer kind                 " + "  ".join(names)]
        for idx, kind in self.layers.items():
            cells = [f"{got.get(idx, Counter())[n]}/{self.expected.get(idx, {}).get(n, 0)}".ljust(len(n)) for n in names]
            lines.append(f"{idx:<5} {kind:<20} " + "  ".join(cells))
        statics = sorted((s for s in self.matches if s != "dynamic"), key=lambda s: (len(s), s))
        lines.append(f"Dynamo graphs: {self.graphs}{'' if self.graphs == 1 else ' (a recompile: some input size guard failed)'}")
        lines.append(f"graph pieces: {self.pieces}, {self.attention_ops} split ops (attention, state) between them; "
                     f"{self.inspected} distinct piece compiles, {self.replayed} repeats of them for other layers")
        lines.append(f"compiles: dynamic token count, then static batch sizes {', '.join(statics) or 'none'} "
                     "(/gN: Dynamo graph N)")
        for shape in ["dynamic", *statics]:
            lines.append(f"  largest tensor, {shape} compile{f' ({self.tokens} tokens)' if shape == 'dynamic' else ''}: "
                         f"{self.largest.get(shape)}")
        if self.mismatches:
            lines.append("MISMATCHES (matched/declared):")
            lines += [f"  {m}" for m in self.mismatches]
        else:
            lines.append("every layer got the fusions its model declares, in every compile")
        return "\n".join(lines)


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
                best = Tensor(nbytes, shape, val.dtype, str(target), layer_of(_NodeMatch(node)))
    return best


class _NodeMatch:
    """The one-node stand-in for a pattern match that layer_of reads."""

    def __init__(self, node):
        self.nodes = [node]


class _Inspected:
    """What a piece 'compiles' to in the audit: its own graph (run on fake tensors), and what Inductor's
    post-grad graph held."""

    def __init__(self, gm: torch.fx.GraphModule, largest: Tensor | None):
        self.gm, self.largest = gm, largest

    def __call__(self, *args):
        return self.gm(*args)


class _Stop(Exception):
    pass


def piece_signature(gm: torch.fx.GraphModule, args: list) -> tuple[tuple, int]:
    """(key, first layer) of a Dynamo graph piece: two pieces with the same key compute the same thing for
    layers shifted by the difference of their first layers (the model's layers of one kind trace alike).
    Layer numbers enter the key relative to the first: each node's layers, the layer index a custom op
    takes, and an integer index into a tensor (Gemma's per-layer input `ple[:, i]`)."""
    layers = {n: set() if n.op == "placeholder" else node_layers(n) for n in gm.graph.nodes}
    base = min(set().union(*layers.values()), default=0)
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

    rows = [("p", tuple(map(str, a.shape)), str(a.dtype)) if isinstance(a, torch.Tensor) else ("p", repr(a))
            for a in args]  # the shapes this compile is for (static or symbolic)
    for i, node in enumerate(gm.graph.nodes):
        pos[node] = i
        if node.op == "placeholder":
            continue
        if node.target is operator.getitem and isinstance(node.args[1], tuple):
            args = (norm(node.args[0]), norm(node.args[1], layer_int=True))
        else:
            args = norm(node.args, layer_int="compiled_llm" in str(node.target))
        rows.append((node.op, str(node.target), args, norm(node.kwargs), tuple(sorted(x - base for x in layers[node]))))
    return tuple(rows), base


def _shift(key: str, by: int) -> str:
    name, sep, layer = key.partition("@")
    return key if not sep or layer == "-" else f"{name}@{int(layer) + by}"


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
        if hit is not None:
            first, delta, largest = hit
            shift = base - first
            for k, n in delta.items():
                counters["inductor"][_shift(k, shift)] += n
            if largest is not None and largest.layer is not None:
                largest = replace(largest, layer=largest.layer + shift)
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


def layer_kind(spec) -> str:
    kind = f"{'sliding' if spec.sliding_window else 'full'} d{spec.head_dim}"
    if spec.k_eq_v:
        kind += " k=v"
    if not spec.writes_cache:
        kind += " shared"
    return kind


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """Parameters are built in the serving dtype (as the model runner does)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


@torch.inference_mode()
def audit(hf_config: dict, *, device: str = "cuda", dtype: torch.dtype = torch.bfloat16, tokens: int = 8192,
          batch_sizes: list[int] | None = None, passes: tuple[str, ...] | None = None,
          block_size: int = 16, dedupe: bool = True) -> AuditReport:
    """Builds the model from its Hugging Face config under fake tensors and compiles it as far as our
    passes (see the module docstring). batch_sizes: the static buckets (CUDA graphs); default none.
    dedupe: inspect each distinct piece once and replay it for its look-alikes (piece_signature)."""
    from compiled_llm.models.registry import resolve_model_class

    model_cls = resolve_model_class(hf_config)
    cfg = model_cls.config_from_hf(hf_config)
    device = torch.device(device)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with preserved_choices():  # the audit must not rebind a live engine's ops
        with _default_dtype(dtype), fake, torch.device(device):
            model = model_cls(cfg).eval()
        specs = model.attention_specs()
        facts = model_facts(cfg, block_size=block_size)
        select_providers(device, dtype, specs, facts, caps=GPU if device.type == "cuda" else None)
        sizes = sorted(batch_sizes or [])
        attention = {k: name for k, (name, _) in OPS["attention"].chosen.items()}
        ccfg = CompilerConfig(batch_sizes=sizes, cudagraphs=False, full_graph_decode="off", passes=passes,
                              dtype=dtype)
        compiled = CompiledModel(model, ccfg, device, attention, whole_graph=False)
        stats: dict = {}
        compiled.backend.compile_fn = inspect_compile(tokens, stats, dedupe)
        with fake:
            ids = torch.zeros(tokens, dtype=torch.long, device=device)
            pos = torch.arange(tokens, device=device)
            compiled._forward(ids, pos, None)
            for size in sizes:
                compiled._forward(ids[:size], pos[:size], size)
    matches = compiled.matches_by_shape()
    largest: dict[str, Tensor | None] = {}
    for piece in compiled.backend.pieces:
        suffix = "" if piece.graph == 0 else f"/g{piece.graph}"
        for shape, fn in [("dynamic", piece.dynamic), *((str(s), f) for s, f in piece.static.items())]:
            t = getattr(fn, "largest", None)
            if t is not None and (largest.get(shape + suffix) is None or t.bytes > largest[shape + suffix].bytes):
                largest[shape + suffix] = t
    num_experts = getattr(cfg, "num_experts", 0) or 0
    checked = judged(set(compiled.pass_manager.fusions()), num_experts)
    expected = model.expected_fusions()
    split = compiled.backend.split_gm
    split_ops = sum(1 for n in split.graph.nodes if n.op == "call_module"
                    and any(is_split_node(m) for m in split._modules[n.target].graph.nodes))
    report = AuditReport(
        architecture=(hf_config.get("architectures") or ["?"])[0], device=device.type, dtype=dtype, tokens=tokens,
        layers={i: layer_kind(specs[i]) if i in specs else "recurrent" for i in range(cfg.num_hidden_layers)},
        expected=expected, matches=matches, enabled=checked, pieces=len(compiled.backend.pieces),
        graphs=compiled.backend.graph_count, attention_ops=split_ops, largest=largest, num_experts=num_experts,
        inspected=stats.get("inspected", 0), replayed=stats.get("replayed", 0))
    report.mismatches = compare(expected, matches, checked)
    return report
