"""Budget reset intervals and the windows they cut time into.

A budget's ``reset_interval`` is one of:

* ``never`` -- a single window ``[anchor, None)`` that never ends;
* ``hourly``, ``daily``, ``weekly``, ``monthly`` -- calendar windows in UTC,
  starting on the hour, at 00:00, on Monday 00:00 and on the 1st 00:00;
* ``<N>s``, ``<N>m``, ``<N>h``, ``<N>d`` -- fixed windows of that length counted
  from the budget's creation (the *anchor*): ``[anchor + k*len, anchor + (k+1)*len)``.

Datetimes: aware datetimes in any zone are converted to UTC; naive datetimes are
treated as UTC (SQLite hands them back without a zone). Returned datetimes are
always aware, in UTC. Fixed windows are computed with exact integer arithmetic on
microseconds. A window whose boundary would fall outside the range of
``datetime`` (after 9999-12-31) raises ``OverflowError``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from metering.numbers import upto_pattern

__all__ = [
    "CALENDAR_KINDS",
    "INTERVAL_PATTERN",
    "MAX_FIXED_SECONDS",
    "InvalidInterval",
    "Interval",
    "parse_interval",
    "window_for",
    "next_reset",
]

CALENDAR_KINDS = frozenset({"hourly", "daily", "weekly", "monthly"})
_KINDS = CALENDAR_KINDS | {"never", "fixed"}

_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_FIXED_DAYS = 3650
MAX_FIXED_SECONDS = MAX_FIXED_DAYS * 86400

# ASCII digits only (no Unicode digits, underscores, signs or leading zeros), at
# most 10 of them, then exactly one lowercase unit. fullmatch: no trailing "\n".
_FIXED = re.compile(r"([1-9][0-9]{0,9})([smhd])", re.ASCII)

# Every text parse_interval takes, as the JSON Schema `pattern` /openapi.json declares for a
# reset_interval: the same forms and the same bound, each unit's count up to MAX_FIXED_DAYS.
INTERVAL_PATTERN = (
    "^(?:never|hourly|daily|weekly|monthly|"
    + "|".join(
        f"{upto_pattern(MAX_FIXED_SECONDS // seconds)}{unit}"
        for unit, seconds in _UNIT_SECONDS.items()
    )
    + ")$"
)

_ACCEPTED = (
    "expected one of 'never', 'hourly', 'daily', 'weekly', 'monthly', or a duration "
    f"'<N>s', '<N>m', '<N>h', '<N>d' (N a positive integer without sign or leading "
    f"zeros, at most 10 digits, total length at most {MAX_FIXED_DAYS} days), "
    "lowercase, without whitespace"
)

_US_PER_SECOND = 1_000_000
_ONE_US = timedelta(microseconds=1)


class InvalidInterval(ValueError):
    """A ``reset_interval`` text that is not one of the accepted forms."""


@dataclass(frozen=True, slots=True)
class Interval:
    kind: str  # "never" | "hourly" | "daily" | "weekly" | "monthly" | "fixed"
    seconds: int | None  # window length, for "fixed" only
    text: str  # canonical text: parse_interval(text) == self

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise InvalidInterval(f"unknown interval kind {self.kind!r}")
        if self.kind == "fixed":
            if type(self.seconds) is not int or not 0 < self.seconds <= MAX_FIXED_SECONDS:
                raise InvalidInterval(
                    f"fixed interval needs 1..{MAX_FIXED_SECONDS} seconds, got {self.seconds!r}"
                )
        elif self.seconds is not None:
            raise InvalidInterval(f"{self.kind!r} interval takes no seconds")

    @property
    def length(self) -> timedelta | None:
        """The window length for fixed intervals, else None."""
        return None if self.seconds is None else timedelta(seconds=self.seconds)

    def __str__(self) -> str:
        return self.text


def _describe(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:40] + "...")


def parse_interval(text: str) -> Interval:
    """Parse a ``reset_interval``; raise InvalidInterval for anything else.

    Only exact canonical forms are accepted, so ``parse_interval(t).text == t``.
    """
    if not isinstance(text, str):
        raise InvalidInterval(f"reset_interval must be a string, got {type(text).__name__}")
    if text == "never":
        return Interval("never", None, "never")
    if text in CALENDAR_KINDS:
        return Interval(text, None, text)
    m = _FIXED.fullmatch(text)
    if m is None:
        raise InvalidInterval(f"invalid reset_interval {_describe(text)}: {_ACCEPTED}")
    seconds = int(m.group(1)) * _UNIT_SECONDS[m.group(2)]
    if seconds > MAX_FIXED_SECONDS:
        raise InvalidInterval(
            f"invalid reset_interval {_describe(text)}: longer than {MAX_FIXED_DAYS} days; "
            f"{_ACCEPTED}"
        )
    return Interval("fixed", seconds, text)


def _utc(value: datetime, name: str) -> datetime:
    if not isinstance(value, datetime):
        raise TypeError(f"{name} must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        return value.replace(tzinfo=UTC, fold=0)  # naive: treated as UTC
    return value.astimezone(UTC).replace(fold=0)


def _calendar_window(kind: str, now: datetime) -> tuple[datetime, datetime]:
    if kind == "hourly":
        start = now.replace(minute=0, second=0, microsecond=0)
        return start, start + timedelta(hours=1)
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
    if kind == "daily":
        return midnight, midnight + timedelta(days=1)
    if kind == "weekly":
        start = midnight - timedelta(days=midnight.weekday())
        return start, start + timedelta(days=7)
    # monthly
    start = midnight.replace(day=1)
    if start.month == 12:
        end = start.replace(year=start.year + 1, month=1)  # ValueError past 9999
    else:
        end = start.replace(month=start.month + 1)
    return start, end


def window_for(
    interval: Interval, anchor: datetime, now: datetime
) -> tuple[datetime, datetime | None]:
    """The window ``[start, end)`` of ``interval`` that contains ``now``.

    ``never``: ``(anchor, None)``. Calendar kinds ignore the anchor. Fixed windows
    are ``anchor + k*length`` with ``k = floor((now - anchor) / length)``; if ``now``
    is before the anchor (clock skew between replicas) the first window
    ``[anchor, anchor + length)`` is returned.
    """
    anchor = _utc(anchor, "anchor")
    now = _utc(now, "now")
    kind = interval.kind
    if kind == "never":
        return anchor, None
    if kind == "fixed":
        assert interval.seconds is not None  # a fixed interval has its length
        length_us = interval.seconds * _US_PER_SECOND
        elapsed_us = (now - anchor) // _ONE_US  # exact: timedelta // timedelta is an int
        k = max(elapsed_us // length_us, 0)
        start = anchor + timedelta(microseconds=k * length_us)
        return start, start + timedelta(microseconds=length_us)
    if kind in CALENDAR_KINDS:
        try:
            return _calendar_window(kind, now)
        except ValueError as exc:  # month end past year 9999
            raise OverflowError(f"{kind} window end is out of the datetime range") from exc
    raise InvalidInterval(f"unknown interval kind {kind!r}")


def next_reset(interval: Interval, anchor: datetime, now: datetime) -> datetime | None:
    """When the window containing ``now`` ends (None for ``never``)."""
    return window_for(interval, anchor, now)[1]
