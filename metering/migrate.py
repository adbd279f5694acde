"""Alembic, driven from code: `metering db upgrade` and the upgrade at `metering serve` start."""

from importlib import resources
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, pool, text

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
