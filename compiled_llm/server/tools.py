"""Tool calling on /v1/chat/completions: which parser a checkpoint's calls need, what a request's tools and
tool_choice turn into (the template's `tools`, a forced call prefix, extra sampling settings), and the
assistant/tool messages fed back through the template.

tool_choice: "none" renders no tools and parses nothing; "auto" (the default with tools) renders them and parses
what the model writes in its own call format. "required" and a named function force a call: with xgrammar (a
declared dependency) the answer is JSON under a grammar, as vLLM does it: the named function's arguments
(its parameters schema), or for "required" a list of {"name", "parameters"} objects, one of the given tools each
(`JsonCallStream`); so the call always parses and its arguments follow the schema. Without xgrammar the format's
opening of a call is appended after the generation prompt instead and nothing forces the rest (a call that does
not parse then comes back as content)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path

from compiled_llm.server.errors import APIError
from compiled_llm.server.structured_output import grammar_library_installed
from compiled_llm.server.tool_parsers import CallEvent, ContentEvent, ToolCallStream, ToolParser, parser_for
from compiled_llm.server.unicode import find_invalid_unicode


def checkpoint_model_type(model_path: str) -> str | None:
    """config.json's model_type (a multimodal checkpoint's text_config one when the outer one is unknown)."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg.get("model_type") or (cfg.get("text_config") or {}).get("model_type")


def make_tool_parser(name: str | None, model_path: str, chat_template: str | None) -> ToolParser | None:
    return parser_for(name, checkpoint_model_type(model_path), chat_template)


@dataclass
class ToolSetup:
    """What one request's tools change."""

    parser: ToolParser
    tools: list[dict]  # the template's `tools`
    prefix: str  # forced opening of a call ("" for auto)
    parallel: bool
    forced: str | None = None  # a call forced under a grammar: the named function, or "" for "required"

    def stream(self) -> ToolCallStream | JsonCallStream:
        if self.forced is not None:
            return JsonCallStream(self.forced, self.parallel)
        return ToolCallStream(self.parser, self.tools, self.prefix)

    def constraint(self) -> dict | None:
        """SamplingParams.structured_output of a forced call (None when the model's own format is parsed)."""
        if self.forced is None:
            return None
        if self.forced:
            return {"json": _parameters(self.tools, self.forced)}
        one_of = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                    "parameters": _parameters(self.tools, t["function"]["name"])},
                   "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
        return {"json": {"type": "array", "minItems": 1, **({} if self.parallel else {"maxItems": 1}),
                         "items": {"anyOf": one_of}}}

    def sampling_overrides(self, stop: list[str] | str | None) -> dict:
        over = {}
        if self.forced is not None:
            return over
        if self.parser.keep_special_tokens:
            over["skip_special_tokens"] = False
        if self.parser.stop:
            stops = [stop] if isinstance(stop, str) else list(stop or [])
            over["stop"] = stops + [s for s in self.parser.stop if s not in stops]
        return over


def template_tools(tools) -> list[dict]:
    out = [t.model_dump(exclude_none=True) for t in tools]
    bad = find_invalid_unicode(out, "tools")
    if bad:
        raise APIError(400, f"{bad}: invalid Unicode (a lone surrogate)", param="tools")
    return out


def tool_setup(state, req) -> ToolSetup | None:
    """None when the request has no tools to render (none given, or tool_choice "none"); 400 for tools this
    server cannot serve for this model, or a tool_choice that names no given tool."""
    choice = req.tool_choice
    if choice not in (None, "none") and not req.tools:  # "none" without tools asks for nothing: harmless
        raise APIError(400, "tool_choice is only allowed when tools are given", param="tool_choice")
    if not req.tools or choice == "none":
        return None
    parser = state.tool_parser
    if parser is None:
        raise APIError(400, "tool calling is not available for this model: no tool-call parser for its model type "
                            "(start the server with --tool-call-parser gemma4|qwen)", param="tools")
    template = state.chat_template or getattr(state.tokenizer, "chat_template", None) or ""
    if "tools" not in template:
        raise APIError(400, "this model's chat template does not render tools", param="tools")
    names = [t.function.name for t in req.tools]
    named = None if isinstance(choice, str) or choice is None else choice.function.name
    if named is not None and named not in names:
        raise APIError(400, f"tool_choice names `{named}`, which is not among the tools ({', '.join(names)})",
                       param="tool_choice")
    forcing = choice == "required" or named is not None
    parallel = req.parallel_tool_calls is not False
    if forcing and grammar_library_installed():
        return ToolSetup(parser, template_tools(req.tools), "", parallel, forced=named or "")
    return ToolSetup(parser, template_tools(req.tools), parser.forced_prefix(named) if forcing else "", parallel)


