"""The compiler checks its own work. After compiling, the fusions each layer got (the passes count their
matches per layer, passes/base.py) are compared with those the model declares (`model.expected_fusions()`),
for the dynamic-token-count compile and for every static batch size. A missed fusion is silent otherwise:
the graph still runs, only slower, and a compiled MoE layer whose MoE fusion (GEGLU or SwiGLU) missed runs every
expert on every token (E/k times the FLOPs, an [E, tokens, hidden] intermediate: out of memory at the
released shapes). That case is always an error for models with more than a handful of experts; any other
difference is a warning naming the layer and the pass, or an error with fusion_check="error" (tests).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

log = logging.getLogger("compiled_llm")

DENSE_MOE_MAX_EXPERTS = 8  # above this many experts a compiled MoE layer must take the routed op
MOE_PASSES = ("geglu_moe", "swiglu_moe")  # the passes that turn the dense expert sum into a routed op
MODES = ("warn", "error")


class FusionCheckError(RuntimeError):
    pass


@dataclass(frozen=True)
class Mismatch:
    shape: str  # "dynamic" or a static batch size
    layer: int | None
    name: str  # the pass
    want: int
    got: int

    def __str__(self) -> str:
        where = "outside any layer" if self.layer is None else f"layer {self.layer}"
        what = ("the unfused computation runs instead" if self.got < self.want
                else "more than the model declares: a look-alike computation may have been rewritten")
        return f"{where}: {self.name} matched {self.got} of {self.want} in the {self.shape} compile ({what})"


def per_layer(matches: Counter) -> dict[int | None, Counter]:
    """{'geglu_moe@3': 1, ...} -> {3: {'geglu_moe': 1}}; '@-' (a match outside any layer) is None."""
    out: dict[int | None, Counter] = {}
    for key, n in matches.items():
        name, sep, layer = key.partition("@")
        if sep:
            out.setdefault(None if layer == "-" else int(layer), Counter())[name] += n
    return out


def compare(expected: dict[int, dict[str, int]], matches: dict[str, Counter], enabled: set[str]) -> list[Mismatch]:
    """Every (compile, layer, pass) whose match count differs from the declaration; passes not enabled
    are not judged."""
    out = []
    for shape, counter in matches.items():
        got = per_layer(counter)
        for layer in sorted(set(expected) | set(got), key=lambda x: -1 if x is None else x):
            for name in sorted(enabled):
                want, have = expected.get(layer, {}).get(name, 0), got.get(layer, Counter())[name]
                if want != have:
                    out.append(Mismatch(shape, layer, name, want, have))
    return out


def judged(enabled: set[str], num_experts: int) -> set[str]:
    """The passes whose counts are checked: the enabled fusions (not the kernel choices, `fusion_check = False`:
    skinny_mm), and the MoE passes for models with many experts even when they were switched off (their dense
    fallback must not run)."""
    from compiled_llm.passes.manager import all_passes

    passes = all_passes()
    fusions = {n for n in enabled if getattr(passes.get(n), "fusion_check", True)}
    return fusions | (set(MOE_PASSES) if num_experts > DENSE_MOE_MAX_EXPERTS else set())


def verify(expected: dict[int, dict[str, int]], matches: dict[str, Counter], enabled: set[str], mode: str,
           num_experts: int = 0) -> list[Mismatch]:
    """Raises FusionCheckError for a dense MoE fallback (always) or any mismatch (mode 'error'); logs a
    warning per mismatch otherwise. Returns the mismatches."""
    if mode not in MODES:
        raise ValueError(f"fusion check must be one of {', '.join(MODES)}, not {mode!r}")
    problems = compare(expected, matches, judged(enabled, num_experts))
    fatal = [m for m in problems if m.name in MOE_PASSES and m.got < m.want and num_experts > DENSE_MOE_MAX_EXPERTS]
    if fatal:
        raise FusionCheckError(
            f"the MoE fusion ({', '.join(sorted({m.name for m in fatal}))}) missed, so compiled MoE layers would run all {num_experts} experts on every "
            "token; refusing to serve that (run with --enforce-eager to serve anyway, and report it):\n  "
            + "\n  ".join(map(str, fatal)))
    if problems and mode == "error":
        raise FusionCheckError("compiled fusions differ from the model's declaration:\n  "
                               + "\n  ".join(map(str, problems)))
    for m in problems:
        log.warning("fusion check: %s", m)
    return problems
