import calendar
import re
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metering.budgets.windows import (
    INTERVAL_PATTERN,
    MAX_FIXED_SECONDS,
    Interval,
    InvalidInterval,
    next_reset,
    parse_interval,
    window_for,
)

US = timedelta(microseconds=1)
ANCHOR = datetime(2020, 1, 1, tzinfo=UTC)


def dt(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def win(text: str, now: datetime, anchor: datetime = ANCHOR):
    return window_for(parse_interval(text), anchor, now)


# --------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("text", "kind", "seconds"),
    [
        ("never", "never", None),
        ("hourly", "hourly", None),
        ("daily", "daily", None),
        ("weekly", "weekly", None),
        ("monthly", "monthly", None),
        ("3s", "fixed", 3),
        ("90m", "fixed", 5400),
        ("2h", "fixed", 7200),
        ("7d", "fixed", 604800),
        ("3650d", "fixed", MAX_FIXED_SECONDS),
        ("315360000s", "fixed", MAX_FIXED_SECONDS),
        ("87600h", "fixed", MAX_FIXED_SECONDS),
    ],
)
def test_parse_accepts(text, kind, seconds):
    interval = parse_interval(text)
    assert interval == Interval(kind, seconds, text)
    assert interval.text == text
    assert str(interval) == text


@pytest.mark.parametrize(
    "text",
    [
        "",
        "0s",
        "0d",
        "-5m",
        "+5m",
        "5x",
        "5 m",
        " 5m",
        "5m ",
        "5m\n",
        "1.5h",
        "DAILY",
        "Daily",
        "daily ",
        "5M",
        "99999999999s",
        "5",
        "s",
        "05m",
        "1_0s",
        "١٢s",  # Arabic-Indic digits: int() would accept them
        "3651d",
        "315360001s",
        "5256001m",
        "9999999999s",
        "1e3s",
        "5mm",
        "5ms",
        "fixed",
    ],
)
def test_parse_rejects(text):
    with pytest.raises(InvalidInterval) as exc_info:
        parse_interval(text)
    message = str(exc_info.value)
    assert "never" in message and "monthly" in message and "<N>s" in message


def test_parse_rejects_non_string():
    with pytest.raises(InvalidInterval):
        parse_interval(None)  # type: ignore[arg-type]
    with pytest.raises(InvalidInterval):
        parse_interval(5)  # type: ignore[arg-type]


def test_invalid_interval_is_value_error():
    assert issubclass(InvalidInterval, ValueError)


def test_interval_validates_fields():
    with pytest.raises(ValueError, match="unknown interval kind 'yearly'"):
        Interval("yearly", None, "yearly")
    with pytest.raises(ValueError, match="fixed interval needs 1.."):
        Interval("fixed", None, "5s")
    with pytest.raises(ValueError, match="fixed interval needs 1.."):
        Interval("fixed", 0, "0s")
    with pytest.raises(ValueError, match="'daily' interval takes no seconds"):
        Interval("daily", 5, "daily")


@given(
    n=st.integers(min_value=1, max_value=10**10),
    unit=st.sampled_from(["s", "m", "h", "d"]),
)
def test_parse_fixed_roundtrip_or_reject(n, unit):
    seconds = n * {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit]
    text = f"{n}{unit}"
    if seconds <= MAX_FIXED_SECONDS:
        interval = parse_interval(text)
        assert interval.seconds == seconds
        assert interval.kind == "fixed"
        assert parse_interval(interval.text) == interval
    else:
        with pytest.raises(InvalidInterval):
            parse_interval(text)


@given(st.text(max_size=12))
def test_parse_arbitrary_text_roundtrips_or_raises(text):
    try:
        interval = parse_interval(text)
    except InvalidInterval:
        return
    assert interval.text == text
    assert parse_interval(interval.text) == interval


# ------------------------------------------------------------------ calendar windows