def _parameters(tools: list[dict], name: str) -> dict:
    for t in tools:
        if t["function"]["name"] == name:
            return t["function"].get("parameters") or {"type": "object"}
    return {"type": "object"}


class JsonCallStream:
    """A forced call's output (JSON under a grammar, ToolSetup.constraint) -> call events, once it is complete:
    `forced` names the function whose arguments the JSON is, or is "" for a list of {"name", "parameters"}.
    Output that does not parse (max_tokens cut it) comes back as content."""

    def __init__(self, forced: str, parallel: bool):
        self.forced, self.parallel = forced, parallel
        self.buf = ""
        self.calls: list[CallEvent] = []

    def feed(self, text: str) -> list:
        self.buf += text
        return []

    def finish(self) -> list:
        try:
            value = json.loads(self.buf)
        except ValueError:
            return [ContentEvent(self.buf)] if self.buf.strip() else []
        if self.forced:
            pairs = [(self.forced, value)]
        elif isinstance(value, list) and all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in value):
            pairs = [(c["name"], c.get("parameters", {})) for c in value]
        else:
            return [ContentEvent(self.buf)]
        for name, args in pairs[:None if self.parallel else 1]:
            self.calls.append(CallEvent(len(self.calls), f"call_{uuid.uuid4().hex[:24]}", name,
                                        json.dumps(args, ensure_ascii=False)))
        return list(self.calls)


def message_tool_fields(message, earlier_calls: dict[str, str]) -> dict:
    """The template fields of an assistant message's tool_calls (arguments as an object, as templates iterate
    them) or a tool message's answer (tool_call_id, and the function's name when an earlier call has that id)."""
    out = {}
    calls = getattr(message, "tool_calls", None)
    if calls:
        out["tool_calls"] = []
        for i, c in enumerate(calls):
            try:
                args = json.loads(c.function.arguments) if c.function.arguments.strip() else {}
            except ValueError:
                raise APIError(400, f"tool_calls.{i}.function.arguments is not valid JSON",
                               param="messages") from None
            if not isinstance(args, dict) or find_invalid_unicode(args, ""):
                raise APIError(400, f"tool_calls.{i}.function.arguments must be a JSON object of valid Unicode",
                               param="messages")
            earlier_calls[c.id] = c.function.name
            out["tool_calls"].append({"id": c.id, "type": "function",
                                      "function": {"name": c.function.name, "arguments": args}})
    call_id = getattr(message, "tool_call_id", None)
    if message.role == "tool":
        if call_id is None:
            raise APIError(400, "a tool message needs tool_call_id", param="messages")
        out["tool_call_id"] = call_id
        if call_id in earlier_calls:
            out["name"] = earlier_calls[call_id]
    return out


@dataclass
class ParsedOutput:
    content: str | None
    calls: list[CallEvent]


def parse_output(setup: ToolSetup, text: str) -> ParsedOutput:
    """A finished choice's text -> content and calls (the streaming extractor fed everything at once)."""
    stream = setup.stream()
    events = stream.feed(text) + stream.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentEvent))
    calls = [e for e in events if isinstance(e, CallEvent)]
    return ParsedOutput(content or None, calls if setup.parallel else calls[:1])


def finish_reason(reason: str | None, num_calls: int) -> str | None:
    """A choice that ended normally after calling tools finishes with "tool_calls" (one cut by max_tokens
    stays "length")."""
    return "tool_calls" if num_calls and reason == "stop" else reason
