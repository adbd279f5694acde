"""The counted limits beyond credit: requests and tokens per minute, requests in flight (the
model allow-lists, the other limit beyond credit, are matched by metering.limits).

A rate limit is a budget of requests or tokens over a short window, kept in PostgreSQL (or
SQLite) so every replica and worker counts against the same row: one row of rate_counters per
subject (token, user, team) and kind (`rpm`, `tpm`, `parallel`).

Windows are fixed: the UTC minute (`window_of`). A request is admitted by ONE statement (the
requests with the same limits that reach a process together share one: AdmissionQueue), a
multi-row conditional upsert over every counter its limits name (sorted by subject and kind, the
one order every writer uses): each row is moved into the current window if its window has ended
(a row is never moved back: a replica whose clock is behind counts in the newer window), and
`used` grows by the request's amount only `WHERE used + amount <= limit`. A row that does not
match is not changed and not returned, so fewer rows returned = refused; the rows that did grow
are shrunk back at once. Worst case at a boundary: `limit` requests admitted in the last instant
of one minute and `limit` more in the first instant of the next, 2 x limit within any 60 s span
that straddles it, never more than `limit` in one window.

`parallel` counts requests in flight (its window never rolls). `tpm` reserves the prompt's upper
bound plus the output allowance up front. What a request took is written on its hold
(`rate_kinds`, `rate_window`, `rate_tokens`), and whoever ends the hold gives it back in the
same transaction that deletes it (budgets.settle, budgets.release): a release (nothing reached an
upstream) gives back all of it, a settle its parallel slot and the tokens it did not use (in
the window it was counted in), the sweeper (a process that died) its parallel slot. A request
with no such limit anywhere costs nothing: its limits come with its cached credential.
"""

import asyncio
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
from sqlalchemy import (
    BigInteger,
    String,
    TextualSelect,
    bindparam,
    case,
    func,
    select,
    text,
    update,
)
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from metering.budgets.groups import GroupWriter
from metering.db import Database, UTCDateTime, dialect_name, utcnow
from metering.limits import KINDS, SCOPES, Limits, ScopeLimits
from metering.models import Hold, RateCounter
from metering.timefmt import rfc3339

log = logging.getLogger("metering.budgets")

WINDOW_S = 60
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# The parallel counter's window: it never rolls.
NO_WINDOW = EPOCH
_LETTER = {"rpm": "r", "tpm": "t", "parallel": "p"}
_KIND = {letter: kind for kind, letter in _LETTER.items()}


