"""Dynamo's compiled forward, called without Dynamo's frame evaluation.

After Dynamo has compiled the model's forward, each call still goes through `torch.compile`'s wrapper, the
module's `_call_impl` and Dynamo's frame callback before the compiled code runs: ~0.1 ms a call on the 2-core
CPU (benchmarks/NOTES.md, 2026-12-05 session 43), 3% of a CPU decode step of the host-overhead model. Here the
compiled code Dynamo made for our backend (its cache entry's bytecode) is called as an ordinary function, after
the same guards Dynamo would check (the entry's guard manager on the call's arguments). A call that no entry's
guards admit goes back through Dynamo, which compiles again as it would have; the entries are read again after
each compile. As vLLM did with its own dispatcher to Dynamo's compiled code.
"""

from __future__ import annotations

import types
import weakref
from typing import Any

import torch

MISS = object()  # no compiled code admits the call: Dynamo's turn


def _made_by(entry, backend) -> bool:
    return getattr(entry.backend, "compiler_fn", entry.backend) is backend


def _has_hooks(module: torch.nn.Module) -> bool:
    """Module hooks would run in `_call_impl`, which this path skips (Dynamo's code is the forward's alone)."""
    from torch.nn.modules import module as m

    globals_ = (m._global_forward_hooks, m._global_forward_pre_hooks, m._global_backward_hooks,
                m._global_backward_pre_hooks)
    own = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks)
    return any(globals_) or any(own)


class DirectForward:
    """The compiled forward of `module` for `backend` (our torch.compile backend), called directly."""

    def __init__(self, module: torch.nn.Module, backend):
        self.module, self.backend = module, backend
        self.fn = type(module).forward
        code = self.fn.__code__
        self.names = code.co_varnames[:code.co_argcount]  # (self, input_ids, positions, ...)
        self.defaults = self.fn.__defaults__ or ()
        self.required = len(self.names) - len(self.defaults)  # (self included)
        # (guards, the compiled code weakly: Dynamo frees it with its cache entry, and a global of the module it
        # installed goes with it, which a strong reference here would keep until interpreter shutdown)
        self.entries: list[tuple[Any, weakref.ref]] = []
        self.read_at = -1  # the backend's graph count when the entries were read
        self.calls = 0  # calls that ran compiled code directly (a test's check that this path is taken)

    def _read(self) -> None:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        self.entries = [(e.guard_manager, weakref.ref(e.code))
                        for e in _debug_get_cache_entry_list(self.fn.__code__) if _made_by(e, self.backend)]
        self.read_at = self.backend.graph_count

    def __call__(self, args: tuple) -> Any:
        """The forward's output, or MISS (nothing compiled yet, guards that fail, hooks on the module)."""
        if self.backend.graph_count != self.read_at:
            self._read()
        if not self.entries or _has_hooks(self.module):
            return MISS
        given = len(args) + 1
        if not self.required <= given <= len(self.names):
            return MISS
        local = dict(zip(self.names, (self.module, *args)))
        for i in range(given, len(self.names)):
            local[self.names[i]] = self.defaults[i - self.required]
        fn = self.fn
        for guards, code in self.entries:
            code = code()
            if code is None:  # Dynamo dropped it (a reset): read the entries again next time
                self.read_at = -1
                return MISS
            if guards.check(local):
                self.calls += 1
                return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)(
                    self.module, *args)
        return MISS
