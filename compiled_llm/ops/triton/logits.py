"""The final logits' soft cap in one pass (ops/logits.py): float32(cap * tanh(logits / cap)) with each
intermediate rounded to the logits' dtype, as eager PyTorch's three launches round them (the division is a
multiplication by the float32 reciprocal there too), so the sampler sees the same values."""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from compiled_llm.ops.jit import MONITOR, JitKernel, register_kernel
from compiled_llm.ops.triton._common import _INTERPRETED, _tanh

BLOCK = 2048


@triton.jit(do_not_specialize=["n"])
def _softcap_kernel(X, Y, n, inv, cap, BLOCK: tl.constexpr, INTERP: tl.constexpr = False):
    # INTERP: the Triton interpreter (tests on the CPU) has no libdevice; tanh from exp there
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0)
    low = X.dtype.element_ty
    y = (x.to(tl.float32) * inv).to(low).to(tl.float32)
    if INTERP:
        t = _tanh(y)
    else:
        t = libdevice.tanh(y)
    t = t.to(low).to(tl.float32)
    tl.store(Y + offs, (t * cap).to(low).to(tl.float32), mask=mask)


def logits_softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    x = logits.contiguous()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    n = x.numel()
    MONITOR.note("logits_softcap", (x.dtype,))
    if n:
        inv = float(np.float32(1.0) / np.float32(cap))  # PyTorch divides by a scalar as this multiplication
        _softcap_kernel[(triton.cdiv(n, BLOCK),)](x, y, n, inv, float(cap), BLOCK=BLOCK, INTERP=_INTERPRETED,
                                                 num_warps=8)
    return y


def _keys(facts: dict) -> list:
    return [(facts["dtype"],)] if facts.get("final_logit_softcapping") and "dtype" in facts else []


def _compile(key, device) -> None:
    logits_softcap(torch.zeros(2, 64, dtype=key[0], device=device), 30.0)


register_kernel(JitKernel("logits_softcap", "logits_softcap", "triton", _keys, _compile))
