"""Structured output (response_format json_object / json_schema, the Responses API's text.format) is not served
yet: it needs a grammar backend (xgrammar or llguidance) masking the logits at each step, and neither is
installed. Until then such a request is a 400 that says so, never free text that merely claims to be JSON."""

from __future__ import annotations

from compiled_llm.server.errors import APIError


def reject_structured_output(format_type: str | None, param: str) -> None:
    if format_type in (None, "text"):
        return
    raise APIError(400, f"{param} type `{format_type}` is not supported: structured output (json_object, "
                        "json_schema) is not implemented by this server yet; only `text` is", param=param)
