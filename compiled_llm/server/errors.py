"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}} for every failure."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """Raised by handlers; turned into an error response with this status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(status: int, message: str, param: str | None = None, code: str | int | None = None):
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    parts, param = [], None
    for err in errors[:5]:
        # pydantic puts union members in the path ("list[tagged-union[...]]"): not part of the client's JSON
        loc = [str(x) for x in err.get("loc", ()) if x != "body" and "[" not in str(x)]
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            return f"Invalid JSON in request body: {detail}".rstrip(": "), None
        where = ".".join(loc)
        if param is None and loc:
            param = loc[0]
        if err.get("type") == "extra_forbidden":  # never silently dropped (protocol.RequestModel)
            parts.append(f"unknown field `{where}`: this server does not support it")
            continue
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    message = "; ".join(parts) or "Invalid request"
    if len(errors) > 5:
        message += f" (and {len(errors) - 5} more errors)"
    return message, param


def install_error_handlers(app: FastAPI, on_error=None) -> None:
    """Every error, FastAPI's own included, gets the OpenAI shape; on_error(request, status) observes it."""

    def observe(request: Request, status: int) -> None:
        if on_error is not None:
            on_error(request, status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        observe(request, exc.status)
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        observe(request, 400)
        message, param = _validation_message(list(exc.errors()))
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        observe(request, exc.status_code)
        return error_response(exc.status_code, str(exc.detail), None, None)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        observe(request, 500)
        return error_response(500, f"Internal server error: {type(exc).__name__}: {exc}")
