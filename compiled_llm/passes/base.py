"""What every fusion pass shares: a PatternMatcherPass holding (pattern, replacement) pairs, traced from
plain functions the way the model writes the computation, and a count of the matches it replaced.

Patterns are traced with `fwd_only` under a fake mode (so traced ops never run), in each dtype family
the model may use (float32 graphs carry no casts, half-precision graphs do). Scalars the replacement
needs (eps, layer index, top-k) are traced with sentinel values and become pattern arguments through
`scalar_workaround`; other ints (shapes) and dtypes are wildcards.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
import torch._inductor.pattern_matcher as pm
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode

_REGISTER_PARAMS = inspect.signature(pm.register_replacement).parameters  # differs across torch versions

# sentinel scalars: values that occur nowhere else in a traced pattern
EPS = 1.2345e-5
LAYER = 9973
TOP_K = 3
ROOT = 0.0123456


def trace_fn(fn, args, **kwargs):
    """fwd_only, then what Inductor did to the real graph before our passes see it: the joint-graph
    canonicalisations (pointless permute pairs, views, converts) and views written as reshapes."""
    from torch._inductor.fx_passes import joint_graph
    from torch._inductor.fx_passes.post_grad import view_to_reshape

    gm = pm.fwd_only(fn, args, **kwargs)
    joint_graph.lazy_init()
    for patterns in [getattr(joint_graph, "early_patterns", None), *joint_graph.pass_patterns]:
        if patterns is None:
            continue
        patterns.apply(gm.graph)
    pm.stable_topological_sort(gm.graph)
    gm.graph.eliminate_dead_code()
    view_to_reshape(gm)
    gm.recompile()
    return gm


class FusionPass:
    name = ""  # short id, used in counters and the report
    fusion = ""  # human-readable name of the fusion

    def __init__(self, dtypes: tuple[torch.dtype, ...], device: str = "cpu"):
        self.dtypes = dtypes
        self.device = torch.device(device)
        # stages run in order: patterns that contain others (q, k and v) go before them (q alone)
        self.stages = [pm.PatternMatcherPass(pass_name=f"compiled_llm.{self.name}") for _ in range(2)]
        self.replaced = 0
        # example inputs on the model's device: some canonicalisations Inductor applies first are device-specific
        with torch._guards.tracing(None), FakeTensorMode(), torch.device(self.device):
            self.register()

    def register(self) -> None:
        raise NotImplementedError

    def add(self, search: Callable, replace: Callable, example_inputs: list, scalars: dict | None = None,
            stage: int = 0) -> None:
        scalars = scalars or {}
        argnames = [*inspect.signature(search).parameters]  # tensors first, the scalars last
        tensors = iter(example_inputs)
        args = [scalars[name] if name in scalars else next(tensors) for name in argnames]
        pattern = pm.fx_to_pattern(trace_fn(search, args), ignore_types=(int, float, list, torch.device, torch.dtype),
                                   argnames=argnames, scalar_workaround=scalars)
        extra = {"skip_duplicates": True} if "skip_duplicates" in _REGISTER_PARAMS else {}
        pm.register_replacement(search, replace, example_inputs, trace_fn, self.stages[stage],
                                scalar_workaround=scalars, search_fn_pattern=pattern, **extra)

    def __call__(self, graph: torch.fx.Graph) -> int:
        n = sum(stage.apply(graph) for stage in self.stages)
        if n:
            counters["inductor"][f"compiled_llm.{self.name}"] += n
            self.replaced += n
            pm.stable_topological_sort(graph)  # a multi-output replacement can land before its inputs
            graph.eliminate_dead_code()
        return n


def empty(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype)
