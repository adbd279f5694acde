"""create_app(): routers, error handlers, and the lifespan (database, upstream clients, jobs)."""

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Literal

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy import exc as sa_exc
from sqlalchemy import text
from starlette.requests import ClientDisconnect

from metering import __version__, jobs, metrics
from metering.alerts.endpoints import router as alerts_router
from metering.alerts.outbox.delivery import Outbox, Policy
from metering.alerts.targets import Reach
from metering.auth.endpoints import router as auth_router
from metering.auth.failures import FailedCredentials
from metering.auth.invalidation import Credentials
from metering.auth.openapi import declare_security
from metering.auth.passwords import Passwords
from metering.auth.principal import RefreshedTokenHeaders, open_access
from metering.auth.tokens import Signer
from metering.billing.endpoints import router as billing_router
from metering.billing.schemas import declare_event_schema
from metering.budgets.endpoints import router as budgets_router
from metering.budgets.refusals import RefusalLog
from metering.budgets.runtime import BudgetRuntime
from metering.catalog import CatalogStore, record_prices
from metering.catalog import describe as describe_catalog
from metering.clock import SYSTEM, Clock, reset_current, set_current
from metering.container import Services, ServicesDep, install
from metering.dashboard.apidocs import OPENAPI as OPENAPI_URL
from metering.dashboard.apidocs import router as apidocs_router
from metering.dashboard.endpoints import router as dashboard_router
from metering.db import Database
from metering.encoding import ContentEncoding
from metering.errors import (
    LEDGER_RETRY_AFTER,
    error_response,
    error_responses,
    install_error_handlers,
)
from metering.identity.endpoints import router as identity_router
from metering.proxy.dispatch import DirectChat
from metering.proxy.endpoints import router as proxy_router
from metering.proxy.live import LiveHolds
from metering.proxy.routing import Breakers
from metering.proxy.tracing import Tracing
from metering.proxy.upstreams import Upstreams
from metering.reports.endpoints import MAX_EXPORT_BYTES
from metering.reports.endpoints import router as reports_router
from metering.reports.prometheus import router as metrics_router
from metering.requestid import RequestId
from metering.responses.endpoints import router as responses_router
from metering.settings import Catalog, Settings, load_catalog
from metering.text import declare_parameters, valid_parameters

log = logging.getLogger("metering")

# Routes whose (decoded) bodies may be larger than METERING_MAX_BODY_BYTES.
LARGER_BODIES = {"/v1/reconciliations": MAX_EXPORT_BYTES}


class Health(BaseModel):
    status: Literal["ok"]
    # The running code's version (metering.__version__): which release a replica serves.
    version: str


class Ready(BaseModel):
    status: Literal["ready"]


def _ledger_unavailable(request: Request, exc: Exception) -> JSONResponse:
    log.error("database unreachable: %s", exc)
    return error_response(
        503,
        "ledger_unavailable",
        "the ledger database cannot be reached; retry later",
        headers=dict(LEDGER_RETRY_AFTER),
    )


# PostgreSQL refuses text it cannot store (a NUL character): the client's input is at fault.
_UNSTORABLE_TEXT = frozenset({"22021", "22P05"})


# The server went away, is shutting down or starting up, or has no connection left: asyncpg's
# errors for these reach us as a plain DBAPIError, not an OperationalError.
_UNREACHABLE = frozenset({"57P01", "57P02", "57P03", "53300"})


