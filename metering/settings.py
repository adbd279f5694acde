"""Settings from the environment (prefix METERING_, a .env file too) and the TOML catalog."""

import os
import tomllib
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import ClassVar

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from metering.dburl import hosts_in_query
from metering.money import MoneyError, parse_usd, price_to_micro
from metering.timefmt import parse_rfc3339

ADMIN_KEY_MIN_CHARS = 32
# METERING_DATABASE_POOLER's values (metering.db builds the engine for each).
POOLERS = ("pgbouncer",)
DIALECTS = ("openai", "exascale", "genesis", "tokenchange", "nim")
# The `model` a client sees in an answer: the upstream's own name, or the one it asked for.
RESPONSE_MODELS = ("upstream", "requested")


class Settings(BaseSettings):
    """Every setting, from METERING_<NAME> (a .env file too). Each field's docstring is its
    meaning in docs/operator/configuration.md (`make reference` writes the page from this class;
    a test fails while the page is not what the class says)."""

    model_config = SettingsConfigDict(
        env_prefix="METERING_", env_file=".env", extra="ignore", use_attribute_docstrings=True
    )

    database_url: str = "sqlite:///./metering.db"
    """The database: `sqlite:///PATH` (one process) or `postgresql://user@host:port/db` (any
    number of replicas and workers). Several PostgreSQL hosts, a primary and its standbys:
    `postgresql://user@h1:5432,h2:5432/db?target_session_attrs=read-write` (or
    `postgresql://user@/db?host=h1:5432&host=h2:5432&target_session_attrs=read-write`): every
    connection goes to the one that accepts writes, found again after a failover."""
    database_password: str | None = Field(default=None, repr=False)
    """The database's password, quoted into the database URL (replacing the URL's own), so it may
    hold any character, `@ : / %` included; docker-compose.yml passes POSTGRES_PASSWORD here.
    Unset: the URL's own."""
    database_pooler: str | None = None
    """`pgbouncer`: METERING_DATABASE_URL is a pooler in transaction mode (PgBouncer, or a
    managed database's pooler): no prepared statement is kept by name and no setting is given
    at connect (docs/operator/pgbouncer.md). Unset: a direct connection or a session pooler."""
    database_direct_url: str | None = None
    """The same database without the pooler, for what needs a session of its own (the
    credential listener's LISTEN) and for the migrations. The database name, user and password
    it leaves out are METERING_DATABASE_URL's (METERING_DATABASE_PASSWORD's). Unset: the
    database URL."""
    admin_key: str | None = None
    """The operator's key for the admin API, at least 32 characters (`openssl rand -hex 32`);
    `metering serve` refuses a shorter one or one containing `change-me`. Empty is unset: the
    admin API answers 401."""
    admin_key_min_chars: ClassVar[int] = ADMIN_KEY_MIN_CHARS
    config: str | None = None
    """The TOML catalog of providers, models and prices. Unset: `./metering.toml` if it exists,
    else an empty catalog."""
    secret: str | None = None
    """The secret access tokens are signed with (a key derived from it). Unset: one is made once
    and kept in the database, shared by every replica."""
    hold_ttl_s: int = 900
    """A hold not settled after this many seconds is charged as `unsettled`; the sweeper runs
    every min(60, ttl/4) seconds. Requests still running extend their holds."""
    # Bounds on one upstream answer: an SSE event (or line), the whole body or stream, and how
    # long a request may run (seconds, from its arrival). Beyond: 502/504 or an error event.
    max_sse_event_bytes: int = Field(default=1024 * 1024, ge=1024)
    """The longest SSE event (or line without a newline) an upstream may send; beyond: 502
    `max_sse_event_bytes` (an error event once the stream has started)."""
    max_response_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    """The longest upstream body, or whole stream, in bytes; beyond: 502
    `max_response_bytes`."""
    max_response_s: float = Field(default=3600.0, gt=0)
    """The longest a request may run, from its arrival to the end of its answer (seconds);
    beyond: 504 `max_response_s`."""
    settle_retry_s: float = Field(default=30.0, ge=0)
    """How long a settle (or release) is retried while the database cannot be reached (seconds);
    keep it below the hold TTL."""
    max_body_bytes: int = 4 * 1024 * 1024
    """The largest request body accepted, decoded (413 `request_too_large` beyond);
    POST /v1/reconciliations takes larger files."""
    # Slow and hostile clients (metering.server): deadlines for a request's headers (from the
    # connection's opening) and body (from the end of its headers), the size of the request line
    # and headers, and the open connections one process accepts (beyond: 503).
    header_timeout_s: float = Field(default=10.0, gt=0)
    """A request's line and headers must arrive within this many seconds of the connection's
    opening (or of a kept-alive connection's next request); beyond: 408 `request_timeout`, the
    connection closed."""
    body_timeout_s: float = Field(default=30.0, gt=0)
    """A request's whole body must arrive within this many seconds of the end of its headers;
    beyond: 408 `request_timeout`, the connection closed, nothing sent upstream."""
    max_header_bytes: int = Field(default=64 * 1024, ge=1024)
    """The request line and headers, in bytes; beyond: 431 `headers_too_large`, the connection
    closed."""
    max_connections: int = Field(default=1000, ge=1)
    """The open client connections one process accepts; one beyond is answered 503
    `server_busy` (`retry-after: 1`) and closed."""
    # Longer than the clients' own pools keep an idle connection (httpx and the openai SDK 5 s,
    # aiohttp 15 s), so that a client never sends a request on a connection the server is
    # closing at that very moment.
    keep_alive_s: float = Field(default=20.0, gt=0, le=3600)
    """How long an idle kept-alive client connection stays open (seconds); keep it above the
    idle time of the clients' pools and of a load balancer in front (AWS ALB: 60 s)."""
    forwarded_allow_ips: str = "127.0.0.1"
    """Proxies trusted to give the client's address in `X-Forwarded-For` (comma-separated
    addresses, or `*`): the address the failed-credential throttle counts by."""
    auth_failures_per_minute: int = Field(default=600, ge=1)
    """Failed bearer credentials one client address may present per minute; then 429
    `rate_limited` until the minute ends."""
    # A revocation or deletion drops cached credentials on every replica before its call returns.
    credential_cache_size: int = Field(default=10_000, ge=0)
    """Credentials (API tokens, login sessions) each process keeps, oldest dropped first; 0 turns
    the cache off."""
    credential_cache_ttl_s: float = Field(default=60.0, gt=0)
    """The longest a cached credential is kept (seconds): a safety net, since changes drop
    entries at once on every replica."""
    lease_share: int = Field(default=8, ge=0, le=1000)
    """Credit leases: each process takes 1/N of what is left of a busy budget and admits
    requests against it in memory; 0 turns leases off."""
    openapi_enabled: bool = True
    """Serve GET /openapi.json and GET /docs (Swagger UI); false answers both 404."""
    token_max_lifetime_s: int | None = Field(default=None, ge=1)
    """The longest lifetime of a token created or extended from now on (seconds); a longer, or
    no, expiry is capped to it. Unset: any."""
    access_token_ttl_s: int = 900
    """The lifetime of an access token (`mat_...`) from POST /v1/auth/login (seconds)."""
    refresh_token_ttl_s: int = 2_592_000
    """The lifetime of a refresh token (`mrt_...`), each refresh starting a new one (seconds)."""
    metrics_key: str | None = None
    """If set, GET /metrics wants `Authorization: Bearer` this key (401 otherwise) and also
    serves the series that name a team, user or token. Unset: /metrics is open, aggregate
    series only."""
    upstream_max_connections: int = 1000
    """Pooled connections one process keeps to each upstream."""
    db_pool_size: int = 20
    """Database connections per process (PostgreSQL), up to twice this under a burst."""
    config_poll_s: float = 2.0
    """How often the catalog file is checked for changes (seconds); a change is loaded without
    a restart."""
    breaker_failures: int = Field(default=3, ge=1)
    """A provider failing this many times in a row rests for METERING_BREAKER_COOLDOWN_S."""
    breaker_cooldown_s: float = Field(default=30.0, gt=0)
    """How long a failing provider rests before it is tried again (seconds)."""
    retention_days: int | None = Field(default=None, ge=1)
    """Events older than this many days move to `ledger_events_archive` (spend reports keep
    them; /v1/usage no longer lists them); older refusals, alert events and finished webhook
    deliveries are deleted. Unset: everything is kept."""
    focus_billing_account: str = Field(default="metering", min_length=1, max_length=200)
    """The FOCUS export's BillingAccountId and BillingAccountName (GET /v1/exports/focus)."""
    run_idle_s: int = Field(default=3600, ge=1, le=30 * 86400)
    """A run (`x-metering-run`) not used for this long is forgotten (seconds): its id may start
    a new run."""
    webhooks_allow_loopback: bool = False
    """Webhooks may reach loopback addresses, over http:// too (tests and the demo)."""
    webhooks_allow_private: bool = False
    """Webhooks may reach private and shared addresses (10/8, 172.16/12, 192.168/16, fc00::/7,
    100.64/10); link-local, multicast, reserved and unspecified addresses never."""
    webhook_poll_s: float = Field(default=1.0, gt=0, le=3600)
    """How often each replica looks for alert events to deliver (seconds)."""
    webhook_timeout_s: float = Field(default=10.0, gt=0, le=300)
    """One webhook POST's timeout (seconds)."""
    webhook_backoff_base_s: float = Field(default=1.0, gt=0, le=3600)
    """The first retry of a failed delivery waits this long, each next one twice as long
    (seconds)."""
    webhook_backoff_max_s: float = Field(default=3600.0, gt=0, le=86400)
    """The longest wait between two retries of a delivery (seconds)."""
    webhook_retry_for_s: float = Field(default=86400.0, gt=0, le=30 * 86400)
    """A delivery is retried for this long, then marked failed (seconds)."""
    webhook_concurrency: int = Field(default=16, ge=1, le=256)
    """Deliveries one replica sends at once, to all webhooks."""
    webhook_per_endpoint: int = Field(default=4, ge=1, le=256)
    """Deliveries one replica sends at once to one webhook: a receiver that hangs holds these
    slots at most, never all of METERING_WEBHOOK_CONCURRENCY."""

    @field_validator("database_url")
    @classmethod
    def _hosts_in_query(cls, value: str) -> str:
        return hosts_in_query(value)

    @field_validator("database_direct_url", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: str | None) -> str | None:
        return hosts_in_query(value) if value else None

    @field_validator("database_pooler", mode="before")
    @classmethod
    def _known_pooler(cls, value: str | None) -> str | None:
        if value and value not in POOLERS:
            raise ValueError(
                f"METERING_DATABASE_POOLER is {value!r}: unset, or one of {', '.join(POOLERS)}"
            )
        return value or None

    @field_validator("admin_key")
    @classmethod
    def _admin_key_long_enough(cls, value: str | None) -> str | None:
        if not value:
            return None  # empty is unset: the admin API answers 401
        if len(value) < cls.admin_key_min_chars:
            raise ValueError(
                f"METERING_ADMIN_KEY must be at least {cls.admin_key_min_chars} characters "
                f"(it has {len(value)}): make one with `openssl rand -hex 32`"
            )
        return value

    @model_validator(mode="after")
    def _password_into_url(self) -> "Settings":
        if self.database_password:
            # Loaded here: the settings of a command that never opens a database, or is refused
            # for a wrong one, do not pay for SQLAlchemy.
            from sqlalchemy.engine import make_url
            from sqlalchemy.exc import ArgumentError

            try:
                url = make_url(self.database_url)
            except ArgumentError:
                raise ValueError(
                    "METERING_DATABASE_URL is not a database URL (sqlite:///PATH or "
                    "postgresql://user@host:port/db)"
                ) from None
            url = url.set(password=self.database_password)
            self.database_url = url.render_as_string(hide_password=False)
        return self

    def config_path(self) -> Path | None:
        if self.config:
            return Path(self.config)
        default = Path("metering.toml")
        return default if default.exists() else None


