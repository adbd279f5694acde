"""Changes to what a credential may do, seen by every replica before the changing call returns.

A change (a token revoked, a user or team deleted, a user moved or given a new password, a
login session ended) is recorded inside its own transaction by `record()`: on PostgreSQL it
moves the shared change counter (`auth.change_seq` in key_values) on and sends
`NOTIFY metering_auth, '<seq> <subject>...'`, which PostgreSQL delivers at commit. After the
commit, `Credentials.changed()` drops the subjects from this process's cache and waits (at most
`ack_timeout_s`) until every live replica has acknowledged that sequence number.

Each process runs a Listener on a dedicated connection (LISTEN metering_auth). A notification
drops its subjects at once. Every `interval_s` (at once after a notification) the listener pings:
one statement that records its heartbeat and the last sequence it handled (its acknowledgement)
in `auth_replicas` and reads the committed counter. A counter beyond what it handled (a
notification not yet arrived, or lost) clears the whole cache. The cache is trusted for
`trust_s` from the start of a ping that found nothing unhandled, and only on a connection that
already registered once; a lost connection distrusts it at once, and a new connection starts
from an empty cache. Callers wait for the replicas whose heartbeat is younger than
`LIVE_WINDOW_S`; a replica older than that cannot still be trusting its cache.
"""

import asyncio
import contextlib
import logging
import os
import time
import uuid

import asyncpg
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncSession

from metering.auth.cache import CredentialCache
from metering.db import Database, asyncpg_dsn, dialect_name

log = logging.getLogger("metering.auth")

CHANNEL = "metering_auth"
SEQ_KEY = "auth.change_seq"
# session.info key: the changes a unit of work made, settled after its commit.
PENDING = "metering.auth.changes"
# A replica whose heartbeat is older than this is not waited for: it pings every interval_s,
# each ping gives up after ping_timeout_s, and its trust lasts trust_s from a ping's start, so
# one that still trusts its cache has a committed heartbeat younger than this.
LIVE_WINDOW_S = 3.0

_BUMP = text(
    "INSERT INTO key_values (key, value) VALUES (:key, '1') ON CONFLICT (key) DO UPDATE "
    "SET value = (key_values.value::bigint + 1)::text RETURNING value::bigint"
)
_NOTIFY = text("SELECT pg_notify(:channel, :payload)")
_PING = (
    "INSERT INTO auth_replicas (id, heartbeat_at, acked_seq) VALUES ($1, now(), $2) "
    "ON CONFLICT (id) DO UPDATE SET heartbeat_at = now(), acked_seq = EXCLUDED.acked_seq "
    "RETURNING (SELECT value::bigint FROM key_values WHERE key = $3)"
)
_WAITING = text(
    "SELECT count(*) FROM auth_replicas WHERE id <> :me AND acked_seq < :seq "
    "AND heartbeat_at > now() - make_interval(secs => :window)"
)


def subject(kind: str, ident: str) -> str:
    return f"{kind}:{ident}"


async def record(session: AsyncSession, *subjects: str) -> None:
    """Inside the changing transaction: what changed, sent to every replica at commit."""
    if not subjects:
        return
    seq = 0
    if dialect_name(session) == "postgresql":
        seq = (await session.execute(_BUMP, {"key": SEQ_KEY})).scalar_one()
        payload = " ".join((str(seq), *subjects))
        await session.execute(_NOTIFY, {"channel": CHANNEL, "payload": payload})
    session.info.setdefault(PENDING, []).append((seq, frozenset(subjects)))


def pending(session: AsyncSession) -> list[tuple[int, frozenset[str]]]:
    changes: list[tuple[int, frozenset[str]]] = session.info.pop(PENDING, [])
    return changes


