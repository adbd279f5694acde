"""The time the rules read: budget windows, rate minutes, token and access-token expiry, holds'
TTL and the sweeper that charges them (now()); and the durations they measure, such as a
provider's cool-down after failures (monotonic()).

A process's clock belongs to its container (metering.container.Services.clock). The app makes it
the current clock of everything it runs, its lifespan's background work and each request, and
metering.db.utcnow() reads the current clock. Outside an app (the CLI, a job called directly) the
current clock is the system's. A test hands the app a MovableClock and moves it forward instead
of waiting for the wall clock."""

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token
from datetime import UTC, datetime, timedelta
from typing import Protocol


class Clock(Protocol):
    def now(self) -> datetime:
        """The current moment, UTC-aware."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that the wall clock's steps do not move, for durations."""
        ...


class SystemClock:
    """The wall clock, in UTC."""

    def now(self) -> datetime:
        return datetime.now(UTC)

    def monotonic(self) -> float:
        return time.monotonic()


class MovableClock:
    """The wall clock shifted by an offset that a test moves: it keeps ticking with real time,
    so what runs on it keeps its order and its durations."""

    def __init__(self) -> None:
        self.offset = timedelta(0)

    def now(self) -> datetime:
        return datetime.now(UTC) + self.offset

    def monotonic(self) -> float:
        return time.monotonic() + self.offset.total_seconds()

    def advance(self, by: float | timedelta) -> datetime:
        """Move forward by `by` (seconds or a timedelta); returns the new current moment."""
        step = by if isinstance(by, timedelta) else timedelta(seconds=by)
        if step < timedelta(0):
            raise ValueError("a clock only moves forward")
        self.offset += step
        return self.now()

    def move_to(self, moment: datetime) -> datetime:
        """Move forward to `moment` (aware), from where the clock goes on ticking."""
        return self.advance(max(moment - self.now(), timedelta(0)))

    def reset(self) -> None:
        """Back to the wall clock."""
        self.offset = timedelta(0)


SYSTEM = SystemClock()

_current: ContextVar[Clock] = ContextVar("metering_clock", default=SYSTEM)


def now() -> datetime:
    """The current moment on the current clock."""
    return _current.get().now()


def current() -> Clock:
    return _current.get()


def set_current(clock: Clock) -> Token[Clock]:
    """Make `clock` the current one for this task and the tasks it starts (the app, for each
    request and its lifespan); reset_current(token) restores the one before."""
    return _current.set(clock)


def reset_current(token: Token[Clock]) -> None:
    _current.reset(token)


@contextmanager
def using(clock: Clock) -> Iterator[Clock]:
    """Make `clock` the current one for this task (and the tasks it starts) while inside."""
    token = set_current(clock)
    try:
        yield clock
    finally:
        reset_current(token)
