"""Decode projections: `mm(x, W^T)` with a decode batch's rows and a narrow output (N < K) -> skinny_mm
(ops/linear.py), which adds its K slices inside one launch where cuBLAS takes a split-K kernel and a reduce; also
the wide weights (N >= K) that ops/linear.py's WIDE_MEASURED lists for the GPU model compiled for (an unsplit tile
measured faster than cuBLAS there).

Not a fusion: a kernel choice for one matmul, made from the weight's shape (and, for a wide one, the GPU's name).
A static compile of more than 16 rows keeps torch's mm; in the dynamic-token compile (which every decode size
replays by default) the op chooses per call by the row count (ops/linear.py). The matches are counted under
`compiled_llm_kernel.skinny_mm` (in total, not per layer: no model declares it, so the fusion check does not judge
it). On CUDA by default, and on the CPU where torch has oneDNN (the op's packed-weight provider: every projection
whose weight is a graph input, i.e. a parameter; `COMPILED_LLM_SKINNY_MM=0`: off, an A/B); where the op has its
reference only, the pass, when named, counts.
"""

from __future__ import annotations

import torch
from compiled_llm.ops.linear import CPU, enabled, takes, takes_device
from compiled_llm.passes.base import count_matches, first_layer, node_layers
from compiled_llm.passes.moe_overlap import _with_val


def enabled_by_default(device: str) -> bool:
    """CUDA (the Triton GEMM), and the CPU where oneDNN is built in (its packed weights)."""
    return enabled() and (device == "cuda" or (device == "cpu" and torch.backends.mkldnn.is_available()))


def _weight_of(node) -> torch.fx.Node | None:
    """W where node is W^T (a permute of a 2-D weight's two dims, or aten.t), else None."""
    if not isinstance(node, torch.fx.Node):
        return None
    if node.target is torch.ops.aten.t.default:
        return node.args[0]
    if node.target is torch.ops.aten.permute.default and list(node.args[1]) == [1, 0]:
        return node.args[0]
    return None


class SkinnyMMPass:
    name = "skinny_mm"
    fusion = "a decode batch's narrow projections (N < K, one split-K launch) and measured wide ones on our GEMM"
    op = "skinny_mm"
    count_only_on_reference = False  # the CPU has a provider (oneDNN); where it has not, the next line counts
    count_only_while_reference = True
    fusion_check = False  # a kernel choice: models declare no count for it

    def __init__(self, dtypes: tuple[torch.dtype, ...] = (), device: str = "cpu"):
        self.count_only = False  # set per graph by the pass manager
        self.device = device

    @staticmethod
    def _match(node: torch.fx.Node, device: str | None) -> tuple[torch.fx.Node, torch.fx.Node] | None:
        """(x, W) of mm(x, W^T) where the op takes the product on `device` (ops/linear.py takes_device: the GPU
        model, whose measured wide shapes count, or the CPU, where W must be a graph input: the oneDNN provider
        keeps a packed copy of each parameter, which a weight computed in the graph would need on every call)."""
        if node.target is not torch.ops.aten.mm.default:
            return None
        x, wt = node.args
        w = _weight_of(wt)
        if device == CPU and (w is None or w.op != "placeholder"):
            return None
        xv, wv = (getattr(a, "meta", {}).get("val") for a in (x, w))
        if xv is None or wv is None or wv.dim() != 2 or xv.dim() != 2 or xv.dtype != wv.dtype:
            return None
        m, (n, k) = xv.shape[0], wv.shape
        if not isinstance(n, int) or not isinstance(k, int):
            return None
        if not takes(n, k, m if isinstance(m, int) else None, device):
            return None  # a shape cuBLAS serves as well, or a static row count past a decode batch's
        if wv.stride() != (k, 1) or xv.stride(-1) != 1:
            return None
        return x, w

    def __call__(self, graph: torch.fx.Graph) -> int:
        device = takes_device(self.device)
        found = [(n, hit) for n in graph.nodes if (hit := self._match(n, device)) is not None]
        if not found:
            return 0
        count_matches(self.name, len(found), [min(node_layers(n), default=None) for n, _ in found], first_layer(graph))
        if self.count_only:
            return len(found)
        for node, (x, w) in found:
            with graph.inserting_before(node):
                new = _with_val(graph.call_function(torch.ops.compiled_llm.skinny_mm.default, (x, w)), [node])
            node.replace_all_uses_with(new)
            graph.erase_node(node)
        graph.eliminate_dead_code()
        return len(found)
