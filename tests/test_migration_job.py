"""Migrations as a job of their own (the Kubernetes manifests' `metering-migrate`): `metering db
check` and `metering db wait` tell a fresh database from a migrated one, `metering serve
--no-migrate` refuses to start on a schema behind its release and starts on a current one,
and a schema a newer release applied counts as current (a replica of the release before keeps
serving during a rolling update)."""

import os
import re
import subprocess
import sys
import uuid

import psycopg
import pytest
from sqlalchemy import create_engine, text

from metering import migrate
from metering.cli import parser
from metering.db import sync_url
from metering.testing import free_port
from tests.conftest import PG_ADMIN_DSN
from tests.demo.test_demo import read_until

INHERITED = {k: v for k, v in os.environ.items() if k != "METERING_CONFIG"}
pytestmark = pytest.mark.e2e  # starts `metering` and makes databases


@pytest.fixture(params=["sqlite", "postgresql"])
def fresh(request, tmp_path):
    """A database with no schema at all."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'job.db'}"
        return
    name = f"metering_job_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield f"postgresql://postgres@127.0.0.1:5432/{name}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class Done:
    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr

    def __repr__(self) -> str:
        return f"exit {self.returncode}: {self.stdout} {self.stderr}"


@pytest.fixture
def metering(monkeypatch, capsys):
    """`metering ...` on a database, in this process (the commands read the settings from the
    environment, as they do in the job's and the pod's containers)."""

    def run(url: str, *args: str) -> Done:
        monkeypatch.setenv("METERING_DATABASE_URL", url)
        monkeypatch.delenv("METERING_CONFIG", raising=False)
        parsed = parser().parse_args(list(args))
        code = parsed.func(parsed)  # as `metering` runs it, without its logging set-up
        out = capsys.readouterr()
        return Done(code, out.out, out.err)

    return run


def test_the_job_migrates_and_the_replicas_wait_for_it(fresh, metering):
    head = migrate.schema_state(fresh)[2]
    checked = metering(fresh, "db", "check")
    assert checked.returncode == 1, checked
    assert f"schema pending: database at none, this release's head {head}" in checked.stdout
    waited = metering(fresh, "db", "wait", "--timeout", "0.5")
    assert waited.returncode == 1, waited
    refused = metering(fresh, "serve", "--no-migrate", "--port", str(free_port()))
    assert refused.returncode == 2, refused
    assert "run `metering db upgrade` (the migration job) first" in refused.stderr
    assert migrate.schema_state(fresh)[:2] == ("pending", None)  # nothing was applied

    upgraded = metering(fresh, "db", "upgrade")
    assert upgraded.returncode == 0, upgraded
    for command in (("db", "check"), ("db", "wait", "--timeout", "5")):
        done = metering(fresh, *command)
        assert done.returncode == 0, done
        assert (
            done.stdout.strip() == f"schema current: database at {head}, this release's head {head}"
        )


def test_serve_no_migrate_starts_on_a_current_schema(tmp_path):
    """The pod's own command, as a process: it listens without migrating."""
    url = f"sqlite:///{tmp_path / 'current.db'}"
    migrate.upgrade(url)
    process = subprocess.Popen(
        [sys.executable, "-m", "metering.cli", "serve", "--no-migrate", "--port", str(free_port())],
        cwd=tmp_path,
        env={**INHERITED, "METERING_DATABASE_URL": url},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        log = read_until(process, re.compile(r"Uvicorn running on|Traceback"), timeout=60)
    finally:
        process.terminate()
        process.wait(timeout=15)
    assert "Uvicorn running on" in log, log


def test_a_newer_releases_schema_counts_as_current(fresh, metering):
    migrate.upgrade(fresh)
    engine = create_engine(sync_url(fresh))
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = 'from_a_newer_release'"))
    engine.dispose()
    state, revision, _ = migrate.schema_state(fresh)
    assert (state, revision) == ("newer", "from_a_newer_release")
    checked = metering(fresh, "db", "check")
    assert checked.returncode == 0, checked
    assert "schema newer: database at from_a_newer_release" in checked.stdout


@pytest.mark.parametrize("timeout", ["0", "-1", "86401", "nan"])
def test_the_wait_is_bounded(timeout):
    with pytest.raises(SystemExit):
        parser().parse_args(["db", "wait", "--timeout", timeout])