@pytest.mark.parametrize(
    ("now", "start", "end"),
    [
        (dt(2025, 3, 14, 15, 0), dt(2025, 3, 14, 15), dt(2025, 3, 14, 16)),
        (dt(2025, 3, 14, 15, 0) - US, dt(2025, 3, 14, 14), dt(2025, 3, 14, 15)),
        (dt(2025, 3, 14, 15, 0) + US, dt(2025, 3, 14, 15), dt(2025, 3, 14, 16)),
        (dt(2025, 3, 14, 15, 59, 59, 999999), dt(2025, 3, 14, 15), dt(2025, 3, 14, 16)),
        (dt(2025, 3, 14, 23, 30), dt(2025, 3, 14, 23), dt(2025, 3, 15, 0)),
        (dt(2025, 12, 31, 23, 59), dt(2025, 12, 31, 23), dt(2026, 1, 1, 0)),
    ],
)
def test_hourly(now, start, end):
    assert win("hourly", now) == (start, end)


@pytest.mark.parametrize(
    ("now", "start", "end"),
    [
        (dt(2025, 3, 14), dt(2025, 3, 14), dt(2025, 3, 15)),
        (dt(2025, 3, 14) - US, dt(2025, 3, 13), dt(2025, 3, 14)),
        (dt(2025, 3, 14) + US, dt(2025, 3, 14), dt(2025, 3, 15)),
        (dt(2025, 1, 31, 12), dt(2025, 1, 31), dt(2025, 2, 1)),
        (dt(2025, 2, 28, 23, 59, 59, 999999), dt(2025, 2, 28), dt(2025, 3, 1)),
        (dt(2024, 2, 28, 23), dt(2024, 2, 28), dt(2024, 2, 29)),
        (dt(2024, 2, 29, 1), dt(2024, 2, 29), dt(2024, 3, 1)),
        (dt(2000, 2, 29, 1), dt(2000, 2, 29), dt(2000, 3, 1)),
        (dt(1900, 2, 28, 1), dt(1900, 2, 28), dt(1900, 3, 1)),
        (dt(2100, 2, 28, 1), dt(2100, 2, 28), dt(2100, 3, 1)),
        (dt(2025, 12, 31, 18), dt(2025, 12, 31), dt(2026, 1, 1)),
        (dt(2026, 1, 1), dt(2026, 1, 1), dt(2026, 1, 2)),
    ],
)
def test_daily(now, start, end):
    assert win("daily", now) == (start, end)


@pytest.mark.parametrize(
    ("now", "start", "end"),
    [
        # 2025-03-10 is a Monday
        (dt(2025, 3, 10), dt(2025, 3, 10), dt(2025, 3, 17)),
        (dt(2025, 3, 10) + US, dt(2025, 3, 10), dt(2025, 3, 17)),
        (dt(2025, 3, 10) - US, dt(2025, 3, 3), dt(2025, 3, 10)),
        # Sunday 23:59:59.999999 vs Monday 00:00
        (dt(2025, 3, 16, 23, 59, 59, 999999), dt(2025, 3, 10), dt(2025, 3, 17)),
        (dt(2025, 3, 17), dt(2025, 3, 17), dt(2025, 3, 24)),
        (dt(2025, 3, 13, 12), dt(2025, 3, 10), dt(2025, 3, 17)),
        # across month and year ends: 2025-12-29 is a Monday
        (dt(2026, 1, 1, 8), dt(2025, 12, 29), dt(2026, 1, 5)),
        (dt(2025, 3, 1), dt(2025, 2, 24), dt(2025, 3, 3)),
        # 2024-02-26 is a Monday; leap day inside the week
        (dt(2024, 2, 29), dt(2024, 2, 26), dt(2024, 3, 4)),
    ],
)
def test_weekly(now, start, end):
    assert start.weekday() == 0 and end.weekday() == 0
    assert win("weekly", now) == (start, end)


