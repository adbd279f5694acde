"""POST /v1/chat/completions and GET /v1/models."""

import inspect
import json
import logging
import time
from dataclasses import replace
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from metering import metrics
from metering.auth.principal import (
    RULE_ERRORS,
    Principal,
    SelfPrincipal,
    UserPrincipal,
    authenticate,
    refreshed_headers,
    user_principal,
)
from metering.budgets.ceilings import MAX_COST, run_of, unknown_run, usd_header
from metering.budgets.rates import release_claim
from metering.budgets.refusals import Refused
from metering.budgets.reserve import BudgetShortfall, HoldSpec, Shortfall, reserve
from metering.budgets.runs import RunKey, UnknownRun
from metering.container import get_services
from metering.errors import ErrorResponse, InvalidRequest, MeteringError, error_responses
from metering.ledger.outcome import Attribution
from metering.money import format_usd
from metering.proxy import admission
from metering.proxy.attempt import Attempt
from metering.proxy.dialects import dialect_for
from metering.proxy.estimate import estimate_prompt_tokens, prompt_tokens_upper_bound
from metering.proxy.forward import forward
from metering.proxy.request import ChatRequest, parse_json, read_body, validate
from metering.proxy.routing import Target, candidates, parse_model
from metering.proxy.runtime import ProxyServices
from metering.proxy.transport import FailedBeforeAnswer
from metering.requestid import new_request_id, request_id_header
from metering.settings import Catalog, ModelRoute
from metering.timefmt import rfc3339

log = logging.getLogger("metering")

router = APIRouter(prefix="/v1")

# The container, as the proxy's functions take it.
ProxyServicesDep = Annotated[ProxyServices, Depends(get_services)]


class BudgetExceeded(MeteringError):
    status, code = 402, "budget_exceeded"
    refused: Refused | None = None  # what refused it, for the refusals table


def _hold(shortfall: Shortfall) -> str:
    """What the refused request needed to hold, as its message says it."""
    if shortfall.needed is None:
        return "this request"
    if shortfall.max_tokens is None:
        return (
            f"this request's smallest hold of {format_usd(shortfall.needed)} USD (its prompt "
            "and one output token)"
        )
    return (
        f"this request's hold of {format_usd(shortfall.needed)} USD (its prompt and "
        f"max_tokens {shortfall.max_tokens})"
    )


def budget_exceeded(exc: BudgetShortfall) -> BudgetExceeded:
    shortfall = exc.shortfall
    budget = shortfall.budget
    metrics.budget_rejected(budget.scope)
    resets = rfc3339(budget.resets_at)
    when = f"resets at {resets}" if resets else "never resets"
    message = (
        f"{budget.scope} budget {budget.subject_id} cannot cover {_hold(shortfall)}: limit "
        f"{format_usd(budget.credit_limit)} USD, spent {format_usd(budget.spent)}, reserved "
        f"{format_usd(budget.reserved)}, remaining {format_usd(budget.remaining)}; {when}"
    )
    if shortfall.fits is not None:
        message += f"; max_tokens {shortfall.fits} or less would fit"
    headers = {"x-budget-scope": budget.scope}
    if resets:
        headers["x-budget-resets-at"] = resets
    error = BudgetExceeded(message, headers=headers)
    # A run's id may be longer than the column keeps (its first 40 characters are kept).
    error.refused = Refused("budget", budget.scope, budget.subject_id[:40])
    return error


REFUSALS = (BudgetExceeded, admission.RateLimitExceeded, admission.ModelNotAllowed)


def ceilings(
    request: Request, principal: Principal, idle_s: int
) -> tuple[int | None, RunKey | None]:
    """x-metering-max-cost, and the run (x-metering-run, x-metering-run-budget), if sent."""
    headers = request.headers
    assert principal.team_id is not None  # a user's credential: the proxy's only caller
    return usd_header(headers, MAX_COST), run_of(headers, principal.team_id, idle_s)