class CatalogError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Provider:
    name: str
    base_url: str
    dialect: str
    api_key: str | None
    timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    # NIM's pending answers (202 + NVCF-REQID): where and how long to poll for the result.
    status_url: str | None = None
    poll_interval_s: float = 0.5
    poll_timeout_s: float = 300.0
    # `requested`: answers name the model as the client asked for it (metering.proxy.rename).
    response_model: str = "upstream"


@dataclass(frozen=True, slots=True)
class ModelRoute:
    """One provider's offer of a model, with its prices in micro-USD per 1M tokens."""

    name: str
    provider: str
    upstream_model: str
    input_micro: int
    output_micro: int
    cached_micro: int
    max_output_tokens: int
    # From when this price holds, if the entry says so (a correction back-dated: recorded in
    # the price history from then; rerating the events since applies it).
    effective_from: datetime | None = None


@dataclass(slots=True)
class Catalog:
    providers: dict[str, Provider] = field(default_factory=dict)
    models: dict[str, list[ModelRoute]] = field(default_factory=dict)

    def routes(self, model: str) -> list[ModelRoute]:
        return self.models.get(model, [])


def _price(entry: dict, key: str, where: str) -> int:
    try:
        return price_to_micro(parse_usd(entry[key], places=6, field=f"{where}.{key}"))
    except KeyError:
        raise CatalogError(f"{where}: {key} is required") from None
    except MoneyError as exc:
        raise CatalogError(str(exc)) from None


