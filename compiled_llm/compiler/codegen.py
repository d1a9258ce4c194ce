"""Our heuristics for Inductor's GPU code generation, installed around each piece's compile
(`torch._inductor.choices.InductorChoices`, the hook Inductor documents for this).

Persistent reductions for rows up to `COMPILED_LLM_PERSISTENT_ROWS` elements (default 8192). Inductor keeps a
row in registers (a "persistent" reduction, one pass over memory) only up to 1,024 elements; a wider row gets a
looped kernel that walks the row once per reduction. A decoder layer's norms are such rows: Gemma 4's
26B-A4B reduces rows of 2,816, and Inductor fuses its sandwich norms (post-FFN norms of the MLP and the
experts, their sum, the post-feedforward norm, the residual add and the next layer's input norm) into one
kernel of four dependent reductions. Looped, that kernel walked the row five times and took 7.0-7.5 us at
decode sizes on the H200 (session 12's profile); persistent, each input is read once.

Programmatic dependent launch (PDL) for Inductor's own kernels on CUDA sm_90+ (`triton.enable_pdl`; Inductor
puts `griddepcontrol.wait` before a kernel's first read of what the previous kernel wrote, and lets the next launch
after its last load). Our Triton kernels and cuBLAS's neither wait early nor release early, so Inductor's kernels
behind them gain only the launch itself. H100, Gemma 4 26B-A4B, alternating two rounds (benchmarks/NOTES.md, session
62): batch 1 +0.8%, 1024x8x256 +0.2%, 8192x4x512 +0.0%. (Session 13, on the same torch 2.11, measured -2.6% at batch
1, when about 12 of a layer's 17 kernels were Inductor's; now three are.) `COMPILED_LLM_INDUCTOR_PDL=0` turns it off.

The limit and PDL are part of the compile's cache key (the pass manager's uuid), so a change recompiles.
"""

from __future__ import annotations

import contextlib
import functools
import os

ENV = "COMPILED_LLM_PERSISTENT_ROWS"
PDL_ENV = "COMPILED_LLM_INDUCTOR_PDL"  # 0: Inductor's kernels launched without programmatic dependent launch
DEFAULT_PERSISTENT_ROWS = 8192
INDUCTOR_PERSISTENT_ROWS = 1024  # Inductor's own limit for a row reduction (ReductionHint.INNER)


def persistent_rows() -> int:
    """The widest row kept in registers; at or below Inductor's own limit, Inductor's heuristic is unchanged."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return DEFAULT_PERSISTENT_ROWS
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{ENV} must be a whole number of elements (0: Inductor's own limit), not {text!r}") from None
    return max(value, 0)


def inductor_pdl(device_type: str) -> bool:
    """Inductor's kernels launched with PDL: a CUDA compile on sm_90+ (the GPU this process compiles for), unless
    PDL_ENV is 0."""
    if device_type != "cuda" or os.environ.get(PDL_ENV, "1") == "0":
        return False
    import torch

    try:
        return torch.cuda.get_device_capability()[0] >= 9
    except (AssertionError, RuntimeError):  # no GPU here (a CUDA graph's audit on the CPU)
        return False


def cache_key(device_type: str = "cpu") -> str:
    pdl = ",inductor_pdl" if inductor_pdl(device_type) else ""
    return f"persistent_rows={max(persistent_rows(), INDUCTOR_PERSISTENT_ROWS)}{pdl}"


@functools.cache
def _choices_class():
    from torch._inductor import config as inductor_config
    from torch._inductor.choices import InductorChoices
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.virtualized import V

    class Choices(InductorChoices):
        def __init__(self, rows: int):
            super().__init__()
            self.rows = rows

        def should_use_persistent_reduction(self, features, cooperative_reduction: bool) -> bool:
            if InductorChoices.should_use_persistent_reduction(features, cooperative_reduction):
                return True
            if (cooperative_reduction or not inductor_config.triton.persistent_reductions
                    or features.get_reduction_hint() != ReductionHint.INNER):
                return False
            # torch >= 2.14: a strict-sum reduction keeps its own block size (Inductor's check, repeated)
            strict = getattr(features, "strict_sum_rblock", None)
            rblock = strict() if strict is not None else None
            if rblock is not None and not features.has_strict_sum_multirow_reduction():
                if not V.graph.sizevars.statically_known_geq(rblock, features.reduction_numel):
                    return False
            return V.graph.sizevars.statically_known_leq(features.reduction_numel, self.rows)

    return Choices


def choices(rows: int | None = None):
    """Our InductorChoices with the given persistent-row limit (default: the environment's)."""
    return _choices_class()(persistent_rows() if rows is None else rows)


def _no_repro_script(*args, **kwargs) -> None:
    return None


@contextlib.contextmanager
def without_repro_script():
    """Inductor in torch 2.11-2.13 writes a repro script of every graph it compiles (the graph's code, the
    process's absolute cache folders, a tensor's address) into the compiled graph, which its FX cache and our
    compile cache's saved forward (compiler/aot.py) then keep: the cache held its build folder's path. Torch 2.14
    writes it only for a structured trace (TORCH_TRACE); so do we, on every version."""
    from torch._dynamo.repro import after_aot
    from torch._logging._internal import trace_log

    write = after_aot.save_graph_repro
    if trace_log.handlers or write is _no_repro_script:  # a structured trace logs it; or swapped already
        yield
        return
    after_aot.save_graph_repro = _no_repro_script  # compile_fx looks it up at each compile
    try:
        yield
    finally:
        after_aot.save_graph_repro = write


@contextlib.contextmanager
def heuristics():
    """Our choices for the compiles inside (Inductor reads them per thread, at code generation)."""
    rows = persistent_rows()
    if rows <= INDUCTOR_PERSISTENT_ROWS:
        yield
        return
    from torch._inductor.virtualized import V

    with V.set_choices_handler(choices(rows)):
        yield
