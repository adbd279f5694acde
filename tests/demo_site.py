"""Fixtures: a server of its own per backend, on a fresh database, with the demo traffic sent
through the proxy (so the expected figures are the API's own). Used by the tests of the demo,
the page and the Grafana dashboards."""

import uuid
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import httpx
import psycopg
import pytest

from metering import migrate
from metering.demo import demo_catalog, generate_traffic
from metering.settings import Settings, parse_catalog
from metering.testing import ServerThread, metering_server

ADMIN_KEY = "dashboard-admin-" + uuid.uuid4().hex


@dataclass
class Site:
    """A running server with the demo traffic in its ledger."""

    backend: str
    url: str
    database_url: str
    server: ServerThread
    statuses: dict
    http: httpx.Client

    def get(self, path: str, key: str = ADMIN_KEY, **params) -> dict:
        response = self.http.get(path, params=params, headers={"authorization": f"Bearer {key}"})
        assert response.status_code == 200, response.text
        return response.json()


def sibling_database(pg_url: str, suffix: str) -> tuple[str, str]:
    """A new database on pg_url's server: (its URL, the URL of the server's maintenance db)."""
    parts = urlsplit(pg_url)
    name = f"{parts.path.lstrip('/')}_{suffix}"
    admin = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return urlunsplit(parts._replace(path=f"/{name}")), admin


class Sites:
    def __init__(self, request, sim, tmp_path_factory) -> None:
        self.request, self.sim, self.tmp = request, sim, tmp_path_factory
        self.sites: dict[str, Site] = {}
        self.dropped: list[tuple[str, str]] = []

    def get(self, backend: str) -> Site:
        if backend not in self.sites:
            self.sites[backend] = self._start(backend)
        return self.sites[backend]

    def _start(self, backend: str) -> Site:
        if backend == "postgresql":
            url, admin = sibling_database(self.request.getfixturevalue("pg_url"), "dashboard")
            self.dropped.append((admin, url.rsplit("/", 1)[1]))
        else:
            url = f"sqlite:///{self.tmp.mktemp('dashboard') / 'metering.db'}"
        migrate.upgrade(url)
        settings = Settings(database_url=url, admin_key=ADMIN_KEY, _env_file=None)
        server = metering_server(settings, parse_catalog(demo_catalog(self.sim)))
        statuses = generate_traffic(server.url, ADMIN_KEY)
        http = httpx.Client(base_url=server.url, timeout=30)
        return Site(backend, server.url, url, server, dict(statuses), http)

    def close(self) -> None:
        for site in self.sites.values():
            site.http.close()
            site.server.stop()
        for admin, name in self.dropped:
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def sites(request, sim, tmp_path_factory):
    cache = Sites(request, sim, tmp_path_factory)
    yield cache
    cache.close()


@pytest.fixture(scope="session")
def site(sites, backend) -> Site:
    """The demo site on each backend."""
    return sites.get(backend)


@pytest.fixture(scope="session")
def pg_site(sites) -> Site:
    return sites.get("postgresql")
