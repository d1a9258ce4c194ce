"""compiled_llm: an LLM inference and serving engine whose speed comes from torch.compile."""

from compiled_llm.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutputKind", "LLMEngine", "EngineConfig"]


def __getattr__(name):  # heavy modules load on first use
    if name == "LLM":
        from compiled_llm.runtime.llm import LLM
        return LLM
    if name == "LLMEngine":
        from compiled_llm.runtime.engine import LLMEngine
        return LLMEngine
    if name == "EngineConfig":
        from compiled_llm.config import EngineConfig
        return EngineConfig
    raise AttributeError(name)
