"""Ids of the ledger's rows (the request id, which is its event's id; the id of an event
recorded outside the proxy): a prefix, then 32 hex digits, the first 12 the creation time in
milliseconds since the epoch and the other 20 random (80 bits), as a UUIDv7 lays them out.

Ids made later sort after those made earlier, so a new event's primary key goes to the right
edge of its index, where the index's recent pages are, instead of to a random page of the whole
index: at a ledger of millions of events a random id dirties a page of the index that is
rarely in memory, and the first change to a page after each checkpoint writes the whole page
to the WAL (docs/decisions/time-ordered-ids.md).
"""

import os
import time


def time_ordered(prefix: str) -> str:
    return f"{prefix}_{time.time_ns() // 1_000_000:012x}{os.urandom(10).hex()}"
