"""Alembic environment: the URL comes from the caller (metering.migrate) or the settings."""

from alembic import context
from sqlalchemy import create_engine, pool

# Every table on Base.metadata: the ledger's and the rest of the schema's.
from metering import models  # noqa: F401
from metering.db import Base, sync_url
from metering.ledger import tables  # noqa: F401
from metering.responses import tables as responses_tables  # noqa: F401
from metering.settings import Settings

config = context.config
# Indexes made by a migration on one database only, which the models do not declare: the
# comparison with the models passes over them (0022: pg_trgm's, on PostgreSQL where it exists).
UNMODELED_INDEXES = frozenset({"ix_teams_name_search", "ix_users_search", "ix_ledger_events_txid"})
# 0026: the writing transaction of each ledger event, on PostgreSQL only, set by the database
# (metering.reports.changes reads it; no statement writes it).
UNMODELED_COLUMNS = frozenset({("ledger_events", "txid")})


def include_object(obj, name, type_, reflected, compare_to) -> bool:
    if type_ == "column" and (obj.table.name, name) in UNMODELED_COLUMNS:
        return False
    return not (type_ == "index" and name in UNMODELED_INDEXES)


url = config.get_main_option("sqlalchemy.url") or sync_url(Settings().database_url)


def run_migrations_offline() -> None:
    context.configure(url=url, target_metadata=Base.metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.connect() as conn:
        _run(conn)


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        include_object=include_object,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
