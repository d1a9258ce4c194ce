"""Warm starts without Dynamo: the traced forward, saved in the compile cache.

A compile-cache hit used to trace the model again with Dynamo (10-12 s for Gemma 4 26B-A4B's 6,074-node graph
on the H200, most of a 17-18 s warm start) only to find every piece in Inductor's cache. With a compile cache
the first forward is instead compiled ahead of time (`torch.compile(...).aot_compile`, torch >= 2.11): Dynamo's
bytecode and guards and our backend's result are saved in the cache folder (`aot/forward.bin`), and a later
start loads them and calls the model without tracing.

What our backend saves (`SplitArtifact`): the split module's graph with the attention pieces, and per compute
piece its name, first layer, match counts and which compiled code it runs. Look-alike pieces share one
compiled artifact (Inductor's own `standalone_compile(..., aot=True)` result, which carries its generated
code), saved once. A piece's FX graph is needed again only for a static batch-size compile; it is kept
pickled and unpickled on that first use.

Single process only for now: the ranks of a parallel engine share one cache key, and their graphs differ.
"""

from __future__ import annotations

import logging
import pickle
import time
from pathlib import Path
from typing import Any

import torch
import torch.fx

from compiled_llm.compiler.piecewise import PieceRunner

log = logging.getLogger("compiled_llm")

FILE = "forward.bin"


def supported() -> bool:
    """torch.compile(...).aot_compile and the serializable-callable protocol (torch >= 2.11)."""
    try:
        from torch._dynamo.aot_compile_types import SerializableCallable  # noqa: F401
        from torch._inductor.standalone_compile import AOTCompiledArtifact  # noqa: F401
    except ImportError:
        return False
    return hasattr(torch._dynamo.config, "enable_aot_compile")


class PieceArtifact:
    """A piece compiled for the dynamic token count by Inductor as a self-contained artifact that serializes
    (`standalone_compile(..., aot=True)`). A loaded artifact returns its graph's outputs as a list, also where
    the piece returns one value (which the split module passes on as is): such a piece is compiled with its
    output made a 1-tuple, and `single` unwraps it, the same before saving and after loading."""

    def __init__(self, artifact, single: bool):
        self.artifact, self.single = artifact, single

    def __call__(self, *args):
        out = self.artifact(*args)
        return out[0] if self.single else out

    def serialize(self) -> tuple[bytes, bool]:
        return self.artifact.serialize(), self.single

    @classmethod
    def deserialize(cls, data: tuple[bytes, bool]) -> "PieceArtifact":
        from torch._inductor.standalone_compile import AOTCompiledArtifact

        code, single = data
        return cls(AOTCompiledArtifact.deserialize(code), single)


def compile_artifact(gm: torch.fx.GraphModule, fake_args: list, config_patches: dict) -> PieceArtifact:
    """The same compile_fx with our passes as the piece would get, inside Dynamo's tracing context (its symbolic
    sizes included), as a PieceArtifact. `gm` is the compile's own copy (its output may be rewritten)."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    single = not isinstance(out.args[0], (tuple, list))
    if single:
        out.args = ((out.args[0],),)
        gm.recompile()
    artifact = torch._inductor.standalone_compile(gm, fake_args, dynamic_shapes="from_tracing_context",
                                                  options={"config_patches": config_patches}, aot=True)
    return PieceArtifact(artifact, single)


try:
    from torch._dynamo.aot_compile_types import SerializableCallable as _Serializable
except ImportError:  # torch < 2.11: never instantiated (supported() is False)
    _Serializable = object


def dump_graph(gm: torch.fx.GraphModule) -> bytes:
    """A piece's graph with its nodes' metadata (the fake values and module stacks our passes and Inductor's
    caches read), which plain pickling of a GraphModule drops."""
    from torch.fx._graph_pickler import GraphPickler, Options

    # our ops are allowed (the default refuses any op outside aten and prims); the module stack is kept
    # (which layer a node came from: our passes' per-layer counts); Dynamo's fake values are not (they hold
    # its fake mode, which does not pickle; a static compile traces the piece again with its own inputs)
    keep = Options(ops_filter=None, node_metadata_key_filter=lambda k: k in ("nn_module_stack", "stack_trace"))
    return GraphPickler.dumps(gm, keep)


def load_graph(data: bytes) -> torch.fx.GraphModule:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv()))


def add_example_values(gm: torch.fx.GraphModule, fake_args: list) -> None:
    """Each node's value on these fake inputs as `example_value`, as Dynamo's graph had it (a loaded piece's graph
    comes without: AOTAutograd's cache reads it to tell a tensor method from another call, and bypasses
    the cache without it)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = next(a.fake_mode for a in fake_args if isinstance(a, FakeTensor))
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fake_args)
    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta.setdefault("example_value", node.meta["val"])


