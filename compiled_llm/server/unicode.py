"""Invalid Unicode in requests: JSON may carry lone surrogates ("\\ud800") that Python keeps in a str but that
no tokenizer (and no UTF-8 response) can take. They are refused at the door, naming the field."""

from __future__ import annotations

from typing import Any


def valid_unicode(text: str) -> str:
    """Pydantic validator of request strings: ValueError (a 400 naming the field) for a lone surrogate."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"invalid Unicode: lone surrogate U+{ord(text[e.start]):04X} at character {e.start} "
                         "(strings must be valid UTF-8)") from None
    return text


def find_invalid_unicode(value: Any, path: str) -> str | None:
    """The path of the first string (key or value) in a JSON value that is not valid Unicode, else None.
    For free-form JSON fields (tool schemas, tool-call arguments) that no typed validator walks."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            bad = find_invalid_unicode(k, path) or find_invalid_unicode(v, f"{path}.{k}")
            if bad:
                return bad
    elif isinstance(value, list):
        for i, v in enumerate(value):
            bad = find_invalid_unicode(v, f"{path}.{i}")
            if bad:
                return bad
    return None
