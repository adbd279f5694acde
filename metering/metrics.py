"""Prometheus metrics: GET /metrics, and the hooks the proxy calls after each settle.

With several uvicorn workers (`metering serve --workers N`) each worker is its own process:
`metering serve` then points PROMETHEUS_MULTIPROC_DIR at a fresh directory before the workers
start, every worker writes its samples there, and a scrape (answered by any one worker) sums
them all. The open-holds gauge is read from the database at scrape time, so it is the same
whichever worker answers. Metrics are floats, for dashboards; the ledger stays the exact record.

Without METERING_METRICS_KEY the scrape is open and carries aggregate series only: no label holds
a team, user or token id. With the key (as a Bearer token) it also carries the per-subject ones
(metering_budget_used_ratio{scope, subject_id}).
"""

import logging
import os

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import GaugeMetricFamily

from metering.auth.principal import open_access
from metering.auth.tokens import digest, same
from metering.budgets import queries
from metering.errors import Unauthorized
from metering.ledger.event import Event
from metering.money import pico_to_usd
from metering.services import Services, get_services

log = logging.getLogger("metering.metrics")

# Read by prometheus_client when it is imported; set by `metering serve` for its workers.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
SECONDS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
ROUTE = ("model", "provider")

REQUESTS = Counter(
    "metering_requests",
    "Requests that reached an upstream (ledger events), by model, provider and status",
    [*ROUTE, "status"],
)
TOKENS = Counter(
    "metering_tokens",
    "Tokens metered, by kind: prompt, cached (part of prompt), completion, reasoning (part of "
    "completion)",
    [*ROUTE, "kind"],
)
COST = Counter("metering_cost_usd", "Cost charged to budgets, USD", list(ROUTE))
USAGE_ANOMALIES = Counter(
    "metering_usage_anomalies",
    "Ledger events whose reported usage was not taken as it came, by reason (usage_anomaly)",
    [*ROUTE, "reason"],
)
UNCHARGED = Counter(
    "metering_uncharged_usd",
    "Cost of reported usage above what the request allowed, not charged to budgets, USD",
    list(ROUTE),
)
BUDGET_REJECTIONS = Counter(
    "metering_budget_rejections",
    "Requests refused with 402 budget_exceeded, by the scope that could not cover them",
    ["scope"],
)
LIMIT_REJECTIONS = Counter(
    "metering_limit_rejections",
    "Requests refused by a limit beyond credit, by scope and kind: `requests` (rpm_limit), "
    "`tokens` (tpm_limit), `parallel` (max_parallel_requests), both 429; `model` (403)",
    ["scope", "kind"],
)
REFUSALS_DROPPED = Counter(
    "metering_refusals_dropped",
    "Refused requests not recorded in the refusals table (too many waiting, or the database "
    "refused the write), by reason",
    ["reason"],
)
RESERVATIONS = Counter(
    "metering_reservations",
    "Requests admitted, by path: `lease` (against this process's credit leases, in memory) or "
    "`database` (a hold reserved in the budgets' rows)",
    ["path"],
)
_LEASED, _DIRECT = RESERVATIONS.labels("lease"), RESERVATIONS.labels("database")
LATENCY = Histogram(
    "metering_upstream_latency_seconds",
    "From the request's arrival to its upstream answer's end",
    list(ROUTE),
    buckets=SECONDS,
)
TTFT = Histogram(
    "metering_time_to_first_token_seconds",
    "From the request's arrival to the first byte of the upstream's answer",
    list(ROUTE),
    buckets=SECONDS,
)


class _Route:
    """The labelled series of one (model, provider), looked up once: the label lookup costs more
    than the increment."""

    __slots__ = (
        "requests",
        "prompt",
        "cached",
        "completion",
        "reasoning",
        "cost",
        "latency",
        "ttft",
    )

    def __init__(self, model: str, provider: str) -> None:
        self.requests: dict[str, object] = {}
        self.prompt = TOKENS.labels(model, provider, "prompt")
        self.cached = TOKENS.labels(model, provider, "cached")
        self.completion = TOKENS.labels(model, provider, "completion")
        self.reasoning = TOKENS.labels(model, provider, "reasoning")
        self.cost = COST.labels(model, provider)
        self.latency = LATENCY.labels(model, provider)
        self.ttft = TTFT.labels(model, provider)


_ROUTES: dict[tuple[str, str], _Route] = {}
_ROUTES_KEPT = 10_000  # routes come from the catalog; the bound is for safety


