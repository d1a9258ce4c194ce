"""Tool-call parsers, one file per format, found by the checkpoint's model_type (or --tool-call-parser)."""

from __future__ import annotations

from compiled_llm.server.tool_parsers.base import ParsedCall, ToolParser
from compiled_llm.server.tool_parsers.gemma4 import Gemma4ToolParser
from compiled_llm.server.tool_parsers.qwen import QwenToolParser
from compiled_llm.server.tool_parsers.stream import CallEvent, ContentEvent, ToolCallStream

PARSERS: dict[str, type[ToolParser]] = {"gemma4": Gemma4ToolParser, "qwen": QwenToolParser}

# config.json model_type (the text config's as well) -> parser name
MODEL_TYPES = {
    "gemma4": "gemma4", "gemma4_text": "gemma4",
    "qwen3_5": "qwen", "qwen3_5_text": "qwen", "qwen3_5_moe": "qwen", "qwen3_5_moe_text": "qwen",
    "qwen3": "qwen", "qwen3_moe": "qwen", "qwen3_next": "qwen", "qwen2": "qwen",
}


def parser_for(name: str | None, model_type: str | None, chat_template: str | None) -> ToolParser | None:
    """The parser named by --tool-call-parser, else the one of the model type; None when there is none."""
    key = name or MODEL_TYPES.get(model_type or "")
    if key is None:
        return None
    if key not in PARSERS:
        raise ValueError(f"unknown tool-call parser {key!r}; known: {', '.join(sorted(PARSERS))}")
    return PARSERS[key](chat_template)


__all__ = ["PARSERS", "MODEL_TYPES", "CallEvent", "ContentEvent", "ParsedCall", "ToolCallStream", "ToolParser",
           "parser_for"]
