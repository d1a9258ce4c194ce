"""Gemma 4 tool calls: <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>

The arguments are Gemma's own object notation: bare keys, strings between <|"|> delimiters (so they need no
escaping), numbers, true/false/null, nested {...} and [...]. The markers and the delimiter are special tokens
of the Gemma 4 vocabulary, so the output is detokenized with special tokens kept while tools are on."""

from __future__ import annotations

import re

from compiled_llm.server.tool_parsers.base import ParsedCall, ToolParser

QUOTE = '<|"|>'
_CALL = re.compile(r"\s*call:([\w.\-]+)\s*(\{.*\})\s*$", re.S)
_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][+-]?\d+)?")
_KEY = re.compile(r"[^\s:{}\[\],]+")


class _Reader:
    """Recursive descent over Gemma's object notation; ValueError on anything malformed."""

    def __init__(self, text: str):
        self.s, self.i = text, 0

    def _ws(self) -> None:
        while self.i < len(self.s) and self.s[self.i].isspace():
            self.i += 1

    def _eat(self, token: str) -> bool:
        self._ws()
        if self.s.startswith(token, self.i):
            self.i += len(token)
            return True
        return False

    def value(self):
        self._ws()
        if self._eat(QUOTE):
            j = self.s.find(QUOTE, self.i)
            if j < 0:
                raise ValueError("unterminated string")
            text, self.i = self.s[self.i:j], j + len(QUOTE)
            return text
        if self._eat("{"):
            return self._object()
        if self._eat("["):
            return self._array()
        for word, val in (("true", True), ("false", False), ("null", None)):
            if self._eat(word):
                return val
        m = _NUMBER.match(self.s, self.i)
        if m is None:
            raise ValueError(f"unexpected text at {self.i}")
        self.i = m.end()
        return float(m.group()) if (m.group(1) or m.group(2)) else int(m.group())

    def _object(self) -> dict:
        out = {}
        if self._eat("}"):
            return out
        while True:
            self._ws()
            if self._eat(QUOTE):  # a quoted key
                j = self.s.find(QUOTE, self.i)
                if j < 0:
                    raise ValueError("unterminated key")
                key, self.i = self.s[self.i:j], j + len(QUOTE)
            else:
                m = _KEY.match(self.s, self.i)
                if m is None:
                    raise ValueError(f"expected a key at {self.i}")
                key, self.i = m.group(), m.end()
            if not self._eat(":"):
                raise ValueError(f"expected ':' at {self.i}")
            out[key] = self.value()
            if self._eat("}"):
                return out
            if not self._eat(","):
                raise ValueError(f"expected ',' or '}}' at {self.i}")

    def _array(self) -> list:
        out = []
        if self._eat("]"):
            return out
        while True:
            out.append(self.value())
            if self._eat("]"):
                return out
            if not self._eat(","):
                raise ValueError(f"expected ',' or ']' at {self.i}")


def parse_gemma_value(text: str):
    """Gemma object notation -> Python (ValueError when malformed or followed by more text)."""
    r = _Reader(text)
    value = r.value()
    r._ws()
    if r.i != len(text):
        raise ValueError(f"trailing text at {r.i}")
    return value


class Gemma4ToolParser(ToolParser):
    name = "gemma4"
    start = "<|tool_call>"
    end = "<tool_call|>"
    keep_special_tokens = True
    stop = ("<|tool_response>",)  # after its calls the model would go on to write the response itself

    def parse_call(self, body: str, tools: list[dict]) -> ParsedCall | None:
        m = _CALL.match(body)
        if m is None:
            return None
        try:
            args = parse_gemma_value(m.group(2))
        except ValueError:
            return None
        return ParsedCall(m.group(1), args) if isinstance(args, dict) else None

    def forced_prefix(self, function: str | None) -> str:
        return "<|tool_call>call:" + (f"{function}{{" if function else "")
