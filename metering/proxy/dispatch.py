"""The raw ASGI path: POST /v1/chat/completions dispatched ahead of the application's middleware
and router (why: docs/decisions/raw-asgi-path.md)."""

import inspect
import logging
import time

from fastapi import FastAPI, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from metering.auth.principal import authenticate, refreshed_headers, user_principal
from metering.proxy.request import read_body
from metering.proxy.responses.service import create_response
from metering.proxy.runtime import ProxyServices
from metering.proxy.service import chat_completion
from metering.requestid import new_request_id, request_id_header

log = logging.getLogger("metering")

CHAT_PATH = "/v1/chat/completions"
RESPONSES_PATH = "/v1/responses"
# The paths served here, each by its service.
SERVED = {CHAT_PATH: chat_completion, RESPONSES_PATH: create_response}


class DirectChat:
    """POST /v1/chat/completions served ahead of the application's middleware and router.

    Every request of every user takes this route, so it is dispatched ahead of the whole stack
    (metering.app.Application calls this first) straight to the service the route calls
    (metering.proxy.service.chat_completion), with what the general stack would have done for
    it done here once: the request id, the credential (the same dependencies, called directly),
    the error handlers the application registered (looked up as Starlette looks them up) and
    the response headers those layers add (`x-request-id`, a refreshed token pair). A request
    whose body is compressed takes the general stack, which decodes it (metering.encoding); so
    does every other path and method. The route stays declared in the application
    (metering.proxy.endpoints), for its OpenAPI document and for that general path.

    `app`: the application's general stack, for every other request; `application`: the
    application itself (its exception handlers are the ones used); `services`: the container,
    handed over by the application's lifespan once it is built."""

    services: ProxyServices

    def __init__(self, app: ASGIApp, application: FastAPI) -> None:
        self.app = app
        self.application = application

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["path"] not in SERVED
            or scope["method"] != "POST"
            or any(name == b"content-encoding" for name, _ in scope["headers"])
        ):
            await self.app(scope, receive, send)
            return
        scope["app"] = self.application
        state = scope.setdefault("state", {})
        new_request_id(state)
        started = False

        async def send_with_headers(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [
                    *message.get("headers", ()),
                    request_id_header(state),
                    *refreshed_headers(state),
                ]
            await send(message)

        request = Request(scope, receive, send_with_headers)
        services = self.services
        try:
            principal = await user_principal(await authenticate(request, services))
            t0 = time.perf_counter()
            raw = await read_body(request, services.settings.max_body_bytes)
            serve = SERVED[scope["path"]]
            response = await serve(request.headers, state, raw, principal, services, t0)
            await response(scope, receive, send_with_headers)
        except Exception as exc:
            if started:
                raise  # the answer has begun: the server closes the connection
            await self._answer_error(request, exc, send, send_with_headers)

    async def _answer_error(
        self, request: Request, exc: Exception, send: Send, send_with_headers: Send
    ) -> None:
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
