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
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from compiled_llm.compiler.backend import CompilerConfig
from compiled_llm.compiler.inspect import Tensor, inspect_compile
from compiled_llm.compiler import whole_graph_decode_ok
from compiled_llm.compiler.model import CompiledModel
from compiled_llm.compiler.verify import compare, judged, per_layer
from compiled_llm.models.interfaces import has_recurrent_state
from compiled_llm.models.registry import resolve_model_class
from compiled_llm.ops.registry import Capabilities, model_facts, preserved_choices, select_providers

GPU = Capabilities("cuda", (9, 0), frozenset({"triton"}))  # an H100/H200 with Triton, without FlashInfer


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
    kernels: list = field(default_factory=list)  # the Triton kernels generated (codegen=True), by name
    kernel_sources: list = field(default_factory=list)  # and their sources, in the same order
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
          block_size: int = 16, dedupe: bool = True, codegen: bool = False) -> AuditReport:
    """Builds the model from its Hugging Face config under fake tensors and compiles it as far as our
    passes (see the module docstring). batch_sizes: the static buckets (CUDA graphs); default none.
    dedupe: inspect each distinct piece once and replay it for its look-alikes (piece_signature). codegen: go on
    through Inductor's CUDA code generation (compiler/inspect.py fake_cuda_codegen; CUDA only), whose errors then
    propagate; the report's `kernels` names the Triton kernels generated."""
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
        ccfg = CompilerConfig(batch_sizes=sizes, cudagraphs=False, full_graph_decode="off", passes=passes,
                              dtype=dtype)
        compiled = CompiledModel(model, ccfg, device, whole_graph_decode_ok(has_recurrent_state(model)))
        stats: dict = {}
        assert not codegen or device.type == "cuda", "codegen: Inductor's CUDA code generation"
        compiled.backend.compile_fn = inspect_compile(tokens, stats, dedupe, codegen)
        compiled.backend.shared_compiles = None  # the audit inspects (or replays, with dedupe) every piece itself
        with fake:
            ids = torch.zeros(tokens, dtype=torch.long, device=device)
            pos = torch.arange(tokens, device=device)
            compiled._forward(ids, pos, None)
            for size in sizes:
                compiled._forward(ids[:size], pos[:size], size)
    matches = compiled.matches_by_shape()
    largest: dict[str, Tensor | None] = {}
    for piece in compiled.backend.pieces:
        for shape, fn in [("dynamic", piece.dynamic), *((str(s), f) for s, f in piece.static.items())]:
            t, label = getattr(fn, "largest", None), piece.label(shape)
            if t is not None and (largest.get(label) is None or t.bytes > largest[label].bytes):
                largest[label] = t
    num_experts = getattr(cfg, "num_experts", 0) or 0
    checked = judged(set(compiled.pass_manager.fusions()), num_experts)
    expected = model.expected_fusions()
    report = AuditReport(
        architecture=(hf_config.get("architectures") or ["?"])[0], device=device.type, dtype=dtype, tokens=tokens,
        layers={i: layer_kind(specs[i]) if i in specs else "recurrent" for i in range(cfg.num_hidden_layers)},
        expected=expected, matches=matches, enabled=checked, pieces=len(compiled.backend.pieces),
        graphs=compiled.backend.graph_count, attention_ops=len(compiled.backend.attention_pieces), largest=largest, num_experts=num_experts,
        inspected=stats.get("inspected", 0), replayed=stats.get("replayed", 0), kernels=stats.get("kernels", []),
        kernel_sources=stats.get("sources", []))
    report.mismatches = compare(expected, matches, checked)
    return report
