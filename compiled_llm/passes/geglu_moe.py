"""GEGLU MoE: the model's traceable expert sum (ops/moe.py `dense_gated_moe` with a GELU-tanh gate: every
expert on every token, weighted by a dense routing matrix that is zero off the top-k) -> the routed
geglu_moe op, which computes only the picked experts. This is the fusion that makes MoE compile at all:
the dense form is E/k times the routed FLOPs, and a [E, tokens, hidden] intermediate.

Under expert parallelism the routing matrix is sliced to this rank's experts [first, first + E_local);
that variant becomes geglu_moe with ids shifted by `first`, whose out-of-range ids (other ranks'
experts) the op skips. The pattern ends at the float32 sum, before the model's cast back (see
dense_gated_moe), and the replacement gives float32 too."""

from __future__ import annotations

import torch

from compiled_llm.ops.activation import gelu_tanh
from compiled_llm.ops.moe import dense_gated_moe
from compiled_llm.passes.base import FusionPass, empty, halves

FIRST = 7919  # sentinel for the first local expert (expert parallel)


class GegluMoEPass(FusionPass):
    name = "geglu_moe"
    fusion = "GEGLU MoE"
    op = "geglu_moe"  # the routed op the replacement calls
    act = staticmethod(gelu_tanh)  # the gate's activation, as the model passes it to dense_gated_moe
    model_dtype_weights = False  # the routing weights: float32 (Gemma's router) or the model's dtype

    def register(self) -> None:
        op = getattr(torch.ops.compiled_llm, self.op)
        act = self.act

        def search(x, weights, ids, gate_up_proj, down_proj):
            return dense_gated_moe(x, weights, ids, gate_up_proj, down_proj, act, gate_up_proj.shape[0])

        def replace(x, weights, ids, gate_up_proj, down_proj):
            return op(x, weights, ids, gate_up_proj, down_proj).float()

        def search_ep(x, weights, ids, gate_up_proj, down_proj, first):
            return dense_gated_moe(x, weights, ids, gate_up_proj, down_proj, act, first + gate_up_proj.shape[0], first)

        def replace_ep(x, weights, ids, gate_up_proj, down_proj, first):
            return op(x, weights, ids - first, gate_up_proj, down_proj).float()

        for dt in self.dtypes:
            wdt = dt if self.model_dtype_weights else torch.float32
            inputs = [empty(8, 32, dtype=dt), empty(8, 2, dtype=wdt), empty(8, 2, dtype=torch.long),
                      empty(6, 20, 32, dtype=dt), empty(6, 32, 10, dtype=dt)]
            self.add(search_ep, replace_ep, inputs, {"first": FIRST}, check=halves, tokens=8)  # contains the plain one
            self.add(search, replace, inputs, stage=1, check=halves, tokens=8)
