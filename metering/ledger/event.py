"""A ledger event: one request that reached an upstream, the columns of table ledger_events.

`Event` declares every column once: its name, its Python type (`| None`: the column is
nullable), its SQL type and length, and how GET /v1/usage shows it. The ORM table
(metering.ledger.tables), the insert (metering.ledger.writer), the rollup, the JSON and CSV readers
(metering.reports.usage) and the tests all take the columns from here.

Money is integer picodollars (cost, uncharged); prices are micro-USD per 1M tokens, which is
picodollars per token.
"""

from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields, replace
from datetime import datetime
from types import NoneType, UnionType
from typing import Any, Self, get_args, overload

from sqlalchemy import BigInteger, Boolean, Column, Integer, String, Text
from sqlalchemy.types import TypeEngine

from metering.db import Pico, UTCDateTime

PROMPT_DETAILS = "prompt_tokens_details"
COMPLETION_DETAILS = "completion_tokens_details"
# The reported usage's cost above the charge kept per event: 1,000 USD, far above any real
# request's cost (the counts themselves are kept, so the reported cost can be recomputed), and
# small enough that sums over millions of events fit a signed 64-bit column.
MAX_UNCHARGED = 10**15
UNSETTLED = "unsettled"  # status and usage_source of a hold charged in full on expiry
INGESTED = "ingested"  # usage_source of usage recorded through POST /v1/events
USAGE = "usage"  # kind of an event that records usage
ADJUSTMENT = "adjustment"  # kind of an event that corrects another's charge (or credits one)
CHAT = "chat.completions"  # endpoint of a chat completion (and the default of usage ingested)
RESPONSES = "responses"  # endpoint of a Responses API request
ENDPOINTS = (CHAT, RESPONSES)


@dataclass(frozen=True, slots=True)
class Spec:
    """How one column is stored and shown."""

    sql: TypeEngine[Any]
    limit: int | None = None  # the longest text kept (a String's length unless given)
    public: bool = True  # shown by GET /v1/usage
    group: str | None = None  # the object GET /v1/usage nests it in
    money: bool = False  # picodollars, shown as a decimal USD string
    price: bool = False  # micro-USD per 1M tokens, shown as a decimal USD-per-1M-tokens string
    json_text: bool = False  # JSON text, shown in JSON as the value it holds (in CSV as text)
    server_default: str | None = None


def column(sql: TypeEngine[Any], *, default: object = MISSING, **spec: Any) -> Any:
    return field(default=default, metadata={"spec": Spec(sql, **spec)})


