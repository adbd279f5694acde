"""The holds of the requests this process is serving, kept from expiring while they run.

One task per process pushes the expiry of every live hold out by the hold TTL, every TTL/3, in
one UPDATE per batch: a request may wait on its upstream (first byte, a slow answer, NIM polls)
for as long as the provider allows, and only the holds of a process that died are swept.

The same task releases the holds in doubt: a hold whose write failed in a way that may have
committed it (the connection lost mid-commit, a primary killed, a network cut). Its request was
answered 503 and sent nowhere, so the hold, if it was written, is released as soon as the
database answers again (every second until then), instead of being swept at its expiry and
charged as `unsettled`; with its rate claim, unless that was given back already.
"""

import logging

import anyio

from metering.budgets.release import extend, release
from metering.db import Database

log = logging.getLogger("metering.proxy")

BATCH = 500
RETRY_S = 1.0  # after a failed refresh (the database restarting), try again this soon


class LiveHolds:
    def __init__(self) -> None:
        self._ids: set[str] = set()
        # hold id -> whether its rate claim is still to be given back with it
        self._doubtful: dict[str, bool] = {}

    def add(self, hold_id: str) -> None:
        self._ids.add(hold_id)

    def discard(self, hold_id: str) -> None:
        self._ids.discard(hold_id)

    def __contains__(self, hold_id: str) -> bool:
        return hold_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def doubt(self, hold_id: str, rates_too: bool) -> None:
        """A hold that may have been written for a request answered without it: released by
        keep_alive once the database answers (see the module's docstring). `rates_too`: its
        rate claim was not given back, and goes with it."""
        self._doubtful[hold_id] = rates_too

    @property
    def doubtful(self) -> int:
        return len(self._doubtful)

    async def release_doubtful(self, db: Database) -> int:
        """Release the holds in doubt (each found or not); returns how many were found."""
        found = 0
        for hold_id, rates_too in list(self._doubtful.items()):
            found += await release(db, hold_id, rates_too=rates_too)
            del self._doubtful[hold_id]
        return found

    async def refresh(self, db: Database, ttl_s: int) -> int:
        """Extend every live hold; returns how many there were."""
        ids = list(self._ids)
        for start in range(0, len(ids), BATCH):
            await extend(db, ids[start : start + BATCH], ttl_s)
        return len(ids)

    async def keep_alive(self, db: Database, ttl_s: int) -> None:
        """Run until cancelled (the app's lifespan owns the task)."""
        every = ttl_s / 3
        wait = every
        while True:
            await anyio.sleep(min(wait, RETRY_S) if self._doubtful else wait)
            try:
                if self._doubtful:
                    found = await self.release_doubtful(db)
                    if found:
                        log.warning("released %d holds whose writes were cut short", found)
                await self.refresh(db, ttl_s)
            except Exception:
                log.warning("could not extend %d live holds; retrying", len(self), exc_info=True)
                wait = min(every, RETRY_S)
            else:
                wait = every
