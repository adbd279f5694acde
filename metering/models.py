"""The tables of teams, users, credentials, budgets, holds, alerts and the rest of the schema;
the ledger's own tables are metering.ledger.tables. Money columns are integer picodollars;
prices are integer micro-USD per 1M tokens."""

from datetime import datetime

from sqlalchemy import BigInteger, Boolean, ForeignKey, Index, Integer, String, Text, text
from sqlalchemy.orm import Mapped, mapped_column

from metering.db import Base, Pico, UTCDateTime


class Team(Base):
    __tablename__ = "teams"
    __table_args__ = (
        # Names are unique among live teams, compared without case: racing creations and
        # renames meet here (the service's check names the holder in its 409).
        Index(
            "uq_teams_name_live",
            text("lower(name)"),
            unique=True,
            sqlite_where=text("deleted_at IS NULL"),
            postgresql_where=text("deleted_at IS NULL"),
        ),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # Limits beyond credit (metering.budgets.rates); None: no such limit at this scope.
    rpm_limit: Mapped[int | None] = mapped_column(Integer)
    tpm_limit: Mapped[int | None] = mapped_column(BigInteger)
    max_parallel_requests: Mapped[int | None] = mapped_column(Integer)
    allowed_models: Mapped[str | None] = mapped_column(Text)  # a JSON list; None: every model
    # The default budget of each of its end users (metering.budgets.end_users); a limit of None:
    # end users without an override of their own are not limited.
    end_user_credit_limit: Mapped[int | None] = mapped_column(Pico)
    end_user_reset_interval: Mapped[str] = mapped_column(
        String(20), default="never", server_default="never"
    )


class User(Base):
    __tablename__ = "users"
    __table_args__ = (
        Index(
            "uq_users_email_live",
            "email",
            unique=True,
            sqlite_where=text("deleted_at IS NULL"),
            postgresql_where=text("deleted_at IS NULL"),
        ),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    email: Mapped[str] = mapped_column(String(320))
    name: Mapped[str] = mapped_column(String(200))
    team_id: Mapped[str] = mapped_column(ForeignKey("teams.id"), index=True)
    password_hash: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # Limits beyond credit (metering.budgets.rates); None: no such limit at this scope.
    rpm_limit: Mapped[int | None] = mapped_column(Integer)
    tpm_limit: Mapped[int | None] = mapped_column(BigInteger)
    max_parallel_requests: Mapped[int | None] = mapped_column(Integer)
    allowed_models: Mapped[str | None] = mapped_column(Text)  # a JSON list; None: every model


class ApiToken(Base):
    __tablename__ = "api_tokens"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    prefix: Mapped[str] = mapped_column(String(16))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # Limits beyond credit (metering.budgets.rates); None: no such limit at this scope.
    rpm_limit: Mapped[int | None] = mapped_column(Integer)
    tpm_limit: Mapped[int | None] = mapped_column(BigInteger)
    max_parallel_requests: Mapped[int | None] = mapped_column(Integer)
    allowed_models: Mapped[str | None] = mapped_column(Text)  # a JSON list; None: every model


class Budget(Base):
    """The running counters of one token's, user's or team's credit limit in its current window."""

    __tablename__ = "budgets"

    subject_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    scope: Mapped[str] = mapped_column(String(8))  # token | user | team | end_user
    credit_limit: Mapped[int | None] = mapped_column(Pico)
    reset_interval: Mapped[str] = mapped_column(String(20))
    anchor_at: Mapped[datetime] = mapped_column(UTCDateTime)
    window_start: Mapped[datetime] = mapped_column(UTCDateTime)
    spent: Mapped[int] = mapped_column(Pico, default=0)
    reserved: Mapped[int] = mapped_column(Pico, default=0)
    # Alerts (metering.alerts): percentages of credit_limit as a JSON list (None: the default
    # [50, 80, 100]), and an amount that alerts but never refuses.
    alert_thresholds: Mapped[str | None] = mapped_column(String(200))
    soft_limit: Mapped[int | None] = mapped_column(Pico)


class BudgetWindow(Base):
    """A closed window's total, kept when the window rolls over."""

    __tablename__ = "budget_windows"

    subject_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    window_start: Mapped[datetime] = mapped_column(UTCDateTime, primary_key=True)
    window_end: Mapped[datetime | None] = mapped_column(UTCDateTime)
    scope: Mapped[str] = mapped_column(String(8))
    credit_limit: Mapped[int | None] = mapped_column(Pico)
    spent: Mapped[int] = mapped_column(Pico)
    recorded_at: Mapped[datetime] = mapped_column(UTCDateTime)


class BudgetLease(Base):
    """A slice of one budget's credit reserved by one serving process (metering.budgets.leases):
    counted in the budget's `reserved`; the process admits requests against it in memory."""

    __tablename__ = "budget_leases"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    subject_id: Mapped[str] = mapped_column(String(40), index=True)
    owner: Mapped[str] = mapped_column(String(40))
    amount: Mapped[int] = mapped_column(Pico)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)


class Hold(Base):
    """Credit reserved for a request in flight; deleted when it settles.

    A hold reserved in the database (`leased` false) is counted in each budget's `reserved`. A
    hold admitted against leases (`leased` true) is carved out of them: each limited budget's
    lease is named here (the foreign key keeps a lease from being returned while a hold still
    names it); a budget without a limit has none and nothing reserved."""

    __tablename__ = "holds"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    token_id: Mapped[str | None] = mapped_column(String(40))
    user_id: Mapped[str] = mapped_column(String(40))
    team_id: Mapped[str] = mapped_column(String(40))
    amount: Mapped[int] = mapped_column(Pico)
    model: Mapped[str] = mapped_column(String(200))
    provider: Mapped[str] = mapped_column(String(100))
    upstream_model: Mapped[str] = mapped_column(String(200))
    stream: Mapped[bool] = mapped_column(Boolean)
    input_price: Mapped[int] = mapped_column(BigInteger)
    cached_price: Mapped[int] = mapped_column(BigInteger)
    output_price: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
    leased: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("false"))
    token_lease: Mapped[str | None] = mapped_column(ForeignKey("budget_leases.id"), index=True)
    user_lease: Mapped[str | None] = mapped_column(ForeignKey("budget_leases.id"), index=True)
    team_lease: Mapped[str | None] = mapped_column(ForeignKey("budget_leases.id"), index=True)
    # The rate counters this request took (metering.budgets.rates), given back by whoever ends
    # the hold: its kinds per scope, the rate window counted in, the tokens reserved there.
    rate_kinds: Mapped[str | None] = mapped_column(String(16))
    rate_window: Mapped[datetime | None] = mapped_column(UTCDateTime)
    rate_tokens: Mapped[int | None] = mapped_column(BigInteger)
    # The run (metering.budgets.runs) the request is held against as well, if any.
    run_id: Mapped[str | None] = mapped_column(String(100))
    # Who and what it is for (metering.ledger.outcome.Attribution), so that a hold charged on
    # expiry is attributed like the request: its end user, and its tags as JSON text.
    end_user: Mapped[str | None] = mapped_column(String(256))
    tags: Mapped[str | None] = mapped_column(Text)
    # The API called (chat.completions or responses; None: chat.completions).
    endpoint: Mapped[str | None] = mapped_column(String(32))
    # The end user's budget (metering.budgets.end_users) the hold is reserved in too, if any:
    # whoever ends the hold gives it back there, whatever the end user's limit became since.
    end_user_budget: Mapped[str | None] = mapped_column(String(40))


