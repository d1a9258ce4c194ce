"""Generated text -> content and tool calls, as it streams. The non-streamed answer is the same extractor fed
the whole text at once, so a streamed answer always adds up to the non-streamed one.

Outside a call, text is content, except a tail that could still grow into the start marker (held back until
it cannot); inside, text is buffered until the end marker, and then the whole call goes out as one event.
Whitespace around calls and at either end of the content is dropped (the templates put newlines there).
A call that does not parse is given back as content, marker and all: never dropped, never invented."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from compiled_llm.server.tool_parsers.base import ToolParser


@dataclass
class ContentEvent:
    text: str


@dataclass
class CallEvent:
    index: int
    id: str
    name: str
    arguments: str  # JSON text, as the API carries it


def partial_marker(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ToolCallStream:
    def __init__(self, parser: ToolParser, tools: list[dict], prefix: str = ""):
        self.parser, self.tools = parser, tools
        self.buf = prefix  # a forced prefix is prompt text: it opens a call but is never content
        self.in_call = False
        self.calls: list[CallEvent] = []
        self._pending_ws = ""
        self._held_ws = ""
        self._at_start = True

    def feed(self, text: str) -> list[ContentEvent | CallEvent]:
        self.buf += text
        return self._drain(final=False)

    def finish(self) -> list[ContentEvent | CallEvent]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list:
        p, out = self.parser, []
        while True:
            if not self.in_call:
                i = self.buf.find(p.start)
                if i >= 0:
                    out += self._content(self.buf[:i])
                    self._held_ws, self._pending_ws = self._pending_ws, ""  # dropped unless the call fails
                    self.buf, self.in_call = self.buf[i + len(p.start):], True
                    continue
                keep = 0 if final else partial_marker(self.buf, p.start)
                out += self._content(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                return out
            j = self.buf.find(p.end)
            if j >= 0:
                body, self.buf, self.in_call = self.buf[:j], self.buf[j + len(p.end):], False
                out += self._call(body, p.start + body + p.end)
                continue
            if final:  # the output ended inside a call (max_tokens, or a model that ends calls with EOS)
                body, self.buf, self.in_call = self.buf, "", False
                out += self._call(body, p.start + body)
            return out

    def _call(self, body: str, raw: str) -> list:
        parsed = self.parser.parse_call(body, self.tools)
        if parsed is None:
            self._at_start, self._pending_ws = False, self._held_ws
            return self._content(raw)
        event = CallEvent(len(self.calls), f"call_{uuid.uuid4().hex[:24]}", parsed.name, parsed.arguments_json())
        self.calls.append(event)
        self._at_start, self._pending_ws = True, ""
        return [event]

    def _content(self, text: str) -> list:
        if self._at_start:
            text = text.lstrip()
            if not text:
                return []
            self._at_start = False
        body = text.rstrip()
        if not body:
            self._pending_ws += text
            return []
        out, self._pending_ws = self._pending_ws + body, text[len(body):]
        return [ContentEvent(out)]
