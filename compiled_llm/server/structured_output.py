"""Structured output (chat and completions' `response_format`, the Responses API's `text.format`): the request's
format -> SamplingParams.structured_output, which the engine enforces while decoding with xgrammar
(runtime/structured_output.py). `json_object` is any JSON object; `json_schema` is JSON valid against the
given schema (a schema xgrammar cannot compile is a 400 from admission, naming the field: server/generation.py).
Without xgrammar installed such a request is a 400 that names the missing package, never free text that merely
claims to be JSON."""

from __future__ import annotations

import importlib.util

from compiled_llm.server.errors import APIError


def grammar_library_installed() -> bool:
    return importlib.util.find_spec("xgrammar") is not None


def reject_structured_output(format_type: str | None, param: str) -> None:
    """A json format on a server without the grammar library is a 400 naming it."""
    if format_type in (None, "text") or grammar_library_installed():
        return
    raise APIError(400, f"{param} type `{format_type}` is not supported here: structured output (json_object, "
                        "json_schema) needs the `xgrammar` package, which is not installed on this server "
                        "(pip install xgrammar)", param=param)


def structured_output(format_type: str | None, schema: dict | None, param: str, schema_path: str) -> dict | None:
    """SamplingParams.structured_output of a request's format (None for text). param: the request field the
    format came from (named in errors); schema_path: where its schema sits, for the message."""
    reject_structured_output(format_type, param)
    if format_type in (None, "text"):
        return None
    if format_type == "json_object":
        return {"json_object": True}
    if schema is None:
        raise APIError(400, f"{schema_path} is required for type `json_schema`", param=param)
    return {"json": schema}


RESPONSE_FORMAT_PARAM = ("response_format", "response_format.json_schema.schema")


def response_format_output(fmt) -> dict | None:
    """SamplingParams.structured_output of a chat or completion request's response_format (protocol.ResponseFormat)."""
    if fmt is None:
        return None
    return structured_output(fmt.type, fmt.json_schema.schema_ if fmt.json_schema else None, *RESPONSE_FORMAT_PARAM)
