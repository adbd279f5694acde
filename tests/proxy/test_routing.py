"""Price-aware routing end to end: one model from several providers, cheapest first for the
request's expected tokens; pins and price caps; failover before the first byte (connect error,
5xx, 429, timeout) and never after it; circuit breakers; one event per attempt that reached
an upstream, and x-request-id naming the final attempt's event.

Failing providers are the simulated upstream under `/fault/{name}/...` (every request on that
base URL fails that way) or a closed port (connect error).
"""

import json
import time
from decimal import Decimal

import httpx
import pytest
from sqlalchemy import create_engine, pool, text

from metering.db import sync_url
from metering.proxy.estimate import estimate_prompt_tokens
from metering.proxy.routing import EXPECTED_OUTPUT, expected_cost
from metering.settings import parse_catalog
from metering.sim.app import SimServer
from metering.sim.text import prose
from metering.testing import free_port
from tests.proxy.conftest import (
    assert_error_shape,
    data_of,
    provider_entry,
    serving,
    sim_log,
    user,
    wait_events,
)

MODEL = "route-m25"
# provider: (input, output) USD per 1M tokens; cheapest first for any request.
TIERS = {"cheap": ("0.10", "0.40"), "mid": ("0.20", "0.80"), "dear": ("0.40", "1.60")}


def route_catalog(urls: dict[str, str], prices: dict = TIERS, **provider_extra) -> dict:
    """One model from each provider, at its price; urls: provider -> base URL."""
    return {
        "providers": {
            name: provider_entry(url, "openai", **provider_extra.get(name, {}))
            for name, url in urls.items()
        },
        "models": [
            {
                "name": MODEL,
                "provider": name,
                "upstream_model": f"{name}/m25",
                "input_usd_per_mtok": prices[name][0],
                "output_usd_per_mtok": prices[name][1],
                "max_output_tokens": 8192,
            }
            for name in urls
        ],
    }


def healthy(sim) -> dict[str, str]:
    return dict.fromkeys(TIERS, sim.base_url("openai"))


def failing(sim, fault: str) -> str:
    """A base URL where every request fails with `fault` ('connect': nothing listens)."""
    if fault == "connect":
        return f"http://127.0.0.1:{free_port()}/v1"
    return sim.base_url("openai", fault=fault)


def post(proxy, token: dict, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {token['token']}"},
        timeout=kwargs.pop("timeout", 30),
        **kwargs,
    )


def by_time(events: list[dict]) -> list[dict]:
    """Oldest first (the usage API lists newest first)."""
    return sorted(events, key=lambda e: (e["created_at"], e["id"]))


def new_records(sim, before: int) -> list[dict]:
    return sim_log(sim)[before:]


