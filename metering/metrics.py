"""Prometheus series and the hooks that count: the proxy calls them after each settle and
refusal, the jobs after each sweep. A leaf: it imports nothing of the domains, so whatever
counts may import it; the scrape, GET /metrics, is metering.reports.prometheus.

With several uvicorn workers (`metering serve --workers N`) each worker is its own process:
`metering serve` then points PROMETHEUS_MULTIPROC_DIR at a fresh directory before the workers
start, every worker writes its samples there, and a scrape (answered by any one worker) sums
them all. Metrics are floats, for dashboards; the ledger stays the exact record.
"""

import logging
from typing import Protocol

from prometheus_client import Counter, Histogram

from metering.money import pico_to_usd

log = logging.getLogger("metering.metrics")

# Read by prometheus_client when it is imported; set by `metering serve` for its workers.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
SECONDS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# The proxy's own time, in milliseconds: what it adds to a request besides the upstream's.
ADDED_SECONDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
ROUTE = ("model", "provider")
# Served by the scrape, per team, user and token, behind METERING_METRICS_KEY only.
BUDGET_USED_RATIO = "metering_budget_used_ratio"

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

ADDED = Histogram(
    "metering_proxy_added_seconds",
    "The proxy's own time on a request that reached an upstream, by phase: `before_upstream`, "
    "from its arrival to its sending (authentication, admission, the hold's commit); `settle`, "
    "from the upstream answer's end to its ledger event's commit, before the client sees the "
    "end",
    ["phase"],
    buckets=ADDED_SECONDS,
)
_BEFORE_UPSTREAM, _SETTLE = ADDED.labels("before_upstream"), ADDED.labels("settle")


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
        self.requests: dict[str, Counter] = {}
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


class Counted(Protocol):
    """What is counted of a settled ledger event (a metering.ledger.event.Event)."""

    @property
    def id(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def provider(self) -> str: ...
    @property
    def status(self) -> str: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def cached_tokens(self) -> int: ...
    @property
    def completion_tokens(self) -> int: ...
    @property
    def reasoning_tokens(self) -> int | None: ...
    @property
    def cost(self) -> int: ...
    @property
    def uncharged(self) -> int: ...
    @property
    def usage_anomaly(self) -> str | None: ...
    @property
    def latency_ms(self) -> int | None: ...
    @property
    def ttft_ms(self) -> int | None: ...


def observe_event(event: Counted) -> None:
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


def before_upstream(seconds: float) -> None:
    _BEFORE_UPSTREAM.observe(seconds)


def settled(seconds: float) -> None:
    _SETTLE.observe(seconds)


def reserved(leased: bool) -> None:
    (_LEASED if leased else _DIRECT).inc()


def budget_rejected(scope: str) -> None:
    BUDGET_REJECTIONS.labels(scope).inc()


def refusal_dropped(reason: str) -> None:
    REFUSALS_DROPPED.labels(reason).inc()


def limit_rejected(scope: str, kind: str) -> None:
    LIMIT_REJECTIONS.labels(scope, kind).inc()
