"""The per-process credential cache: a credential (an API token's hash, an access token's
session) -> what the database said of it, so an authenticated request makes no round trip for
its credential.

Correctness rests on three rules (the argument is in docs/decisions/cached-credentials.md):
- An entry is served only while the cache is trusted: on PostgreSQL, while this process's
  listener (metering.auth.invalidation) is connected and has confirmed, less than `trust_s` ago,
  that it has handled every change committed before that confirmation began. On SQLite (one
  process) the cache is always trusted and changes drop entries directly; processes sharing
  one SQLite file also see each other's changes through a marker file beside it (`watch`, read
  on every lookup: a changed marker empties the cache).
- A change drops every entry naming one of its subjects ("token:ID", "user:ID", "team:ID",
  "session:ID") and moves the epoch on: an entry read from the database before the change and
  stored after it is refused, because it was read under an older epoch.
- Bounded: at most `size` entries, each kept `ttl_s` at most (a safety net, not the mechanism).

Misses of one credential that arrive together share one database lookup (`load`): an entry
expiring under load, or a cache just emptied, would otherwise send every request in flight to
the database at once (sixteen at C=16, each with a connection of its own, past what the pool
keeps). A request joins a lookup in flight only where the cache would serve the entry that
lookup is about to store: while the cache is trusted and no change has been applied since the
lookup began (the same epoch). A lookup that fails is not shared: each of its callers looks for
itself (an unknown token may be created meanwhile).
"""

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

Loaded = tuple[Any, frozenset[str], "datetime | None"]  # value, subjects, expires_at


@dataclass(frozen=True, slots=True)
class _Flight:
    """A lookup in flight: the epoch it began in, and its value and expiry when it ends."""

    epoch: int
    done: asyncio.Future[tuple[Any, datetime | None]]


@dataclass(frozen=True, slots=True)
class Entry:
    value: Any
    subjects: frozenset[str]
    # An API token's own expiry, checked on every hit; None: never expires.
    expires_at: datetime | None
    stored_at: float


class CredentialCache:
    def __init__(
        self,
        size: int,
        ttl_s: float,
        *,
        always_trusted: bool,
        watch: Callable[[], str] | None = None,
    ) -> None:
        self.size = size
        self.ttl_s = ttl_s
        self._entries: dict[str, Entry] = {}
        self._epoch = 0
        self._trusted_until = float("inf") if always_trusted else 0.0
        self._watch = watch
        self._seen = watch() if watch is not None else ""
        # Called with the subjects a change names (None: everything) before it is acknowledged.
        self.on_change: list[Callable[[frozenset[str] | None], None]] = []
        self._flights: dict[str, _Flight] = {}  # at most one per key, removed when it ends
        self.lookups = 0  # database lookups made by load()
        self.joined = 0  # misses served by a lookup already in flight

    def _sync(self) -> None:
        if self._watch is not None:
            marker = self._watch()
            if marker != self._seen:
                self._seen = marker
                self.clear()

    # --- trust -----------------------------------------------------------------------------

    def trusted(self) -> bool:
        return time.monotonic() < self._trusted_until

    def trust_until(self, deadline: float) -> None:
        self._trusted_until = deadline

    def distrust(self) -> None:
        self._trusted_until = 0.0

    # --- entries ---------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """Read before a database lookup; handed back to put()."""
        return self._epoch

    def get(self, key: str) -> Entry | None:
        self._sync()
        if not self.trusted():
            return None
        entry = self._entries.get(key)
        if entry is None:
            return None
        if time.monotonic() - entry.stored_at >= self.ttl_s:
            self._entries.pop(key, None)
            return None
        return entry

    def put(
        self,
        key: str,
        value: Any,
        subjects: frozenset[str],
        epoch: int,
        expires_at: datetime | None = None,
    ) -> None:
        self._sync()
        if epoch != self._epoch or self.size <= 0:
            return
        if key not in self._entries and len(self._entries) >= self.size:
            # Oldest first: dicts keep insertion order.
            self._entries.pop(next(iter(self._entries)))
        self._entries[key] = Entry(value, subjects, expires_at, time.monotonic())

    async def load(
        self, key: str, lookup: Callable[[], Awaitable[Loaded]]
    ) -> tuple[Any, "datetime | None"]:
        """A miss: `lookup()` reads the credential from the database (raising if it is not
        valid) and its value is stored; or, while the cache is trusted, a lookup of the same
        key begun in the current epoch is already in flight, and its value is shared. Returns
        the value and its expiry (the caller checks the expiry, as on a hit)."""
        self._sync()
        flight = self._flights.get(key)
        if flight is not None and flight.epoch == self._epoch and self.trusted():
            await asyncio.wait((flight.done,))  # raises only if this caller is cancelled
            if not flight.done.cancelled() and flight.done.exception() is None:
                self.joined += 1
                return flight.done.result()
            # It failed: not shared, this caller looks for itself.
        epoch = self._epoch
        mine = _Flight(epoch, asyncio.get_running_loop().create_future())
        self._flights[key] = mine
        self.lookups += 1
        try:
            value, subjects, expires_at = await lookup()
        except BaseException as exc:
            if isinstance(exc, Exception):
                mine.done.set_exception(exc)
                mine.done.exception()  # retrieved: its callers look again, none raises it
            else:
                mine.done.cancel()
            raise
        finally:
            if self._flights.get(key) is mine:
                del self._flights[key]
        self.put(key, value, subjects, epoch, expires_at)
        mine.done.set_result((value, expires_at))
        return value, expires_at

    def drop(self, subjects: set[str] | frozenset[str]) -> None:
        """Forget every entry naming one of `subjects`."""
        self._epoch += 1
        for hook in self.on_change:
            hook(frozenset(subjects))
        if not subjects:
            return
        stale = [key for key, entry in self._entries.items() if entry.subjects & subjects]
        for key in stale:
            del self._entries[key]

    def clear(self) -> None:
        self._epoch += 1
        for hook in self.on_change:
            hook(None)
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
