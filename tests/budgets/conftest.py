"""Budget fixtures: `metering serve` as real subprocesses on a database of the test's own,
plus small helpers shared by the budget tests (money in Decimal, direct database reads)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from decimal import Decimal
from pathlib import Path

import httpx
import psycopg
import pytest
from sqlalchemy import create_engine, pool, select, text

from metering import migrate
from metering.db import sync_url
from metering.models import Hold
from metering.money import PICO
from metering.settings import Settings
from metering.testing import free_port
from tests.conftest import ADMIN_KEY, PG_ADMIN_DSN, Api, catalog_for

SIM_KEYS = {"SIM_OPENAI_KEY": "sim-key", "SIM_EXASCALE_KEY": "sim-key"}


# --- money and the database ---------------------------------------------------------------


def usd(value: str | None) -> Decimal | None:
    return None if value is None else Decimal(value)


def pico(value: str) -> int:
    """A USD decimal string as integer picodollars (exact)."""
    amount = Decimal(value) * PICO
    assert amount == amount.to_integral_value(), value
    return int(amount)


def budget(api: Api, scope: str, subject_id: str, key: str | None = None) -> dict:
    return api.ok("GET", f"/v1/{scope}s/{subject_id}/budget", key=key)


def query(database_url: str, statement, **params) -> list:
    """Rows of one query (SQL text, or a SQLAlchemy select for typed columns), read with a
    throwaway sync engine."""
    if isinstance(statement, str):
        statement = text(statement)
    engine = create_engine(sync_url(database_url), poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            return list(conn.execute(statement, params))
    finally:
        engine.dispose()


def holds_of(database_url: str, token_id: str) -> list:
    return query(database_url, select(Hold.id, Hold.amount).where(Hold.token_id == token_id))


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05, message: str = ""):
    """Poll until predicate() returns something truthy; return it."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting: {message or predicate}")
        time.sleep(interval)


def sim_records(sim, marker: str) -> list[dict]:
    """The simulated upstream's log records whose last message mentions marker."""
    out = []
    for record in sim.log():
        body = record.get("received")
        if not isinstance(body, dict):
            continue
        messages = body.get("messages") or []
        content = messages[-1].get("content") if messages else None
        if isinstance(content, str) and marker in content:
            out.append(record)
    return out


# --- the catalog file ---------------------------------------------------------------------


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string for the plain texts used here
    raise TypeError(f"no TOML for {value!r}")


def to_toml(catalog: dict) -> str:
    lines = []
    for name, provider in catalog["providers"].items():
        lines.append(f"[providers.{json.dumps(name)}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in provider.items()]
        lines.append("")
    for model in catalog["models"]:
        lines.append("[[models]]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in model.items()]
        lines.append("")
    return "\n".join(lines)


@pytest.fixture(scope="session")
def catalog_file(sim, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("catalog") / "metering.toml"
    path.write_text(to_toml(catalog_for(sim)))
    return path


# --- databases of a test's own ------------------------------------------------------------


@contextlib.contextmanager
def new_pg_database():
    """A new, empty PostgreSQL database, dropped at the end."""
    name = f"metering_budget_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN_DSN.rsplit("/", 1)[0]
    try:
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def fresh_pg():
    """A database of the test's own."""
    with new_pg_database() as url:
        yield url


@pytest.fixture
def fresh_sqlite(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'metering.db'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def fresh_db(request) -> str:
    """A migrated, empty database of each backend."""
    url = request.getfixturevalue("fresh_pg" if request.param == "postgresql" else "fresh_sqlite")
    migrate.upgrade(url)
    return url


# --- `metering serve` subprocesses --------------------------------------------------------


class ServerProcess:
    """One `metering serve` replica in its own process."""

    def __init__(self, database_url: str, config: Path, workdir: Path, env: dict) -> None:
        self.database_url = database_url
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"server-{self.port}.log"
        self.env = {
            **os.environ,
            **SIM_KEYS,
            "METERING_DATABASE_URL": database_url,
            "METERING_ADMIN_KEY": ADMIN_KEY,
            "METERING_CONFIG": str(config),
            # Two replicas and the in-process test servers share PostgreSQL's 100 connections.
            "METERING_DB_POOL_SIZE": "8",
            **env,
        }
        self.workdir = workdir
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> "ServerProcess":
        command = [sys.executable, "-m", "metering.cli", "serve", "--port", str(self.port)]
        command += ["--log-level", "warning"]
        with open(self.log_path, "ab") as log:
            # cwd: a folder without .env or metering.toml, so only the env above applies.
            self.process = subprocess.Popen(
                command, cwd=self.workdir, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"metering serve exited early:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"metering serve did not answer /healthz:\n{self.log()}")
            time.sleep(0.1)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-5000:]
        except OSError:
            return ""

    def kill(self) -> None:
        """kill -9: the replica dies without settling anything."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.kill()

    def api(self) -> Api:
        settings = Settings(database_url=self.database_url, admin_key=ADMIN_KEY, _env_file=None)
        backend = "sqlite" if self.database_url.startswith("sqlite") else "postgresql"
        return Api(self.url, backend, settings)


@contextlib.contextmanager
def replicas(config: Path, workdir: Path):
    """Yields start(database_url, **env) -> a running replica; all are stopped at the end."""
    started: list[ServerProcess] = []

    def start(database_url: str, **env: str) -> ServerProcess:
        server = ServerProcess(database_url, config, workdir, env)
        started.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in started:
            server.stop()


@pytest.fixture
def serve(catalog_file, tmp_path):
    """Factory: serve(database_url, **env) starts a replica; all are stopped at teardown."""
    with replicas(catalog_file, tmp_path) as start:
        yield start


# --- requests -----------------------------------------------------------------------------


def chat_body(content: str, model: str = "gpt-sim", **fields) -> bytes:
    """The exact bytes a client sends (so the proxy's prompt bound can be recomputed)."""
    body = {"model": model, "messages": [{"role": "user", "content": content}], **fields}
    return json.dumps(body).encode()


def chat(api: Api, key: str, content: str, model: str = "gpt-sim", **fields) -> httpx.Response:
    body = chat_body(content, model, **fields)
    return api.request(
        "POST",
        "/v1/chat/completions",
        key=key,
        content=body,
        headers={"content-type": "application/json"},
    )


def marker() -> str:
    return f"m{uuid.uuid4().hex[:16]}"
