"""SwiGLU MoE (Qwen3.5): the model's traceable expert sum (ops/moe.py `dense_gated_moe` with a SiLU gate, every
expert on every token, weighted by a dense routing matrix that is zero off the top-k) -> the routed
swiglu_moe op. The GEGLU MoE pass with another activation and op; Qwen's router hands the experts weights
in the model's dtype (transformers casts them), so the patterns are traced with those. The shared expert
and its sigmoid gate stay plain PyTorch around it (three matmuls Inductor schedules, one elementwise
epilogue), and so does the expert-parallel slice (the pass's second pattern, as for GEGLU)."""

from __future__ import annotations

import torch.nn.functional as F

from compiled_llm.passes.geglu_moe import GegluMoEPass


class SwigluMoEPass(GegluMoEPass):
    name = "swiglu_moe"
    fusion = "SwiGLU MoE"
    op = "swiglu_moe"
    act = staticmethod(F.silu)
    model_dtype_weights = True
