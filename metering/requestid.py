"""Every request's id (the ledger event's id for the proxy) and the response header that
carries it."""

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from metering.ids import time_ordered


def new_request_id(state: dict) -> None:
    state["request_id"] = time_ordered("req")


def request_id_header(state: dict) -> tuple[bytes, bytes]:
    # Read when the answer starts: after a failover it names the final attempt.
    return (b"x-request-id", state["request_id"].encode())


class RequestId:
    """Gives every request an id and every response x-request-id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        new_request_id(state)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), request_id_header(state)]
            await send(message)

        await self.app(scope, receive, send_with_id)