def event_prices(api, event_id: str) -> tuple[int, int, int]:
    """(input, cached, output) micro-USD per 1M tokens the ledger event was charged at."""
    engine = create_engine(sync_url(api.settings.database_url), poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            row = conn.execute(
                text(
                    "SELECT input_price, cached_price, output_price FROM ledger_events"
                    " WHERE id = :id"
                ),
                {"id": event_id},
            ).one()
    finally:
        engine.dispose()
    return tuple(row)


def micro(usd: str) -> int:
    return int(Decimal(usd) * 10**6)


# --- the order -------------------------------------------------------------------------------


def test_cheapest_provider_is_tried_first(api, sim):
    _, _, token = api.principal()
    urls = {"dear": sim.base_url("openai"), "cheap": sim.base_url("openai")}
    urls["mid"] = sim.base_url("exascale")
    with serving(api, route_catalog(urls)) as proxy:
        before = len(sim_log(sim))
        response = post(proxy, token, {"model": MODEL, "messages": user("Hi sim:tokens=5")})
        assert response.status_code == 200, response.text
        [record] = new_records(sim, before)
        assert record["received"]["model"] == "cheap/m25"
        [event] = wait_events(proxy, token["id"], 1)
        assert event["provider"] == "cheap" and event["id"] == response.headers["x-request-id"]
        assert event_prices(proxy, event["id"]) == (micro("0.10"), micro("0.10"), micro("0.40"))


def test_output_price_can_outweigh_a_cheaper_input_when_max_tokens_is_large(api, sim):
    # in_cheap: cheapest input, dear output; out_cheap: the other way round.
    prices = {"in_cheap": ("0.10", "2.00"), "out_cheap": ("0.50", "1.00")}
    urls = dict.fromkeys(prices, sim.base_url("openai"))
    messages = user(prose("a long prompt", 1200) + " sim:tokens=3")
    prompt = estimate_prompt_tokens({"messages": messages})
    catalog = parse_catalog(route_catalog(urls, prices), environ={})
    in_cheap, out_cheap = (
        next(r for r in catalog.routes(MODEL) if r.provider == p) for p in prices
    )
    # The expected-cost rule: estimated prompt x input + max_tokens (else 256) x output.
    assert expected_cost(in_cheap, prompt, 1) < expected_cost(out_cheap, prompt, 1)
    assert expected_cost(in_cheap, prompt, 4000) > expected_cost(out_cheap, prompt, 4000)
    assert expected_cost(in_cheap, prompt, EXPECTED_OUTPUT) < expected_cost(
        out_cheap, prompt, EXPECTED_OUTPUT
    )
    _, _, token = api.principal()
    with serving(api, route_catalog(urls, prices)) as proxy:
        chosen = []
        for max_tokens in (1, 4000, None):
            before = len(sim_log(sim))
            body = {"model": MODEL, "messages": messages}
            if max_tokens is not None:
                body["max_tokens"] = max_tokens
            response = post(proxy, token, body)
            assert response.status_code == 200, response.text
            [record] = new_records(sim, before)
            chosen.append(record["received"]["model"].removesuffix("/m25"))
        assert chosen == ["in_cheap", "out_cheap", "in_cheap"]


def test_model_at_provider_pins_that_provider(api, sim):
    _, _, token = api.principal()
    with serving(api, route_catalog(healthy(sim))) as proxy:
        client = proxy.openai(token["token"])
        before = len(sim_log(sim))
        raw = client.chat.completions.with_raw_response.create(
            model=f"{MODEL}@dear", messages=user("Pinned sim:tokens=4")
        )
        [record] = new_records(sim, before)
        assert record["received"]["model"] == "dear/m25"
        [event] = wait_events(proxy, token["id"], 1)
        assert (event["id"], event["model"], event["provider"]) == (
            raw.headers["x-request-id"],
            MODEL,
            "dear",
        )


def test_unknown_pinned_provider_or_model_is_404(api, sim):
    _, _, token = api.principal()
    with serving(api, route_catalog(healthy(sim))) as proxy:
        before = len(sim_log(sim))
        for model in (f"{MODEL}@nowhere", "no-such-model", "no-such-model@cheap"):
            response = post(proxy, token, {"model": model, "messages": user("x")})
            assert_error_shape(response, 404, "model_not_found")
        assert len(sim_log(sim)) == before
        assert proxy.events(token_id=token["id"]) == []


@pytest.mark.parametrize(
    ("caps", "provider"),
    [
        ({"max_input_usd_per_mtok": "0.2"}, "cheap"),
        ({"max_input_usd_per_mtok": 0.4, "max_output_usd_per_mtok": "1.6"}, "cheap"),
        ({"max_output_usd_per_mtok": 0.8}, "cheap"),
    ],
)
def test_price_caps_admit_the_cheapest_within_them(api, sim, caps, provider):
    _, _, token = api.principal()
    with serving(api, route_catalog(healthy(sim))) as proxy:
        before = len(sim_log(sim))
        response = post(proxy, token, {"model": MODEL, "messages": user("Capped"), **caps})
        assert response.status_code == 200, response.text
        [record] = new_records(sim, before)
        assert record["received"]["model"] == f"{provider}/m25"
        # Our routing fields are ours: they never reach the upstream.
        assert not set(caps) & set(record["received"])


def test_price_caps_skip_providers_above_them(api, sim):
    _, _, token = api.principal()
    # The cheapest provider fails, the caps leave out the dear one: only mid can answer.
    urls = {**healthy(sim), "cheap": failing(sim, "http500")}
    with serving(api, route_catalog(urls)) as proxy:
        before = len(sim_log(sim))
        body = {"model": MODEL, "messages": user("Caps"), "max_output_usd_per_mtok": "1.00"}
        assert post(proxy, token, body).status_code == 200
        models = [r["received"]["model"] for r in new_records(sim, before)]
        assert models == ["cheap/m25", "mid/m25"]
        before = len(sim_log(sim))
        body = {"model": MODEL, "messages": user("Caps"), "max_input_usd_per_mtok": "0.3"}
        response = post(proxy, token, {**body, "messages": user("x sim:fault=http500")})
        assert_error_shape(response, 502, "upstream_error")
        models = [r["received"]["model"] for r in new_records(sim, before)]
        assert models == ["cheap/m25", "mid/m25"]  # never the dear one above the cap


@pytest.mark.parametrize(
    "caps",
    [
        {"max_input_usd_per_mtok": "0.05"},
        {"max_output_usd_per_mtok": 0.1},
        {"max_input_usd_per_mtok": "0.4", "max_output_usd_per_mtok": "0.3"},
    ],
)
def test_price_caps_nothing_meets_is_400_before_any_cost(api, sim, caps):
    _, _, token = api.principal()
    with serving(api, route_catalog(healthy(sim))) as proxy:
        before = len(sim_log(sim))
        response = post(proxy, token, {"model": MODEL, "messages": user("x"), **caps})
        error = assert_error_shape(response, 400, "invalid_request")
        assert error["param"] in caps
        assert len(sim_log(sim)) == before
        assert proxy.events(token_id=token["id"]) == []


@pytest.mark.parametrize("cap", ["abc", -1, True, {"usd": 1}, "NaN"])
def test_a_malformed_price_cap_is_400(api, sim, cap):
    _, _, token = api.principal()
    with serving(api, route_catalog(healthy(sim))) as proxy:
        body = {"model": MODEL, "messages": user("x"), "max_input_usd_per_mtok": cap}
        error = assert_error_shape(post(proxy, token, body), 400, "invalid_request")
        assert error["param"] == "max_input_usd_per_mtok"


# --- failover before the first byte ----------------------------------------------------------


FAILURES = {
    # fault: (event status of the failed attempt, its http_status); connect: no event.
    "http500": ("upstream_error", 500),
    "http429": ("upstream_error", 429),
    "timeout": ("timeout", None),
    "connect": None,
}


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
@pytest.mark.parametrize("fault", list(FAILURES))
def test_failover_before_the_first_byte(api, sim, fault, stream):
    _, _, token = api.principal()
    urls = {**healthy(sim), "cheap": failing(sim, fault)}
    extra = {"cheap": {"timeout_s": 0.5}}
    with serving(api, route_catalog(urls, **extra)) as proxy:
        before = len(sim_log(sim))
        body = {"model": MODEL, "messages": user("Fail over sim:tokens=7"), "stream": stream}
        response = post(proxy, token, body)
        assert response.status_code == 200, response.text
        records = new_records(sim, before)
        tried = [r["received"]["model"] for r in records]
        assert tried == (["mid/m25"] if fault == "connect" else ["cheap/m25", "mid/m25"])
        answer = records[-1]
        if stream:
            assert data_of(response.content)[-1] == "[DONE]"
            assert json.loads(data_of(response.content)[0])["id"] == answer["id"]
        else:
            assert response.json()["id"] == answer["id"]
        events = by_time(wait_events(proxy, token["id"], len(records)))
        assert len(events) == len(records)  # one per attempt that reached an upstream
        final = events[-1]
        assert response.headers["x-request-id"] == final["id"]
        assert (final["provider"], final["status"], final["upstream_id"]) == (
            "mid",
            "ok",
            answer["id"],
        )
        assert Decimal(final["cost"]) > 0
        assert event_prices(proxy, final["id"]) == (micro("0.20"), micro("0.20"), micro("0.80"))
        if fault != "connect":
            failed = events[0]
            assert (failed["provider"], failed["status"], failed["http_status"]) == (
                "cheap",
                *FAILURES[fault],
            )
            assert Decimal(failed["cost"]) == 0
            assert failed["id"] != final["id"]
            assert event_prices(proxy, failed["id"]) == (
                micro("0.10"),
                micro("0.10"),
                micro("0.40"),
            )


def test_failover_runs_down_the_whole_list_and_the_last_answer_is_the_clients(api, sim):
    _, _, token = api.principal()
    urls = {
        "cheap": failing(sim, "http500"),
        "mid": failing(sim, "http429"),
        "dear": failing(sim, "connect"),
    }
    with serving(api, route_catalog(urls)) as proxy:
        before = len(sim_log(sim))
        response = post(proxy, token, {"model": MODEL, "messages": user("Nobody")})
        # The last provider could not be reached: 502, as every upstream failed.
        assert_error_shape(response, 502, "upstream_error")
        assert [r["received"]["model"] for r in new_records(sim, before)] == [
            "cheap/m25",
            "mid/m25",
        ]
        events = by_time(wait_events(proxy, token["id"], 2))
        assert [(e["provider"], e["http_status"]) for e in events] == [
            ("cheap", 500),
            ("mid", 429),
        ]
        assert all(Decimal(e["cost"]) == 0 for e in events)
        # The final attempt never reached an upstream, so no event carries its id.
        assert response.headers["x-request-id"] not in {e["id"] for e in events}


def test_when_every_provider_fails_the_client_gets_the_last_failure(api, sim):
    _, _, token = api.principal()
    urls = {"cheap": failing(sim, "http500"), "mid": failing(sim, "http429")}
    with serving(api, route_catalog(urls)) as proxy:
        response = post(proxy, token, {"model": MODEL, "messages": user("Nobody")})
        assert_error_shape(response, 429, None)
        assert response.headers["retry-after"] == "1"
        events = by_time(wait_events(proxy, token["id"], 2))
        assert [e["provider"] for e in events] == ["cheap", "mid"]
        assert response.headers["x-request-id"] == events[-1]["id"]


def test_the_hold_of_each_attempt_uses_the_price_of_the_provider_tried(api, sim):
    # max_tokens 1000: a hold at cheap's price (0.40/M output) fits the token's limit, one at
    # mid's (0.80/M) does not. When cheap fails, mid's own price decides: 402.
    team, user_, _ = api.principal()
    token = api.token(user_["id"], credit_limit="0.0006")
    urls = {"cheap": failing(sim, "http500"), "mid": sim.base_url("openai")}
    with serving(api, route_catalog(urls)) as proxy:
        before = len(sim_log(sim))
        body = {"model": MODEL, "messages": user("Hold"), "max_tokens": 1000}
        response = post(proxy, token, body)
        assert_error_shape(response, 402, "budget_exceeded")
        assert response.headers["x-budget-scope"] == "token"
        assert [r["received"]["model"] for r in new_records(sim, before)] == ["cheap/m25"]
        [event] = wait_events(proxy, token["id"], 1)
        assert (event["provider"], Decimal(event["cost"])) == ("cheap", 0)
        budget = proxy.ok("GET", f"/v1/tokens/{token['id']}/budget")
        assert Decimal(budget["reserved"]) == Decimal(budget["spent"]) == 0


def test_upstream_4xx_other_than_429_is_not_failed_over(api, sim):
    _, _, token = api.principal()
    urls = {**healthy(sim), "cheap": failing(sim, "http400")}
    with serving(api, route_catalog(urls)) as proxy:
        before = len(sim_log(sim))
        response = post(proxy, token, {"model": MODEL, "messages": user("Bad")})
        assert_error_shape(response, 400, None)
        assert [r["received"]["model"] for r in new_records(sim, before)] == ["cheap/m25"]


# --- never after the first byte --------------------------------------------------------------


@pytest.mark.parametrize("fault", ["stream_error", "disconnect"])
def test_no_failover_after_the_first_byte(api, sim, fault):
    _, _, token = api.principal()
    urls = {**healthy(sim), "cheap": failing(sim, fault)}
    with serving(api, route_catalog(urls)) as proxy:
        before = len(sim_log(sim))
        body = {"model": MODEL, "messages": user("Mid-stream sim:tokens=30"), "stream": True}
        response = post(proxy, token, body)
        assert response.status_code == 200
        data = data_of(response.content)
        assert data[-1] == "[DONE]" and "error" in json.loads(data[-2])
        assert json.loads(data[0])["choices"][0]["delta"] is not None  # bytes had gone out
        records = new_records(sim, before)
        assert [r["received"]["model"] for r in records] == ["cheap/m25"]
        time.sleep(0.3)
        [event] = wait_events(proxy, token["id"], 1)
        assert event["provider"] == "cheap" and event["id"] == response.headers["x-request-id"]
        expected = {"disconnect": "upstream_disconnected"}.get(fault, fault)
        assert event["status"] == expected
        assert len(new_records(sim, before)) == 1


def test_no_failover_after_the_first_byte_with_the_sdk(api, sim):
    import openai

    _, _, token = api.principal()
    urls = {**healthy(sim), "cheap": failing(sim, "stream_error")}
    with serving(api, route_catalog(urls)) as proxy:
        before = len(sim_log(sim))
        stream = proxy.openai(token["token"]).chat.completions.create(
            model=MODEL, messages=user("Mid-stream sim:tokens=30"), stream=True
        )
        with pytest.raises(openai.APIError):
            for _ in stream:
                pass
        assert [r["received"]["model"] for r in new_records(sim, before)] == ["cheap/m25"]


# --- circuit breakers ------------------------------------------------------------------------


def test_a_failing_provider_rests_for_the_cool_down_then_is_tried_again(api, sim, clock):
    _, _, token = api.principal()
    urls = {**healthy(sim), "cheap": failing(sim, "http500")}
    cooldown = 60.0  # three requests fit inside it even on a busy machine; the clock moves past
    with serving(
        api, route_catalog(urls), breaker_failures=2, breaker_cooldown_s=cooldown
    ) as proxy:

        def tried() -> list[str]:
            before = len(sim_log(sim))
            response = post(proxy, token, {"model": MODEL, "messages": user("Breaker")})
            assert response.status_code == 200, response.text
            records = new_records(sim, before)
            # Which base URL each request came in on: the failing one or the healthy one.
            paths = ["cheap" if r["path"].startswith("/fault/http500/") else "mid" for r in records]
            assert paths == [r["received"]["model"].removesuffix("/m25") for r in records]
            return paths

        # Two failures in a row open the breaker...
        assert tried() == ["cheap", "mid"]
        assert tried() == ["cheap", "mid"]
        opened = clock.monotonic()
        # ...so during the cool-down the failing provider gets no requests at all.
        for _ in range(3):
            assert tried() == ["mid"]
        assert clock.monotonic() - opened < cooldown
        clock.advance(cooldown)
        # After it, one request tries it again (half-open); failing, it rests again.
        assert tried() == ["cheap", "mid"]
        assert tried() == ["mid"]
        events = wait_events(proxy, token["id"], 10)
        assert len(events) == 10  # 3 failed attempts + 7 answers
        assert sum(e["provider"] == "cheap" for e in events) == 3


def test_a_provider_that_recovers_closes_its_breaker(api, sim, clock):
    _, _, token = api.principal()
    port = free_port()
    urls = {**healthy(sim), "cheap": f"http://127.0.0.1:{port}/openai/v1"}
    body = {"model": MODEL, "messages": user("Recover sim:tokens=3")}
    cooldown = 60.0  # starting a server on a busy machine stays inside it; the clock moves past
    with serving(
        api, route_catalog(urls), breaker_failures=1, breaker_cooldown_s=cooldown
    ) as proxy:
        # Nothing listens yet: a connect error (no event) opens the breaker at once.
        assert post(proxy, token, body).status_code == 200
        with SimServer(port=port) as recovered:
            before = len(sim_log(sim))
            assert post(proxy, token, body).status_code == 200
            assert recovered.log() == []  # resting: not tried, though it is back
            assert [r["received"]["model"] for r in new_records(sim, before)] == ["mid/m25"]
            clock.advance(cooldown)
            for n in (1, 2):
                # After the cool-down it is tried, answers, and its breaker closes.
                assert post(proxy, token, body).status_code == 200
                assert [r["received"]["model"] for r in recovered.log()] == ["cheap/m25"] * n
        events = by_time(wait_events(proxy, token["id"], 4))
        assert [e["provider"] for e in events] == ["mid", "mid", "cheap", "cheap"]
