"""GET /v1/usage/changes: the ledger's events in the order they became visible, for an exporter
that polls with the `next` cursor and must get every event exactly once, however late its
transaction commits (a long stream's settle, a group commit, another replica's).

PostgreSQL: each event carries the id of the transaction that wrote it (`txid`, set by the
database: migration 0026). A poll returns, in (txid, id) order after the cursor, only the
events of transactions older than the oldest still running (the snapshot's xmin): every one of
those has committed or rolled back, so no event can later appear before the cursor. A
transaction still running holds the feed back at its own id until it ends, and no longer
(docs/decisions/change-feed.md).

SQLite: one writer at a time commits its rows in rowid order, so a row after the cursor's rowid
is every row committed since."""

import base64
import binascii
from typing import Any

from sqlalchemy import ColumnClause, literal_column, select, text

from metering.auth.service import Principal
from metering.db import Database
from metering.errors import InvalidRequest
from metering.ledger.tables import LedgerEvent

_t = LedgerEvent.__table__
_TXID: ColumnClause[Any] = literal_column("ledger_events.txid")
_TXID_TEXT: ColumnClause[Any] = literal_column("CAST(ledger_events.txid AS text)")
_AFTER = text(
    "(ledger_events.txid, ledger_events.id) > (CAST(CAST(:after_txid AS text) AS xid8), :after_id)"
)
_ROWID: ColumnClause[Any] = literal_column("ledger_events.rowid")
# Transactions below this one have all ended: their events are all the feed will ever see.
_HORIZON = text("ledger_events.txid < pg_snapshot_xmin(pg_current_snapshot())")
MAX_CURSOR = 200


def _bad_cursor() -> InvalidRequest:
    return InvalidRequest("after is not a cursor this feed gave", param="after")


def encode(position: tuple[Any, ...]) -> str:
    raw = ":".join(str(p) for p in position).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode(cursor: str, dialect: str) -> tuple[Any, ...]:
    """(txid, id) on PostgreSQL, (rowid,) on SQLite; 400 for anything else."""
    if len(cursor) > MAX_CURSOR:
        raise _bad_cursor()
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode("ascii")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise _bad_cursor() from None
    kind, _, rest = raw.partition(":")
    if dialect == "postgresql" and kind == "p":
        txid, _, event_id = rest.partition(":")
        if txid.isdigit() and len(txid) <= 20 and 0 < len(event_id) <= 40:
            return int(txid), event_id
    if dialect == "sqlite" and kind == "s" and rest.isdigit() and len(rest) <= 19:
        return (int(rest),)
    raise _bad_cursor()


async def changes(
    db: Database, principal: Principal, after: str | None, limit: int
) -> tuple[list[Any], str | None]:
    """Up to `limit` events after the cursor `after` (from the oldest retained event without
    one), in the order they became visible, and the cursor to poll with next (`after` itself
    when none was found)."""
    position = decode(after, db.dialect) if after is not None else None
    conditions = [] if principal.is_admin else [_t.c.user_id == principal.user_id]
    if db.dialect == "postgresql":
        query = select(_t, _TXID_TEXT.label("feed_txid")).where(_HORIZON, *conditions)
        if position is not None:
            txid, event_id = position
            query = query.where(_AFTER.bindparams(after_txid=str(txid), after_id=event_id))
        query = query.order_by(_TXID, _t.c.id)
    else:
        query = select(_t, _ROWID.label("feed_rowid")).where(*conditions)
        if position is not None:
            query = query.where(position[0] < _ROWID)
        query = query.order_by(_ROWID)
    async with db.transaction() as session:
        rows = list((await session.execute(query.limit(limit))).all())
    if not rows:
        return rows, after
    last = rows[-1]
    if db.dialect == "postgresql":
        return rows, encode(("p", last.feed_txid, last.id))
    return rows, encode(("s", last.feed_rowid))
