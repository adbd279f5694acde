"""The price catalog over time: a server watching its TOML file (METERING_CONFIG_POLL_S) keeps
every price with the moment it took effect. A change adds a `prices` row, never rewrites one;
each request is charged at the price in effect when it started."""

import threading
import time
import uuid
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, pool, text

from metering.db import sync_url
from metering.settings import Settings, load_catalog
from metering.testing import metering_server
from tests.conftest import ADMIN_KEY, Api
from tests.proxy.conftest import sim_log, wait_events

POLL_S = 0.2


def toml(sim, model: str, price_in: str, price_out: str, price_cached: str, **extra) -> str:
    more = "".join(f"{k} = {v}\n" for k, v in extra.items())
    return f"""
[providers.priced]
base_url = "{sim.base_url("openai")}"
dialect = "openai"
api_key = "sim-key"
timeout_s = 10
{more}
[[models]]
name = "{model}"
provider = "priced"
upstream_model = "sim/priced"
input_usd_per_mtok = "{price_in}"
output_usd_per_mtok = "{price_out}"
cached_input_usd_per_mtok = "{price_cached}"
max_output_tokens = 4096
"""


def write(path: Path, content: str) -> None:
    """Replace the file in one step, as an editor or a config deploy does."""
    scratch = path.with_suffix(".tmp")
    scratch.write_text(content)
    scratch.replace(path)