class SplitArtifact(_Serializable):
    """What the backend returns to an ahead-of-time compile: the split module, runnable, and how to save it.
    Loaded in another process it has no backend until `bind` gives it one (CompiledModel does)."""

    def __init__(self, split: torch.fx.GraphModule, counts: dict, state: dict | None = None):
        self.split = split
        self.counts = counts  # this graph's look-alike compile reuses and traced nodes (the compile report)
        self.state = state  # when loaded: what bind() turns into PieceRunners

    def __call__(self, *args: Any) -> Any:
        return self.split(*args)

    @classmethod
    def serialize_compile_artifacts(cls, fn: "SplitArtifact") -> bytes:
        split = fn.split
        runners = {name: obj for name, obj in split.__dict__.items() if isinstance(obj, PieceRunner)}
        codes: list = []  # each distinct compiled artifact once
        index: dict[int, int] = {}
        pieces = []
        for name, runner in runners.items():
            if id(runner.dynamic) not in index:
                if not isinstance(runner.dynamic, PieceArtifact):
                    raise TypeError(f"{name}: its dynamic compile cannot be saved ({type(runner.dynamic).__name__})")
                index[id(runner.dynamic)] = len(codes)
                codes.append((runner.dynamic.serialize(), dump_graph(runner.gm)))
            pieces.append({"name": name, "base": runner.base, "graph": runner.graph, "code": index[id(runner.dynamic)],
                           "matches": dict(runner.matches.get(runner.label("dynamic"), {}))})
        # the split's graph, with an empty module where each compute piece goes (bind puts the runner there)
        modules = {}
        for node in split.graph.nodes:
            if node.op == "call_module":
                modules[node.target] = torch.nn.Module() if node.target in runners else getattr(split, node.target)
        skeleton = torch.fx.GraphModule(modules, split.graph)
        attention = [node.target for node in split.graph.nodes
                     if node.op == "call_module" and node.target not in runners]
        state = {"skeleton": skeleton, "pieces": pieces, "codes": codes, "attention": attention,
                 "counts": fn.counts}
        return pickle.dumps(state)

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> "SplitArtifact":
        state = pickle.loads(data)
        state["codes"] = [(PieceArtifact.deserialize(code), gm) for code, gm in state["codes"]]
        return cls(state.pop("skeleton"), state.pop("counts"), state)

    def bind(self, backend) -> None:
        """Puts a PieceRunner (of this backend: its run state, config, passes) where each compute piece goes."""
        state, self.state = self.state, None
        if state is None:
            return
        graphs: dict[int, Any] = {}
        for p in state["pieces"]:
            fn, gm_bytes = state["codes"][p["code"]]
            runner = PieceRunner.restored(p["name"], backend, p["base"], p["graph"], fn,
                                          lambda b=gm_bytes, i=p["code"]: graphs[i] if i in graphs else graphs.setdefault(i, load_graph(b)),
                                          p["matches"])
            self.split.__dict__[p["name"]] = runner
            backend.pieces.append(runner)
        backend.split_gm, backend.attention_pieces = self.split, state["attention"]
        backend.graph_count += 1
        backend.shared_hits += self.counts["shared_hits"]
        backend.traced_nodes = backend.traced_nodes or self.counts["traced_nodes"]  # (the first graph's)


def saved_guards(entries) -> list[bool]:
    """Which of Dynamo's guards the saved forward keeps: torch's default for ahead-of-time compiles (none on
    globals or of kinds that cannot be saved) less those matching tensor properties. Under torch 2.11 the saved
    tensor guards held other dispatch keys than the live tensors have (a parameter's autograd key, the
    inputs' keys of tensors made outside inference mode), so a loaded forward refused every call; what they
    would check (shapes, dtypes and devices of the weights and inputs) is in the compile cache's key (model
    config, dtype, device) and fixed by the runtime. Guards on the modules' structure and attributes and on
    the global state stay."""
    from torch._dynamo.guards import CheckFunctionManager

    return [not (g.is_global or g.guard_type in CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
                 or g.guard_type == "TENSOR_MATCH") for g in entries]


