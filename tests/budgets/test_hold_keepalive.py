"""A stream that outlives METERING_HOLD_TTL_S keeps its hold: only dead requests are swept."""

import httpx
import pytest

from metering import migrate
from metering.settings import Settings, parse_catalog
from metering.testing import metering_server
from tests.conftest import ADMIN_KEY, Api, catalog_for


@pytest.fixture(scope="module")
def short_ttl_api(request, backend, sim):
    url = request.getfixturevalue("pg_url" if backend == "postgresql" else "sqlite_url")
    migrate.upgrade(url)
    settings = Settings(database_url=url, admin_key=ADMIN_KEY, hold_ttl_s=2, _env_file=None)
    catalog = parse_catalog(
        catalog_for(sim), environ={"SIM_EXASCALE_KEY": "k", "SIM_OPENAI_KEY": "k"}
    )
    server = metering_server(settings, catalog)
    yield Api(server.url, backend, settings)
    server.stop()


def test_a_stream_longer_than_the_hold_ttl_is_settled_with_its_reported_usage(short_ttl_api):
    api = short_ttl_api
    _, _, token = api.principal(token_limit="1.00")
    body = {
        "model": "gpt-sim",
        "stream": True,
        "messages": [
            {"role": "user", "content": "slow sim:tokens=30 sim:chunks=30 sim:delay_ms=200"}
        ],
    }
    with httpx.stream(
        "POST",
        f"{api.url}/v1/chat/completions",
        json=body,
        timeout=30,
        headers={"authorization": f"Bearer {token['token']}"},
    ) as response:
        assert response.status_code == 200
        text = "".join(response.iter_text())
    assert text.rstrip().endswith("data: [DONE]")
    events = api.events(token_id=token["id"])
    assert len(events) == 1
    assert events[0]["usage_source"] == "reported"
    assert events[0]["status"] == "ok"
    assert events[0]["completion_tokens"] == 30
    budget = api.ok("GET", f"/v1/tokens/{token['id']}/budget")
    assert budget["reserved"] in ("0.000000", "0")
    assert budget["spent"] == events[0]["cost"]