def query(api: Api, sql: str, **params) -> list:
    engine = create_engine(sync_url(api.settings.database_url), poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            return [tuple(row) for row in conn.execute(text(sql), params)]
    finally:
        engine.dispose()


def price_rows(api: Api, model: str) -> list[tuple]:
    return query(
        api,
        "SELECT id, provider, upstream_model, input_price, cached_price, output_price,"
        " effective_from FROM prices WHERE model = :model ORDER BY effective_from, id",
        model=model,
    )


def charged(api: Api, event_id: str) -> tuple[int, int, int]:
    [row] = query(
        api,
        "SELECT input_price, cached_price, output_price FROM ledger_events WHERE id = :id",
        id=event_id,
    )
    return row


def wait_rows(api: Api, model: str, count: int, timeout: float = 10.0) -> list[tuple]:
    deadline = time.monotonic() + timeout
    while True:
        rows = price_rows(api, model)
        if len(rows) >= count:
            return rows
        assert time.monotonic() < deadline, f"no price row #{count} for {model}: {rows}"
        time.sleep(0.05)


def micro(usd: str) -> int:
    return int(Decimal(usd) * 10**6)


def cost(usage: dict, prices: tuple[str, str, str]) -> Decimal:
    price_in, price_cached, price_out = (Decimal(p) for p in prices)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return (
        (usage["prompt_tokens"] - cached) * price_in
        + cached * price_cached
        + usage["completion_tokens"] * price_out
    ) / 10**6


@pytest.fixture
def watched(api, sim, tmp_path):
    """A server whose catalog is a TOML file in tmp_path, checked every POLL_S seconds."""
    model = f"priced-{uuid.uuid4().hex[:8]}"
    path = tmp_path / "metering.toml"
    write(path, toml(sim, model, "0.10", "0.40", "0.05"))
    settings = Settings(
        database_url=api.settings.database_url,
        admin_key=ADMIN_KEY,
        config=str(path),
        config_poll_s=POLL_S,
        _env_file=None,
    )
    server = metering_server(settings, load_catalog(path))
    try:
        yield Api(server.url, api.backend, settings), path, model
    finally:
        server.stop()


def ask(proxy: Api, token: dict, model: str, text: str) -> httpx.Response:
    response = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": text}]},
        headers={"authorization": f"Bearer {token['token']}"},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    return response


def test_a_price_change_adds_a_row_and_applies_from_then_on(api, sim, watched):
    proxy, path, model = watched
    _, _, token = api.principal()
    [old_row] = wait_rows(proxy, model, 1)
    assert old_row[1:6] == ("priced", "sim/priced", micro("0.10"), micro("0.05"), micro("0.40"))

    first = ask(proxy, token, model, "Before sim:tokens=20 sim:cached=4")
    write(path, toml(sim, model, "0.20", "0.90", "0.08"))
    rows = wait_rows(proxy, model, 2)
    second = ask(proxy, token, model, "After sim:tokens=20 sim:cached=4")

    # The old row is kept as it was; the new one took effect after it.
    assert rows[0] == old_row
    new_row = rows[1]
    assert new_row[1:6] == ("priced", "sim/priced", micro("0.20"), micro("0.08"), micro("0.90"))
    assert new_row[6] > old_row[6]

    events = {e["id"]: e for e in wait_events(proxy, token["id"], 2)}
    one, two = events[first.headers["x-request-id"]], events[second.headers["x-request-id"]]
    assert charged(proxy, one["id"]) == (micro("0.10"), micro("0.05"), micro("0.40"))
    assert charged(proxy, two["id"]) == (micro("0.20"), micro("0.08"), micro("0.90"))
    assert Decimal(one["cost"]) == cost(first.json()["usage"], ("0.10", "0.05", "0.40"))
    assert Decimal(two["cost"]) == cost(second.json()["usage"], ("0.20", "0.08", "0.90"))
    assert Decimal(two["cost"]) > Decimal(one["cost"])
    # Each event's price is the row in effect when its request started.
    [(one_started,)] = query(
        proxy, "SELECT started_at FROM ledger_events WHERE id = :id", id=one["id"]
    )
    [(two_started,)] = query(
        proxy, "SELECT started_at FROM ledger_events WHERE id = :id", id=two["id"]
    )
    assert one_started < new_row[6] <= two_started

    # Changing it back is a third row, not a return to the first.
    write(path, toml(sim, model, "0.10", "0.40", "0.05"))
    rows = wait_rows(proxy, model, 3)
    assert rows[:2] == [old_row, new_row]
    assert rows[2][0] != old_row[0] and rows[2][3:6] == old_row[3:6]


def test_a_request_in_flight_keeps_the_price_it_started_with(api, sim, watched):
    proxy, path, model = watched
    _, _, token = api.principal()
    wait_rows(proxy, model, 1)
    result = {}

    def slow_stream() -> None:
        # 150 ms between chunks: the stream outlasts the price change.
        text = "Slow sim:tokens=40 sim:chunks=10 sim:delay_ms=150"
        result["response"] = httpx.post(
            f"{proxy.url}/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": text}], "stream": True},
            headers={"authorization": f"Bearer {token['token']}"},
            timeout=30,
        )

    before = len(sim_log(sim))
    thread = threading.Thread(target=slow_stream)
    thread.start()
    deadline = time.monotonic() + 10
    while len(sim_log(sim)) == before:  # the request has reached the upstream
        assert time.monotonic() < deadline
        time.sleep(0.02)
    write(path, toml(sim, model, "0.30", "1.50", "0.10"))
    wait_rows(proxy, model, 2)
    assert not sim_log(sim)[before]["completed"], "the stream ended before the price changed"
    thread.join(timeout=30)
    response = result["response"]
    assert response.status_code == 200
    [record] = sim_log(sim)[before:]
    assert record["completed"]
    [event] = wait_events(proxy, token["id"], 1)
    assert event["id"] == response.headers["x-request-id"] and event["status"] == "ok"
    assert charged(proxy, event["id"]) == (micro("0.10"), micro("0.05"), micro("0.40"))
    # The next request is charged at the new price.
    after = ask(proxy, token, model, "Next sim:tokens=5")
    assert charged(proxy, after.headers["x-request-id"]) == (
        micro("0.30"),
        micro("0.10"),
        micro("1.50"),
    )


def test_a_change_that_is_not_a_price_adds_no_row(api, sim, watched):
    proxy, path, model = watched
    [row] = wait_rows(proxy, model, 1)
    write(path, toml(sim, model, "0.10", "0.40", "0.05", connect_timeout_s="3"))
    time.sleep(POLL_S * 5)
    assert price_rows(proxy, model) == [row]


def test_a_broken_file_keeps_the_last_good_catalog(api, sim, watched):
    proxy, path, model = watched
    _, _, token = api.principal()
    [row] = wait_rows(proxy, model, 1)
    write(path, toml(sim, model, "0.10", "not a price", "0.05"))
    time.sleep(POLL_S * 5)
    assert price_rows(proxy, model) == [row]
    response = ask(proxy, token, model, "Still served sim:tokens=3")
    assert charged(proxy, response.headers["x-request-id"]) == (
        micro("0.10"),
        micro("0.05"),
        micro("0.40"),
    )
    # Fixed, with a new price: that is the next row.
    write(path, toml(sim, model, "0.12", "0.40", "0.05"))
    rows = wait_rows(proxy, model, 2)
    assert rows[0] == row and rows[1][3] == micro("0.12")
