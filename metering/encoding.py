"""Compressed request bodies: `Content-Encoding: gzip` or `deflate` is decoded before the app sees
the body, within a bound on the decoded size; any other encoding is refused.

The body is read and decoded whole (it is bounded, and compressed requests are few), then given
to the app as if it had arrived plain, without the content-encoding header. A body decoding to
more than its route's limit (a "zip bomb") answers 413 as soon as the limit is passed: the
decoder never produces more than the limit plus one byte.
"""

import zlib

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from metering.errors import error_response

DECODERS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


class BodyRefused(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def encodings(value: bytes) -> list[str]:
    names = [part.strip().lower() for part in value.decode("latin-1").split(",")]
    return [name for name in names if name and name != "identity"]


def decode(data: bytes, encoding: str, limit: int) -> bytes:
    """The decoded body, at most `limit` bytes, or BodyRefused."""
    decoder = zlib.decompressobj(DECODERS[encoding])
    try:
        try:
            decoded = decoder.decompress(data, limit + 1)
        except zlib.error:
            if encoding != "deflate":
                raise
            # Some clients send raw DEFLATE (no zlib header) as "deflate".
            decoder = zlib.decompressobj(-zlib.MAX_WBITS)
            decoded = decoder.decompress(data, limit + 1)
    except zlib.error:
        raise BodyRefused(400, "invalid_request", f"request body is not valid {encoding}") from None
    if len(decoded) > limit:
        raise _too_large(limit)
    if not decoder.eof or decoder.unused_data:
        raise BodyRefused(
            400, "invalid_request", f"request body is not one complete {encoding} stream"
        )
    return decoded


def _too_large(limit: int) -> BodyRefused:
    return BodyRefused(413, "request_too_large", f"request body decodes to more than {limit} bytes")


class ContentEncoding:
    """ASGI middleware. `limit` bounds a decoded body; `limits` gives larger bounds by path prefix."""

    def __init__(self, app: ASGIApp, limit: int, limits: dict[str, int] | None = None) -> None:
        self.app, self.limit, self.limits = app, limit, limits or {}

    def limit_for(self, path: str) -> int:
        for prefix, limit in self.limits.items():
            if path.startswith(prefix):
                return limit
        return self.limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = next((v for n, v in scope["headers"] if n == b"content-encoding"), None)
        names = encodings(header) if header is not None else []
        if not names:
            if scope["path"].startswith(SELF_BOUNDED) or not _has_body(scope):
                await self.app(scope, receive, send)
                return
            # A plain body for a route that parses it whole (admin and account APIs): bounded
            # here, so no route can be handed more than its limit.
            try:
                body = await read_whole(receive, self.limit_for(scope["path"]))
            except BodyRefused as refused:
                await self._refuse(refused, scope, receive, send)
                return
            await self.app(scope, replay(body, receive), send)
            return
        try:
            if len(names) > 1 or names[0] not in DECODERS:
                assert header is not None  # the names were read from it
                raise BodyRefused(
                    415,
                    "unsupported_content_encoding",
                    "request bodies may be sent plain, gzip or deflate, not "
                    + header.decode("latin-1"),
                )
            limit = self.limit_for(scope["path"])
            body = decode(await read_whole(receive, limit), names[0], limit)
        except BodyRefused as refused:
            await self._refuse(refused, scope, receive, send)
            return
        await self.app(plain(scope, len(body)), replay(body, receive), send)

    @staticmethod
    async def _refuse(refused: BodyRefused, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {"connection": "close"} if refused.status == 413 else None
        response = error_response(refused.status, refused.code, refused.message, None, headers)
        await response(scope, receive, send)


# The proxy reads its own body within the same limit, without a copy.
SELF_BOUNDED = ("/v1/chat/",)


def _has_body(scope: Scope) -> bool:
    return any(n in (b"content-length", b"transfer-encoding") for n, _ in scope["headers"])


async def read_whole(receive: Receive, limit: int) -> bytes:
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise BodyRefused(400, "client_closed", "the client closed the request")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:  # the encoded body alone is already too large
            raise _too_large(limit)
        chunks.append(chunk)
        more = message.get("more_body", False)
    return b"".join(chunks)


def plain(scope: Scope, length: int) -> Scope:
    headers = [
        (n, v) for n, v in scope["headers"] if n not in (b"content-encoding", b"content-length")
    ]
    headers.append((b"content-length", str(length).encode()))
    return {**scope, "headers": headers}


def replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def receive_decoded() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # what follows the body: the client's disconnect

    return receive_decoded