def _args(annotation: object) -> tuple[object, ...]:
    return get_args(annotation) if isinstance(annotation, UnionType) else ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """One row of the ledger, as an immutable value: a change (a charge capped at its hold, the
    moment of the placeholder it replaces) is a new Event. Append-only, but for the `unsettled`
    placeholder of a request whose hold was swept while it ran: its real outcome replaces it
    when it settles after all."""

    id: str = column(String(40))
    created_at: datetime = column(UTCDateTime())  # when it was charged
    started_at: datetime = column(UTCDateTime())  # when the attempt began
    token_id: str | None = column(String(40))
    user_id: str = column(String(40))
    team_id: str = column(String(40))
    model: str = column(String(200))
    provider: str = column(String(100))
    upstream_model: str = column(String(200))
    upstream_id: str | None = column(String(200))
    stream: bool = column(Boolean())
    status: str = column(String(32))
    http_status: int | None = column(Integer())
    finish_reason: str | None = column(String(64))
    prompt_tokens: int = column(BigInteger())
    completion_tokens: int = column(BigInteger())
    total_tokens: int = column(BigInteger())
    cached_tokens: int = column(BigInteger(), group=PROMPT_DETAILS)
    # completion_tokens_details.*; None when the upstream did not report the field.
    text_tokens: int | None = column(BigInteger(), group=COMPLETION_DETAILS)
    reasoning_tokens: int | None = column(BigInteger(), group=COMPLETION_DETAILS)
    audio_tokens: int | None = column(BigInteger(), group=COMPLETION_DETAILS)
    image_tokens: int | None = column(BigInteger(), group=COMPLETION_DETAILS)
    video_tokens: int | None = column(BigInteger(), group=COMPLETION_DETAILS)
    accepted_prediction_tokens: int | None = column(BigInteger(), group=COMPLETION_DETAILS)
    rejected_prediction_tokens: int | None = column(BigInteger(), group=COMPLETION_DETAILS)
    usage_source: str = column(String(16))  # reported | estimated | unsettled
    # Why the reported usage was not taken as it came (see metering.ledger.charge), or None.
    usage_anomaly: str | None = column(String(40))
    # The output allowance max_tokens was lowered to so that the credit left covers the
    # request (the response's x-max-tokens-clamped), or None when it was not lowered.
    max_tokens_clamped: int | None = column(BigInteger(), default=None)
    input_price: int = column(BigInteger(), price=True)
    cached_price: int = column(BigInteger(), price=True)
    output_price: int = column(BigInteger(), price=True)
    cost: int = column(Pico(), money=True)  # what the budgets were charged
    # The reported usage's cost above what was charged (the charge stops at the hold).
    uncharged: int = column(Pico(), money=True, server_default="0")
    ttft_ms: int | None = column(Integer())
    latency_ms: int | None = column(Integer())
    error: str | None = column(Text(), limit=2000)
    # usage, or adjustment: a correction appended to the ledger (its cost is the difference it
    # makes; the event it corrects, if any, and why). An original row is never rewritten.
    kind: str = column(String(16), server_default=USAGE, default=USAGE)
    corrects_event_id: str | None = column(String(40), default=None)
    reason: str | None = column(Text(), limit=500, default=None)
    # The run (x-metering-run) the request belonged to, within its team, or None.
    run_id: str | None = column(String(100), default=None)
    # Who the request was made for, within the team (x-metering-end-user, else the body's
    # `user`, else its `safety_identifier`), or None.
    end_user: str | None = column(String(256), default=None)
    # The request's tags (its `metadata` merged with x-metering-tags): a JSON object of string
    # values as compact text, its keys sorted; "{}" when none (metering.ledger.attribution).
    tags: str = column(Text(), limit=None, server_default="{}", default="{}", json_text=True)
    # The API the client called: chat.completions, or responses (the Responses API).
    endpoint: str = column(String(32), server_default=CHAT, default=CHAT)

    def params(self) -> dict[str, Any]:
        """The event as the insert's parameters (replaced below by its written-out form)."""
        return {name: getattr(self, name) for name in NAMES}

    def capped(self, amount: int) -> Self:
        """The event charging at most `amount` (what was held): the rest is recorded as
        uncharged. The event itself when it charges no more."""
        if self.cost <= amount:
            return self
        uncharged = min(self.uncharged + self.cost - amount, MAX_UNCHARGED)
        return replace(self, cost=amount, uncharged=uncharged)


SPECS: dict[str, Spec] = {f.name: f.metadata["spec"] for f in fields(Event)}
NAMES = tuple(SPECS)
NULLABLE = frozenset(f.name for f in fields(Event) if NoneType in _args(f.type))
PUBLIC = tuple(name for name, spec in SPECS.items() if spec.public)  # the CSV columns, in order
DETAIL_FIELDS = tuple(name for name, spec in SPECS.items() if spec.group == COMPLETION_DETAILS)
LIMITS = {
    name: spec.limit or getattr(spec.sql, "length", None)
    for name, spec in SPECS.items()
    if isinstance(spec.sql, String)
}


def _params_method() -> Callable[[Event], dict[str, Any]]:
    """Event.params(), written out for the declared columns when this module loads: a dict
    display of attributes is the fastest way to the insert's parameters (settle runs it for
    every request; dataclasses.asdict copies deeply and takes twenty times as long)."""
    items = ", ".join(f"{name!r}: self.{name}" for name in NAMES)
    namespace: dict[str, Any] = {}
    exec(f"def params(self):\n    return {{{items}}}\n", namespace)
    params: Callable[[Event], dict[str, Any]] = namespace["params"]
    params.__doc__ = "The event as the insert's parameters: every column, by name."
    params.__qualname__ = "Event.params"
    return params


# The same method, written out: mypy sees a plain callable replacing a method.
Event.params = _params_method()  # type: ignore[method-assign, assignment]


def columns() -> list[Column[Any]]:
    """The table's columns, new for each table built from them (ledger_events, its archive)."""
    return [
        Column(
            name,
            spec.sql,
            primary_key=name == "id",
            nullable=name in NULLABLE,
            default=0 if spec.server_default == "0" else None,
            server_default=spec.server_default,
        )
        for name, spec in SPECS.items()
    ]


@overload
def bounded(name: str, value: str) -> str: ...
@overload
def bounded(name: str, value: str | None) -> str | None: ...
def bounded(name: str, value: str | None) -> str | None:
    """Text from outside as its column can store it: no NUL (PostgreSQL refuses it), and no
    longer than the column, so a strange upstream can never make a settle fail."""
    if not value:
        return value
    return value.replace("\x00", "")[: LIMITS[name]]
