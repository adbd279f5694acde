"""Accounts fixtures: users with passwords, logins, a bare HTTP client (no admin key), second
servers on the same database (replicas, short token lifetimes), and forged/expired tokens."""

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import httpx
import psycopg
import pytest
from sqlalchemy import create_engine, pool, text

from metering import migrate
from metering.auth.tokens import SECRET_KEY, Signer, derive_key
from metering.db import sync_url
from metering.settings import Settings, parse_catalog
from metering.testing import metering_server
from tests.conftest import ADMIN_KEY, PG_ADMIN_DSN, catalog_for

SIM_KEYS = {"SIM_EXASCALE_KEY": "sim-key", "SIM_OPENAI_KEY": "sim-key"}
CHAT = {"model": "gpt-sim", "messages": [{"role": "user", "content": "hi sim:tokens=3"}]}


def headers_for(credential: str | None, **extra: str) -> dict:
    headers = dict(extra)
    if credential is not None:
        headers["authorization"] = f"Bearer {credential}"
    return headers


class Client:
    """A client of one server that sends only the credential it is given."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=30)

    def call(self, method: str, path: str, credential: str | None = None, **kwargs):
        headers = headers_for(credential, **kwargs.pop("headers", {}))
        return self.http.request(method, path, headers=headers, **kwargs)

    def login(self, email: str, password: str) -> httpx.Response:
        return self.call("POST", "/v1/auth/login", json={"email": email, "password": password})

    def refresh(self, refresh_token: str) -> httpx.Response:
        return self.call("POST", "/v1/auth/refresh", json={"refresh_token": refresh_token})

    def logout(self, refresh_token: str) -> httpx.Response:
        return self.call("POST", "/v1/auth/logout", json={"refresh_token": refresh_token})

    def chat(self, credential: str, **headers: str) -> httpx.Response:
        return self.call("POST", "/v1/chat/completions", credential, json=CHAT, headers=headers)

    def tokens(self, email: str, password: str) -> dict:
        response = self.login(email, password)
        assert response.status_code == 200, response.text
        return response.json()


@dataclass
class Account:
    team: dict
    user: dict
    email: str
    password: str
    api_token: dict

    @property
    def id(self) -> str:
        return self.user["id"]


def new_account(api, password: str | None = None) -> Account:
    """A team, a user with a password, and one API token."""
    team = api.team()
    email = f"acct-{uuid.uuid4().hex[:12]}@example.com"
    password = password or f"pw-{uuid.uuid4().hex}"
    user = api.ok(
        "POST",
        "/v1/users",
        201,
        json={"email": email, "name": "Account", "team_id": team["id"], "password": password},
    )
    return Account(team, user, email, password, api.token(user["id"]))


@pytest.fixture
def client(api) -> Client:
    return Client(api.url)


@pytest.fixture
def account(api) -> Account:
    return new_account(api)


def error_code(response: httpx.Response) -> str:
    return response.json()["error"]["code"]


def signing_key(database_url: str) -> bytes:
    engine = create_engine(sync_url(database_url), poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            secret = conn.execute(
                text("SELECT value FROM key_values WHERE key = :k"), {"k": SECRET_KEY}
            ).scalar_one()
    finally:
        engine.dispose()
    return derive_key(secret)


def session_of(access_token: str) -> str:
    return access_token.removeprefix("mat_").split(".")[0]


def expired_twin(database_url: str, access_token: str) -> str:
    """The same session's access token, validly signed, expired a minute ago."""
    past = datetime.now(UTC) - timedelta(minutes=1)
    return Signer.issue(signing_key(database_url), session_of(access_token), past)


@pytest.fixture
def replica(api, sim):
    """Factory: another server on the api's database, with its own settings overrides, on the
    api's clock (the `clock` fixture moves both)."""
    started = []

    def start(**overrides):
        settings = Settings(
            database_url=api.settings.database_url,
            admin_key=ADMIN_KEY,
            _env_file=None,
            **overrides,
        )
        server = metering_server(
            settings,
            parse_catalog(catalog_for(sim), environ=SIM_KEYS),
            run_jobs=False,
            clock=api.clock,
        )
        started.append(server)
        return Client(server.url)

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def empty_db(request, backend, tmp_path):
    """A new, migrated database of the current backend, for one test."""
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'empty.db'}"
        migrate.upgrade(url)
        yield url
        return
    name = f"metering_auth_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = f"{PG_ADMIN_DSN.rsplit('/', 1)[0]}/{name}"
    migrate.upgrade(url)
    yield url
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