def _response_model(entry: dict, where: str, default: str) -> str:
    value = entry.get("response_model", default)
    if value not in RESPONSE_MODELS:
        raise CatalogError(f"{where}response_model must be one of {', '.join(RESPONSE_MODELS)}")
    return str(value)


def _provider(name: str, entry: dict, environ: dict, response_model: str) -> Provider:
    where = f"providers.{name}"
    dialect = entry.get("dialect", "openai")
    if dialect not in DIALECTS:
        raise CatalogError(f"{where}.dialect must be one of {', '.join(DIALECTS)}")
    base_url = entry.get("base_url")
    if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        raise CatalogError(f"{where}.base_url must be an http(s) URL")
    key_env = entry.get("api_key_env")
    api_key = environ.get(key_env) if isinstance(key_env, str) else entry.get("api_key")
    return Provider(
        name=name,
        base_url=base_url.rstrip("/"),
        dialect=dialect,
        api_key=api_key,
        timeout_s=_positive(entry, "timeout_s", 600, where),
        connect_timeout_s=_positive(entry, "connect_timeout_s", 10, where),
        status_url=entry.get("status_url"),
        poll_interval_s=_positive(entry, "poll_interval_s", 0.5, where),
        poll_timeout_s=_positive(entry, "poll_timeout_s", 300, where),
        response_model=_response_model(entry, f"{where}.", response_model),
    )