def window_of(now: datetime) -> tuple[datetime, datetime]:
    """The fixed rate window holding `now`: [start, start + 60 s), on UTC minutes."""
    elapsed = now - EPOCH
    start = EPOCH + timedelta(seconds=(elapsed // timedelta(seconds=WINDOW_S)) * WINDOW_S)
    return start, start + timedelta(seconds=WINDOW_S)


# --- admission ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RateClaim:
    """What one request took from its counters: written on its hold, given back at its end."""

    kinds: str  # per scope (token,user,team), the letters of the kinds taken: "rp,,t"
    window: datetime
    tokens: int
    headers: dict[str, str]


@dataclass(frozen=True, slots=True)
class Refusal:
    scope: str
    subject_id: str
    kind: str
    limit: int
    used: int
    requested: int
    resets_at: datetime | None  # None: a parallel slot frees when a request ends
    never_fits: bool = False

    def retry_after_s(self, now: datetime) -> int | None:
        if self.never_fits:
            return None
        if self.resets_at is None:
            return 1
        return max(1, math.ceil((self.resets_at - now).total_seconds()))


# The setting that sets each kind.
SETTINGS = {"rpm": "rpm_limit", "tpm": "tpm_limit", "parallel": "max_parallel_requests"}


def explain(refusal: Refusal, now: datetime) -> str:
    """What refused a request, in words a person can act on."""
    who = f"{refusal.scope} {refusal.subject_id}"
    setting = SETTINGS[refusal.kind]
    if refusal.never_fits:
        return (
            f"{who}: this request needs up to {refusal.requested} tokens (its prompt's upper "
            f"bound and output allowance), more than its {setting} of {refusal.limit} per "
            "minute allows: lower max_tokens or the prompt"
            if refusal.kind == "tpm"
            else f"{who}: its {setting} is {refusal.limit}: no request is admitted"
        )
    if refusal.kind == "parallel":
        return (
            f"{who} has {refusal.used} requests in flight, its {setting} of {refusal.limit}: "
            "a slot frees when one of them ends"
        )
    unit = "requests" if refusal.kind == "rpm" else "tokens"
    wait = refusal.retry_after_s(now)
    needs = "" if refusal.kind == "rpm" else f"; this request needs up to {refusal.requested}"
    return (
        f"{who} is over its {setting}: {refusal.limit} {unit} per minute, {refusal.used} used "
        f"in this window{needs}; it frees at {rfc3339(refusal.resets_at)} (in {wait} s)"
    )


class RateLimited(Exception):
    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.kind)
        self.refusal = refusal


def _build_admit(n: int, backend: str) -> TextualSelect:
    """The admission upsert of n counters, its values bound by position (i: s{i} subject,
    k{i} kind, w{i} window, a{i} amount, c{i} limit). Written as SQL text: an expression of it
    would be compiled again on every request.

    On PostgreSQL its commit does not wait for the WAL flush (`synchronous_commit` off for this
    statement's own transaction), so the counters' rows are locked for the statement only, not
    for a disk flush. Nothing that matters can be lost: the request's hold is committed after
    it, synchronously, which flushes the WAL up to and including this admission; a crash
    before that loses only the admissions of requests that had not been forwarded yet."""
    if backend == "postgresql":
        rows = " UNION ALL ".join(
            f"SELECT CAST(:s{i} AS VARCHAR), CAST(:k{i} AS VARCHAR), "
            f"CAST(:w{i} AS TIMESTAMPTZ), CAST(:a{i} AS BIGINT), CAST(:now AS TIMESTAMPTZ)"
            for i in range(n)
        )
        source = (
            "WITH quick AS (SELECT set_config('synchronous_commit', 'off', true) AS v) "
            "INSERT INTO rate_counters (subject_id, kind, window_start, used, updated_at) "
            f"SELECT r.* FROM ({rows}) AS r CROSS JOIN quick"
        )
    else:
        values = ", ".join(f"(:s{i}, :k{i}, :w{i}, :a{i}, :now)" for i in range(n))
        source = (
            "INSERT INTO rate_counters (subject_id, kind, window_start, used, updated_at) "
            f"VALUES {values}"
        )
    caps = " ".join(
        f"WHEN rate_counters.subject_id = :s{i} AND rate_counters.kind = :k{i} "
        f"THEN CAST(:c{i} AS BIGINT)"
        for i in range(n)
    )
    rolled = "excluded.window_start > rate_counters.window_start"
    grown = f"CASE WHEN {rolled} THEN excluded.used ELSE rate_counters.used + excluded.used END"
    sql = (
        f"{source} ON CONFLICT (subject_id, kind) DO UPDATE SET used = {grown}, "
        f"window_start = CASE WHEN {rolled} THEN excluded.window_start "
        "ELSE rate_counters.window_start END, updated_at = excluded.updated_at "
        f"WHERE {grown} <= CASE {caps} ELSE -1 END "
        "RETURNING subject_id, kind, window_start, used"
    )
    types = [bindparam("now", type_=UTCDateTime)]
    types += [bindparam(f"w{i}", type_=UTCDateTime) for i in range(n)]
    types += [bindparam(f"a{i}", type_=BigInteger) for i in range(n)]
    types += [bindparam(f"c{i}", type_=BigInteger) for i in range(n)]
    return (
        text(sql)
        .bindparams(*types)
        .columns(subject_id=String, kind=String, window_start=UTCDateTime, used=BigInteger)
    )


# Built once per backend and number of counters.
_ADMITS: dict[tuple[str, int], TextualSelect] = {}


def _admit_statement(
    backend: str, rows: list[dict[str, Any]]
) -> tuple[TextualSelect, dict[str, Any]]:
    key = (backend, len(rows))
    stmt = _ADMITS.get(key)
    if stmt is None:
        stmt = _ADMITS[key] = _build_admit(len(rows), backend)
    params: dict[str, Any] = {"now": rows[0]["now"]}
    for i, r in enumerate(rows):
        params.update(
            {
                f"s{i}": r["subject_id"],
                f"k{i}": r["kind"],
                f"w{i}": r["window_start"],
                f"a{i}": r["amount"],
                f"c{i}": r["cap"],
            }
        )
    return stmt, params


_GIVE_BACK = (
    update(RateCounter.__table__)
    .where(
        RateCounter.subject_id == bindparam("s_id"),
        RateCounter.kind == bindparam("s_kind"),
        RateCounter.window_start == bindparam("s_window"),
    )
    .values(
        used=case(
            (RateCounter.used > bindparam("s_amount"), RateCounter.used - bindparam("s_amount")),
            else_=0,
        )
    )
    .execution_options(synchronize_session=False)
)


async def give_back(conn: AsyncConnection | AsyncSession, returns: list[dict[str, Any]]) -> None:
    """Shrink counters: rows {s_id, s_kind, s_window, s_amount}, in key order."""
    returns = [r for r in returns if r["s_amount"] > 0]
    if returns:
        returns.sort(key=lambda r: (r["s_id"], r["s_kind"]))
        await conn.execute(_GIVE_BACK, returns)


def _amounts(limits: Limits, tokens: int) -> list[tuple[ScopeLimits, str, int]]:
    amounts = {"rpm": 1, "tpm": tokens, "parallel": 1}
    return [
        (scope, kind, amounts[kind])
        for scope in limits.scopes
        for kind in KINDS
        if scope.cap(kind) is not None
    ]


def _encode(taken: list[tuple[ScopeLimits, str, int]]) -> str:
    letters = {s: "" for s in SCOPES}
    for scope, kind, _ in taken:
        letters[scope.scope] += _LETTER[kind]
    return ",".join(letters[s] for s in SCOPES)


def decode(kinds: str) -> list[tuple[str, list[str]]]:
    """Per scope (token, user, team): the kinds a hold took."""
    return [
        (scope, [_KIND[c] for c in letters])
        for scope, letters in zip(SCOPES, kinds.split(","), strict=True)
    ]


def duration(seconds: float) -> str:
    """A reset delay as OpenAI writes it: `20ms`, `1.5s`, `1m0s`."""
    if seconds < 1:
        return f"{max(int(seconds * 1000), 0)}ms"
    minutes, rest = divmod(seconds, 60)
    text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text


def headers(limits: Limits, used: dict[tuple[str, str], int], now: datetime) -> dict[str, str]:
    """x-ratelimit-* of the tightest requests and tokens limits, as OpenAI sends them."""
    out: dict[str, str] = {}
    _, end = window_of(now)
    reset = duration((end - now).total_seconds())
    for kind, suffix in (("rpm", "requests"), ("tpm", "tokens")):
        best = None
        for scope in limits.scopes:
            cap = scope.cap(kind)
            if cap is None:
                continue
            left = max(cap - used.get((scope.subject_id, kind), 0), 0)
            if best is None or left < best[1]:
                best = (cap, left)
        if best is not None:
            out[f"x-ratelimit-limit-{suffix}"] = str(best[0])
            out[f"x-ratelimit-remaining-{suffix}"] = str(best[1])
            out[f"x-ratelimit-reset-{suffix}"] = reset
    return out


def _counter_rows(
    taken: list[tuple[ScopeLimits, str, int]], start: datetime, now: datetime
) -> list[dict[str, Any]]:
    """The admission upsert's rows, in (subject, kind) order: the one order every writer uses."""
    rows = (
        {
            "subject_id": scope.subject_id,
            "kind": kind,
            "window_start": NO_WINDOW if kind == "parallel" else start,
            "amount": amount,
            "cap": scope.cap(kind),
            "now": now,
        }
        for scope, kind, amount in taken
    )
    return sorted(rows, key=lambda r: (r["subject_id"], r["kind"]))


async def admit_one(db: Database, limits: Limits, tokens: int) -> RateClaim:
    """AdmissionQueue.admit() in a statement of its own."""
    now = utcnow()
    start, end = window_of(now)
    taken = _amounts(limits, tokens)
    _check_fits(taken, end)
    rows = _counter_rows(taken, start, now)
    async with db.single() as conn:
        stmt, params = _admit_statement(dialect_name(conn), rows)
        got = {(r.subject_id, r.kind): r for r in await conn.execute(stmt, params)}
        if len(got) == len(rows):
            window = next((r.window_start for r in got.values() if r.kind != "parallel"), start)
            counted = {key: r.used for key, r in got.items()}
            return RateClaim(_encode(taken), window, tokens, headers(limits, counted, now))
        # Refused: give back what this request took, then say which limit refused it.
        await give_back(
            conn,
            [
                {
                    "s_id": r.subject_id,
                    "s_kind": r.kind,
                    "s_window": r.window_start,
                    "s_amount": 1 if r.kind != "tpm" else tokens,
                }
                for r in got.values()
            ],
        )
        current = await counters(conn, [r["subject_id"] for r in rows])
    for scope, kind, amount in taken:
        if (scope.subject_id, kind) in got:
            continue
        window, used = current.get((scope.subject_id, kind), (start, 0))
        cap = scope.cap(kind)
        assert cap is not None
        resets = None if kind == "parallel" else max(window, start) + timedelta(seconds=WINDOW_S)
        raise RateLimited(Refusal(scope.scope, scope.subject_id, kind, cap, used, amount, resets))
    raise AssertionError("a refused admission names no limit")


def _check_fits(taken: list[tuple[ScopeLimits, str, int]], end: datetime) -> None:
    for scope, kind, amount in taken:
        cap = scope.cap(kind)
        assert cap is not None
        if amount > cap:
            resets = None if kind == "parallel" else end
            raise RateLimited(
                Refusal(scope.scope, scope.subject_id, kind, cap, 0, amount, resets, True)
            )


class AdmissionQueue:
    """A process's admissions, counted in groups: while one statement runs, the requests that
    arrive form the next group; those with the same limits (the same counters and caps) are
    counted together, in one upsert adding their sum, which the database admits only if the
    whole sum fits. A group that does not fit is counted again one request at a time, so each
    request is admitted exactly when it alone would be: exact, and one statement (and one
    wait on the counters' row locks) for many requests of a busy subject."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.groups = GroupWriter(self._write_batch, lambda: RuntimeError("admission interrupted"))
        self.grouped = 0  # requests admitted in groups of two or more

    async def admit(self, limits: Limits, tokens: int) -> RateClaim:
        """Count one request (and `tokens` for tpm) against every limit at once, or raise
        RateLimited naming the first limit it would pass."""
        _check_fits(_amounts(limits, tokens), window_of(utcnow())[1])
        claim: RateClaim = await self.groups.submit((limits, tokens))
        return claim

    async def _write_batch(self, batch: list[Any]) -> None:
        """The requests that arrived together, by their limits: each set counted as a group."""
        groups: dict[tuple[Any, ...], list[Any]] = {}
        for (limits, tokens), future in batch:
            groups.setdefault(_group_key(limits), []).append((limits, tokens, future))
        await asyncio.gather(*(self._write(group) for group in groups.values()))

    async def _write(self, group: list[Any]) -> None:
        if len(group) > 1:
            try:
                claims = await _admit_group(self.db, group)
            except Exception:
                claims = None  # one at a time below
            if claims is not None:
                self.grouped += len(group)
                await self._hand_out(group, claims)
                return
        for limits, tokens, future in group:
            try:
                claim = await admit_one(self.db, limits, tokens)
            except BaseException as exc:
                if not future.done():
                    future.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
                continue
            await self._hand_out([(limits, tokens, future)], [claim])

    async def _hand_out(self, group: list[Any], claims: list[RateClaim]) -> None:
        """Resolve each waiter; a waiter gone (cancelled) gets its share given back."""
        gone = []
        for (limits, _, future), claim in zip(group, claims, strict=True):
            if future.done():
                gone.append((limits, claim))
            else:
                future.set_result(claim)
        for limits, claim in gone:
            await release_claim(self.db, claim, limits)


def _group_key(limits: Limits) -> tuple[Any, ...]:
    return tuple((s.subject_id, s.rpm, s.tpm, s.parallel) for s in limits.scopes)


async def _admit_group(db: Database, group: list[Any]) -> list[RateClaim] | None:
    """Count a group with the same limits in one statement; None if their sum does not fit
    (nothing is counted then)."""
    limits = group[0][0]
    now = utcnow()
    start, _ = window_of(now)
    total = sum(tokens for _, tokens, _ in group)
    count = len(group)
    amounts = {"rpm": count, "tpm": total, "parallel": count}
    taken = _amounts(limits, total)
    if any(amounts[kind] > (scope.cap(kind) or 0) for scope, kind, _ in taken):
        return None  # the sum alone is over a limit (a new row is inserted unchecked)
    rows = _counter_rows([(scope, kind, amounts[kind]) for scope, kind, _ in taken], start, now)
    async with db.single() as conn:
        stmt, params = _admit_statement(dialect_name(conn), rows)
        got = {(r.subject_id, r.kind): r for r in await conn.execute(stmt, params)}
        if len(got) != len(rows):
            await give_back(
                conn,
                [
                    {
                        "s_id": r.subject_id,
                        "s_kind": r.kind,
                        "s_window": r.window_start,
                        "s_amount": amounts[r.kind],
                    }
                    for r in got.values()
                ],
            )
            return None
    window = next((r.window_start for r in got.values() if r.kind != "parallel"), start)
    kinds = _encode(_amounts(limits, 0))
    claims = []
    # Each request sees the counts as if admitted in the group's order.
    later_requests, later_tokens = count, total
    for _, tokens, _ in group:
        later_requests -= 1
        later_tokens -= tokens
        used = {
            key: r.used - (later_tokens if key[1] == "tpm" else later_requests)
            for key, r in got.items()
        }
        claims.append(RateClaim(kinds, window, tokens, headers(limits, used, now)))
    return claims


async def counters(
    conn: AsyncConnection | AsyncSession, subject_ids: list[str]
) -> dict[tuple[str, str], tuple[datetime, int]]:
    """(subject, kind) -> (window start, used) as stored (a past window's count is stale)."""
    rows = await conn.execute(
        select(
            RateCounter.subject_id, RateCounter.kind, RateCounter.window_start, RateCounter.used
        ).where(RateCounter.subject_id.in_(subject_ids))
    )
    return {(r.subject_id, r.kind): (r.window_start, r.used) for r in rows}


async def release_claim(db: Database, claim: RateClaim, limits: Limits) -> bool:
    """Give back all of a claim whose request got no hold (refused by a budget); False when it
    could not. Never raises nor yields to a cancellation: a slot it could not give back is
    recounted by heal_parallel."""
    subjects = {s.scope: s.subject_id for s in limits.scopes}
    rows = returns_of(claim.kinds, subjects, claim.window, claim.tokens, 0)
    with anyio.CancelScope(shield=True):
        try:
            async with db.single() as conn:
                await give_back(conn, rows)
        except Exception:
            log.warning("could not give back a refused request's rate counters", exc_info=True)
            return False
    return True


_HOLDS_IN_FLIGHT = (
    select(func.count())
    .select_from(Hold)
    .where(
        Hold.rate_kinds.like("%p%"),
        (Hold.token_id == RateCounter.subject_id)
        | (Hold.user_id == RateCounter.subject_id)
        | (Hold.team_id == RateCounter.subject_id),
    )
    .scalar_subquery()
)
_HEAL = (
    update(RateCounter.__table__)
    .where(
        RateCounter.kind == "parallel",
        RateCounter.used > 0,
        RateCounter.updated_at < bindparam("idle_before"),
    )
    .values(
        used=case((RateCounter.used > _HOLDS_IN_FLIGHT, _HOLDS_IN_FLIGHT), else_=RateCounter.used)
    )
    .execution_options(synchronize_session=False)
)


async def heal_parallel(db: Database, idle_s: float) -> int:
    """Lower every parallel counter no request has been admitted against for `idle_s` to the
    holds that name it: a slot taken by a process that died before writing its hold (or whose
    give-back failed) is not lost. Every request in flight has a hold (kept alive by its
    process), so a counter is never lowered below what is in flight."""
    async with db.begin() as conn:
        healed = await conn.execute(_HEAL, {"idle_before": utcnow() - timedelta(seconds=idle_s)})
    return healed.rowcount or 0


def returns_of(
    kinds: str,
    subjects: Mapping[str, str | None],
    window: datetime,
    tokens: int,
    used_tokens: int | None,
    *,
    requests: bool = True,
    parallel: bool = True,
) -> list[dict[str, Any]]:
    """The give-back rows of one ending: `used_tokens` of the tokens reserved are kept (None:
    all of them), the request count is given back with `requests`."""
    kept = tokens if used_tokens is None else min(max(used_tokens, 0), tokens)
    amounts = {
        "rpm": 1 if requests else 0,
        "tpm": tokens - kept,
        "parallel": 1 if parallel else 0,
    }
    out = []
    for scope, taken in decode(kinds):
        subject_id = subjects.get(scope)
        if not subject_id:
            continue
        for kind in taken:
            out.append(
                {
                    "s_id": subject_id,
                    "s_kind": kind,
                    "s_window": NO_WINDOW if kind == "parallel" else window,
                    "s_amount": amounts[kind],
                }
            )
    return out
