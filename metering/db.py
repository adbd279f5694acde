"""Engines, sessions and the declarative Base (one naming convention for every constraint)."""

import asyncio
import contextlib
import os
import re
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, ClassVar

import asyncpg
from sqlalchemy import BigInteger, DateTime, MetaData, Table, event, func, literal
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import DeclarativeBase, Session
from sqlalchemy.types import TypeDecorator
from sqlalchemy.util import await_only, greenlet_spawn

from metering import clock
from metering.dburl import hosts_in_query

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    if TYPE_CHECKING:  # every model maps a table (the declarative base says only FromClause)
        __table__: ClassVar[Table]


Pico = BigInteger  # a money column: integer picodollars (1e-12 USD)


class UTCDateTime(TypeDecorator):
    """Aware UTC datetimes in Python; naive UTC on SQLite so its text ordering is time ordering."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value, dialect):
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def utcnow() -> datetime:
    """Now, on the current clock (metering.clock): the app's, or the system's outside one."""
    return clock.now()


# Search text (the `q` of a list): at most this many characters.
SEARCH_CHARS = 200
_LIKE_SPECIAL = re.compile(r"([\\%_])")


def contains(column: Any, text: str) -> Any:
    """`column` holds `text` anywhere, without case: LIKE with `%`, `_` and `\\` of the text
    escaped, so each matches itself on SQLite and PostgreSQL alike. Both sides lowered by the
    database (PostgreSQL folds any letter; SQLite's lower() folds ASCII letters only)."""
    pattern = "%" + _LIKE_SPECIAL.sub(r"\\\1", text) + "%"
    return func.lower(column).like(func.lower(literal(pattern)), escape="\\")


def async_url(url: str) -> str:
    parsed = make_url(hosts_in_query(url))
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        return str(parsed.set(drivername="sqlite+aiosqlite").render_as_string(hide_password=False))
    if backend == "postgresql":
        return parsed.set(drivername="postgresql+asyncpg").render_as_string(hide_password=False)
    raise ValueError(f"unsupported database {backend!r}: use sqlite:///PATH or postgresql://...")


def sync_url(url: str) -> str:
    parsed = make_url(hosts_in_query(url))
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        return parsed.set(drivername="sqlite").render_as_string(hide_password=False)
    if backend == "postgresql":
        return parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    raise ValueError(f"unsupported database {backend!r}: use sqlite:///PATH or postgresql://...")


def dialect_name(executor) -> str:
    """The dialect behind a Session or a Connection."""
    bind = getattr(executor, "bind", None)
    return (bind.dialect if bind is not None else executor.dialect).name


def is_sqlite(url: str) -> bool:
    return make_url(hosts_in_query(url)).get_backend_name() == "sqlite"


def asyncpg_dsn(url: str) -> str:
    """The URL as asyncpg.connect() takes it, for a connection of its own outside the pool.
    Several hosts (`?host=a:5432&host=b:5432`, dburl) go back into libpq's `a:5432,b:5432`:
    asyncpg reads one `host` parameter only, the last. Its other parameters (such as
    `target_session_attrs`) stay in the query."""
    parsed = make_url(hosts_in_query(url)).set(drivername="postgresql")
    hosts = parsed.query.get("host")
    if not isinstance(hosts, tuple):
        return parsed.render_as_string(hide_password=False)
    rendered = parsed.difference_update_query(["host"]).render_as_string(hide_password=False)
    # With no host of its own the URL renders as scheme://[userinfo@]/db?...
    scheme, _, tail = rendered.partition("://")
    userinfo, slash, rest = tail.partition("/")
    return f"{scheme}://{userinfo}{','.join(hosts)}{slash}{rest}"


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()
    _exact_sum(dbapi_connection)


INT64 = (-(2**63), 2**63 - 1)


class ExactSum:
    """sum() on SQLite, exact past 64 bits. The builtin raises "integer overflow" once a total
    passes 9,223,372,036,854,775,807 (9,223,372 USD in picodollars): a report adding up the
    rows of several budgets each under the counters' ceiling would fail. Here a total that fits
    is an integer as before; one that does not is its digits as text, which the reports read
    with int(). Also sum() as a window function (OVER). PostgreSQL sums bigints as numeric."""

    __slots__ = ("total", "real", "seen")

    def __init__(self) -> None:
        self.total = 0
        self.real: float | None = None
        self.seen = 0

    def step(self, value: Any) -> None:
        if value is None:
            return
        self.seen += 1
        self._add(value, 1)

    def inverse(self, value: Any) -> None:
        if value is None:
            return
        self.seen -= 1
        self._add(value, -1)

    def _add(self, value: Any, sign: int) -> None:
        if isinstance(value, str | bytes):
            try:
                value = int(value)
            except ValueError:
                try:
                    value = float(value)
                except ValueError:
                    value = 0
        if isinstance(value, float):
            self.real = (self.real or 0.0) + sign * value
        else:
            self.total += sign * int(value)

    def value(self) -> int | float | str | None:
        if not self.seen:
            return None
        if self.real is not None:
            return self.total + self.real
        if INT64[0] <= self.total <= INT64[1]:
            return self.total
        return str(self.total)

    def finalize(self) -> int | float | str | None:
        return self.value()


def _exact_sum(dbapi_connection) -> None:
    """Replace SQLite's sum() with ExactSum on this connection (in aiosqlite's own thread, where
    the sqlite3 connection must be used)."""
    driver = dbapi_connection.driver_connection  # the aiosqlite connection
    await_only(driver._execute(driver._conn.create_window_function, "sum", 1, ExactSum))


# The pool's connections never plan a sequential scan unless they read for a report: the
# statements that serve requests, the API and the jobs find rows by key, and each is planned
# once per connection (prepared by asyncpg; PostgreSQL keeps a generic plan after five runs)
# while `holds`, which takes an insert and a delete from every request, may be a page or two
# (just after a vacuum, the generic plan of `DELETE FROM holds WHERE id = $1` reads the table
# whole). Between two vacuums the table keeps the dead rows of every request since, and such a
# plan reads them all: a minute of 1,000 requests/s (autovacuum's default pause) leaves 60,000
# dead rows in 2,600 pages, 6 ms a scan, measured. With sequential scans off the plan is a key
# lookup whatever the table's size when it was made. A report's transaction (Database.reads)
# turns them back on for itself (SET LOCAL), as its whole-range plans need; and sums its
# groups in memory (work_mem: a report by end user of a day holds some 100,000 groups, which
# spilled to disk at the default 4 MB) without compiling them first (JIT cost a report by end
# user 150 ms of a 1.8 s plan and saved nothing: its rows are too few to pay it back), all
# three in one statement (one round trip).
SERVING_SETTINGS = {"enable_seqscan": "off"}
REPORT_SETTINGS = {"enable_seqscan": "on", "work_mem": "64MB", "jit": "off"}
REPORT_SETTING = "SELECT " + ", ".join(
    f"set_config('{name}', '{value}', true)" for name, value in REPORT_SETTINGS.items()
)


class ReportSession(Session):
    """A session of Database.reads: its transactions plan with the planner's defaults."""


@event.listens_for(ReportSession, "after_begin")
def _plan_freely(session, transaction, connection) -> None:
    if connection.dialect.name == "postgresql":
        connection.exec_driver_sql(REPORT_SETTING)


class NoWritableHost(ConnectionError):
    """Every host of the URL answered, none accepting writes (`target_session_attrs=read-write`
    while a standby is being promoted): the database is unreachable, as when none answers."""


def no_writable_host(exc: BaseException) -> bool:
    """asyncpg's TargetServerAttributeNotMatched, however SQLAlchemy wrapped it."""
    orig = getattr(exc, "orig", None) or exc
    return type(orig).__name__ in ("TargetServerAttributeNotMatched", "InternalClientError") and (
        "target attribute" in str(orig)
    )


def _writable_host_gone(context: Any) -> None:
    # Seen as a lost connection (the pool discarded, the request answered 503, a settle
    # retried), not as an error of the statement.
    if no_writable_host(context.original_exception):
        context.is_disconnect = True


def _unnamed() -> str:
    return ""


def driver_args(pooler: str | None, server_settings: dict[str, str] | None) -> dict[str, Any]:
    """asyncpg's connect arguments. Through a pooler in transaction mode (PgBouncer, as managed
    databases' poolers run) consecutive transactions of one connection may run on different
    server sessions, so nothing may live in the session: no prepared statement kept by name
    (asyncpg's cache and SQLAlchemy's are off; SQLAlchemy's statements are unnamed, parsed in
    the same exchange that runs them: asyncpg sends Parse, Describe and Flush, then Bind,
    Execute and Sync, and the pooler keeps one server session until Sync's answer) and no
    setting given at connect (PgBouncer refuses startup parameters it does not know: the
    serving settings go to the role instead, docs/operator/pgbouncer.md)."""
    if pooler is None:
        return {"server_settings": server_settings} if server_settings else {}
    if pooler != "pgbouncer":
        raise ValueError(f"unknown database pooler {pooler!r}: unset, or pgbouncer")
    return {
        "statement_cache_size": 0,
        "prepared_statement_cache_size": 0,
        "prepared_statement_name_func": _unnamed,
    }


def direct_url(url: str, direct: str | None) -> str:
    """The database without the pooler (LISTEN, the migrations): `direct`, its missing database
    name, user and password taken from `url`; unset, or the database SQLite, `url` itself."""
    if not direct or is_sqlite(url):
        return url
    given, base = make_url(direct), make_url(url)
    same_user = given.username in (None, base.username)
    return given.set(
        database=given.database or base.database,
        username=given.username or base.username,
        password=given.password if given.password is not None or not same_user else base.password,
    ).render_as_string(hide_password=False)


def create_engine(
    url: str,
    pool_size: int = 20,
    server_settings: dict[str, str] | None = None,
    pooler: str | None = None,
) -> AsyncEngine:
    if is_sqlite(url):
        # SQLite has one writer: one pooled connection serializes this process's
        # transactions in order instead of letting them fail with "database is locked".
        engine = create_async_engine(async_url(url), pool_size=1, max_overflow=0, pool_timeout=60)
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        return engine
    engine = create_async_engine(
        async_url(url),
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_timeout=30,
        pool_recycle=1800,
        # The connection given back last is taken first: the few connections a load needs stay
        # in use, with their prepared statements planned, and the rest go idle.
        pool_use_lifo=True,
        connect_args=driver_args(pooler, server_settings),
    )
    event.listen(engine.sync_engine, "handle_error", _writable_host_gone)
    return engine


def _sqlite_query_only(dbapi_connection, _record) -> None:
    _sqlite_pragmas(dbapi_connection, _record)
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA query_only=ON")
    cursor.close()


def _sqlite_reader(url: str) -> AsyncEngine:
    engine = create_async_engine(async_url(url), pool_size=2, max_overflow=0, pool_timeout=60)
    event.listen(engine.sync_engine, "connect", _sqlite_query_only)
    return engine


_NAMED = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


class Prepared:
    """A statement written with :named parameters, for asyncpg: numbered ($1, $2...) in the
    order the names first appear (a name used twice is one parameter)."""

    __slots__ = ("sql", "names")

    def __init__(self, sql: str) -> None:
        names: list[str] = []

        def number(match: re.Match) -> str:
            name = match.group(1)
            if name not in names:
                names.append(name)
            return f"${names.index(name) + 1}"

        self.sql = _NAMED.sub(number, sql)
        self.names = tuple(names)

    def args(self, params: dict) -> list:
        return [params[name] for name in self.names]


# Database.raw keeps up to this many of its connections checked out between groups, so a
# writer's next statement skips the pool's checkout and return (77 µs of CPU together, more
# than a round trip's 66, `python -m bench.checkout`): only with a pool of at least
# KEPT_MIN_POOL (the default METERING_DB_POOL_SIZE), so they never take much of a small one: a
# kept connection is not there for the process's other transactions, which open another when
# the pool has none idle. A kept connection is given back after KEPT_FOR_S, as the pool's
# recycling would.
KEPT_WRITERS = 2
KEPT_MIN_POOL = 20
KEPT_FOR_S = 1800.0
_CONNECTION_GONE = ("08", "57P")


def refused_by_server(exc: BaseException) -> bool:
    """The server refused a statement with an error of its own: its transaction rolled back and
    nothing of it committed."""
    orig = getattr(exc, "orig", None) or exc
    sqlstate = getattr(orig, "sqlstate", None) or ""
    return bool(sqlstate) and not sqlstate.startswith(_CONNECTION_GONE)


def write_in_doubt(exc: BaseException) -> bool:
    """A write that failed on its way to the database or back (the connection lost, a timeout,
    a cancellation), not refused by the server: it may have committed all the same."""
    if refused_by_server(exc):
        return False
    return isinstance(
        exc,
        DBAPIError
        | OSError
        | asyncpg.PostgresError
        | asyncpg.InterfaceError
        | asyncpg.exceptions.InternalClientError
        | asyncio.CancelledError,
    )


class AttrRecord(asyncpg.Record):
    """An asyncpg row whose columns are also attributes, as SQLAlchemy's rows."""

    __slots__ = ()

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Database:
    def __init__(
        self,
        url: str,
        pool_size: int = 20,
        *,
        pooler: str | None = None,
        direct: str | None = None,
    ) -> None:
        """`pooler` and `direct`: METERING_DATABASE_POOLER and METERING_DATABASE_DIRECT_URL,
        read from the environment when not given."""
        self.url = url
        self.pooler = pooler or os.environ.get("METERING_DATABASE_POOLER") or None
        # The database without the pooler, for what needs a session of its own (LISTEN).
        self.direct_url = direct_url(url, direct or os.environ.get("METERING_DATABASE_DIRECT_URL"))
        self.engine = create_engine(url, pool_size, SERVING_SETTINGS, self.pooler)
        self.sessions = async_sessionmaker(self.engine, expire_on_commit=False)
        self.dialect = "sqlite" if is_sqlite(url) else "postgresql"
        # Reports read apart from the request path: on SQLite the one pooled connection is the
        # writer's, and a long report on it would hold every request of the process behind it
        # (WAL lets these readers run beside the writer); PostgreSQL shares its pool, each
        # report's transaction planned with the planner's defaults (ReportSession).
        self.read_engine = _sqlite_reader(url) if self.dialect == "sqlite" else self.engine
        self.reads = async_sessionmaker(
            self.read_engine, expire_on_commit=False, sync_session_class=ReportSession
        )
        self._autocommit = self.engine.execution_options(isolation_level="AUTOCOMMIT")
        # raw()'s idle connections, kept out of the pool: (the pool's connection, kept since).
        self._kept: list[tuple[Any, float]] = []
        self._keep = KEPT_WRITERS if pool_size >= KEPT_MIN_POOL and self.dialect != "sqlite" else 0

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncSession]:
        """One unit of work: commits on success, rolls back on error."""
        async with self.sessions() as session, session.begin():
            yield session

    def begin(self) -> AbstractAsyncContextManager[AsyncConnection]:
        """A Core connection in a transaction, for the proxy's hot path: lighter than a Session."""
        return self.engine.begin()

    @asynccontextmanager
    async def raw(self, keep: tuple[type[BaseException], ...] = ()):
        """A pooled PostgreSQL connection used through asyncpg itself, for a writer's statement
        that runs for every request (the settle and hold group writers): no statement building
        and no result wrapping per call. Taken as the pool's own connection (about a quarter of
        the CPU of a Core connection's checkout and return), which is why nothing here may start
        a transaction through SQLAlchemy; the pool's bound holds every connection. Up to
        KEPT_WRITERS sound ones are kept out of the pool between groups (the last given back is
        the next taken), the rest go back to it. A failure the server did not report (a
        connection lost, a cancellation mid-statement) invalidates it; `keep`: the caller's own
        errors, raised with the connection in a sound state."""
        if self._kept:
            pooled, since = self._kept.pop()
        else:
            try:
                pooled, since = await self.engine.raw_connection(), time.monotonic()
            except Exception as exc:
                if no_writable_host(exc):
                    raise NoWritableHost(str(exc)) from exc
                raise
        sound = False
        try:
            yield pooled.driver_connection
            sound = True
        except keep:
            sound = True
            raise
        except asyncpg.PostgresError as exc:
            # The server refused a statement: the connection is sound, unless the error is the
            # connection's own (class 08: asyncpg reports a lost connection so) or the server
            # going away (57P01-57P03).
            sound = not (exc.sqlstate or "").startswith(_CONNECTION_GONE)
            raise
        finally:
            if not sound or pooled.driver_connection.is_closed():
                # A failure the server did not report (a connection lost, a cancellation
                # mid-statement): never handed out again.
                with contextlib.suppress(Exception):
                    await greenlet_spawn(pooled.invalidate)
                await greenlet_spawn(pooled.close)
            elif len(self._kept) < self._keep and time.monotonic() - since < KEPT_FOR_S:
                self._kept.append((pooled, since))
            else:
                # Back to the pool (its reset has nothing to roll back: no transaction was begun
                # through it); a connection beyond the pool's size is closed there, which is I/O.
                await greenlet_spawn(pooled.close)

    def single(self) -> AsyncConnection:
        """A Core connection in autocommit: each statement is its own transaction, with no
        BEGIN and COMMIT round trips. Only for work that is one statement."""
        return self._autocommit.connect()

    async def dispose(self) -> None:
        self._keep = 0  # a group still being written gives its connection back, not here
        kept, self._kept = self._kept, []
        for pooled, _ in kept:
            with contextlib.suppress(Exception):
                await greenlet_spawn(pooled.close)
        await self.engine.dispose()
        if self.read_engine is not self.engine:
            await self.read_engine.dispose()
