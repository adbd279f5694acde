"""What the proxy's tests share: a module's principal, token and client on the shared server;
the shared catalog's models and prices and what an event of theirs must say; the simulated
upstream's log and the ledger's events; and a server of a test's own (`serving`)."""

import contextlib
import re
import time
import uuid
from decimal import Decimal

import httpx
import pytest

from metering.budgets.reserve import HoldSpec
from metering.ledger.outcome import Attribution
from metering.settings import Settings, parse_catalog
from metering.testing import metering_server
from tests.conftest import ADMIN_KEY, Api

DETAIL_FIELDS = (
    "text_tokens",
    "reasoning_tokens",
    "audio_tokens",
    "image_tokens",
    "video_tokens",
    "accepted_prediction_tokens",
    "rejected_prediction_tokens",
)

# USD per 1M tokens: (input, cached input, output), as in conftest's catalog.
PRICES = {
    "gpt-sim": (Decimal("0.15"), Decimal("0.075"), Decimal("0.60")),
    "minimax-m2.1": (Decimal("0.30"), Decimal("0.30"), Decimal("1.20")),
}

ROUTES = {
    "gpt-sim": ("sim-openai", "sim/gpt"),
    "minimax-m2.1": ("sim-exascale", "MiniMaxAI/MiniMax-M2.1"),
}

MODELS = tuple(PRICES)


def expected_cost(model: str, prompt: int, cached: int, completion: int) -> Decimal:
    input_price, cached_price, output_price = PRICES[model]
    return (
        (prompt - cached) * input_price + cached * cached_price + completion * output_price
    ) / Decimal(1_000_000)


def assert_error_shape(response: httpx.Response, status: int, code: str | None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) >= {"message", "type", "code", "param"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code
    return body["error"]


def sim_log(sim) -> list[dict]:
    response = httpx.get(f"http://{sim.host}:{sim.port}/_sim/log", timeout=10)
    assert response.status_code == 200
    return response.json()


def sim_record(sim, upstream_id: str) -> dict:
    records = [r for r in sim_log(sim) if r["id"] == upstream_id]
    assert len(records) == 1, upstream_id
    return records[0]


def event_by_id(api, token_id: str, event_id: str) -> dict:
    events = [e for e in api.events(token_id=token_id) if e["id"] == event_id]
    assert len(events) == 1, event_id
    return events[0]


def wait_events(api, token_id: str, count: int, timeout: float = 10.0) -> list[dict]:
    """The token's events once there are `count` of them (settling may trail the response)."""
    deadline = time.monotonic() + timeout
    while True:
        events = api.events(token_id=token_id)
        if len(events) >= count or time.monotonic() > deadline:
            return events
        time.sleep(0.05)


def assert_matches_upstream(event: dict, record: dict, principal, model: str, stream: bool):
    """The ledger event says exactly what the upstream reported, at the catalog's price."""
    team, user, token = principal
    usage = record["usage"]
    provider, upstream_model = ROUTES[model]
    assert event["upstream_id"] == record["id"]
    assert event["prompt_tokens"] == usage["prompt_tokens"]
    assert event["completion_tokens"] == usage["completion_tokens"]
    assert event["total_tokens"] == usage["total_tokens"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert event["prompt_tokens_details"] == {"cached_tokens": cached}
    details = usage.get("completion_tokens_details") or {}
    assert event["completion_tokens_details"] == {name: details.get(name) for name in DETAIL_FIELDS}
    assert event["finish_reason"] == "stop"
    assert event["stream"] is stream
    assert (event["model"], event["provider"], event["upstream_model"]) == (
        model,
        provider,
        upstream_model,
    )
    assert (event["token_id"], event["user_id"], event["team_id"]) == (
        token["id"],
        user["id"],
        team["id"],
    )
    assert event["usage_source"] == "reported"
    assert event["http_status"] == 200
    assert event["status"] == "ok"
    assert Decimal(event["cost"]) == expected_cost(
        model, usage["prompt_tokens"], cached, usage["completion_tokens"]
    )


@pytest.fixture(scope="module")
def principal(api):
    return api.principal()


@pytest.fixture(scope="module")
def token(principal):
    return principal[2]


@pytest.fixture(scope="module")
def http(api, token):
    with httpx.Client(
        base_url=api.url, timeout=30, headers={"authorization": f"Bearer {token['token']}"}
    ) as client:
        yield client


def user_message(text: str) -> list[dict]:
    return [
        {"role": "developer", "content": "You are a helpful assistant."},
        {"role": "user", "content": text},
    ]


def data_of(raw: bytes) -> list[str]:
    """The data of each SSE event, comments skipped, whatever the line ends."""
    out = []
    for event in re.split(r"\r\n\r\n|\n\n", raw.decode()):
        lines = [line for line in re.split(r"\r\n|\n", event) if line.startswith("data: ")]
        if lines:
            out.append("\n".join(line[6:] for line in lines))
    return out


def provider_entry(base_url: str, dialect: str, **extra) -> dict:
    return {"base_url": base_url, "dialect": dialect, "api_key": "sim-key", "timeout_s": 5, **extra}


@contextlib.contextmanager
def serving(api: Api, catalog: dict, **settings):
    """A metering server of its own (own catalog and settings) on the shared test database and
    the api's clock (the `clock` fixture moves both)."""
    config = Settings(
        database_url=api.settings.database_url, admin_key=ADMIN_KEY, _env_file=None, **settings
    )
    server = metering_server(config, parse_catalog(catalog, environ={}), clock=api.clock)
    try:
        yield Api(server.url, api.backend, config, api.clock)
    finally:
        server.stop()


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def hold_spec(subjects: dict[str, str]) -> HoldSpec:
    """A gpt-sim hold of 100 prompt tokens and max_tokens 50 on `subjects` (token, user, team)."""
    billing = Attribution(
        id=f"req_{uuid.uuid4().hex}",
        token_id=subjects["token"],
        user_id=subjects["user"],
        team_id=subjects["team"],
        model="gpt-sim",
        provider="sim-openai",
        upstream_model="sim/gpt",
        stream=False,
        input_price=150_000,
        cached_price=75_000,
        output_price=600_000,
        prompt_bound=100,
    )
    return HoldSpec(
        billing,
        prompt_cost=billing.prompt_cost(),
        token_cost=billing.output_price,
        max_tokens=50,
        model_max_output=4096,
    )
