"""Property tests of the rate limits' arithmetic: windows, reset delays, what an ending gives
back, and allow-lists at several scopes; and admissions counted in groups, on both backends."""

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metering.budgets import rates
from metering.clock import MovableClock
from metering.db import Database, utcnow
from metering.limits import Limits, ScopeLimits, allows

instants = st.datetimes(
    min_value=datetime(1971, 1, 1), max_value=datetime(2200, 1, 1), timezones=st.just(UTC)
)


@given(instants)
def test_a_window_is_the_utc_minute_holding_the_instant(now):
    start, end = rates.window_of(now)
    assert start <= now < end
    assert end - start == timedelta(seconds=rates.WINDOW_S)
    assert (start.second, start.microsecond) == (0, 0)
    assert start == now.replace(second=0, microsecond=0)


@given(instants, instants)
def test_windows_never_go_back_in_time(a, b):
    early, late = sorted((a, b))
    assert rates.window_of(early)[0] <= rates.window_of(late)[0]


@given(instants, st.integers(min_value=0, max_value=59_999_999))
def test_every_instant_of_a_window_shares_it(now, micros):
    start, _ = rates.window_of(now)
    assert rates.window_of(start + timedelta(microseconds=micros))[0] == start


def _kinds() -> st.SearchStrategy[str]:
    letters = st.sets(st.sampled_from("rtp")).map(lambda s: "".join(sorted(s)))
    return st.tuples(letters, letters, letters).map(",".join)


@given(
    _kinds(),
    st.integers(min_value=0, max_value=10**12),
    st.one_of(st.none(), st.integers(min_value=-5, max_value=10**13)),
    st.booleans(),
)
def test_an_ending_gives_back_at_most_what_was_taken(kinds, tokens, used, released):
    subjects = {"token": "tok_1", "user": "user_1", "team": "team_1"}
    window = datetime(2026, 1, 1, tzinfo=UTC)
    rows = rates.returns_of(
        kinds, subjects, window, tokens, 0 if released else used, requests=released
    )
    taken = sum(len(letters) for letters in kinds.split(","))
    assert len(rows) == taken
    for row in rows:
        if row["s_kind"] == "parallel":
            assert row["s_amount"] == 1 and row["s_window"] == rates.NO_WINDOW
        elif row["s_kind"] == "rpm":
            assert row["s_amount"] == (1 if released else 0)
        else:
            if released:
                kept = 0  # nothing reached an upstream: all of it back
            elif used is None:
                kept = tokens  # the sweeper's whole charge
            else:
                kept = min(max(used, 0), tokens)
            assert row["s_amount"] == tokens - kept
            assert 0 <= row["s_amount"] <= tokens


@given(st.floats(min_value=0, max_value=60, allow_nan=False))
def test_reset_delays_read_back_as_openai_writes_them(seconds):
    text = rates.duration(seconds)
    if text.endswith("ms"):
        assert seconds < 1 and int(text[:-2]) == int(seconds * 1000)
        return
    minutes, _, rest = text.rpartition("m")
    value = (int(minutes) * 60 if minutes else 0) + float(rest[:-1])
    assert abs(value - seconds) <= 0.0005


names = st.text(alphabet="abc-*", min_size=1, max_size=6)
lists = st.one_of(st.none(), st.lists(names, max_size=4).map(tuple))


@given(lists, lists, lists, st.text(alphabet="abc-", min_size=1, max_size=6))
def test_a_model_is_allowed_only_where_every_scope_allows_it(token, user, team, model):
    limits = Limits.of(
        ScopeLimits("token", "t", models=token),
        ScopeLimits("user", "u", models=user),
        ScopeLimits("team", "g", models=team),
    )
    everywhere = all(allows(models, model) for models in (token, user, team))
    refused = limits.refusing(model) if limits is not None else None
    assert (refused is None) == everywhere


def _start_of_a_window(clock: MovableClock) -> datetime:
    """Move the clock to the start of the next rate window (a burst that straddles two windows
    is counted in each); returns that start."""
    _, end = rates.window_of(clock.now())
    clock.move_to(end)
    return end


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("rpm", "tpm", "expected"), [(100, None, 20), (7, None, 7), (100, 1000, 1000 // 150)]
)
async def test_requests_counted_in_groups_are_admitted_exactly_as_alone(
    fresh_db, rpm, tpm, expected, task_clock
):
    """Many requests of one process at once: their admissions go in groups, and exactly what
    fits is admitted (a group that does not fit is counted one request at a time)."""

    db = Database(fresh_db, 4)
    admissions = rates.AdmissionQueue(db)
    try:
        limits = Limits.of(
            ScopeLimits("token", "tok_g", rpm=rpm, tpm=tpm),
            ScopeLimits("team", "team_g", parallel=50),
        )
        assert limits is not None
        window = _start_of_a_window(task_clock)
        results = await asyncio.gather(
            *(admissions.admit(limits, 150) for _ in range(20)), return_exceptions=True
        )
        assert rates.window_of(utcnow())[0] == window  # the burst stayed in one window
        admitted = [r for r in results if isinstance(r, rates.RateClaim)]
        refused = [r for r in results if isinstance(r, rates.RateLimited)]
        assert len(admitted) + len(refused) == 20
        assert len(admitted) == expected
        if refused:
            assert {r.refusal.kind for r in refused} == {"rpm" if tpm is None else "tpm"}
        else:
            assert admissions.grouped >= 2  # admitted in a group
        remaining = sorted(int(c.headers["x-ratelimit-remaining-requests"]) for c in admitted)
        assert remaining == list(range(rpm - expected, rpm))
        async with db.single() as conn:
            counted = await rates.counters(conn, ["tok_g", "team_g"])
        assert counted[("tok_g", "rpm")][1] == expected
        assert counted[("team_g", "parallel")][1] == expected
        if tpm is not None:
            assert counted[("tok_g", "tpm")][1] == expected * 150
    finally:
        await db.dispose()
