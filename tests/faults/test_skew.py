"""(c) Two replicas whose clocks differ by 30 s (libfaketime: the fast one's clock runs 30 s
ahead of the slow one's) share a budget and a rate limit across an hour's boundary: the fast
one is past it, the slow one still before it. The windows of a budget and of a rate counter are
rows of the database, moved on by the first replica whose clock says the window ended and never
moved back, so the slow replica counts into the window the fast one opened: the limits hold
exactly, in the one window both counted in. A window may so start up to the skew early; holds
need a TTL well above the skew (docs/operator/high-availability.md)."""

import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from metering import migrate
from tests.budgets.conftest import new_pg_database, query
from tests.faults import invariants
from tests.faults.figures import report
from tests.faults.load import one

LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1")
SKEW_S = 30
# The slow replica's clock is this far before the hour when the requests start: they must all
# be made before it reaches the hour (a few seconds of requests), while the fast one is past it.
BEFORE_HOUR_S = 25
STARTUP_S = 40  # the replicas' start, before the requests (the slow clock waits out the rest)
HOLD_TTL_S = 900  # the default: far above the skew
RPM = 10
CREDIT_LIMIT = "0.0005"


def faked(offset_s: float) -> dict[str, str]:
    """The environment that runs a process with its clock offset_s ahead (libfaketime)."""
    return {
        "LD_PRELOAD": str(LIBFAKETIME),
        "FAKETIME": f"{offset_s:+.3f}",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }


def hour_after(moment: datetime) -> datetime:
    return moment.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)


def test_replicas_with_skewed_clocks_hold_limits_exactly(serve, sim):
    if not LIBFAKETIME.exists():
        pytest.fail(f"{LIBFAKETIME} is missing: apt-get install faketime (make faketime)")
    with new_pg_database() as url:
        migrate.upgrade(url)
        # The slow clock reaches BEFORE_HOUR_S before an hour STARTUP_S from now; the fast one
        # is SKEW_S ahead of it, so past that hour.
        real = datetime.now(UTC)
        slow_at = real + timedelta(seconds=STARTUP_S)
        hour = hour_after(slow_at + timedelta(seconds=BEFORE_HOUR_S))
        offset = (hour - timedelta(seconds=BEFORE_HOUR_S) - slow_at).total_seconds()
        env = {"METERING_HOLD_TTL_S": str(HOLD_TTL_S)}
        slow = serve(url, **env, **faked(offset))
        fast = serve(url, **env, **faked(offset + SKEW_S))
        api = slow.api()
        _, _, rated = api.principal()
        api.ok("PATCH", f"/v1/tokens/{rated['id']}", json={"rpm_limit": RPM})
        _, _, spender = api.principal(token_limit=CREDIT_LIMIT, interval="hourly")
        # Wait out what is left of the start-up: the slow clock BEFORE_HOUR_S before the hour.
        time.sleep(max(0.0, (slow_at - datetime.now(UTC)).total_seconds()))

        tag = f"skew{uuid.uuid4().hex[:10]}"
        results = []
        n = 0

        def send(replica, key):
            nonlocal n
            n += 1
            result = one(replica.url, key, f"{tag}-{n}")
            results.append(result)
            return result

        # Rates: the slow replica counts first, in its minute; the fast one moves the counter
        # into the next minute (the hour's first); then both count there, RPM in all.
        assert send(slow, rated["token"]).status == 200
        rated_after = [send(r, rated["token"]) for _ in range(RPM) for r in (fast, slow)]
        # Credit: the slow replica spends in its hour, the fast one rolls the budget into the
        # next; then both spend there until neither can.
        assert send(slow, spender["token"]).status == 200
        spent_after = []
        while len(spent_after) < 400 and not (
            len(spent_after) >= 6 and all(r.status == 402 for r in spent_after[-6:])
        ):
            spent_after += [send(r, spender["token"]) for r in (fast, slow)]
        slow_clock_at_end = datetime.now(UTC) + timedelta(seconds=offset)

        figures = invariants.check(url, sim, tag, results, HOLD_TTL_S)
        counter = query(
            url,
            "SELECT window_start, used FROM rate_counters WHERE subject_id = :s AND kind = 'rpm'",
            s=rated["id"],
        )
        budget = query(
            url,
            "SELECT window_start, spent, credit_limit FROM budgets WHERE subject_id = :s",
            s=spender["id"],
        )
        closed = query(
            url,
            "SELECT window_start, spent FROM budget_windows WHERE subject_id = :s",
            s=spender["id"],
        )
        stamps = query(
            url,
            "SELECT id, created_at FROM ledger_events WHERE token_id IN (:a, :b)",
            a=rated["id"],
            b=spender["id"],
        )
        costs = dict(query(url, "SELECT id, cost FROM ledger_events"))

    # The premise: every request was made while the slow clock was before the hour and the
    # fast one past it (each event is stamped by the clock of the replica that served it).
    assert slow_clock_at_end < hour, "the requests outlasted the slow clock's last minute"
    stamped = {row[0]: row[1].replace(tzinfo=UTC) for row in stamps}
    served_by = {r.request_id: r.url for r in results if r.status == 200}
    assert all((stamped[i] >= hour) == (url_ == fast.url) for i, url_ in served_by.items()), (
        "an event not stamped by its replica's clock"
    )

    # Rates: exactly RPM admitted in the hour's first minute, by both replicas together.
    codes = [r.status for r in rated_after]
    assert codes.count(200) == RPM, codes
    assert set(codes) == {200, 429}
    assert {r.url for r in rated_after if r.status == 200} == {slow.url, fast.url}
    assert [(row[0].replace(tzinfo=UTC), row[1]) for row in counter] == [(hour, RPM)]

    # Credit: one budget row, in the hour the fast clock opened, spent up to its limit and no
    # further; the slow replica's first request closed with the hour before.
    ((window_start, spent, limit),) = budget
    assert window_start.replace(tzinfo=UTC) == hour
    assert 0 < spent <= limit
    first = results[RPM * 2 + 1]  # the spender's first request, on the slow replica
    assert [(row[0].replace(tzinfo=UTC), row[1]) for row in closed] == [
        (hour - timedelta(hours=1), costs[first.request_id])
    ]
    in_hour = [r for r in spent_after if r.status == 200]
    assert {r.url for r in in_hour} == {slow.url, fast.url}
    assert sum(costs[r.request_id] for r in in_hour) == spent
    assert {r.status for r in spent_after} == {200, 402}

    report(
        "clock_skew",
        {
            "skew_s": SKEW_S,
            "rpm_limit": RPM,
            "rpm_admitted_in_window": codes.count(200),
            "credit_admitted_in_window": len(in_hour),
            "events": figures["events"],
        },
    )