@pytest.mark.parametrize(
    ("now", "start", "end"),
    [
        (dt(2025, 3, 1), dt(2025, 3, 1), dt(2025, 4, 1)),
        (dt(2025, 3, 1) - US, dt(2025, 2, 1), dt(2025, 3, 1)),
        (dt(2025, 3, 1) + US, dt(2025, 3, 1), dt(2025, 4, 1)),
        (dt(2025, 1, 31, 23, 59, 59, 999999), dt(2025, 1, 1), dt(2025, 2, 1)),
        (dt(2025, 2, 1), dt(2025, 2, 1), dt(2025, 3, 1)),
        (dt(2025, 2, 28, 12), dt(2025, 2, 1), dt(2025, 3, 1)),
        (dt(2024, 2, 28, 12), dt(2024, 2, 1), dt(2024, 3, 1)),
        (dt(2024, 2, 29, 23, 59, 59, 999999), dt(2024, 2, 1), dt(2024, 3, 1)),
        (dt(2024, 3, 1), dt(2024, 3, 1), dt(2024, 4, 1)),
        (dt(2000, 2, 29), dt(2000, 2, 1), dt(2000, 3, 1)),
        (dt(1900, 2, 28, 23), dt(1900, 2, 1), dt(1900, 3, 1)),
        (dt(2100, 2, 28, 23), dt(2100, 2, 1), dt(2100, 3, 1)),
        (dt(2025, 4, 30, 23), dt(2025, 4, 1), dt(2025, 5, 1)),
        (dt(2025, 12, 31, 23, 59, 59, 999999), dt(2025, 12, 1), dt(2026, 1, 1)),
        (dt(2026, 1, 1), dt(2026, 1, 1), dt(2026, 2, 1)),
    ],
)
def test_monthly(now, start, end):
    assert win("monthly", now) == (start, end)


@pytest.mark.parametrize(
    ("year", "month", "days"),
    [
        (2025, 1, 31),
        (2025, 2, 28),
        (2024, 2, 29),
        (2000, 2, 29),
        (1900, 2, 28),
        (2100, 2, 28),
        (2025, 4, 30),
        (2025, 12, 31),
    ],
)
def test_monthly_length(year, month, days):
    start, end = win("monthly", dt(year, month, 15))
    assert end - start == timedelta(days=days)


def test_calendar_ignores_anchor():
    now = dt(2025, 3, 14, 15, 30)
    for text in ("hourly", "daily", "weekly", "monthly"):
        assert win(text, now, anchor=dt(2025, 3, 14, 15, 29)) == win(text, now, anchor=ANCHOR)
        # anchor after now (skew) does not matter either
        assert win(text, now, anchor=dt(2030, 1, 1)) == win(text, now, anchor=ANCHOR)


# --------------------------------------------------------------------- never / fixed


def test_never():
    anchor = dt(2025, 3, 14, 15, 30, 1, 5)
    assert win("never", dt(2030, 1, 1), anchor) == (anchor, None)
    assert next_reset(parse_interval("never"), anchor, dt(2030, 1, 1)) is None


def test_fixed_basic():
    anchor = dt(2025, 3, 14, 15, 30, 7, 123456)
    length = timedelta(seconds=3)
    assert win("3s", anchor, anchor) == (anchor, anchor + length)
    assert win("3s", anchor + length - US, anchor) == (anchor, anchor + length)
    assert win("3s", anchor + length, anchor) == (anchor + length, anchor + 2 * length)
    assert win("3s", anchor + length + US, anchor) == (anchor + length, anchor + 2 * length)
    assert win("90m", anchor + timedelta(hours=4), anchor) == (
        anchor + timedelta(minutes=180),
        anchor + timedelta(minutes=270),
    )


def test_fixed_before_anchor_returns_first_window():
    anchor = dt(2025, 3, 14, 15, 30)
    for now in (anchor - US, anchor - timedelta(seconds=5), anchor - timedelta(days=400)):
        assert win("1h", now, anchor) == (anchor, anchor + timedelta(hours=1))


def test_fixed_exact_far_from_anchor():
    # 1 s windows ~8000 years from the anchor: 2.5e11 windows, 2.5e17 µs;
    # float arithmetic would lose the microseconds here.
    anchor = dt(1, 1, 1, 0, 0, 0, 1)
    now = dt(9999, 12, 30, 23, 59, 59, 999999)
    start, end = win("1s", now, anchor)
    assert start == dt(9999, 12, 30, 23, 59, 59, 1)
    assert end == dt(9999, 12, 31, 0, 0, 0, 1)
    start, end = win("7s", now, anchor)
    assert start <= now < end
    assert (start - anchor) // US % 7_000_000 == 0


