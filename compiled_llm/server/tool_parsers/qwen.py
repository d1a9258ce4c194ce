"""Qwen tool calls, in either of the two formats Qwen chat templates ask for:

- XML (Qwen3.5, Qwen3-Coder; vLLM's `qwen3_coder` parser):
  <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>
  Parameter values are text; they are typed by the tool's JSON schema (a number stays a number).
- JSON (Qwen2.5 / Qwen3; "hermes"): <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>

Which one a checkpoint speaks is read from its chat template: XML templates show `<function=`."""

from __future__ import annotations

import json
import re

from compiled_llm.server.tool_parsers.base import ParsedCall, ToolParser, tool_schema

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


def _typed(value: str, schema: dict):
    """An XML parameter's text as the type its schema declares (text when it does not parse as that type)."""
    kind = schema.get("type")
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return value
    if value == "null":
        return None
    if kind in ("integer", "number", "boolean", "object", "array") or kind is None:
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


class QwenToolParser(ToolParser):
    name = "qwen"
    start = "<tool_call>"
    end = "</tool_call>"

    @property
    def xml(self) -> bool:
        return "<function=" in self.chat_template or "<parameter=" in self.chat_template

    def parse_call(self, body: str, tools: list[dict]) -> ParsedCall | None:
        return self._parse_xml(body, tools) if "<function=" in body else self._parse_json(body)

    @staticmethod
    def _parse_json(body: str) -> ParsedCall | None:
        try:
            obj = json.loads(body.strip())
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models double-encode
            try:
                args = json.loads(args)
            except ValueError:
                return None
        return ParsedCall(obj["name"], args) if isinstance(args, dict) else None

    @staticmethod
    def _parse_xml(body: str, tools: list[dict]) -> ParsedCall | None:
        m = _FUNCTION.search(body)
        if m is None:
            return None
        name = m.group(1).strip()
        props = tool_schema(tools, name).get("properties") or {}
        args = {}
        for p in _PARAMETER.finditer(m.group(2)):
            key = p.group(1).strip()
            value = p.group(2)
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            args[key] = _typed(value, props.get(key) or {})
        return ParsedCall(name, args)

    def forced_prefix(self, function: str | None) -> str:
        if self.xml:
            return "<tool_call>\n<function=" + (f"{function}>\n" if function else "")
        return '<tool_call>\n{"name": "' + (f'{function}", "arguments": ' if function else "")