def _route(model: str, provider: str) -> _Route:
    route = _ROUTES.get((model, provider))
    if route is None:
        if len(_ROUTES) >= _ROUTES_KEPT:
            _ROUTES.clear()
        route = _ROUTES[(model, provider)] = _Route(model, provider)
    return route


def observe_event(event: Event) -> None:
    """Count one settled ledger event. Never raises: metrics must not fail a request."""
    try:
        route = _route(event.model, event.provider)
        requests = route.requests.get(event.status)
        if requests is None:
            requests = route.requests[event.status] = REQUESTS.labels(
                event.model, event.provider, event.status
            )
        requests.inc()
        route.prompt.inc(event.prompt_tokens)
        route.cached.inc(event.cached_tokens)
        route.completion.inc(event.completion_tokens)
        route.reasoning.inc(event.reasoning_tokens or 0)
        route.cost.inc(float(pico_to_usd(event.cost)))
        if event.usage_anomaly:
            USAGE_ANOMALIES.labels(event.model, event.provider, event.usage_anomaly).inc()
        if event.uncharged:
            UNCHARGED.labels(event.model, event.provider).inc(float(pico_to_usd(event.uncharged)))
        if event.latency_ms is not None:
            route.latency.observe(event.latency_ms / 1000)
        if event.ttft_ms is not None:
            route.ttft.observe(event.ttft_ms / 1000)
    except Exception:
        log.exception("could not record metrics for event %s", getattr(event, "id", None))


def reserved(leased: bool) -> None:
    (_LEASED if leased else _DIRECT).inc()


def budget_rejected(scope: str) -> None:
    BUDGET_REJECTIONS.labels(scope).inc()


def refusal_dropped(reason: str) -> None:
    REFUSALS_DROPPED.labels(reason).inc()


def limit_rejected(scope: str, kind: str) -> None:
    LIMIT_REJECTIONS.labels(scope, kind).inc()


class _Gauges:
    """Values read at scrape time."""

    def __init__(self, open_holds: int | None, used: list | None = None) -> None:
        self.open_holds = open_holds
        self.used = used

    def collect(self):
        if self.open_holds is not None:
            yield GaugeMetricFamily(
                "metering_open_holds",
                "Holds of requests in flight (or of crashed replicas, until they expire)",
                value=self.open_holds,
            )
        if self.used is not None:
            family = GaugeMetricFamily(
                BUDGET_USED_RATIO,
                "Spent / credit_limit of a budget in its current window (the "
                f"{queries.USED_RATIOS_SHOWN} most used limited budgets); alert rules: "
                "dashboards/prometheus",
                labels=["scope", "subject_id"],
            )
            for scope, subject_id, ratio in self.used:
                family.add_metric([scope, subject_id], ratio)
            yield family


BUDGET_USED_RATIO = "metering_budget_used_ratio"


def render(open_holds: int | None, used: list | None = None) -> bytes:
    if os.environ.get(MULTIPROC_ENV):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    else:
        registry = REGISTRY
    gauges = CollectorRegistry()
    gauges.register(_Gauges(open_holds, used))
    return generate_latest(registry) + generate_latest(gauges)


router = APIRouter()


def _check_key(request: Request, key: str | None) -> None:
    if not key:
        return
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    # Digests first: equal lengths, so not even the key's length leaks through timing.
    if scheme.lower() != "bearer" or not same(digest(value.strip()), digest(key)):
        raise Unauthorized("/metrics wants Authorization: Bearer <METERING_METRICS_KEY>")


@router.get("/metrics", include_in_schema=False)
async def metrics(
    request: Request,
    _: None = Depends(open_access),
    services: Services = Depends(get_services),
) -> Response:
    """Open unless METERING_METRICS_KEY is set (then that key, as a Bearer token). The series
    that name a team, user or token are served behind the key only."""
    key = services.settings.metrics_key
    _check_key(request, key)
    try:
        open_holds: int | None = await queries.open_holds(services.db)
    except Exception:
        log.warning("open holds unavailable: the database cannot be reached", exc_info=True)
        open_holds = None
    used: list | None = None  # per team, user and token: behind the key only
    if key:
        try:
            used = await queries.used_ratios(services.db)
        except Exception:
            log.warning("budget use unavailable: the database cannot be reached", exc_info=True)
    return Response(render(open_holds, used), media_type=CONTENT_TYPE_LATEST)
