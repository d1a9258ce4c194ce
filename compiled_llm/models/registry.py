"""Checkpoint `architectures` name -> model class, imported only when asked for."""

from __future__ import annotations

import importlib

# architecture -> (module, class)
_MODELS: dict[str, tuple[str, str]] = {
    "Gemma4ForCausalLM": ("compiled_llm.models.gemma4", "Gemma4ForCausalLM"),
    # Our text backbone plus transformers' vision/audio towers (models/gemma4_mm.py, docs/multimodal.md).
    "Gemma4ForConditionalGeneration": ("compiled_llm.models.gemma4_mm", "Gemma4ForConditionalGeneration"),
    "Qwen3_5ForCausalLM": ("compiled_llm.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("compiled_llm.models.qwen3_5", "Qwen3_5MoeForCausalLM"),
    # Our text backbone plus transformers' vision tower (models/qwen3_5_mm.py, docs/multimodal.md).
    "Qwen3_5ForConditionalGeneration": ("compiled_llm.models.qwen3_5_mm", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForConditionalGeneration": ("compiled_llm.models.qwen3_5_mm", "Qwen3_5MoeForConditionalGeneration"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(hf_config: dict) -> type:
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in _MODELS:
            module, name = _MODELS[arch]
            return getattr(importlib.import_module(module), name)
    raise ValueError(f"unsupported architecture {archs or '(none given)'}; supported: "
                     f"{', '.join(supported_architectures())}")


def register_model(architecture: str, module: str, class_name: str) -> None:
    _MODELS[architecture] = (module, class_name)
