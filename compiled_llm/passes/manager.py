"""The pass manager: Inductor's post-grad custom *pre* pass. Runs each enabled fusion pass over every
compiled piece and keeps the match counts. Pre, not post: Inductor's own post-grad passes are
device-specific (on CUDA, softmax becomes an online-softmax prim, small matmuls are decomposed), so a
pattern traced once would miss the GPU's graph; before them, the graph is what the joint-graph
canonicalisations made of it, which is what the patterns are traced through (passes/base.py).
Its uuid (part of Inductor's FX-graph cache key) hashes the source of the passes and ops and the pass
configuration, so editing a pass or an op recompiles."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from compiled_llm.ops import OPS, linear
from compiled_llm.ops.registry import INDUCTOR
from compiled_llm.passes.base import INDUCTOR_SETTINGS, FusionPass
from compiled_llm.passes import skinny_mm
from compiled_llm.passes.moe_overlap import UNROLL_SLOTS, enabled_by_default, sum_in_graph

log = logging.getLogger("compiled_llm")

PACKAGE = Path(__file__).resolve().parent.parent


def source_hash(*folders: str) -> str:
    """sha256 over the .py files under the given package folders (relative names, so the hash moves)."""
    h = hashlib.sha256()
    for folder in folders:
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            h.update(str(path.relative_to(PACKAGE)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def all_passes() -> dict[str, type[FusionPass]]:
    from compiled_llm.passes.add_rms_norm import AddRMSNormPass
    from compiled_llm.passes.allreduce_rms_norm import AllReduceRMSNormPass
    from compiled_llm.passes.geglu_moe import GegluMoEPass
    from compiled_llm.passes.moe_overlap import MoEOverlapPass
    from compiled_llm.passes.qk_norm_rope import QKNormRopeKVWritePass
    from compiled_llm.passes.router_topk import RouterTopKPass
    from compiled_llm.passes.skinny_mm import SkinnyMMPass
    from compiled_llm.passes.swiglu_moe import SwigluMoEPass

    return {p.name: p for p in (AddRMSNormPass, QKNormRopeKVWritePass, AllReduceRMSNormPass, RouterTopKPass,
                                GegluMoEPass, SwigluMoEPass, MoEOverlapPass, SkinnyMMPass)}


_BUILT: dict[tuple, FusionPass] = {}


def _fusion_pass(cls: type[FusionPass], dtypes: tuple, device: str, tp_group: str | None) -> FusionPass:
    """One instance per (pass, dtypes, device, TP group) in a process: tracing the patterns (on a pass's first
    graph) takes a second or two, and a pass holds no state between graphs."""
    key = (cls, dtypes, device, tp_group if cls.name == "allreduce_rms_norm" else None)
    if key not in _BUILT:
        _BUILT[key] = cls(dtypes, device, tp_group) if cls.name == "allreduce_rms_norm" else cls(dtypes, device)
    return _BUILT[key]


REFERENCE_ONLY = "the fused op has only its reference here"


def _left_to_inductor(p: FusionPass) -> str | None:
    """Why the pass leaves its matches to Inductor on every device here, or None: its op resolved to
    Inductor's own kernel (the "inductor" provider, measured faster than ours: ops/norm.py), or it has only its
    reference, which for such a pass is slower than no pass (count_only_while_reference)."""
    provider = OPS[p.op].provider_name() if p.op is not None else None
    if provider == INDUCTOR:
        return "its kernel, fused with the neighbouring ops, beats the fused op here"
    if provider == "reference" and p.count_only_while_reference:
        return REFERENCE_ONLY
    return None


class PassManager(CustomGraphPass):
    def __init__(self, enabled: tuple[str, ...] | None = None, dtype: torch.dtype = torch.float32,
                 device: str = "cpu", tp_group: str | None = None, reference_only: bool = False,
                 codegen_key: str = ""):
        """reference_only: the fused ops run their PyTorch reference here (a CPU engine); passes that allow it
        count their matches and leave the computation to Inductor (FusionPass.count_only_on_reference).
        codegen_key: the compiler's code-generation heuristics (compiler/codegen.py), part of the cache key."""
        known = all_passes()
        names = list(known) if enabled is None else list(enabled)
        unknown = set(names) - set(known)
        if unknown:
            raise ValueError(f"unknown passes {sorted(unknown)}; passes: {', '.join(known)}")
        names = sorted(names, key=list(known).index)  # in the passes' own order: the MoE overlap follows the MoE fusions
        if tp_group is None and "allreduce_rms_norm" in names and enabled is None:
            names.remove("allreduce_rms_norm")  # only under tensor parallelism
        if enabled is None and not enabled_by_default(torch.device(device).type):
            names.remove("moe_overlap")  # streams: CUDA only (a CPU compile may still name it)
        if enabled is None and not skinny_mm.enabled_by_default(torch.device(device).type):
            names.remove("skinny_mm")  # a CUDA kernel choice (a CPU compile may still name it)
        dtypes = (torch.float32,) if dtype == torch.float32 else (torch.float32, dtype)
        device = torch.device(device).type
        self.device_type = device
        self.reference_only = reference_only
        self.passes = [_fusion_pass(known[name], dtypes, device, tp_group) for name in names]
        # passes whose fused op resolved to Inductor's own kernel, or has only its reference here where that is
        # slower than no pass: they count matches, Inductor computes the graph (_left_to_inductor)
        self.unfused = tuple(p.name for p in self.passes if _left_to_inductor(p))
        # the GPU model's measured wide shapes decide some of skinny_mm's rewrites (ops/linear.py WIDE_MEASURED)
        wide = tuple(sorted(linear.wide_shapes(linear.device_name(device)))) if "skinny_mm" in names else ()
        # the MoE overlap's picks added in the graph (COMPILED_LLM_MOE_SUM_IN_NORM=0 turns it off; read once here)
        self.moe_sum_in_graph = "moe_overlap" in names and sum_in_graph()
        self.config = (tuple(names), tuple(str(d) for d in dtypes), device, tp_group, reference_only, self.unfused,
                       codegen_key, wide) + (("moe_sum_in_graph",) if self.moe_sum_in_graph else ())
        self._uuid = None
        self.calls = 0  # graphs the passes ran on (an FX-cache hit runs none)
        self.last_input = ""  # the last graph as the passes received it, for a report of a missed fusion

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.calls += 1
        self.last_input = str(graph)
        counted = self.count_only()
        for p in self.passes:
            p.count_only = p.name in counted
            if p.name == "moe_overlap":
                p.sum_in_graph = self.moe_sum_in_graph
            try:
                p(graph)
            finally:
                p.count_only = False
        if os.environ.get("COMPILED_LLM_DUMP_GRAPHS"):
            log.warning("post-grad graph after our passes:\n%s", graph)

    def count_only(self) -> set[str]:
        """The passes that count their matches and leave the graph unchanged in this compile."""
        return {p.name for p in self.passes if (self.reference_only and p.count_only_on_reference)
                or p.name in self.unfused}

    def why_counted(self, name: str) -> str:
        """Why a count-only pass leaves its match to Inductor (for the report)."""
        p = next(p for p in self.passes if p.name == name)
        return _left_to_inductor(p) or REFERENCE_ONLY

    def uuid(self) -> str:
        if self._uuid is None:
            self._uuid = hashlib.sha256((source_hash("passes", "ops") + repr(self.config)).encode()).hexdigest()
        return self._uuid

    def inductor_config(self) -> dict:
        extra = {}
        if self.reference_only:  # Inductor then computes what the references did: round as eager rounds
            extra["emulate_precision_casts"] = True
        if any(p.name == "moe_overlap" for p in self.passes):
            # Inductor's peak-memory reordering moved the join ahead of the dense branch (seen on the CPU's
            # code): the graph's own order, which the overlap pass set, is what runs the branches side by side
            extra["reorder_for_peak_memory"] = False
        if self.moe_sum_in_graph:
            extra["unroll_reductions_threshold"] = UNROLL_SLOTS
        return {"post_grad_custom_pre_pass": self, **INDUCTOR_SETTINGS, **extra}

    def fusions(self) -> dict[str, str]:
        return {p.name: p.fusion for p in self.passes}
