"""Runs our fusion passes over small functions: the matches they replace, and the compiled result.

`fuse(fn, args)` compiles with Inductor on the CPU (C++), so the result can be compared with eager;
`inspect(fn, args, device="cuda")` stops after our passes (compiler/audit.py's inspect compile) and needs
no kernel, so it also runs on fake CUDA tensors: the graph a GPU would compile, on a machine without one.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode

from compiled_llm.compiler.audit import inspect_compile
from compiled_llm.passes.manager import PassManager


def _matches(before: Counter) -> Counter:
    delta = counters["inductor"] - before
    return Counter({k.removeprefix("compiled_llm."): v for k, v in delta.items()
                    if k.startswith("compiled_llm.") and "@" not in k})


def _compile(fn, args, passes, dtype, device, dynamic, compile_fn):
    """dynamic: the token count (dim 0 of the inputs that have the first input's) is symbolic, as in the
    engine's dynamic compile; the other dims stay static."""
    torch._dynamo.reset()
    pm = PassManager(passes, dtype, device)
    before = counters["inductor"].copy()
    if dynamic:
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] == args[0].shape[0]:
                torch._dynamo.mark_dynamic(a, 0)
    compiled = torch.compile(fn, fullgraph=True, dynamic=False,
                             backend=lambda gm, ex: compile_fn(gm, ex, config_patches=pm.inductor_config()))
    with torch.inference_mode():
        out = compiled(*args)
    return _matches(before), out


def fuse(fn, args, passes: tuple[str, ...], dynamic: bool = True):
    """(matches, compiled output) on the CPU with Inductor's C++ backend."""
    from torch._inductor.compile_fx import compile_fx

    dtype = next(a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point())
    return _compile(fn, args, passes, dtype, "cpu", dynamic, compile_fx)


def inspect(fn, make_args, passes: tuple[str, ...], dtype=torch.float32, device: str = "cuda",
            dynamic: bool = True) -> Counter:
    """Matches only; make_args() builds the inputs, under a fake-tensor mode on `device`."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.device(device):
        args = make_args()
    with mode:
        return _compile(fn, args, passes, dtype, device, dynamic, inspect_compile(8))[0]
