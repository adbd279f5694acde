"""What a process sent its database to write ledger events and holds, as the driver saw it: each
transaction (or statement sent on its own) that wrote some, whether it committed, and whether it
was one statement with no BEGIN and COMMIT around it. Read from the statements SQLAlchemy
executes and those sent through asyncpg itself (Database.raw), so a test asserts how settles
and holds were written (grouped, in one statement, retried one by one) without reading the
settle queue's own counters."""

import re
from contextlib import asynccontextmanager
from dataclasses import dataclass

from sqlalchemy import event

from metering.db import Database

_EVENTS = re.compile(r"\b(INSERT INTO|UPDATE) ledger_events\b")
_HOLDS = re.compile(r"\bINSERT INTO holds\b")


@dataclass
class Write:
    alone: bool  # one statement on its own: no BEGIN and COMMIT around it
    events: bool = False  # it wrote ledger events
    holds: bool = False  # it inserted holds
    committed: bool = False


class _Connection:
    """A raw asyncpg connection whose statements are noted."""

    def __init__(self, conn, writes: "Writes") -> None:
        self._conn, self._writes = conn, writes

    def __getattr__(self, name: str):
        method = getattr(self._conn, name)
        if name not in ("execute", "executemany", "fetch", "fetchrow", "fetchval"):
            return method

        async def noted(query: str, *args, **kwargs):
            write = Write(True, bool(_EVENTS.search(query)), bool(_HOLDS.search(query)))
            try:
                result = await method(query, *args, **kwargs)
            except BaseException:
                self._writes.note(write)
                raise
            write.committed = True
            self._writes.note(write)
            return result

        return noted


class Writes:
    """Use as `with Writes(db) as seen:`; `seen.writes`: what wrote events or holds, in the
    order each ended."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.writes: list[Write] = []
        self._open: dict[int, Write] = {}

    @property
    def events(self) -> list[Write]:
        return [w for w in self.writes if w.events]

    @property
    def holds_alone(self) -> list[Write]:
        return [w for w in self.writes if w.holds and not w.events]

    def note(self, write: Write) -> None:
        if write.events or write.holds:
            self.writes.append(write)

    def _statement(self, conn, cursor, statement, parameters, context, executemany) -> None:
        events, holds = bool(_EVENTS.search(statement)), bool(_HOLDS.search(statement))
        if not (events or holds):
            return
        if conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT":
            self.note(Write(True, events, holds, committed=True))
            return
        write = self._open.setdefault(id(conn), Write(False))
        write.events |= events
        write.holds |= holds

    def _ended(self, committed: bool):
        def ended(conn) -> None:
            write = self._open.pop(id(conn), None)
            if write is not None:
                write.committed = committed
                self.note(write)

        return ended

    def __enter__(self) -> "Writes":
        engine = self.db.engine.sync_engine
        self._listeners = [
            ("before_cursor_execute", self._statement),
            ("commit", self._ended(True)),
            ("rollback", self._ended(False)),
        ]
        for name, listener in self._listeners:
            event.listen(engine, name, listener)
        raw = self.db.raw

        @asynccontextmanager
        async def noted_raw(*args, **kwargs):
            async with raw(*args, **kwargs) as conn:
                yield _Connection(conn, self)

        self.db.raw = noted_raw
        return self

    def __exit__(self, *exc) -> None:
        del self.db.raw  # the class's own again
        for name, listener in self._listeners:
            event.remove(self.db.engine.sync_engine, name, listener)
