"""Layer modules that more than one model builds from, one kind per file (nano-vllm's `layers/`).

- `norm.py`: `RMSNorm` (plain, zero-centred with a weight offset, or without a scale);
- `mlp.py`: `GatedMLP`, act(gate) * up then down (GEGLU for Gemma 4, SwiGLU for Qwen3.5);
- `experts.py`: `GatedExperts`, routed experts with packed [gate; up] weights, eager through the routed op,
  compiled as the dense sum the MoE fusion passes search for.

Each layer computes with the functions the fusion passes trace (`ops/norm.py` `ref_rms_norm`,
`ops/moe.py` `dense_gated_moe`, the activation it is given), so a model that builds from them traces the
graphs the passes match. Column/row/head-parallel linears, embeddings and `ExpertWeights` (how weights are
split across ranks and loaded) are in `models/parallel_layers.py`; what only one model has stays in its file.
"""

from compiled_llm.models.layers.experts import GatedExperts
from compiled_llm.models.layers.mlp import GatedMLP
from compiled_llm.models.layers.norm import RMSNorm

__all__ = ["GatedExperts", "GatedMLP", "RMSNorm"]