class AheadOfTime:
    """The compiled forward of one CompiledModel, kept in `folder` as one file per Dynamo graph (forward.bin, then
    forward_1.bin, ...: as Dynamo keeps a cache entry per set of guards, e.g. a second graph for one token when
    the first was specialised to two or more). Every saved graph is loaded at start; a call runs the first
    whose guards pass; a call that none accepts compiles another graph ahead of time (the recompile Dynamo
    would make), saved too when `save` (a cache being built; a cache hit writes nothing)."""

    def __init__(self, folder: Path, model: torch.nn.Module, backend, save: bool = True):
        self.folder = Path(folder)
        self.model = model
        self.backend = backend
        self.save = save
        self.fns: list = []
        self.loaded = self.saved = self.unsaved = 0
        self.seconds = 0.0
        self._load()

    def path(self, i: int) -> Path:
        return self.folder / (FILE if i == 0 else FILE.replace(".bin", f"_{i}.bin"))

    def _load(self) -> None:
        from torch._dynamo.aot_compile import AOTCompiledFunction

        t0 = time.perf_counter()
        while self.path(len(self.fns)).is_file():
            fn = AOTCompiledFunction.deserialize(self.path(len(self.fns)).read_bytes())
            fn._artifacts.compiled_fn.bind(self.backend)
            self.fns.append(fn)
        self.loaded = len(self.fns)
        if self.fns:
            self.seconds = time.perf_counter() - t0
            log.info("loaded the compiled forward (%d graph(s), %d pieces; no Dynamo trace) in %.1fs", self.loaded,
                     len(self.backend.pieces), self.seconds)

    def _compile(self, args: tuple):
        t0 = time.perf_counter()
        forward = type(self.model).forward
        self.backend.aot = True
        try:
            with torch._dynamo.config.patch(enable_aot_compile=True):
                compiled = torch.compile(forward, backend=self.backend, fullgraph=True, dynamic=False,
                                         options={"guard_filter_fn": saved_guards})
                fn = compiled.aot_compile(((self.model, *args), {}))
        finally:
            self.backend.aot = False
        self.fns.append(fn)
        self.seconds += time.perf_counter() - t0
        path = self.path(len(self.fns) - 1)
        if self.save:
            self.folder.mkdir(parents=True, exist_ok=True)
        else:
            self.unsaved += 1
            log.warning("compiled another graph of the forward (%d tokens) that the compile cache does not hold; "
                        "every start from it will compile that graph again", args[0].shape[0])
            return fn
        try:
            fn.save_compiled_function(str(path))
        except Exception as e:  # noqa: BLE001 - it runs; only the next start will trace again
            path.unlink(missing_ok=True)
            self.unsaved += 1
            log.warning("the forward compiled ahead of time could not be saved (%s: %s); the next start from this "
                        "compile cache traces it with Dynamo again", type(e).__name__, e)
            return fn
        self.saved += 1
        log.info("compiled the forward ahead of time and saved it (%s, %.1f MB) in %.1fs", path.name,
                 path.stat().st_size / 1e6, time.perf_counter() - t0)
        return fn

    def status(self) -> str | None:
        """'loaded' (every graph this run used came from the cache), 'saved' (compiled and saved: a build), or
        what mixed; None before any."""
        parts = [f"{n} {what}" for n, what in ((self.loaded, "loaded"), (self.saved, "saved"),
                                                (self.unsaved, "not saved")) if n]
        if len(parts) == 1 and not self.unsaved:
            return parts[0].split()[1]
        return ", ".join(parts) or None

    def __call__(self, *args):
        for fn in self.fns:
            if fn.guard_check(self.model, *args):
                return fn.fn(self.model, *args)
        try:
            fn = self._compile(args)
        except Exception as e:  # noqa: BLE001 - CompiledModel compiles with Dynamo instead, and says why
            raise CannotCompile(f"{type(e).__name__}: {e}") from e
        return fn.fn(self.model, *args)


class CannotCompile(RuntimeError):
    """The forward could not be compiled ahead of time (a graph Dynamo cannot capture that way)."""