class RateCounter(Base):
    """One subject's requests or tokens in the current rate window, or its requests in flight
    (kind `parallel`, whose window never rolls): metering.budgets.rates."""

    __tablename__ = "rate_counters"

    subject_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    kind: Mapped[str] = mapped_column(String(8), primary_key=True)  # rpm | tpm | parallel
    window_start: Mapped[datetime] = mapped_column(UTCDateTime)
    used: Mapped[int] = mapped_column(BigInteger)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)


class AuthReplica(Base):
    """A process serving requests with a credential cache: its heartbeat and the last change
    to credentials it has applied (metering.auth.invalidation)."""

    __tablename__ = "auth_replicas"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime)
    acked_seq: Mapped[int] = mapped_column(BigInteger, server_default="0")


class KeyValue(Base):
    """Small process-wide values shared by every replica (e.g. a generated signing secret)."""

    __tablename__ = "key_values"

    key: Mapped[str] = mapped_column(String(100), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class Price(Base):
    """A provider's price for a model from the moment it took effect. Rows are only ever added."""

    __tablename__ = "prices"
    __table_args__ = (Index("ix_prices_model_provider", "model", "provider", "effective_from"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    model: Mapped[str] = mapped_column(String(200))
    provider: Mapped[str] = mapped_column(String(100))
    upstream_model: Mapped[str] = mapped_column(String(200))
    input_price: Mapped[int] = mapped_column(BigInteger)
    cached_price: Mapped[int] = mapped_column(BigInteger)
    output_price: Mapped[int] = mapped_column(BigInteger)
    effective_from: Mapped[datetime] = mapped_column(UTCDateTime)


class AuthSession(Base):
    """One login: a chain of refresh tokens (a "family"). Revoking it ends every token of the chain."""

    __tablename__ = "auth_sessions"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id"), index=True)
    # A digest of the user's password hash at login: a new password ends the session.
    password_stamp: Mapped[str] = mapped_column(String(64))
    generation: Mapped[int] = mapped_column(Integer)  # of the newest refresh token
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    refreshed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    revoked_reason: Mapped[str | None] = mapped_column(String(32))


class RefreshToken(Base):
    """A refresh token of a session, by its SHA-256 only. Spent ones stay, to recognise reuse."""

    __tablename__ = "refresh_tokens"

    token_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("auth_sessions.id"), index=True)
    generation: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    spent_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class LoginThrottle(Base):
    """Recent failed logins of one email (by its SHA-256), shared by every replica."""

    __tablename__ = "login_throttles"

    email_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    failures: Mapped[int] = mapped_column(Integer)
    last_failure_at: Mapped[datetime | None] = mapped_column(UTCDateTime, index=True)
    locked_until: Mapped[datetime | None] = mapped_column(UTCDateTime)


class Reconciliation(Base):
    """One comparison of a provider's usage export with the ledger; the result as JSON text."""

    __tablename__ = "reconciliations"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    provider: Mapped[str] = mapped_column(String(100))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    tolerance: Mapped[str] = mapped_column(String(32))
    result: Mapped[str] = mapped_column(Text)


class IngestedKey(Base):
    """An idempotency key of POST /v1/events, kept for good (a key seen once answers
    `duplicate` forever): unique per team, with the event it made and a digest of what was
    sent under it (the same key with other content is a `conflict`)."""

    __tablename__ = "ingested_keys"

    team_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    idempotency_key: Mapped[str] = mapped_column(String(200), primary_key=True)
    event_id: Mapped[str] = mapped_column(String(40))
    digest: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class IngestKey(Base):
    """A team's ingestion key: reports usage for that team's tokens, users and team only
    (POST /v1/events), charged in full. Only its SHA-256 is stored; the secret is shown once."""

    __tablename__ = "ingest_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    team_id: Mapped[str] = mapped_column(ForeignKey("teams.id"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    prefix: Mapped[str] = mapped_column(String(16))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class Run(Base):
    """A run's own budget (x-metering-run, x-metering-run-budget): the fourth scope a request
    is held against; forgotten after METERING_RUN_IDLE_S without a request."""

    __tablename__ = "runs"

    team_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    id: Mapped[str] = mapped_column(String(100), primary_key=True)
    credit_limit: Mapped[int] = mapped_column(Pico)
    spent: Mapped[int] = mapped_column(Pico, default=0)
    reserved: Mapped[int] = mapped_column(Pico, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    last_used_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)


class EndUserBudget(Base):
    """An end user of a team with a budget (its row of `budgets`, scope `end_user`, keyed by
    `subject_id`): made by its first request while the team has a default limit, or by an
    override. `override` false: the team's default applies (credit_limit and reset_interval
    here unused)."""

    __tablename__ = "end_user_budgets"
    __table_args__ = (
        Index("uq_end_user_budgets_team_end_user", "team_id", "end_user", unique=True),
    )

    subject_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    team_id: Mapped[str] = mapped_column(String(40))
    end_user: Mapped[str] = mapped_column(String(256))
    override: Mapped[bool] = mapped_column(Boolean, default=False)
    credit_limit: Mapped[int | None] = mapped_column(Pico)
    reset_interval: Mapped[str | None] = mapped_column(String(20))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class AlertEvent(Base):
    """One alert, written in the transaction that caused it: the outbox. `dedupe_key` makes it
    once per budget, threshold and window; `dispatched` turns true when its deliveries exist."""

    __tablename__ = "alert_events"
    __table_args__ = (
        Index("ix_alert_events_created", "created_at", "id"),
        Index("ix_alert_events_dispatched", "dispatched", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    type: Mapped[str] = mapped_column(String(40))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    scope: Mapped[str] = mapped_column(String(16))
    subject_id: Mapped[str] = mapped_column(String(40))
    team_id: Mapped[str | None] = mapped_column(String(40))
    user_id: Mapped[str | None] = mapped_column(String(40), index=True)
    dedupe_key: Mapped[str] = mapped_column(String(200), unique=True)
    data: Mapped[str] = mapped_column(Text)  # the body's `data`, as JSON
    dispatched: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("false"))


class Webhook(Base):
    """A receiver of alert events: global (team_id None) or one team's."""

    __tablename__ = "webhooks"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    url: Mapped[str] = mapped_column(Text)
    events: Mapped[str] = mapped_column(Text)  # a JSON list of event types
    team_id: Mapped[str | None] = mapped_column(String(40))
    secret: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class WebhookDelivery(Base):
    """One event to one webhook: pending until a 2xx, retried with backoff, then failed.
    `claimed_until`: a replica sending it; a claim that expires (its replica died) is taken
    again by another."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        Index("uq_webhook_deliveries_pair", "webhook_id", "event_id", unique=True),
        Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    webhook_id: Mapped[str] = mapped_column(String(40))
    event_id: Mapped[str] = mapped_column(String(40))
    status: Mapped[str] = mapped_column(String(12))  # pending | delivered | failed
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    next_attempt_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    claimed_until: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_status_code: Mapped[int | None] = mapped_column(Integer)
    last_error: Mapped[str | None] = mapped_column(String(300))
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class WebhookAttempt(Base):
    """One POST of a delivery: its status code (None: no answer) and a short excerpt."""

    __tablename__ = "webhook_attempts"

    delivery_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime)
    status_code: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(String(300))
    duration_ms: Mapped[int] = mapped_column(Integer)


class Refusal(Base):
    """A request refused before anything was reserved or sent (402 budget, 429 rate or
    parallel, 403 model): never a ledger event, never charged to a budget."""

    __tablename__ = "refusals"
    __table_args__ = (
        Index("ix_refusals_created", "created_at", "id"),
        Index("ix_refusals_user_created", "user_id", "created_at"),
        Index("ix_refusals_team_created", "team_id", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    token_id: Mapped[str | None] = mapped_column(String(40))
    user_id: Mapped[str] = mapped_column(String(40))
    team_id: Mapped[str] = mapped_column(String(40))
    model: Mapped[str] = mapped_column(String(200))
    reason: Mapped[str] = mapped_column(String(16))  # budget | rpm | tpm | parallel | model
    scope: Mapped[str] = mapped_column(String(8))  # token | user | team: whose limit refused
    subject_id: Mapped[str] = mapped_column(String(40))  # that token's, user's or team's id
    http_status: Mapped[int] = mapped_column(Integer)
    code: Mapped[str] = mapped_column(String(40))  # the client's error code
    message: Mapped[str] = mapped_column(Text)  # the client's error message (at most 1000)
