"""JIT warm-up registry and monitor.

Every JIT-compiled kernel registers a `JitKernel`: the compile keys it will need for a model (from the
model's shape facts) and how to compile one key (a launch on dummy inputs). Start-up warm-up
(compiler/warmup.py) compiles them all; launchers call `MONITOR.note(kernel, key)` on every launch,
and Dynamo/Inductor compiles are reported through `MONITOR.compile_event`. Once warm-up is over, a
key or compile that was not seen is reported: logged (`warn`) or raised (`error`), so tests catch
keys missing from the registry.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Hashable

import torch

log = logging.getLogger("compiled_llm")


class JitCompileAfterWarmup(RuntimeError):
    pass


@dataclass
class JitKernel:
    name: str
    op: str  # the op whose provider launches it
    provider: str  # the provider it belongs to ("triton", "flashinfer")
    keys: Callable[[dict], list[Hashable]]  # model facts -> the compile keys it will need
    compile: Callable[[Hashable, torch.device], None]  # compiles one key (launches on dummy inputs)


REGISTRY: dict[str, JitKernel] = {}


@contextlib.contextmanager
def serial_ast_parse():
    """Within: `ast.parse` runs one call at a time, for Triton builds on several threads (start-up's parallel
    build, the sm_90 kernel check). Triton parses a kernel's source with it for every build, and CPython 3.11.7
    keeps the recursion count it checks while building the tree's objects in per-interpreter state, so two threads
    parsing at once can raise "SystemError: AST constructor recursion depth mismatch" (seen once in a clean-clone
    `make test` of the kernel check, session 35). The code generation and LLVM after the parse stay parallel."""
    import ast

    real, lock = ast.parse, threading.Lock()

    def parse(*args, **kwargs):
        with lock:
            return real(*args, **kwargs)

    ast.parse = parse
    try:
        yield
    finally:
        ast.parse = real


def register_kernel(kernel: JitKernel) -> JitKernel:
    REGISTRY[kernel.name] = kernel
    return kernel


class JitMonitor:
    """Process-wide record; the policy (off | warn | error) is the one of the compiled model running now
    (`watch`), so an eager engine in the same process is never policed. Compiles while some model warms
    up are expected."""

    def __init__(self):
        self.mode = "off"
        self.seen: set[tuple[str, Hashable]] = set()
        self.compiles: Counter = Counter()  # kind -> compiles seen (whole process)
        self.late: list[str] = []  # compiles after warm-up
        self._warming = 0
        self._warmed = False
        self._lock = threading.Lock()
        self._hooked = False
        # Triton's compile listener (triton >= 3.4): what its on-disk cache answered, by kernel name. A
        # warm start from the compile cache should build nothing; "built" lists what it built instead
        self.triton_builds: Counter = Counter()
        self.triton_cache_hits: Counter = Counter()
        self.triton_build_seconds = 0.0

    def begin_warmup(self, mode: str) -> None:
        if mode not in ("off", "warn", "error"):
            raise ValueError(f"jit monitor mode must be off, warn or error, not {mode!r}")
        with self._lock:
            self._warming += 1
        self.install_triton_hook()

    @contextlib.contextmanager
    def watch(self, mode: str):
        """Compiles inside are judged by `mode` (the running compiled model's --jit-monitor)."""
        prev, self.mode = self.mode, mode
        try:
            yield
        finally:
            self.mode = prev

    def end_warmup(self) -> None:
        with self._lock:
            self._warming -= 1
            self._warmed = True

    @property
    def active(self) -> bool:
        return self._warmed and not self._warming and self.mode != "off"

    def note(self, kernel: str, key: Hashable) -> None:
        """Called by launchers on every launch; a set lookup unless the key is new."""
        item = (kernel, key)
        if item in self.seen:
            return
        self.seen.add(item)
        self.compile_event(kernel, repr(key))

    def compile_event(self, kind: str, what: str) -> None:
        self.compiles[kind] += 1
        if self.active:
            msg = f"JIT compile after warm-up: {kind} {what} (its key is missing from the warm-up registry)"
            self.late.append(msg)
            if self.mode == "error":
                raise JitCompileAfterWarmup(msg)
            log.warning(msg)

    def install_triton_hook(self) -> None:
        """Every Triton compile (ours and Inductor's) is an event, through triton's post-compile hook."""
        if self._hooked:
            return
        self._hooked = True
        try:
            from triton import knobs
        except ImportError:
            return
        if not hasattr(knobs, "runtime") or not hasattr(knobs.runtime, "jit_post_compile_hook"):
            return
        previous = knobs.runtime.jit_post_compile_hook

        def hook(*args, **kwargs):
            name = getattr(kwargs.get("fn"), "name", "kernel")  # with its specialisation (argument types,
            # alignments, constexprs): what differs from the warm-up's build
            self.compile_event("triton", f"{name} {str(kwargs.get('key', ''))[:600]}".rstrip())
            return previous(*args, **kwargs) if previous else False

        knobs.runtime.jit_post_compile_hook = hook
        compilation = getattr(knobs, "compilation", None)
        if compilation is not None and hasattr(compilation, "listener"):
            before = compilation.listener

            def listener(*, src, metadata, metadata_group, times, cache_hit):
                name = getattr(src, "name", "kernel")
                with self._lock:  # (builds run in threads when the compiler builds kernels in parallel)
                    if cache_hit:
                        self.triton_cache_hits[name] += 1
                    else:
                        self.triton_builds[name] += 1
                        self.triton_build_seconds += getattr(times, "total", 0) / 1e6  # microseconds
                if before is not None:
                    before(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)

            compilation.listener = listener


MONITOR = JitMonitor()
