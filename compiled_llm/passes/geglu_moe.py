"""GEGLU MoE: the model's traceable expert sum (every expert on every token, weighted by a dense routing
matrix that is zero off the top-k) -> the routed geglu_moe op, which computes only the picked experts.
This is the fusion that makes MoE compile at all: the dense form is E/k times the routed FLOPs.

Under expert parallelism the routing matrix is sliced to this rank's experts [first, first + E_local);
that variant becomes geglu_moe with ids shifted by `first`, whose out-of-range ids (other ranks'
experts) the op skips."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compiled_llm.passes.base import FusionPass, empty

FIRST = 7919  # sentinel for the first local expert (expert parallel)


def gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


class GegluMoEPass(FusionPass):
    name = "geglu_moe"
    fusion = "GEGLU MoE"

    def register(self) -> None:
        def search(x, weights, ids, gate_up_proj, down_proj):
            t, (e, two_i, h) = x.shape[0], gate_up_proj.shape
            route = torch.zeros(t, e, dtype=weights.dtype, device=x.device).scatter(1, ids, weights)
            gate, up = F.linear(x, gate_up_proj.reshape(e * two_i, h)).view(t, e, two_i).chunk(2, dim=-1)
            y = torch.bmm((gelu_tanh(gate) * up).transpose(0, 1), down_proj.transpose(1, 2))
            return torch.bmm(route.float()[:, None, :], y.float().transpose(0, 1)).view(t, h).to(x.dtype)

        def replace(x, weights, ids, gate_up_proj, down_proj):
            return torch.ops.compiled_llm.geglu_moe(x, weights, ids, gate_up_proj, down_proj)

        def search_ep(x, weights, ids, gate_up_proj, down_proj, first):
            t, (e, two_i, h) = x.shape[0], gate_up_proj.shape
            route = torch.zeros(t, first + e, dtype=weights.dtype, device=x.device).scatter(1, ids, weights)
            route = route[:, first:first + e]
            gate, up = F.linear(x, gate_up_proj.reshape(e * two_i, h)).view(t, e, two_i).chunk(2, dim=-1)
            y = torch.bmm((gelu_tanh(gate) * up).transpose(0, 1), down_proj.transpose(1, 2))
            return torch.bmm(route.float()[:, None, :], y.float().transpose(0, 1)).view(t, h).to(x.dtype)

        def replace_ep(x, weights, ids, gate_up_proj, down_proj, first):
            return torch.ops.compiled_llm.geglu_moe(x, weights, ids - first, gate_up_proj, down_proj)

        for dt in self.dtypes:
            inputs = [empty(8, 32, dtype=dt), empty(8, 2, dtype=torch.float32), empty(8, 2, dtype=torch.long),
                      empty(6, 20, 32, dtype=dt), empty(6, 32, 10, dtype=dt)]
            self.add(search_ep, replace_ep, inputs, {"first": FIRST})  # contains the plain pattern: first
            self.add(search, replace, inputs, stage=1)