def _driver_lost_connection(exc: BaseException) -> bool:
    """asyncpg's own state errors while a server restarts under it (no SQLSTATE)."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if type(seen).__name__ in ("InternalClientError", "ConnectionDoesNotExistError"):
            return True
        seen = seen.__cause__ or seen.__context__ or getattr(seen, "orig", None)
    return False


def _database_error(request: Request, exc: Exception) -> JSONResponse:
    sqlstate = getattr(getattr(exc, "orig", None), "sqlstate", None) or ""
    if (
        getattr(exc, "connection_invalidated", False)
        or sqlstate.startswith("08")
        or sqlstate in _UNREACHABLE
        or _driver_lost_connection(exc)
    ):
        return _ledger_unavailable(request, exc)
    if sqlstate in _UNSTORABLE_TEXT:
        return error_response(400, "invalid_request", "text must not contain NUL characters")
    log.error("database error", exc_info=exc)
    return error_response(500, "internal_error", "the request failed; retry later")


def _client_gone(request: Request, exc: Exception) -> JSONResponse:
    # The client left before its body arrived (or its body deadline passed): nobody reads this.
    return error_response(400, "client_closed", "the client closed the request")


def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    # Only reached by a bug; the error shape holds even then (the exception is still logged).
    # This runs outside RequestId's middleware, so it adds the header itself.
    request_id = request.scope.get("state", {}).get("request_id")
    headers = {"x-request-id": request_id} if request_id else None
    return error_response(
        500, "internal_error", "the server failed to handle this request", headers=headers
    )


class Application(FastAPI):
    """The application, with `direct` (the proxy's chat route, metering.proxy.dispatch.
    DirectChat) called ahead of everything FastAPI and Starlette put around the routes: their
    server-error, telemetry and body-limit layers cost every request of every user a wrapped
    `send` each, for work DirectChat does itself; it hands every other request to `stack`."""

    direct: DirectChat | None = None
    # The container's clock, made the current one of each request and of the lifespan (whose
    # background work inherits it): metering.clock.
    clock: Clock = SYSTEM

    async def __call__(self, scope, receive, send) -> None:
        token = set_current(self.clock)
        try:
            if self.direct is not None:
                await self.direct(scope, receive, send)
            else:
                await super().__call__(scope, receive, send)
        finally:
            reset_current(token)

    async def stack(self, scope, receive, send) -> None:
        """The application as FastAPI builds it: middleware, router, handlers."""
        await super().__call__(scope, receive, send)


def create_app(
    settings: Settings | None = None,
    catalog: Catalog | None = None,
    *,
    run_jobs: bool = True,
    clock: Clock = SYSTEM,
) -> FastAPI:
    settings = settings or Settings()
    config_path = settings.config_path()
    if catalog is None:  # the file's (a catalog given by the caller is the caller's to tell)
        catalog = load_catalog(config_path)
        describe_catalog(catalog, config_path)
    store = CatalogStore(catalog, config_path)
    # Read once, here: traces are on when the OTEL_* variables configure an OTLP exporter.
    tracing = Tracing.from_environ()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        db = Database(
            settings.database_url,
            settings.db_pool_size,
            pooler=settings.database_pooler,
            direct=settings.database_direct_url,
        )
        credentials = Credentials(
            db, size=settings.credential_cache_size, ttl_s=settings.credential_cache_ttl_s
        )
        budgets = BudgetRuntime(
            db,
            lease_share=settings.lease_share,
            hold_ttl_s=settings.hold_ttl_s,
            trusted=credentials.cache.trusted,
        )
        # A change to a credential or a budget drops its leases before it is acknowledged.
        credentials.cache.on_change.append(budgets.leases.drop)
        services = Services(
            settings=settings,
            db=db,
            passwords=Passwords(),
            signer=Signer(settings.secret),
            credential_failures=FailedCredentials(settings.auth_failures_per_minute),
            credentials=credentials,
            upstreams=Upstreams(catalog, settings.upstream_max_connections),
            breakers=Breakers(
                settings.breaker_failures, settings.breaker_cooldown_s, clock.monotonic
            ),
            # The holds of the requests being served here, extended while they run.
            live_holds=LiveHolds(),
            budgets=budgets,
            catalog=catalog,
            refusals=RefusalLog(db, metrics.refusal_dropped),
            tracing=tracing,
            clock=clock,
            after_commit=credentials.committed,
        )
        install(app, services)
        if isinstance(app, Application) and app.direct is not None:
            app.direct.services = services  # the chat route's own way to the container
        services.credentials.start()
        budgets.start()
        await record_prices(db, catalog)
        keep_alive = asyncio.create_task(services.live_holds.keep_alive(db, settings.hold_ttl_s))

        async def watch_catalog() -> None:
            if await store.reload_if_changed(db):
                services.upstreams.ensure(store.current)
                services.catalog = store.current

        scheduler = (
            jobs.start_scheduler(
                db,
                settings.hold_ttl_s,
                settings.retention_days,
                settings.run_idle_s,
                settings.responses_retention_days,
            )
            if run_jobs
            else None
        )
        if run_jobs:
            services.outbox = Outbox(
                db,
                poll_s=settings.webhook_poll_s,
                timeout_s=settings.webhook_timeout_s,
                concurrency=settings.webhook_concurrency,
                per_webhook=settings.webhook_per_endpoint,
                policy=Policy(
                    base_s=settings.webhook_backoff_base_s,
                    max_s=settings.webhook_backoff_max_s,
                    retry_for_s=settings.webhook_retry_for_s,
                ),
                reach=Reach.of(settings),
            )
            services.outbox.start()
        if scheduler is not None and store.path is not None:
            scheduler.add_job(
                jobs.guard(watch_catalog),
                "interval",
                id="watch_catalog",
                name="watch_catalog",
                seconds=settings.config_poll_s,
                max_instances=1,
                coalesce=True,
            )
        try:
            yield
        finally:
            keep_alive.cancel()
            if scheduler is not None:
                scheduler.shutdown(wait=False)
            if services.outbox is not None:
                await services.outbox.close()
            await services.upstreams.close()
            await budgets.close()
            await services.credentials.stop()
            await db.dispose()
            if tracing is not None:
                # The spans not yet exported are sent (the exporter's timeout bounds it).
                await asyncio.to_thread(tracing.shutdown)

    openapi = settings.openapi_enabled
    app = Application(
        title="metering",
        version=__version__,
        lifespan=lifespan,
        # /docs is Swagger UI with its files served from here (metering.dashboard.apidocs).
        docs_url=None,
        openapi_url=OPENAPI_URL if openapi else None,
        redoc_url=None,
        # Every query parameter, on every route: no control character reaches a query.
        dependencies=[Depends(valid_parameters)],
        # A path with an empty id (/v1/users/) names nothing: a 404, not a redirect to the
        # listing at /v1/users, whose answer is not the object's.
        redirect_slashes=False,
    )
    install_error_handlers(app)
    declare_security(app)
    declare_event_schema(app)
    declare_parameters(app)  # after the event schema: it completes every component
    for error in (
        sa_exc.OperationalError,
        sa_exc.InterfaceError,
        sa_exc.TimeoutError,
        ConnectionError,
    ):
        app.add_exception_handler(error, _ledger_unavailable)
    app.add_exception_handler(sa_exc.DBAPIError, _database_error)
    app.add_exception_handler(ClientDisconnect, _client_gone)
    app.add_exception_handler(Exception, _internal_error)
    app.include_router(proxy_router)
    app.include_router(responses_router)
    app.include_router(identity_router)
    app.include_router(budgets_router)
    app.include_router(reports_router)
    app.include_router(billing_router)
    app.include_router(alerts_router)
    app.include_router(metrics_router)
    app.include_router(auth_router)
    app.include_router(dashboard_router)
    if openapi:
        app.include_router(apidocs_router)

    @app.get("/healthz", dependencies=[Depends(open_access)])
    async def healthz() -> Health:
        """The process answers (liveness)."""
        return Health(status="ok", version=__version__)

    @app.get("/readyz", dependencies=[Depends(open_access)], responses=error_responses(503))
    async def readyz(services: ServicesDep) -> Ready:
        """The database answers too (readiness)."""
        async with services.db.engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
        return Ready(status="ready")

    app.add_middleware(ContentEncoding, limit=settings.max_body_bytes, limits=LARGER_BODIES)
    app.add_middleware(RequestId)
    app.add_middleware(RefreshedTokenHeaders)
    # Ahead of the whole stack, FastAPI's own layers included: the proxy's own route (it does
    # the part of those layers it needs itself).
    app.direct = DirectChat(app.stack, application=app)
    app.clock = clock
    return app
