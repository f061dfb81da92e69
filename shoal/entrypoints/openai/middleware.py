"""Plain ASGI middleware that runs before any body is parsed: the API key and the body-size limit.

Both answer with an OpenAI error body. Neither wraps the response, so streams pass through
untouched (Starlette's `BaseHTTPMiddleware` would buffer and complicate cancellation).
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shoal.entrypoints.openai.errors import body_too_large, unauthorized

# A rejected body is read (and dropped) up to this many more bytes before the 413 goes out, so
# that a client still sending gets the answer rather than a reset connection.
_MAX_DRAIN_BYTES = 16 * 1024 * 1024


class ApiKeyMiddleware:
    """Every route but the open ones needs `Authorization: Bearer <api key>`."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: tuple[str, ...] = ()) -> None:
        self.app = app
        self._api_key = api_key.encode()
        self._open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open_paths or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        response = unauthorized().to_response()
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._api_key)


class BodySizeLimitMiddleware:
    """Reads the whole request body before the app does, refusing one larger than the limit with
    a 413: a declared Content-Length is checked first, a chunked body as it arrives."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            body, more_body = None, True
        else:
            body, more_body = await self._read_body(receive)
        if body is None:
            if more_body:
                await self._drain(receive)
            await body_too_large(self.max_body_bytes).to_response()(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: wait for the disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _read_body(self, receive: Receive) -> tuple[bytes | None, bool]:
        """The whole body, or None as soon as it exceeds the limit; and whether more is coming."""
        chunks: list[bytes] = []
        num_bytes = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks), False  # the client left; the app will see the disconnect
            chunk = message.get("body", b"")
            more_body = message.get("more_body", False)
            num_bytes += len(chunk)
            if num_bytes > self.max_body_bytes:
                return None, more_body
            chunks.append(chunk)
            if not more_body:
                return b"".join(chunks), False

    async def _drain(self, receive: Receive) -> None:
        num_bytes = 0
        while num_bytes < _MAX_DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return
            num_bytes += len(message.get("body", b""))
            if not message.get("more_body", False):
                return
