"""POST /v1/chat/completions served ahead of the application's middleware and router.

Every request of every user takes this route, so it is dispatched by the outermost ASGI layer
straight to its endpoint (metering.proxy.endpoints.chat_completions), with what the general
stack would have done for it done here once: the request id, the credential (the same
dependencies, called directly), the error handlers the application registered (looked up as
Starlette looks them up) and the response headers those layers add (`x-request-id`, a refreshed
token pair). A request whose body is compressed takes the general stack, which decodes it
(metering.encoding); so does every other path and method. The route stays declared in the
application, for its OpenAPI document and for that general path.
"""

import inspect
import logging
import uuid

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from metering.auth.principal import authenticate, user_principal
from metering.proxy.endpoints import chat_completions

log = logging.getLogger("metering")

PATH = "/v1/chat/completions"


class DirectChat:
    """ASGI middleware: the outermost layer. `app` is the whole application (its state and
    its exception handlers are the ones used)."""

    def __init__(self, app: ASGIApp, application=None) -> None:
        self.app = app
        self.application = application

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["path"] != PATH
            or scope["method"] != "POST"
            or any(name == b"content-encoding" for name, _ in scope["headers"])
        ):
            await self.app(scope, receive, send)
            return
        scope["app"] = self.application
        state = scope.setdefault("state", {})
        state["request_id"] = f"req_{uuid.uuid4().hex}"
        started = False

        async def send_with_headers(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                # Read when the answer starts: after a failover it names the final attempt.
                headers = [
                    *message.get("headers", ()),
                    (b"x-request-id", state["request_id"].encode()),
                ]
                pair = state.get("refreshed_pair")
                if pair is not None:
                    headers += [
                        (b"x-access-token", pair.access_token.encode()),
                        (b"x-refresh-token", pair.refresh_token.encode()),
                    ]
                message["headers"] = headers
            await send(message)

        request = Request(scope, receive, send_with_headers)
        services = self.application.state.services
        try:
            principal = await user_principal(await authenticate(request, services))
            response = await chat_completions(request, principal, services)
            await response(scope, receive, send_with_headers)
        except Exception as exc:
            if started:
                raise  # the answer has begun: the server closes the connection
            await self._answer_error(request, exc, send, send_with_headers)

    async def _answer_error(self, request: Request, exc: Exception, send, send_with_headers):
        """As the application's exception middleware would: its handler for the exception's
        class; the last resort (a bug) is logged and answered outside the header layers, as
        Starlette's server error middleware answers it."""
        handlers = self.application.exception_handlers
        handler = next((handlers[c] for c in type(exc).__mro__ if c in handlers), None)
        if handler is None:
            raise exc
        last_resort = handler is handlers.get(Exception)
        if last_resort:
            log.error("Exception in ASGI application", exc_info=exc)
        response = handler(request, exc)
        if inspect.isawaitable(response):
            response = await response
        await response(request.scope, request.receive, send if last_resort else send_with_headers)
