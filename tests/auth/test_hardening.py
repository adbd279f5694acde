"""Hardening: the admin key's length, the throttle on failed bearer credentials, /docs and
/openapi.json behind a setting, and the metrics key compared over fixed-length digests."""

import hmac
import os
import subprocess
import sys
import uuid

import httpx
import pytest
from pydantic import ValidationError

from metering import migrate
from metering.auth.failures import FailedCredentials
from metering.demo import DemoSettings
from metering.settings import Settings, parse_catalog
from metering.testing import metering_server
from tests.auth.conftest import SIM_KEYS, Client, new_account
from tests.conftest import ADMIN_KEY, Api, catalog_for, database_url


def test_an_admin_key_shorter_than_32_characters_is_refused():
    with pytest.raises(ValidationError, match="at least 32 characters \\(it has 31\\)"):
        Settings(admin_key="k" * 31, _env_file=None)
    assert Settings(admin_key="k" * 32, _env_file=None).admin_key == "k" * 32
    assert Settings(admin_key="", _env_file=None).admin_key is None


def test_the_demo_takes_any_admin_key():
    assert DemoSettings(admin_key="demo", _env_file=None).admin_key == "demo"


@pytest.mark.e2e  # starts a `metering serve` process
def test_metering_serve_refuses_to_start_with_a_short_admin_key(tmp_path):
    env = {
        **os.environ,
        "METERING_ADMIN_KEY": "short-key",
        "METERING_DATABASE_URL": f"sqlite:///{tmp_path / 'm.db'}",
    }
    done = subprocess.run(
        [sys.executable, "-m", "metering.cli", "serve", "--port", "1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "metering: METERING_ADMIN_KEY: METERING_ADMIN_KEY must be at least 32 characters "
        "(it has 9): make one with `openssl rand -hex 32`"
    )
    assert not (tmp_path / "m.db").exists()  # refused before touching the database


@pytest.mark.parametrize(
    "key", ["change-me-to-a-random-key-of-32-characters-or-more", "ours-CHANGE-ME-" + "k" * 32]
)
@pytest.mark.e2e  # starts a `metering serve` process
def test_metering_serve_refuses_to_start_with_the_example_admin_key(tmp_path, key):
    env = {
        **os.environ,
        "METERING_ADMIN_KEY": key,
        "METERING_DATABASE_URL": f"sqlite:///{tmp_path / 'm.db'}",
    }
    done = subprocess.run(
        [sys.executable, "-m", "metering.cli", "serve", "--port", "1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "metering: METERING_ADMIN_KEY is still the example's placeholder (it contains "
        "`change-me`): anyone who has read .env.example could use the admin API. Set a random "
        "key of at least 32 characters: `openssl rand -hex 32`"
    )
    assert not (tmp_path / "m.db").exists()  # refused before touching the database


def server_with(request, backend, sim, **settings):
    url = database_url(request, backend)
    migrate.upgrade(url)
    config = Settings(database_url=url, admin_key=ADMIN_KEY, _env_file=None, **settings)
    return metering_server(config, parse_catalog(catalog_for(sim), environ=SIM_KEYS))


@pytest.fixture(scope="module")
def strict(request, backend, sim):
    server = server_with(request, backend, sim, auth_failures_per_minute=5, openapi_enabled=False)
    yield server
    server.stop()


def from_address(address: str) -> dict:
    # The server trusts X-Forwarded-For from 127.0.0.1 (METERING_FORWARDED_ALLOW_IPS).
    return {"x-forwarded-for": address}


def test_failed_credentials_beyond_the_rate_get_429_even_for_a_right_one(strict, backend):
    api = Api(strict.url, backend, None)
    account = new_account(api)
    client = Client(strict.url)
    address = from_address(f"10.1.{uuid.uuid4().int % 250}.{uuid.uuid4().int % 250}")
    wrong = ["mtr_" + uuid.uuid4().hex, "mat_x.1.y", "nonsense", "mtr_", "k" * 40]
    statuses = [client.call("GET", "/v1/me", key, headers=address).status_code for key in wrong]
    assert statuses == [401] * 5

    throttled = client.call("GET", "/v1/me", "mtr_" + uuid.uuid4().hex, headers=address)
    assert throttled.status_code == 429
    assert throttled.json()["error"]["code"] == "rate_limited"
    assert throttled.json()["error"]["type"] == "rate_limit_error"
    assert 1 <= int(throttled.headers["retry-after"]) <= 60
    # A right guess from that address is refused like the others until the minute ends.
    right = client.call("GET", "/v1/me", account.api_token["token"], headers=address)
    assert right.status_code == 429
    assert client.call("GET", "/v1/teams", ADMIN_KEY, headers=address).status_code == 429
    # Other addresses are not affected.
    other = from_address("10.200.0.1")
    me = client.call("GET", "/v1/me", account.api_token["token"], headers=other)
    assert me.status_code == 200 and me.json()["user_id"] == account.id


def test_right_credentials_are_never_counted(strict, backend):
    api = Api(strict.url, backend, None)
    account = new_account(api)
    client = Client(strict.url)
    address = from_address("10.3.3.3")
    statuses = {
        client.call("GET", "/v1/me", account.api_token["token"], headers=address).status_code
        for _ in range(20)
    }
    assert statuses == {200}


def test_a_missing_credential_is_not_a_failed_one(strict):
    client = Client(strict.url)
    address = from_address("10.4.4.4")
    statuses = [client.call("GET", "/v1/me", headers=address).status_code for _ in range(8)]
    assert statuses == [401] * 8


def test_the_count_starts_again_each_minute():
    now = [1000.0]
    failures = FailedCredentials(2, clock=lambda: now[0])
    failures.failed("a")
    failures.failed("a")
    with pytest.raises(Exception, match="retry in 60 s") as refused:
        failures.check("a")
    assert refused.value.headers == {"retry-after": "60", "retry-after-ms": "60000"}
    failures.check("b")
    now[0] += 59.5
    with pytest.raises(Exception, match="retry in 1 s"):
        failures.check("a")
    now[0] += 0.5
    failures.check("a")
    assert failures.counts == {}


def test_openapi_and_docs_can_be_closed(strict):
    for path in ("/openapi.json", "/docs", "/docs/swagger-ui-bundle.js"):
        response = httpx.get(f"{strict.url}{path}")
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "not_found"


def test_openapi_and_docs_are_open_by_default(api):
    assert httpx.get(f"{api.url}/openapi.json").json()["info"]["title"] == "metering"
    docs = httpx.get(f"{api.url}/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


METRICS_KEY = "metrics-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def metered(request, backend, sim):
    server = server_with(request, backend, sim, metrics_key=METRICS_KEY)
    yield server
    server.stop()


def test_the_metrics_key_is_compared_over_fixed_length_digests(metered, monkeypatch):
    lengths: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def spy(a, b):
        lengths.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    statuses = [
        httpx.get(f"{metered.url}/metrics", headers={"authorization": f"Bearer {key}"}).status_code
        for key in ("x", "y" * 200, METRICS_KEY)
    ]
    assert statuses == [401, 401, 200]
    assert lengths == [(64, 64)] * 3
