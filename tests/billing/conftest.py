"""A server of the test's own, on a fresh database of each backend, serving a catalog file the
test rewrites (a price corrected, a run budget's model)."""

import contextlib
from pathlib import Path

import pytest

from metering import migrate
from metering.settings import Settings, load_catalog
from metering.testing import metering_server
from tests.budgets.conftest import SIM_KEYS, new_pg_database, to_toml
from tests.conftest import ADMIN_KEY, Api, catalog_for


class OwnServer:
    """A server whose catalog file the test rewrites; `api` is its admin's view."""

    def __init__(self, api: Api, path: Path, sim) -> None:
        self.api, self.path, self.sim = api, path, sim

    def write_catalog(self, **gpt_fields) -> None:
        catalog = catalog_for(self.sim)
        catalog["models"][0].update(gpt_fields)
        self.path.write_text(to_toml(catalog))


@pytest.fixture(params=["sqlite", "postgresql"])
def own_server(request, sim, tmp_path, monkeypatch):
    """Factory: own_server(**gpt_fields, **settings) -> an OwnServer (stopped at teardown)."""
    for name, value in SIM_KEYS.items():
        monkeypatch.setenv(name, value)
    started = []

    def start(gpt: dict | None = None, **settings) -> OwnServer:
        if request.param == "postgresql":
            url = stack.enter_context(new_pg_database())
        else:
            url = f"sqlite:///{tmp_path / 'metering.db'}"
        migrate.upgrade(url)
        path = tmp_path / "metering.toml"
        config = Settings(
            database_url=url,
            admin_key=ADMIN_KEY,
            config=str(path),
            config_poll_s=0.1,
            _env_file=None,
            **settings,
        )
        own = OwnServer(Api("", request.param, config), path, sim)
        own.write_catalog(**(gpt or {}))
        server = metering_server(config, load_catalog(path))
        started.append(server)
        own.api = Api(server.url, request.param, config)
        return own

    with contextlib.ExitStack() as stack:
        yield start
        for server in started:
            server.stop()