def test_next_reset_is_window_end():
    now = dt(2025, 3, 14, 15, 30)
    assert next_reset(parse_interval("daily"), ANCHOR, now) == dt(2025, 3, 15)
    assert next_reset(parse_interval("5m"), dt(2025, 3, 14, 15, 28), now) == dt(2025, 3, 14, 15, 33)


# ------------------------------------------------------------------ datetime handling


def test_naive_datetimes_are_treated_as_utc():
    naive_now = datetime(2025, 3, 14, 15, 30)
    naive_anchor = datetime(2025, 3, 14, 15, 28)
    start, end = window_for(parse_interval("hourly"), naive_anchor, naive_now)
    assert (start, end) == (dt(2025, 3, 14, 15), dt(2025, 3, 14, 16))
    assert start.tzinfo is UTC and end.tzinfo is UTC
    start, end = window_for(parse_interval("5m"), naive_anchor, naive_now)
    assert (start, end) == (dt(2025, 3, 14, 15, 28), dt(2025, 3, 14, 15, 33))
    assert start.tzinfo is UTC
    start, end = window_for(parse_interval("never"), naive_anchor, naive_now)
    assert start == dt(2025, 3, 14, 15, 28) and start.tzinfo is UTC and end is None
    # mixing naive and aware works too
    assert window_for(parse_interval("5m"), naive_anchor, dt(2025, 3, 14, 15, 30)) == (
        dt(2025, 3, 14, 15, 28),
        dt(2025, 3, 14, 15, 33),
    )


def test_other_timezones_are_converted_to_utc():
    tz = timezone(timedelta(hours=-5))
    # 2025-03-16 21:00 at UTC-5 is Monday 2025-03-17 02:00 UTC
    now = datetime(2025, 3, 16, 21, 0, tzinfo=tz)
    start, end = window_for(parse_interval("weekly"), ANCHOR, now)
    assert (start, end) == (dt(2025, 3, 17), dt(2025, 3, 24))
    assert start.tzinfo is UTC
    assert window_for(parse_interval("daily"), ANCHOR, now) == (dt(2025, 3, 17), dt(2025, 3, 18))
    assert window_for(parse_interval("monthly"), ANCHOR, datetime(2025, 3, 31, 22, tzinfo=tz)) == (
        dt(2025, 4, 1),
        dt(2025, 5, 1),
    )


def test_non_datetime_rejected():
    with pytest.raises(TypeError):
        window_for(parse_interval("daily"), ANCHOR, "2025-01-01")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        window_for(parse_interval("daily"), None, dt(2025, 1, 1))  # type: ignore[arg-type]


def test_out_of_range_raises_overflow():
    with pytest.raises(OverflowError):
        win("monthly", dt(9999, 12, 15))
    with pytest.raises(OverflowError):
        win("daily", dt(9999, 12, 31, 5))
    with pytest.raises(OverflowError):
        win("1h", dt(9999, 12, 31, 23, 30), anchor=dt(9999, 12, 31))


# ------------------------------------------------------------------ property tests

CALENDAR = ["hourly", "daily", "weekly", "monthly"]
UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


@st.composite
def fixed_texts(draw):
    unit = draw(st.sampled_from(list(UNIT_SECONDS)))
    top = MAX_FIXED_SECONDS // UNIT_SECONDS[unit]
    n = draw(
        st.one_of(st.integers(min_value=1, max_value=100), st.integers(min_value=1, max_value=top))
    )
    return f"{n}{unit}"


intervals = st.one_of(st.sampled_from(CALENDAR), fixed_texts()).map(parse_interval)

# Keep clear of datetime.max so that `end` and the window after it exist.
moments = st.datetimes(
    min_value=datetime(1, 1, 2),
    max_value=datetime(9970, 12, 31),
    timezones=st.just(UTC),
)
offsets = st.builds(
    timezone,
    st.integers(min_value=-23 * 60 + 1, max_value=23 * 60 - 1).map(lambda m: timedelta(minutes=m)),
)


