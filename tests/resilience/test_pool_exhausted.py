"""A database pool far smaller than the load: requests wait for a connection or get 503
ledger_unavailable; none gets a 500, and every request that reached the upstream is one event."""

import asyncio
import uuid
from decimal import Decimal

import httpx
import pytest

from metering import migrate
from metering.settings import Settings, parse_catalog
from metering.testing import metering_server
from tests.budgets.conftest import budget, holds_of, new_pg_database, sim_records, usd, wait_for
from tests.conftest import ADMIN_KEY, Api, catalog_for

CONCURRENT = 80


@pytest.fixture(params=["sqlite", "postgresql"])
def tiny_pool(request, sim, tmp_path):
    """A server whose pool holds one connection (PostgreSQL: one more as overflow)."""

    def serve(url: str):
        migrate.upgrade(url)
        settings = Settings(database_url=url, admin_key=ADMIN_KEY, db_pool_size=1, _env_file=None)
        catalog = parse_catalog(
            catalog_for(sim), environ={"SIM_EXASCALE_KEY": "k", "SIM_OPENAI_KEY": "k"}
        )
        return metering_server(settings, catalog), settings

    if request.param == "sqlite":
        server, settings = serve(f"sqlite:///{tmp_path / 'metering.db'}")
        yield Api(server.url, "sqlite", settings)
        server.stop()
        return
    with new_pg_database() as url:
        server, settings = serve(url)
        yield Api(server.url, "postgresql", settings)
        server.stop()


async def _burst(url: str, key: str, tag: str) -> list[dict]:
    limits = httpx.Limits(max_connections=CONCURRENT)
    headers = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(
        base_url=url, headers=headers, limits=limits, timeout=120
    ) as client:

        async def one(n: int) -> dict:
            stream = n % 2 == 1
            body = {
                "model": "gpt-sim",
                "messages": [{"role": "user", "content": f"pool {tag}-{n} sim:tokens=4"}],
                "max_tokens": 4,
                "stream": stream,
            }
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                content = await response.aread()
            out = {"status": response.status_code, "id": response.headers.get("x-request-id")}
            if response.status_code != 200:
                out["code"] = httpx.Response(200, content=content).json()["error"]["code"]
            elif stream:
                assert content.rstrip().endswith(b"data: [DONE]"), content[-200:]
            return out

        return await asyncio.gather(*(one(n) for n in range(CONCURRENT)))


def test_an_exhausted_pool_never_gives_500_nor_loses_an_event(tiny_pool, sim):
    api = tiny_pool
    team, user, token = api.principal(token_limit="10", user_limit="10", team_limit="10")
    tag = f"pool{uuid.uuid4().hex[:10]}"

    results = asyncio.run(_burst(api.url, token["token"], tag))

    statuses = {(r["status"], r.get("code")) for r in results}
    assert statuses <= {(200, None), (503, "ledger_unavailable")}, statuses
    ok = [r for r in results if r["status"] == 200]
    wait_for(
        lambda: not holds_of(api.settings.database_url, token["id"]),
        message="every hold settled",
    )
    received = sim_records(sim, tag)
    assert len(received) == len(ok)
    events = api.events(token_id=token["id"])
    assert sorted(e["id"] for e in events) == sorted(r["id"] for r in ok)
    assert {e["usage_source"] for e in events} == {"reported"}
    total = sum(usd(e["cost"]) for e in events)
    for scope, subject in (("token", token["id"]), ("user", user["id"]), ("team", team["id"])):
        status = budget(api, scope, subject)
        assert usd(status["reserved"]) == 0, status
        assert usd(status["spent"]) == total, status
        assert usd(status["remaining"]) == Decimal(10) - total