def _positive(entry: dict, key: str, default: float, where: str) -> float:
    value = entry.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise CatalogError(f"{where}.{key} must be a positive number of seconds")
    return float(value)


def _route(i: int, entry: dict, providers: dict[str, Provider]) -> ModelRoute:
    where = f"models[{i}]"
    name, provider = entry.get("name"), entry.get("provider")
    if not isinstance(name, str) or not name:
        raise CatalogError(f"{where}.name is required")
    if provider not in providers:
        raise CatalogError(f"{where}.provider {provider!r} is not a configured provider")
    input_micro = _price(entry, "input_usd_per_mtok", where)
    cached = entry.get("cached_input_usd_per_mtok")
    max_output = entry.get("max_output_tokens", 4096)
    if not isinstance(max_output, int) or isinstance(max_output, bool) or max_output < 1:
        raise CatalogError(f"{where}.max_output_tokens must be a positive integer")
    return ModelRoute(
        name=name,
        provider=provider,
        upstream_model=str(entry.get("upstream_model", name)),
        input_micro=input_micro,
        output_micro=_price(entry, "output_usd_per_mtok", where),
        cached_micro=(
            _price(entry, "cached_input_usd_per_mtok", where) if cached is not None else input_micro
        ),
        max_output_tokens=max_output,
        effective_from=_effective_from(entry.get("effective_from"), where),
    )


def _effective_from(value, where: str) -> datetime | None:
    """`effective_from`: RFC 3339 text (or a TOML datetime with its zone), or absent."""
    if value is None:
        return None
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise CatalogError(f"{where}.effective_from needs a time zone")
        return value.astimezone(UTC)
    if not isinstance(value, str) or len(value) > 64:
        raise CatalogError(f"{where}.effective_from must be an RFC 3339 timestamp")
    try:
        return parse_rfc3339(value)
    except ValueError as exc:
        raise CatalogError(f"{where}.effective_from: {exc}") from None


def parse_catalog(data: dict, environ: dict | None = None) -> Catalog:
    environ = dict(os.environ) if environ is None else environ
    # Global, and per provider over it.
    response_model = _response_model(data, "", "upstream")
    providers = {
        name: _provider(name, entry, environ, response_model)
        for name, entry in (data.get("providers") or {}).items()
    }
    catalog = Catalog(providers=providers)
    for i, entry in enumerate(data.get("models") or []):
        route = _route(i, entry, providers)
        catalog.models.setdefault(route.name, []).append(route)
    return catalog


def load_catalog(path: Path | None, environ: dict | None = None) -> Catalog:
    if path is None:
        return Catalog()
    with open(path, "rb") as f:
        return parse_catalog(tomllib.load(f), environ)
