"""Op specs and the provider resolver.

Each fused op is declared once as an `OpSpec`: a name and its providers in order of preference
(FlashInfer, Triton, then the plain-PyTorch reference that runs everywhere). `select_providers`
resolves every op against the device's `Capabilities` and the model's shapes once, when the model
is built; the op bodies then call `spec.impl(key)`, a dict lookup, never a new resolution.
Ops with per-layer shapes (attention, the KV write) resolve per layer and are keyed by layer index.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

log = logging.getLogger("compiled_llm")

_CPU_KERNELS: dict[str, torch.library.Library] = {}  # namespace -> the library holding our ops' CPU kernels


def custom_op(qualname: str, *, mutates_args: tuple[str, ...] = ()):
    """torch.library.custom_op; an op that mutates none of its arguments also gets its function as its CPU
    kernel, which the dispatcher then calls directly. custom_op's own kernel calls it through three Python
    wrappers (Dynamo's disable, the kernel switch, the output alias check): ~2 us a call on 2 cores, and a CPU
    decode step of the host-overhead model calls 37 ops (benchmarks/NOTES.md, 2026-12-05 session 43). A
    mutating op keeps custom_op's kernel alone (its functionalization)."""

    def wrap(fn: Callable):
        op = torch.library.custom_op(qualname, mutates_args=mutates_args)(fn)
        if not mutates_args:
            namespace, name = qualname.split("::")
            if namespace not in _CPU_KERNELS:
                _CPU_KERNELS[namespace] = torch.library.Library(namespace, "IMPL")
            _CPU_KERNELS[namespace].impl(name, fn, "CPU")
        return op

    return wrap


# (capabilities, shape facts) -> None when the provider can run, else the reason it cannot
Requirement = Callable[["Capabilities", dict], "str | None"]


@dataclass(frozen=True)
class Capabilities:
    device_type: str  # "cpu" | "cuda"
    compute_capability: tuple[int, int] | None
    packages: frozenset[str]  # optional packages that are installed ("triton", "flashinfer")
    triton_interpret: bool = False  # TRITON_INTERPRET=1: Triton kernels run on the CPU (tests)

    @classmethod
    def detect(cls, device: torch.device | str) -> "Capabilities":
        device = torch.device(device)
        cc = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        pkgs = frozenset(p for p in ("triton", "flashinfer") if importlib.util.find_spec(p) is not None)
        return cls(device.type, cc, pkgs, os.environ.get("TRITON_INTERPRET") == "1")

    def triton_ok(self) -> str | None:
        if "triton" not in self.packages:
            return "triton is not installed"
        if self.device_type == "cuda" or self.triton_interpret:
            return None
        return f"Triton kernels need a CUDA device (this is {self.device_type})"

    def flashinfer_ok(self) -> str | None:
        if "flashinfer" not in self.packages:
            return "flashinfer is not installed"
        if self.device_type != "cuda":
            return "FlashInfer needs a CUDA device"
        if self.compute_capability < (8, 0):
            return "FlashInfer needs compute capability 8.0 or newer"
        return None


def _always(caps: Capabilities, shape: dict) -> None:
    return None


# the provider name of "Inductor's own kernel": the op's fusion pass only counts its matches and Inductor
# generates the code from the model's PyTorch, fusing it with its neighbours (a fused op is opaque to Inductor
# and would cut that fusion). Its target is the reference, for a call outside a compiled graph.
INDUCTOR = "inductor"


def inductor_codegen(caps: "Capabilities", shape: dict) -> str | None:
    """Inductor generates Triton kernels for the compiled graph: a CUDA device with Triton."""
    if caps.device_type != "cuda":
        return f"Inductor generates C++ here ({caps.device_type}); the CPU engine counts this fusion anyway"
    return caps.triton_ok()


@dataclass(frozen=True)
class Provider:
    name: str  # "reference" | "triton" | "flashinfer" | "inductor" (INDUCTOR)
    target: str  # "module:function", imported only when selected
    requires: Requirement = _always
    # a split op's provider whose launches a CUDA graph can replay: it reads the per-step metadata from
    # device tensors (sequence lengths, offsets, block tables) and syncs nothing to the host. Whole-graph
    # decode captures the split ops too, so it needs every chosen provider of them to say so.
    capturable: bool = False
    # reads device values on the host (a check or a data-dependent shape): it cannot run inside any CUDA graph,
    # a compiled piece's included, so an engine with CUDA graphs refuses it (compiler/__init__.py)
    syncs: bool = False

    def load(self) -> Callable:
        module, attr = self.target.split(":")
        return getattr(importlib.import_module(module), attr)


@dataclass
class OpSpec:
    name: str
    doc: str
    providers: list[Provider]  # preference order; the last is the reference
    per_layer: bool = False  # resolved per attention layer (shape limits such as head_dim differ by layer)
    splits_graph: bool = False  # reads per-step metadata from the forward context: the compiler splits at it
    recurrent_state: bool = False  # reads and updates the per-sequence state slots (ops/state.py)
    applies: Callable[[Any], bool] | None = None  # per-layer ops: the layers it serves (None: every layer)
    chosen: dict[Any, tuple[str, Callable]] = field(default_factory=dict)
    _reference: Callable | None = None

    def chosen_providers(self) -> list[Provider]:
        """The providers chosen for this op, on any layer."""
        names = {name for name, _ in self.chosen.values()}
        return [p for p in self.providers if p.name in names]

    def capturable(self) -> bool:
        """Every provider chosen for this op (on any layer) can be replayed inside a CUDA graph."""
        chosen = self.chosen_providers()
        return bool(chosen) and all(p.capturable for p in chosen)

    def syncing_choice(self) -> str | None:
        """The chosen provider's name if it reads device values on the host (Provider.syncs), else None."""
        return next((p.name for p in self.chosen_providers() if p.syncs), None)

    def resolve(self, caps: Capabilities, shape: dict, force: str | None = None) -> tuple[Provider, list[str]]:
        """First provider whose requirements hold (or the forced one); also the reasons others were skipped."""
        skipped = []
        for p in self.providers:
            if force is not None and p.name != force:
                continue
            why = p.requires(caps, shape)
            if why is None:
                return p, skipped
            if force is not None:
                raise ValueError(f"op {self.name}: provider {force!r} cannot run here: {why}")
            skipped.append(f"{p.name}: {why}")
        if force is not None:
            raise ValueError(f"op {self.name} has no provider {force!r} (has: {[p.name for p in self.providers]})")
        raise RuntimeError(f"op {self.name}: no provider can run ({'; '.join(skipped)})")

    def select(self, caps: Capabilities, shape: dict, key: Any = None, force: str | None = None) -> str:
        provider, _ = self.resolve(caps, shape, force)
        self.chosen[key] = (provider.name, provider.load())
        return provider.name

    def reference(self) -> Callable:
        if self._reference is None:
            self._reference = self.providers[-1].load()
        return self._reference

    def impl(self, key: Any = None) -> Callable:
        hit = self.chosen.get(key) or self.chosen.get(None)
        return hit[1] if hit else self.reference()

    def provider_name(self, key: Any = None) -> str:
        hit = self.chosen.get(key) or self.chosen.get(None)
        return hit[0] if hit else self.providers[-1].name


OPS: dict[str, OpSpec] = {}


def register(spec: OpSpec) -> OpSpec:
    if spec.providers[-1].name != "reference":
        raise ValueError(f"op {spec.name}: the last provider must be the reference")
    OPS[spec.name] = spec
    return spec


@contextlib.contextmanager
def preserved_choices():
    """Resolutions made inside (the graph audit's, a test's) are undone on exit, so they never rebind the
    ops of an engine that lives in the same process."""
    saved = {name: dict(spec.chosen) for name, spec in OPS.items()}
    try:
        yield
    finally:
        for name, spec in OPS.items():
            spec.chosen.clear()
            spec.chosen.update(saved.get(name, {}))


def parse_overrides(text: str | None) -> dict[str, str]:
    """'attention=reference,rms_norm=triton' -> {'attention': 'reference', 'rms_norm': 'triton'}."""
    out = {}
    for item in (text or "").split(","):
        if item.strip():
            op, _, prov = item.partition("=")
            if op.strip() not in OPS or not prov.strip():
                raise ValueError(f"bad op provider override {item!r}; ops: {', '.join(sorted(OPS))}")
            out[op.strip()] = prov.strip()
    return out


def select_providers(device: torch.device | str, dtype: torch.dtype, layers: dict[int, Any],
                     facts: dict | None = None, overrides: str | None = None,
                     caps: Capabilities | None = None) -> dict[str, dict]:
    """Resolves every registered op for this device and model; returns {op: {key: provider}} for the log.

    layers: the model's AttentionSpecs (per-layer head_dim, window, ...); facts: model-wide shapes
    (hidden_size, num_experts, ...); caps: the device's capabilities (default: detected; the graph audit
    passes a GPU's without one)."""
    import compiled_llm.ops  # noqa: F401  (registers every op)

    caps = caps or Capabilities.detect(device)
    force = parse_overrides(overrides)
    facts = dict(facts or {}, dtype=dtype, head_dims=sorted({layer.head_dim for layer in layers.values()}))
    table: dict[str, dict] = {}
    for name, spec in OPS.items():
        spec.chosen.clear()
        if spec.per_layer:
            for idx, layer in layers.items():
                if spec.applies is not None and not spec.applies(layer):
                    continue
                shape = dict(facts, layer=layer, source=layers[layer.cache_layer], head_dim=layer.head_dim)
                table.setdefault(name, {})[idx] = spec.select(caps, shape, idx, force.get(name))
        else:
            table[name] = {None: spec.select(caps, facts, None, force.get(name))}
    return table


def model_facts(model_config, **extra) -> dict:
    """Model-wide shapes the resolver and the JIT registry key on (extra: engine facts such as block_size)."""
    names = ("hidden_size", "num_experts", "top_k_experts", "moe_intermediate_size", "rms_norm_eps", "vocab_size",
             "moe_op", "rotary_dim", "final_logit_softcapping")
    facts = {k: getattr(model_config, k) for k in names if getattr(model_config, k, None) is not None}
    if "top_k_experts" not in facts and getattr(model_config, "num_experts_per_tok", None):
        facts["top_k_experts"] = model_config.num_experts_per_tok  # Qwen's name for it
    return {**facts, **extra}


def describe(table: dict[str, dict]) -> str:
    parts = []
    for op, by_key in table.items():
        names = sorted(set(by_key.values()))
        parts.append(f"{op}={'/'.join(names)}")
    return ", ".join(parts)

