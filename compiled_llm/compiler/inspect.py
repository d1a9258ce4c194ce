"""Inductor up to and including our fusion passes, and no further: the compile function the graph audit
(runtime/audit.py) and the pass tests give the backend. Nothing is generated, so it runs on fake tensors of
any device, a GPU's included, on a machine without one. Each inspected piece reports the largest tensor
it materialises; a piece that repeats an inspected one for other layers is not compiled again.

With codegen=True Inductor goes on through its CUDA code generation (scheduling, fusion, tiling, the Triton
kernels' source and the wrapper) under `fake_cuda_codegen`: an H200's device properties stand in for the
missing GPU and the kernels are not built. Errors of Inductor's GPU code generation at the released shapes can
then show on the CPU, and the GPU's kernel choices can be checked there. (Not all: session 22's `CantSplit` in
the CUDA tiling, seen on the H200, did not reproduce under it.)
"""

from __future__ import annotations

import contextlib
import operator
import types
from collections import Counter
from dataclasses import dataclass, replace
from unittest import mock

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


# an H200 (sm_90): what Inductor's CUDA code generation asks of the device
H200 = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132,
                             total_memory=141 * 2**30, regs_per_multiprocessor=65536,
                             max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32,
                             L2_cache_size=60 * 2**20, shared_memory_per_block_optin=232448, gcnArchName="",
                             uuid="fake-h200")


class _Unbuilt:
    """A Triton kernel whose source was generated and never built (fake_cuda_codegen)."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def fake_cuda_codegen(props=H200, kernels: list | None = None, sources: list | None = None):
    """Inductor's CUDA code generation on a machine without a GPU: the device's properties from `props`, Triton
    taken as present, the kernels' sources generated but not built (their names appended to `kernels`, their
    sources to `sources`). Only for compiles whose result is not run."""
    names = kernels if kernels is not None else []

    def unbuilt(self, kernel_name, *args, **kwargs):
        names.append(kernel_name)
        if sources is not None:
            sources.append(args[0] if args else kwargs.get("source_code", ""))
        return _Unbuilt()

    import torch._inductor.async_compile as async_compile
    import torch._inductor.codegen.triton as triton_codegen
    import torch._inductor.compile_fx as compile_fx_module
    import torch._inductor.scheduler as scheduler
    import torch.utils._triton as torch_triton
    from torch._inductor.runtime.hints import DeviceProperties

    def device_properties(cls, device):
        return cls(type="cuda", index=device.index or 0, multi_processor_count=props.multi_processor_count,
                   cc=props.major * 10 + props.minor, major=props.major,
                   regs_per_multiprocessor=props.regs_per_multiprocessor,
                   max_threads_per_multi_processor=props.max_threads_per_multi_processor,
                   max_threads_per_block=props.max_threads_per_block, warp_size=props.warp_size)

    targets = [
        (torch.cuda, "get_device_properties", lambda *a, **k: props),
        (torch.cuda, "get_device_capability", lambda *a, **k: (props.major, props.minor)),
        (torch.cuda, "current_device", lambda: 0),
        (DeviceProperties, "create", classmethod(device_properties)),
        (compile_fx_module, "_check_triton_bf16_support", lambda *a, **k: None),
        (scheduler, "has_triton", lambda: True),
        (async_compile.AsyncCompile, "triton", unbuilt),
        (torch_triton, "triton_hash_with_backend", lambda: "unbuilt"),
        (triton_codegen, "triton_hash_with_backend", lambda: "unbuilt"),
    ]
    with contextlib.ExitStack() as stack:
        for owner, name, value in targets:
            if hasattr(owner, name):  # (names differ a little between torch versions)
                stack.enter_context(mock.patch.object(owner, name, value))
        yield


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


def inspect_compile(tokens: int, stats: dict | None = None, dedupe: bool = True, codegen: bool = False):
    """A compile function for the backend: Inductor up to and including our passes, then stop. A piece
    whose signature matches one inspected before is not compiled again: its matches and largest tensor
    are replayed for its own layers. stats (optional) counts 'inspected' and 'replayed' pieces, and with
    codegen=True (CUDA pieces: Inductor's code generation under fake_cuda_codegen, see the module doc)
    lists in 'kernels' the names of the Triton kernels generated and in 'sources' their sources."""
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
                if not codegen:
                    raise _Stop

            def uuid(self):
                return None

        before = counters["inductor"].copy()
        patches = {**config_patches, "post_grad_custom_pre_pass": Inspect(), "fx_graph_cache": False,
                   # uniform-value constant folding evaluates constants on the real device, which the audit may
                   # lack; it never touches what our patterns match
                   "joint_graph_constant_folding": False}
        if codegen:
            with fake_cuda_codegen(kernels=stats.setdefault("kernels", []), sources=stats.setdefault("sources", [])):
                compile_fx(gm, args, config_patches=patches)  # any error of the code generation propagates
        else:
            try:
                compile_fx(gm, args, config_patches=patches)
            except Exception:
                if "largest" not in seen:
                    raise
        delta = Counter({k: v for k, v in (counters["inductor"] - before).items() if k.startswith("compiled_llm.")})
        seen_pieces[key] = (base, delta, seen["largest"])
        stats["inspected"] = stats.get("inspected", 0) + 1
        return _Inspected(gm, seen["largest"])

    return compile_fn
