"""The holds of the requests this process is serving, kept from expiring while they run.

One task per process pushes the expiry of every live hold out by the hold TTL, every TTL/3, in
one UPDATE per batch: a request may wait on its upstream (first byte, a slow answer, NIM polls)
for as long as the provider allows, and only the holds of a process that died are swept.
"""

import logging

import anyio

from metering.budgets.release import extend
from metering.db import Database

log = logging.getLogger("metering.proxy")

BATCH = 500
RETRY_S = 1.0  # after a failed refresh (the database restarting), try again this soon


class LiveHolds:
    def __init__(self) -> None:
        self._ids: set[str] = set()

    def add(self, hold_id: str) -> None:
        self._ids.add(hold_id)

    def discard(self, hold_id: str) -> None:
        self._ids.discard(hold_id)

    def __contains__(self, hold_id: str) -> bool:
        return hold_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

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
            await anyio.sleep(wait)
            try:
                await self.refresh(db, ttl_s)
            except Exception:
                log.warning("could not extend %d live holds; retrying", len(self), exc_info=True)
                wait = min(every, RETRY_S)
            else:
                wait = every