def _encode(body: dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError:
        pass  # a lone surrogate, or an integer beyond 64 bits: Python's encoder says which
    try:
        return json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        # JSON allows escapes such as \ud800; a lone surrogate is not text to send upstream.
        raise InvalidRequest(
            "request body contains a lone UTF-16 surrogate escape: not valid Unicode text"
        ) from None


CHAT_RESPONSES = {
    200: {
        "description": "The upstream's answer as it sent it: a chat.completion, or (stream) "
        "server-sent chat.completion.chunk events",
        "content": {"application/json": {}, "text/event-stream": {}},
    },
    **error_responses(400, 402, 404, 413, 415, 502, 504, *RULE_ERRORS["user"]),
    # 403 also model_not_allowed; 429 also rate_limit_exceeded (with retry-after).
    "4XX": {
        "model": ErrorResponse,
        "description": "An upstream's own refusal (e.g. 422), passed on with its status",
    },
}


@router.post("/chat/completions", responses=CHAT_RESPONSES)
async def chat_completions(
    request: Request,
    principal: UserPrincipal,
    services: ProxyServicesDep,
) -> Response:
    t0 = time.perf_counter()
    raw = await read_body(request, services.settings.max_body_bytes)
    chat = validate(parse_json(raw), len(raw))
    try:
        return await serve(request, principal, services, chat, t0)
    except REFUSALS as exc:
        if exc.refused is not None:
            await services.refusals.record(
                request.scope["state"]["request_id"],
                principal=principal,
                model=chat.model,
                refused=exc.refused,
                status=exc.status,
                code=exc.code,
                message=exc.message,
            )
        raise


async def serve(
    request: Request, principal: Principal, services: ProxyServices, chat: ChatRequest, t0: float
) -> Response:
    """The request's routes tried in turn (the next one when an attempt fails before any byte
    reached the client)."""
    max_cost, run = ceilings(request, principal, services.settings.run_idle_s)
    catalog = services.catalog  # the prices in effect when the request started
    target = parse_model(chat.model)
    admission.check_model(principal, target.name)
    routes = candidates(
        catalog, target, chat.body, lambda: estimate_prompt_tokens(chat.body), chat.max_tokens
    )
    routes = usable_routes(routes, catalog, chat, target)
    request_id = request.scope["state"]["request_id"]
    last: FailedBeforeAnswer | None = None
    for n, route in enumerate(services.breakers.order(routes), start=1):
        attempt_id = request_id if n == 1 else f"{request_id}_{n}"
        try:
            response = await try_route(
                services, principal, chat, catalog, route, target, attempt_id, t0, max_cost, run
            )
        except FailedBeforeAnswer as failure:
            services.breakers.failed(route.provider)
            last = failure
            continue
        services.breakers.succeeded(route.provider)
        request.scope["state"]["request_id"] = attempt_id
        return response
    assert last is not None
    request.scope["state"]["request_id"] = attempt_id
    if isinstance(last.answer, Response):
        return last.answer
    raise last.answer


def usable_routes(
    routes: list[ModelRoute], catalog: Catalog, chat: ChatRequest, target: Target
) -> list[ModelRoute]:
    """The routes whose provider accepts this request as it is; the first refusal if none does."""
    usable: list[ModelRoute] = []
    refusal: InvalidRequest | None = None
    for route in routes:
        dialect = dialect_for(catalog.providers[route.provider].dialect)
        try:
            if target.endpoint and not dialect.pins_endpoints:
                raise InvalidRequest(
                    f"provider {route.provider} has no endpoints to pin with /ep/",
                    param="model",
                )
            ceiling = dialect.output_ceiling(route)
            if chat.max_tokens is not None and chat.max_tokens > ceiling:
                raise InvalidRequest(
                    f"max_tokens {chat.max_tokens} is above the model's maximum of {ceiling}",
                    param="max_tokens",
                )
            dialect.validate(chat.body)
        except InvalidRequest as exc:
            refusal = refusal or exc
            continue
        usable.append(route)
    if not usable:
        assert refusal is not None  # there was a route, and it was refused
        raise refusal
    return usable


async def try_route(
    services: ProxyServices,
    principal: Principal,
    chat: ChatRequest,
    catalog: Catalog,
    route: ModelRoute,
    target: Target,
    attempt_id: str,
    t0: float,
    max_cost: int | None = None,
    run: RunKey | None = None,
) -> Response:
    """One provider: reserve at its prices, forward, and end the attempt (settle or release).
    Raises FailedBeforeAnswer when the next provider may be tried."""
    provider = catalog.providers[route.provider]
    dialect = dialect_for(provider.dialect)
    if target.endpoint:
        route = replace(route, upstream_model=f"{route.upstream_model}/ep/{target.endpoint}")
    assert principal.user_id is not None and principal.team_id is not None  # a user's credential
    billing = Attribution(
        id=attempt_id,
        token_id=principal.token_id,
        user_id=principal.user_id,
        team_id=principal.team_id,
        model=route.name,
        provider=route.provider,
        upstream_model=route.upstream_model,
        stream=chat.stream,
        input_price=route.input_micro,
        cached_price=route.cached_micro,
        output_price=route.output_micro,
        prompt_bound=prompt_tokens_upper_bound(chat.size, chat.body),
        run_id=run.run_id if run is not None else None,
    )
    spec = HoldSpec(
        billing,
        prompt_cost=billing.prompt_cost(),
        token_cost=billing.output_price * chat.choices,  # every choice may use max_tokens
        max_tokens=chat.max_tokens,
        model_max_output=dialect.output_ceiling(route),
        max_cost=max_cost,
        run=run,
    )
    spec = await admission.admit(services, principal, spec, billing.prompt_bound, chat.choices)
    try:
        budgets = services.budgets
        reservation = await reserve(budgets, spec, services.settings.hold_ttl_s, budgets.leases)
    except BaseException as exc:
        if spec.rates is not None and principal.limits is not None:
            # No hold carries the rate claim: given back here.
            await release_claim(services.db, spec.rates, principal.limits)
        if isinstance(exc, BudgetShortfall):
            raise budget_exceeded(exc) from None
        if isinstance(exc, UnknownRun):
            assert run is not None  # only a run named in the request is unknown
            raise unknown_run(run) from None
        raise
    metrics.reserved(reservation.claim is not None)
    async with Attempt(services, spec, reservation, chat, provider, dialect, t0) as attempt:
        if spec.rates is not None:
            attempt.headers.update(spec.rates.headers)
        # Built inside: a body that cannot be sent gives its hold back too.
        upstream_body = dialect.prepare(chat.body, route, max_tokens=reservation.max_tokens)
        attempt.upstream_body = _encode(upstream_body)
        return await forward(attempt)


@router.get("/models", responses=error_responses(*RULE_ERRORS["self"]))
async def list_models(principal: SelfPrincipal, services: ProxyServicesDep) -> dict[str, Any]:
    """The catalog's models this credential may call (its allow-lists applied)."""
    catalog = services.catalog
    names = admission.visible_models(principal, sorted(catalog.models))
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": catalog.models[name][0].provider,
            }
            for name in names
        ],
    }


CHAT_PATH = "/v1/chat/completions"


class DirectChat:
    """POST /v1/chat/completions served ahead of the application's middleware and router.

    Every request of every user takes this route, so it is dispatched ahead of the whole stack
    (metering.app.Application calls this first) straight to its endpoint (chat_completions), with what the general
    stack would have done for it done here once: the request id, the credential (the same
    dependencies, called directly), the error handlers the application registered (looked up as
    Starlette looks them up) and the response headers those layers add (`x-request-id`, a refreshed
    token pair). A request whose body is compressed takes the general stack, which decodes it
    (metering.encoding); so does every other path and method. The route stays declared in the
    application, for its OpenAPI document and for that general path.

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
            or scope["path"] != CHAT_PATH
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
            response = await chat_completions(request, principal, services)
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
