"""Request-body size limit (--max-request-body-bytes): a larger body is a 413 before any of it is parsed.

A declared Content-Length over the limit is refused at once; a chunked body is read up to the limit and then
handed to the app unchanged, so nothing past the limit is ever buffered."""

from __future__ import annotations

from compiled_llm.server.errors import error_response

DEFAULT_MAX_REQUEST_BODY_BYTES = 32 << 20


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def _too_large(self, scope, receive, send) -> None:
        response = error_response(413, f"request body is larger than the server's limit of {self.max_bytes} bytes "
                                       "(--max-request-body-bytes)", code="request_too_large")
        await response(scope, receive, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = 0
            if declared > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            await self.app(scope, receive, send)  # the server never reads past the declared length
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # gone before the body was complete
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # then disconnects, as the app's watchers expect

        await self.app(scope, replay, send)
