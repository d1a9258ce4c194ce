"""Structured output (chat and completions' `response_format`, vLLM's `structured_outputs` and `guided_*` fields,
the Responses API's `text.format`): the request's constraint -> SamplingParams.structured_output, which the engine
enforces while decoding with xgrammar (runtime/structured_output.py). `json_object` is any JSON object;
`json_schema` is JSON valid against the given schema; vLLM's fields add a regular expression, a choice of strings
and an EBNF grammar (a constraint xgrammar cannot compile is a 400 from admission, naming the field:
server/generation.py). Without xgrammar installed such a request is a 400 that names the missing package, never
free text that merely claims to follow it."""

from __future__ import annotations

import importlib.util

from compiled_llm.sampling_params import STRUCTURED_KINDS, SamplingParams
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


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _structured_outputs_spec(so) -> dict:
    """vLLM's structured_outputs object -> its one constraint."""
    given = {kind: value for kind, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                             ("grammar", so.grammar), ("json_object", so.json_object))
             if value is not None and value is not False}
    if len(given) != 1:
        raise APIError(400, f"structured_outputs takes exactly one of {', '.join(STRUCTURED_KINDS)}; got "
                            f"{', '.join(given) or 'none'}", param="structured_outputs")
    return given


def request_constraint(req) -> tuple[dict | None, tuple[str, str]]:
    """SamplingParams.structured_output of a chat or completion request (protocol.ConstraintFields) and the field it
    came from (field, path of its schema: named when admission cannot compile it). At most one of response_format
    (other than text), structured_outputs and the guided_* fields; each checked here (a 400 naming the field)."""
    found: list[tuple[dict, tuple[str, str]]] = []
    fmt = response_format_output(req.response_format)
    if fmt is not None:
        found.append((fmt, RESPONSE_FORMAT_PARAM))
    if req.structured_outputs is not None:
        found.append((_structured_outputs_spec(req.structured_outputs), ("structured_outputs", "structured_outputs")))
    found += [({kind: getattr(req, name)}, (name, name)) for name, kind in GUIDED.items()
              if getattr(req, name) is not None]
    if not found:
        return None, RESPONSE_FORMAT_PARAM
    if len(found) > 1:
        names = [param for _, (param, _) in found]
        raise APIError(400, f"one structured-output constraint a request: got {', '.join(names)}", param=names[1])
    spec, param = found[0]
    if param[0] != "response_format" and not grammar_library_installed():  # (response_format's was checked)
        raise APIError(400, f"{param[0]} is not supported here: structured output needs the `xgrammar` package, "
                            "which is not installed on this server (pip install xgrammar)", param=param[0])
    try:  # the spec's own checks (a schema that is not JSON, an empty choice), named by its field
        SamplingParams(structured_output=spec)
    except ValueError as e:
        raise APIError(400, f"{param[0]}: {str(e).removeprefix('structured_output: ')}", param=param[0]) from e
    return spec, param
