"""The final logits' soft cap (Gemma: cap * tanh(logits / cap)), returned in float32 for the sampler.

The models apply it after the LM head, outside the compiled graph (compute_logits runs on the rows that
sample). Eagerly on a GPU that was four launches a decode step (divide, tanh, multiply, the float copy: ~22 us
of Gemma 4 26B-A4B's 7.2 ms step on the H200); the Triton provider is one pass that rounds each intermediate to
the logits' dtype as those launches do, so its result is theirs.
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
