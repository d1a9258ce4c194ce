"""Server-sent events, and client-disconnect handling for streaming and non-streaming requests."""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from compiled_llm.server.async_engine import EngineDeadError
from compiled_llm.server.errors import APIError, error_body
from compiled_llm.server.generation import Generation

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def usage_modes(stream_options) -> tuple[bool, bool]:
    """(a usage chunk at the end, the usage so far in every chunk) of a request's stream_options (vLLM's
    continuous_usage_stats counts only with include_usage, as there)."""
    include = bool(stream_options and stream_options.include_usage)
    return include, include and bool(stream_options.continuous_usage_stats)


def sse(data, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_generation(request: Request, gen: Generation) -> None:
    """Run a non-streaming generation to the end; a client that goes away aborts it."""
    task = asyncio.ensure_future(gen.run())
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise ClientGone()
        try:
            task.result()
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from exc
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        gen.close()


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


def client_gone_response() -> Response:
    return Response(status_code=499)


def chunk_error(status: int, message: str, code: str | None) -> str:
    """Chat/completions: an error object in the stream, then the end marker."""
    return sse(error_body(status, message, code=code)) + sse("[DONE]")


def stream(gen: Generation, events, error_event=chunk_error, on_error=None) -> StreamingResponse:
    """Stream the SSE strings of the async iterator ``events``. An error mid-stream becomes
    error_event(status, message, code); any exit, cancellation by a gone client included, aborts
    what is still running."""

    async def body():
        try:
            async for chunk in events:
                yield chunk
        except EngineDeadError as exc:
            if on_error:
                on_error(503)
            yield error_event(503, str(exc), "engine_dead")
        except Exception as exc:  # noqa: BLE001 - the response has started; report in-band
            logger.exception("error while streaming")
            if on_error:
                on_error(500)
            yield error_event(500, f"{type(exc).__name__}: {exc}", None)
        finally:
            gen.close()

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)
