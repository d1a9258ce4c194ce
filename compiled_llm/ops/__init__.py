"""Ops: torch.library custom ops with fake implementations (so they trace), each declared as an OpSpec
whose provider (reference, Triton, FlashInfer) is resolved once per model. Importing this package
registers them all."""

from compiled_llm.ops import attention, collective, moe, norm, qk_norm_rope  # noqa: F401
from compiled_llm.ops import conv1d, delta_rule, swiglu_moe  # noqa: F401  (Qwen3.5: recurrent-state ops, SwiGLU MoE)
from compiled_llm.ops import sparse  # noqa: F401  (sparse_attention: StreamingLLM, OmniKV)
from compiled_llm.ops import moe_overlap  # noqa: F401  (the routed-expert branch on a side stream)
from compiled_llm.ops import logits  # noqa: F401  (the LM-head tail: soft cap, greedy argmax)
from compiled_llm.ops import linear  # noqa: F401  (skinny_mm: a decode step's narrow projections in one launch)
from compiled_llm.ops.registry import OPS, Capabilities, select_providers  # noqa: F401
