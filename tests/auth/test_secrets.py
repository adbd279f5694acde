"""Secrets stay secret: never in logs (SQL debug logs included), compared in constant time, and
the signing secret is made once for all replicas."""

import asyncio
import hmac
import logging
import sys
import threading

import pytest
from sqlalchemy import create_engine, pool, text

from metering.app import create_app
from metering.auth.tokens import SECRET_KEY, Signer, derive_key, load_or_create_secret
from metering.db import Database, sync_url
from metering.settings import Settings, parse_catalog
from metering.testing import ServerThread
from tests.auth.conftest import SIM_KEYS, Client, expired_twin, new_account
from tests.conftest import ADMIN_KEY, Api, catalog_for

# SQLAlchemy keeps its own loggers at WARNING unless told otherwise: SQL, parameters and rows
# are logged from DEBUG on.
DEBUG_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "sqlalchemy.engine")


def stored_secret(database_url: str) -> str | None:
    engine = create_engine(sync_url(database_url), poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            return conn.execute(
                text("SELECT value FROM key_values WHERE key = :k"), {"k": SECRET_KEY}
            ).scalar_one_or_none()
    finally:
        engine.dispose()


@pytest.fixture
def logged_server(empty_db, sim, caplog):
    """A server on an empty database (so the signing secret is made during the test), its access
    log on, with every logger, uvicorn's and SQLAlchemy's (SQL with parameters and rows)
    included, captured at DEBUG."""
    settings = Settings(database_url=empty_db, admin_key=ADMIN_KEY, _env_file=None)
    app = create_app(settings, parse_catalog(catalog_for(sim), environ=SIM_KEYS), run_jobs=False)
    server = ServerThread(app)
    server.server.config.access_log = True
    # After the server's config, which sets uvicorn's levels to its own.
    caplog.set_level(logging.DEBUG)
    for name in DEBUG_LOGGERS:
        caplog.set_level(logging.DEBUG, logger=name)
    server.start()
    yield Api(server.url, "logged", settings)
    server.stop()


@pytest.fixture
def uvicorn_captured(caplog):
    """uvicorn's loggers do not propagate to the root logger: hand them the capture of the test's
    call phase (pytest keeps one capture handler per phase)."""
    loggers = [logging.getLogger(name) for name in ("uvicorn", "uvicorn.access")]
    for logger in loggers:
        logger.addHandler(caplog.handler)
    yield
    for logger in loggers:
        logger.removeHandler(caplog.handler)


def server_log(caplog, client_thread: int) -> str:
    """What the server logged: records of other threads than the test's own (whose HTTP client
    logs the response headers it receives, the client's business)."""
    formatter = logging.Formatter()
    lines = []
    for record in caplog.records:
        if record.thread == client_thread:
            continue
        lines.append(f"{record.name} {record.getMessage()}")
        if record.exc_info:
            lines.append(formatter.formatException(record.exc_info))
    return "\n".join(lines)


def test_no_secret_ever_reaches_the_logs(logged_server, caplog, request):
    request.getfixturevalue("uvicorn_captured")  # after the server: in the call phase
    api, client = logged_server, Client(logged_server.url)
    account = new_account(api, password="correct-horse-battery-staple")
    secrets = [account.password, "wrong-password-guess", account.api_token["token"]]

    assert client.login(account.email, "wrong-password-guess").status_code == 401
    first = client.tokens(account.email, account.password)
    second = client.refresh(first["refresh_token"]).json()
    secrets += [first["access_token"], first["refresh_token"]]
    secrets += [second["access_token"], second["refresh_token"]]

    assert client.chat(second["access_token"]).status_code == 200
    assert client.chat(account.api_token["token"]).status_code == 200
    expired = expired_twin(api.settings.database_url, second["access_token"])
    served = client.chat(expired, **{"refresh-token": second["refresh_token"]})
    assert served.status_code == 200
    secrets += [expired, served.headers["x-access-token"], served.headers["x-refresh-token"]]

    made = client.call(
        "POST", f"/v1/users/{account.id}/tokens", served.headers["x-access-token"], json={}
    )
    assert made.status_code == 201
    secrets.append(made.json()["token"])
    assert client.refresh(first["refresh_token"]).status_code == 401  # reuse: revoked, logged
    assert client.logout(served.headers["x-refresh-token"]).status_code == 204
    secrets.append(stored_secret(api.settings.database_url))

    logged = server_log(caplog, threading.get_ident())
    # The capture is real: SQL, the access log and our own records are all in it.
    assert "INSERT INTO refresh_tokens" in logged
    assert "POST /v1/auth/login" in logged
    assert "refresh token reused" in logged
    for secret in secrets:
        assert secret and secret not in logged


@pytest.fixture
def compare_digest_calls(monkeypatch):
    """Every hmac.compare_digest call, with the names of the functions that led to it."""
    calls: list[set[str]] = []
    real = hmac.compare_digest

    def spy(a, b):
        frame, names = sys._getframe(1), set()
        while frame is not None and len(names) < 8:
            names.add(frame.f_code.co_name)
            frame = frame.f_back
        calls.append(names)
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    return calls


def made_by(calls: list[set[str]], function: str) -> bool:
    return any(function in names for names in calls)


def test_every_secret_is_compared_in_constant_time(api, client, account, compare_digest_calls):
    calls = compare_digest_calls
    pair = client.tokens(account.email, account.password)

    calls.clear()
    assert api.request("GET", "/v1/teams").status_code == 200
    assert made_by(calls, "_is_admin_key")

    calls.clear()
    assert client.chat(account.api_token["token"]).status_code == 200
    assert made_by(calls, "_api_token_principal")

    calls.clear()
    assert client.call("GET", f"/v1/users/{account.id}", pair["access_token"]).status_code == 200
    assert made_by(calls, "read")  # the access token's signature
    assert made_by(calls, "_live_user")  # the session's password stamp

    calls.clear()
    assert client.refresh(pair["refresh_token"]).status_code == 200
    assert made_by(calls, "_find")  # the refresh token's hash, after the lookup by hash


def test_replicas_starting_together_make_one_signing_secret(empty_db):
    async def race():
        dbs = [Database(empty_db, 2) for _ in range(6)]
        try:
            return await asyncio.gather(*(load_or_create_secret(db) for db in dbs))
        finally:
            for db in dbs:
                await db.dispose()

    secrets = asyncio.run(race())
    assert len(set(secrets)) == 1
    assert len(secrets[0]) >= 64
    assert stored_secret(empty_db) == secrets[0]


def test_a_configured_secret_is_used_and_nothing_is_stored(empty_db):
    async def key():
        db = Database(empty_db, 2)
        try:
            return await Signer("configured-secret").key(db)
        finally:
            await db.dispose()

    assert asyncio.run(key()) == derive_key("configured-secret")
    assert stored_secret(empty_db) is None
