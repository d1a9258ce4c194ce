"""What a tool-call format is: the markers around one call, how to read the text between them, and the prompt
text that forces a call (tool_choice "required" or a named function, with no grammar backend to force it).

Every format here wraps each call in a start and an end marker, so one generic extractor (stream.py) finds the
calls in streamed text and each format only parses one call's body."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass
class ParsedCall:
    name: str
    arguments: dict[str, Any]

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


class ToolParser:
    name = "base"
    start = ""  # text opening one call
    end = ""  # text closing it
    # The markers are special tokens in the real vocabulary (Gemma 4): detokenize with them kept.
    keep_special_tokens = False
    stop: tuple[str, ...] = ()  # extra stop strings while tools are on (text that starts the tool's answer)

    def __init__(self, chat_template: str | None = None):
        self.chat_template = chat_template or ""

    def parse_call(self, body: str, tools: list[dict]) -> ParsedCall | None:
        """One call from the text between start and end; None when it is not a well-formed call."""
        raise NotImplementedError

    def forced_prefix(self, function: str | None) -> str:
        """Text appended after the generation prompt so that the model's answer is a call (to `function`, or to
        a function of its choosing when None): the opening marker and as much of the call as is fixed."""
        raise NotImplementedError


def tool_schema(tools: list[dict], name: str) -> dict:
    """The JSON schema of `name`'s parameters ({} when unknown)."""
    for t in tools:
        fn = t.get("function", {})
        if fn.get("name") == name:
            return fn.get("parameters") or {}
    return {}
