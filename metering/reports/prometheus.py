"""GET /metrics, the Prometheus scrape: the series every part counts (metering.metrics) and the
gauges read from the database when it is scraped, so they are the same whichever worker answers.

Without METERING_METRICS_KEY the scrape is open and carries aggregate series only: no label holds
a team, user or token id. With the key (as a Bearer token) it also carries the per-subject ones
(metering_budget_used_ratio{scope, subject_id}).
"""

import logging
import os

from fastapi import APIRouter, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import GaugeMetricFamily

from metering.auth.principal import OpenAccess
from metering.auth.tokens import digest, same
from metering.budgets import queries
from metering.container import ServicesDep
from metering.errors import Unauthorized
from metering.metrics import BUDGET_USED_RATIO, MULTIPROC_ENV

log = logging.getLogger("metering.metrics")


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
    _: OpenAccess,
    services: ServicesDep,
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
