"""One chat completion, from its validated body to its answer: the routes that may serve it
(route choice), each tried in turn (try_route: attribution, admission and hold, the upstream
call), the refusals recorded, the budget's refusal put in the client's terms.

Called by the route (metering.proxy.endpoints.chat_completions) and, for nearly every request,
straight from the raw ASGI dispatcher (metering.proxy.dispatch.DirectChat): nothing here knows
which of the two called it."""

import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any

import orjson

from metering import metrics
from metering.auth.principal import Principal
from metering.budgets.ceilings import MAX_COST, run_of, unknown_run, usd_header
from metering.budgets.refusals import Refused
from metering.budgets.reserve import BudgetShortfall, HoldSpec, Shortfall
from metering.budgets.runs import RunKey, UnknownRun
from metering.errors import InvalidRequest, MeteringError
from metering.ledger.attribution import NO_TAGS
from metering.ledger.outcome import Attribution
from metering.money import format_usd
from metering.proxy import admission
from metering.proxy.attempt import Attempt
from metering.proxy.dialects import dialect_for
from metering.proxy.estimate import estimate_prompt_tokens, prompt_tokens_upper_bound
from metering.proxy.forward import forward
from metering.proxy.request import ChatRequest, attribution, parse_json, validate
from metering.proxy.routing import Target, candidates, parse_model
from metering.proxy.runtime import Answer, ProxyServices
from metering.proxy.tracing import RequestTrace
from metering.proxy.transport import FailedBeforeAnswer
from metering.settings import Catalog, ModelRoute
from metering.timefmt import rfc3339


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


# The refusals recorded in the refusals table (each carries what refused it).
REFUSALS = (BudgetExceeded, admission.RateLimitExceeded, admission.ModelNotAllowed)


def ceilings(
    headers: Mapping[str, str], principal: Principal, idle_s: int
) -> tuple[int | None, RunKey | None]:
    """x-metering-max-cost, and the run (x-metering-run, x-metering-run-budget), if sent."""
    assert principal.team_id is not None  # a user's credential: the proxy's only caller
    return usd_header(headers, MAX_COST), run_of(headers, principal.team_id, idle_s)


def encode(body: dict[str, Any]) -> bytes:
    """The upstream request's body as JSON bytes; 400 for a body that is not Unicode text."""
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


# How a request's body becomes the chat request served: a chat completion's is validated as
# it is; a Responses API request's is translated first (metering.proxy.responses.service).
Prepare = Callable[[bytes, dict[str, Any], Principal, ProxyServices], Awaitable[ChatRequest]]


async def as_chat(
    raw: bytes, state: dict[str, Any], principal: Principal, services: ProxyServices
) -> ChatRequest:
    return validate(parse_json(raw), len(raw))


async def chat_completion(
    headers: Mapping[str, str],
    state: dict[str, Any],
    raw: bytes,
    principal: Principal,
    services: ProxyServices,
    t0: float,
    prepare: Prepare = as_chat,
) -> Answer:
    """POST /v1/chat/completions for an authenticated user, from its headers, the request's
    state (its `request_id`, set to the attempt that answered) and its body as read within its
    bound: validated (`prepare`), then served; a refusal by a limit or a budget is recorded
    before it is raised. `t0`: when the request arrived (time.perf_counter). Traced when
    tracing is on (metering.proxy.tracing)."""
    tracing = services.tracing
    if tracing is not None:
        return await tracing.traced(
            headers,
            principal,
            lambda trace: _chat_completion(
                headers, state, raw, principal, services, t0, trace, prepare
            ),
        )
    return await _chat_completion(headers, state, raw, principal, services, t0, None, prepare)


async def _chat_completion(
    headers: Mapping[str, str],
    state: dict[str, Any],
    raw: bytes,
    principal: Principal,
    services: ProxyServices,
    t0: float,
    trace: RequestTrace | None,
    prepare: Prepare,
) -> Answer:
    chat = await prepare(raw, state, principal, services)
    if trace is not None:
        trace.requested(chat)
    try:
        return await serve(headers, state, principal, services, chat, t0, trace)
    except REFUSALS as exc:
        if exc.refused is not None:
            await services.refusals.record(
                state["request_id"],
                principal=principal,
                model=chat.model,
                refused=exc.refused,
                status=exc.status,
                code=exc.code,
                message=exc.message,
            )
        raise


async def serve(
    headers: Mapping[str, str],
    state: dict[str, Any],
    principal: Principal,
    services: ProxyServices,
    chat: ChatRequest,
    t0: float,
    trace: RequestTrace | None = None,
) -> Answer:
    """The request's routes tried in turn (the next one when an attempt fails before any byte
    reached the client)."""
    max_cost, run = ceilings(headers, principal, services.settings.run_idle_s)
    end_user, tags = attribution(headers, chat.body)
    catalog = services.catalog  # the prices in effect when the request started
    target = parse_model(chat.model)
    admission.check_model(principal, target.name)
    routes = candidates(
        catalog, target, chat.body, lambda: estimate_prompt_tokens(chat.body), chat.max_tokens
    )
    routes = usable_routes(routes, catalog, chat, target)
    request_id = state["request_id"]
    last: FailedBeforeAnswer | None = None
    for n, route in enumerate(services.breakers.order(routes), start=1):
        attempt_id = request_id if n == 1 else f"{request_id}_{n}"
        try:
            response = await try_route(
                services,
                principal,
                chat,
                catalog,
                route,
                target,
                attempt_id,
                t0,
                max_cost,
                run,
                end_user=end_user,
                tags=tags,
                trace=trace,
            )
        except FailedBeforeAnswer as failure:
            services.breakers.failed(route.provider)
            last = failure
            continue
        services.breakers.succeeded(route.provider)
        state["request_id"] = attempt_id
        return response
    assert last is not None
    state["request_id"] = attempt_id
    if isinstance(last.answer, MeteringError):
        raise last.answer
    return last.answer


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
    *,
    end_user: str | None = None,
    tags: str = NO_TAGS,
    trace: RequestTrace | None = None,
) -> Answer:
    """One provider: admit and hold at its prices, forward, and end the attempt (settle or
    release). Raises FailedBeforeAnswer when the next provider may be tried. `end_user` and
    `tags`: the request's (metering.proxy.request.attribution), kept on its hold and event;
    `trace`: the request's spans, when tracing is on."""
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
        end_user=end_user,
        tags=tags,
        endpoint="chat.completions" if chat.bridge is None else "responses",
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
    # The rate claim is the door's until the hold carries it (given back there otherwise).
    if trace is not None:
        trace.attempt(attempt_id, route, dialect.name)
    door = admission.Admission(services, principal.limits, spec, trace)
    try:
        reservation = await door.hold(billing.prompt_bound, chat.choices)
    except BudgetShortfall as exc:
        raise budget_exceeded(exc) from None
    except UnknownRun:
        assert run is not None  # only a run named in the request is unknown
        raise unknown_run(run) from None
    spec = door.spec
    metrics.reserved(reservation.claim is not None)
    async with Attempt(services, spec, reservation, chat, provider, dialect, t0, trace) as attempt:
        if spec.rates is not None:
            attempt.headers.update(spec.rates.headers)
        # Built inside: a body that cannot be sent gives its hold back too.
        upstream_body = dialect.prepare(chat.body, route, max_tokens=reservation.max_tokens)
        if chat.bridge is not None:
            upstream_body = chat.bridge.upstream(
                upstream_body, provider, route, reservation, dialect
            )
        attempt.upstream_body = encode(upstream_body)
        return await forward(attempt)
