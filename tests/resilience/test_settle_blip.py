"""A settle that meets the database gone for a moment waits for it (METERING_SETTLE_RETRY_S)
and commits once it is back: the event is the real usage, not an unsettled charge."""

import json
import threading
import uuid
from decimal import Decimal

import httpx
import psycopg
import pytest

from metering import migrate
from metering.settings import Settings, parse_catalog
from metering.testing import metering_server
from tests.conftest import ADMIN_KEY, PG_ADMIN_DSN, Api, catalog_for
from tests.resilience.link import DatabaseLink


@pytest.fixture
def blipping(sim):
    name = f"metering_test_blip_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    migrate.upgrade(f"postgresql://postgres@127.0.0.1:5432/{name}")
    blip = DatabaseLink()
    settings = Settings(
        database_url=f"postgresql://postgres@127.0.0.1:{blip.port}/{name}",
        admin_key=ADMIN_KEY,
        settle_retry_s=20,
        _env_file=None,
    )
    catalog = parse_catalog(
        catalog_for(sim), environ={"SIM_EXASCALE_KEY": "k", "SIM_OPENAI_KEY": "k"}
    )
    server = metering_server(settings, catalog)
    yield Api(server.url, "postgresql", settings), blip
    server.stop()
    blip.close()
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.postgres
def test_a_stream_ending_while_the_database_is_down_settles_once_it_is_back(blipping, sim):
    api, blip = blipping
    _, _, token = api.principal(token_limit="1")
    body = {
        "model": "gpt-sim",
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [
            {"role": "user", "content": "blip sim:tokens=20 sim:chunks=5 sim:delay_ms=200"}
        ],
    }
    chunks, back = [], threading.Timer(3, blip.up)
    with httpx.stream(
        "POST",
        f"{api.url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {token['token']}"},
        timeout=60,
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if not chunks:
                # The stream ends (in about 1 s) while the database is away for 3 s.
                blip.down()
                back.start()
            chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    back.join()
    usage = json.loads(chunks[-2])["usage"]
    events = api.events(token_id=token["id"])
    assert len(events) == 1
    event = events[0]
    assert (event["status"], event["usage_source"]) == ("ok", "reported")
    assert (event["prompt_tokens"], event["completion_tokens"]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    budget = api.ok("GET", f"/v1/tokens/{token['id']}/budget")
    assert Decimal(budget["reserved"]) == 0
    assert Decimal(budget["spent"]) == Decimal(event["cost"]) > 0