class Listener:
    """This process's side of the protocol on PostgreSQL (see the module's docstring)."""

    def __init__(
        self,
        url: str,
        cache: CredentialCache,
        *,
        interval_s: float = 0.25,
        ping_timeout_s: float = 0.5,
        trust_s: float = 1.0,
    ) -> None:
        self.dsn = asyncpg_dsn(url)
        self.cache = cache
        self.replica_id = f"rep_{uuid.uuid4().hex[:16]}"
        self.interval_s = interval_s
        self.ping_timeout_s = ping_timeout_s
        self.trust_s = trust_s
        self.handled = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._up = True

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        self.cache.distrust()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        # Gone: callers stop waiting for this process's acknowledgements at once.
        with contextlib.suppress(Exception):
            await self._execute("DELETE FROM auth_replicas WHERE id = $1", self.replica_id)

    async def _execute(self, statement: str, *args: object) -> None:
        conn = await asyncio.wait_for(asyncpg.connect(self.dsn), 2)
        try:
            await asyncio.wait_for(conn.execute(statement, *args), 2)
        finally:
            conn.terminate()

    def _notified(self, _conn: object, _pid: int, _channel: str, payload: str) -> None:
        seq_text, *subjects = payload.split(" ")
        self.cache.drop(frozenset(subjects))
        seq = int(seq_text)
        if seq == self.handled + 1:
            self.handled = seq
        self._wake.set()

    def _lost(self, _conn: object) -> None:
        self.cache.distrust()
        self._wake.set()

    async def _ping(self, conn: asyncpg.Connection) -> float | None:
        """One heartbeat and acknowledgement: when it started, if it found nothing committed
        left unhandled; else None."""
        self._wake.clear()
        started = time.monotonic()
        committed = await asyncio.wait_for(
            conn.fetchval(_PING, self.replica_id, self.handled, SEQ_KEY), self.ping_timeout_s
        )
        committed = committed or 0
        if committed > self.handled:
            # Not yet arrived, or lost: either way nothing cached may predate it.
            self.cache.clear()
            self.handled = committed
            self._wake.set()  # acknowledge it without waiting for the next beat
            return None
        return started

    async def _session(self) -> None:
        conn = await asyncio.wait_for(
            asyncpg.connect(self.dsn, server_settings={"application_name": "metering-auth"}), 5
        )
        try:
            conn.add_termination_listener(self._lost)
            await conn.add_listener(CHANNEL, self._notified)
            # Anything cached before LISTEN took effect may have missed its notification.
            self.cache.clear()
            self.handled = 0
            await self._ping(conn)  # registers; trust waits for a second, committed beat
            self._up = True
            while not conn.is_closed():
                started = await self._ping(conn)
                if started is not None:
                    self.cache.trust_until(started + self.trust_s)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.interval_s)
        finally:
            self.cache.distrust()
            with contextlib.suppress(Exception):
                conn.terminate()

    async def _run(self) -> None:
        with contextlib.suppress(Exception):
            await self._execute(
                "DELETE FROM auth_replicas WHERE heartbeat_at < now() - interval '1 hour'"
            )
        while True:
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the database went away: distrusted until back
                self.cache.distrust()
                if self._up:  # once per outage, not once per attempt
                    log.warning("credential listener lost its connection: %s", exc)
                self._up = False
            await asyncio.sleep(self.interval_s)


class Marker:
    """SQLite: a file beside the database that every change rewrites with a new random value;
    each process reads it on every lookup (a few microseconds, no database)."""

    def __init__(self, url: str) -> None:
        database = make_url(url).database
        self.path = f"{database}-credentials" if database and database != ":memory:" else None

    def read(self) -> str:
        if self.path is None:
            return ""
        try:
            with open(self.path, encoding="ascii") as f:
                return f.read()
        except OSError:
            return ""

    def touch(self) -> None:
        if self.path is None:
            return
        temporary = f"{self.path}.{uuid.uuid4().hex}"
        with open(temporary, "w", encoding="ascii") as f:
            f.write(uuid.uuid4().hex)
        os.replace(temporary, self.path)


class Credentials:
    """The cache, its listener (PostgreSQL) and the wait a changing call makes."""

    def __init__(
        self, db: Database, *, size: int, ttl_s: float, ack_timeout_s: float = 1.0
    ) -> None:
        self.db = db
        postgres = db.dialect == "postgresql"
        self.marker = None if postgres else Marker(db.url)
        self.cache = CredentialCache(
            size,
            ttl_s,
            always_trusted=not postgres,
            watch=self.marker.read if self.marker is not None else None,
        )
        if postgres and db.pooler and db.direct_url == db.url:
            log.warning(
                "METERING_DATABASE_POOLER is set and METERING_DATABASE_DIRECT_URL is not: the "
                "credential listener LISTENs through the pooler, which gives its session to "
                "other clients between two statements; changes to credentials reach the other "
                "replicas by the listener's heartbeat instead of its notifications"
            )
        # LISTEN holds a session: the direct URL's (a pooler in transaction mode would give the
        # session to other clients between two statements, and the notifications with it).
        self.listener = (
            Listener(db.direct_url, self.cache, trust_s=ack_timeout_s) if postgres else None
        )
        self.ack_timeout_s = ack_timeout_s

    def start(self) -> None:
        if self.listener is not None:
            self.listener.start()

    async def stop(self) -> None:
        if self.listener is not None:
            await self.listener.stop()

    async def committed(self, session: AsyncSession) -> None:
        """After a unit of work committed (the container's after_commit): the changes it
        recorded reach every replica before its answer leaves."""
        await self.changed(pending(session))

    async def changed(self, changes: list[tuple[int, frozenset[str]]]) -> None:
        """After the changing transaction committed: drop here, wait for the other replicas."""
        if not changes:
            return
        self.cache.drop(frozenset().union(*(subjects for _, subjects in changes)))
        if self.marker is not None:
            self.marker.touch()
        if self.listener is None:
            return
        seq = max(seq for seq, _ in changes)
        deadline = time.monotonic() + self.ack_timeout_s
        params = {"me": self.listener.replica_id, "seq": seq, "window": LIVE_WINDOW_S}
        while True:
            try:
                async with self.db.engine.connect() as conn:
                    waiting = (await conn.execute(_WAITING, params)).scalar_one()
            except Exception:
                waiting = 1  # cannot tell: wait out the timeout
            if waiting == 0 or time.monotonic() >= deadline:
                return
            await asyncio.sleep(min(0.01, max(0.0, deadline - time.monotonic())))
