"""Alembic, driven from code: `metering db upgrade` and the upgrade at `metering serve` start;
`metering db check` and `metering db wait`, for a deployment whose migrations run as a job of
their own before the replicas start (`metering serve --no-migrate`)."""

import time
from importlib import resources
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, pool, text
from sqlalchemy.exc import DBAPIError

from metering.db import is_sqlite, sync_url

# Any constant: every replica that starts at once takes the same lock, one migrates.
MIGRATION_LOCK = 727_001
FILE_TEMPLATE = "%%(year)d_%%(month).2d_%%(day).2d_%%(hour).2d%%(minute).2d_%%(slug)s"


def _script_location() -> str:
    packaged = resources.files("metering").joinpath("migrations")
    if packaged.is_dir():
        return str(packaged)
    return str(Path(__file__).resolve().parent.parent / "migrations")


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", _script_location())
    config.set_main_option("sqlalchemy.url", sync_url(url).replace("%", "%%"))
    config.set_main_option("file_template", FILE_TEMPLATE)
    return config


def upgrade(url: str) -> None:
    """Apply pending migrations; on PostgreSQL under an advisory lock so replicas can race."""
    config = alembic_config(url)
    if is_sqlite(url):
        command.upgrade(config, "head")
        return
    engine = create_engine(sync_url(url), poolclass=pool.NullPool)
    # The transaction's own lock, taken in the migrations' one transaction and let go at its
    # end: a pooler in transaction mode keeps a transaction on one server session, where a
    # session's lock could be taken on one and "released" on another.
    with engine.connect() as conn, conn.begin():
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK})
        config.attributes["connection"] = conn
        command.upgrade(config, "head")
    engine.dispose()


def schema_state(url: str) -> tuple[str, str | None, str]:
    """('current', 'pending' or 'newer'; the database's revision, None before any; the code's
    head). 'newer': a revision this code does not know, applied by a newer release (a replica
    of the release before still serves on it: migrations add before they take away)."""
    script = ScriptDirectory.from_config(alembic_config(url))
    head = script.get_current_head()
    assert head is not None
    engine = create_engine(sync_url(url), poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            revision = MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
    if revision == head:
        return "current", revision, head
    known = revision is None or any(s.revision == revision for s in script.walk_revisions())
    return ("pending" if known else "newer"), revision, head


def wait_current(url: str, timeout_s: float, poll_s: float = 2.0) -> tuple[str, str | None, str]:
    """Poll until the schema is current or newer, or `timeout_s` has passed: the last state.
    A database not yet reachable counts as pending."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            state = schema_state(url)
        except (DBAPIError, OSError) as exc:  # the database may still be starting
            state = ("pending", None, f"unknown ({type(exc).__name__})")
        if state[0] != "pending" or time.monotonic() >= deadline:
            return state
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
