"""The per-process credential cache: a credential (an API token's hash, an access token's
session) -> what the database said of it, so an authenticated request makes no round trip for
its credential.

Correctness rests on three rules (the argument is in the README):
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
"""

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any


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