def anchor_and_now():
    """(anchor, now) with now >= anchor; often close together, sometimes far apart."""
    near = st.tuples(
        moments,
        st.integers(min_value=0, max_value=10 * 86400 * 10**6).map(lambda us: timedelta(0, 0, us)),
    ).map(lambda t: (t[0], t[0] + t[1]))
    far = st.tuples(moments, moments).map(lambda t: (min(t), max(t)))
    return st.one_of(near, far)


def _check_window(interval, anchor, now):
    start, end = window_for(interval, anchor, now)
    assert start.tzinfo is UTC and end.tzinfo is UTC
    # contains now
    assert start <= now < end
    # the window of `start` is the same window
    assert window_for(interval, anchor, start) == (start, end)
    # the window of the last microsecond is the same window
    assert window_for(interval, anchor, end - US) == (start, end)
    # windows tile: the next window starts at `end`
    assert window_for(interval, anchor, end)[0] == end
    return start, end


@given(interval=intervals, pair=anchor_and_now())
def test_property_window_contains_and_tiles(interval, pair):
    anchor, now = pair
    start, end = _check_window(interval, anchor, now)
    if interval.kind == "fixed":
        length_us = interval.seconds * 10**6
        assert (end - start) // US == length_us
        offset_us = (start - anchor) // US
        assert offset_us >= 0
        assert offset_us % length_us == 0
        assert start >= anchor
    else:
        for boundary in (start, end):
            assert boundary.second == 0 and boundary.microsecond == 0
            assert boundary.minute == 0
            if interval.kind != "hourly":
                assert boundary.hour == 0
            if interval.kind == "weekly":
                assert boundary.weekday() == 0
            if interval.kind == "monthly":
                assert boundary.day == 1
        expected = {
            "hourly": timedelta(hours=1),
            "daily": timedelta(days=1),
            "weekly": timedelta(days=7),
            "monthly": timedelta(days=calendar.monthrange(start.year, start.month)[1]),
        }[interval.kind]
        assert end - start == expected


@given(interval=intervals, pair=anchor_and_now())
def test_property_next_reset_is_end(interval, pair):
    anchor, now = pair
    assert next_reset(interval, anchor, now) == window_for(interval, anchor, now)[1]


@given(interval=intervals, anchor=moments, now=moments)
def test_property_calendar_and_skew(interval, anchor, now):
    start, end = window_for(interval, anchor, now)
    if interval.kind == "fixed" and now < anchor:
        # clock skew: the first window
        assert (start, end) == (anchor, anchor + timedelta(seconds=interval.seconds))
    else:
        assert start <= now < end


@given(interval=intervals, pair=anchor_and_now(), tz=offsets)
def test_property_timezone_and_naive_equivalence(interval, pair, tz):
    anchor, now = pair
    expected = window_for(interval, anchor, now)
    assert window_for(interval, anchor.astimezone(tz), now.astimezone(tz)) == expected
    naive = window_for(interval, anchor.replace(tzinfo=None), now.replace(tzinfo=None))
    assert naive == expected
    assert all(d.tzinfo is UTC for d in naive)


@given(anchor=moments, now=moments)
def test_property_never(anchor, now):
    assert window_for(parse_interval("never"), anchor, now) == (anchor, None)


@settings(max_examples=300, deadline=None)
@given(st.from_regex(INTERVAL_PATTERN, fullmatch=True) | st.text(max_size=14))
def test_the_declared_interval_pattern_is_what_parse_interval_takes(text):
    """/openapi.json declares INTERVAL_PATTERN for every reset_interval: a text it matches is
    taken, any other refused (the unit's bound included: 3650d, 87600h, 5256000m, 315360000s)."""
    try:
        parse_interval(text)
        taken = True
    except InvalidInterval:
        taken = False
    assert taken is (re.fullmatch(INTERVAL_PATTERN, text) is not None), text


@pytest.mark.parametrize("text", ["3650d", "87600h", "5256000m", "315360000s", "3651d", "87601h"])
def test_the_interval_pattern_holds_each_unit_to_its_bound(text):
    taken = int(re.sub(r"\D", "", text)) in (3650, 87600, 5256000, 315360000)
    assert (re.fullmatch(INTERVAL_PATTERN, text) is not None) is taken
