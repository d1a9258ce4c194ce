"""The LM-head tail: the final logits' soft cap (Gemma: cap * tanh(logits / cap)), returned in float32 for the
sampler, and the greedy rows' argmax.

The models apply it after the LM head, outside the compiled graph (compute_logits runs on the rows that
sample). Eagerly on a GPU that was four launches a decode step (divide, tanh, multiply, the float copy: ~22 us
of Gemma 4 26B-A4B's 7.2 ms step on the H200); the Triton provider is one pass that rounds each intermediate to
the logits' dtype as those launches do, so its result is theirs.

torch.argmax over a decode batch's float32 logits (8 x 262,144) was a memset and a 9.3 us reduction on the H200,
at 0.9 TB/s; the Triton provider reads the rows in chunks with many programs and merges them in a second launch
(ops/triton/logits.py), with torch's answer: the first index of the maximum, a NaN larger than any number. On
the CPU a C++ kernel does the same (ops/cpu_logits.py).
"""

from __future__ import annotations

import torch

from compiled_llm.ops.registry import Capabilities, OpSpec, Provider, register


def ref_logits_softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    return (torch.tanh(logits / cap) * cap).float()


def _triton(caps: Capabilities, shape: dict) -> str | None:
    return caps.triton_ok()


LOGITS_SOFTCAP = register(OpSpec("logits_softcap", "float32(cap * tanh(logits / cap)), intermediates in the logits' dtype", [
    Provider("triton", "compiled_llm.ops.triton.logits:logits_softcap", _triton),
    Provider("reference", "compiled_llm.ops.logits:ref_logits_softcap"),
]))


def logits_softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """Soft-capped float32 logits (eager: the models call it outside the compiled graph)."""
    return LOGITS_SOFTCAP.impl()(logits, cap)


def ref_argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def _cpu_argmax(caps: Capabilities, shape: dict) -> str | None:
    from compiled_llm.ops.cpu_logits import unsupported

    return unsupported(caps, shape)


ARGMAX_ROWS = register(OpSpec("argmax_rows", "each row's first index of its maximum (NaN the largest), int64", [
    Provider("triton", "compiled_llm.ops.triton.logits:argmax_rows", _triton),
    Provider("cpu", "compiled_llm.ops.cpu_logits:argmax_rows", _cpu_argmax),
    Provider("reference", "compiled_llm.ops.logits:ref_argmax_rows"),
]))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B] int64, as torch.argmax(logits, -1) (the sampler's greedy rows)."""
    return ARGMAX_ROWS.impl()(logits)
