"""Non-streaming chat completions end to end: official SDK -> proxy -> simulated upstream.

Each ledger event is checked field by field against what the upstream reported (the
sim's log), upstream faults against the error contract, and x-request-id everywhere.
"""

import re
from decimal import Decimal

import httpx
import pytest

from metering.proxy.estimate import estimate_prompt_tokens
from tests.proxy.conftest import (
    MODELS,
    ROUTES,
    assert_error_shape,
    assert_matches_upstream,
    event_by_id,
    expected_cost,
    sim_record,
    user_message,
    wait_events,
)

# Fields whose value depends on the moment or the request, not on the prompt.
VOLATILE = re.compile(rb'"(id|created)": ?("[^"]*"|\d+)')


# --- metering what the upstream reported -----------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
def test_sdk_completion_is_metered_exactly_as_the_upstream_reported(api, sim, principal, model):
    token = principal[2]
    client = api.openai(token["token"])
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=user_message("Tell me sim:tokens=11 sim:reasoning=4 sim:cached=6"),
    )
    completion = raw.parse()
    event = event_by_id(api, token["id"], raw.headers["x-request-id"])
    record = sim_record(sim, completion.id)

    assert_matches_upstream(event, record, principal, model, stream=False)
    assert event["completion_tokens"] == 11
    assert event["completion_tokens_details"]["reasoning_tokens"] == 4
    assert event["prompt_tokens_details"]["cached_tokens"] == (6 if model == "gpt-sim" else 0)
    assert completion.usage.prompt_tokens == event["prompt_tokens"]
    assert completion.usage.completion_tokens == event["completion_tokens"]
    assert record["received"]["model"] == ROUTES[model][1]
    assert record["received"]["messages"] == user_message(
        "Tell me sim:tokens=11 sim:reasoning=4 sim:cached=6"
    )


def test_upstream_4xx_passes_through_in_the_openai_shape(api, sim):
    _, _, token = api.principal()
    response = api.request(
        "POST",
        "/v1/chat/completions",
        key=token["token"],
        json={"model": "minimax-m2.1", "messages": user_message("x sim:fault=http400")},
    )
    error = assert_error_shape(response, 400, None)
    assert error["message"] == "simulated fault http400"
    [event] = api.events(token_id=token["id"])
    assert event["id"] == response.headers["x-request-id"]
    assert (event["status"], event["http_status"]) == ("upstream_error", 400)
    assert Decimal(event["cost"]) == 0


def test_upstream_429_passes_through_with_retry_after(api, sim, token, http):
    response = http.post(
        "/v1/chat/completions",
        json={"model": "gpt-sim", "messages": user_message("x sim:fault=http429")},
    )
    error = assert_error_shape(response, 429, "rate_limit_exceeded")
    assert error["message"] == "simulated fault http429"
    assert response.headers["retry-after"] == "1"
    event = event_by_id(api, token["id"], response.headers["x-request-id"])
    assert (event["status"], event["http_status"]) == ("upstream_error", 429)
    assert Decimal(event["cost"]) == 0


def test_client_giving_up_on_a_completion_still_leaves_one_event(api, sim):
    _, _, token = api.principal()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{api.url}/v1/chat/completions",
            json={"model": "gpt-sim", "messages": user_message("x sim:fault=timeout")},
            headers={"authorization": f"Bearer {token['token']}"},
            timeout=0.5,
        )
    # The proxy waits out the provider's 2 s timeout, then meters the attempt.
    events = wait_events(api, token["id"], 1)
    assert len(events) == 1
    assert events[0]["status"] == "timeout"
    assert Decimal(events[0]["cost"]) == 0


# --- passthrough fidelity --------------------------------------------------------------------


def direct(sim, dialect: str, body: dict) -> httpx.Response:
    """The same request sent straight to the simulated upstream."""
    return httpx.post(
        f"{sim.base_url(dialect)}/chat/completions",
        json=body,
        headers={"authorization": "Bearer sim-key"},
        timeout=10,
    )


def test_exascale_body_reaches_the_client_byte_for_byte(api, sim, http):
    response = http.post(
        "/v1/chat/completions",
        json={"model": "minimax-m2.1", "messages": user_message("hello sim:reasoning=5")},
    )
    assert response.status_code == 200
    body = response.json()
    record = sim_record(sim, body["id"])
    # The sim answers the same body the same way, but for the id and the time.
    again = direct(sim, "exascale", record["received"])
    assert VOLATILE.sub(b"", response.content) == VOLATILE.sub(b"", again.content)
    message = body["choices"][0]["message"]
    assert message["name"] == "MiniMax AI"
    assert message["reasoning_content"] == record["reasoning"]
    assert message["reasoning_details"] == [
        {
            "type": "reasoning.text",
            "text": record["reasoning"],
            "id": "reasoning-text-1",
            "format": "openai-responses-v1",
            "index": 0,
        }
    ]
    assert body["system_fingerprint"] == ""
    assert body["model"] == "minimax/minimax-m2.1"
    assert body["usage"]["prompt_tokens_details"] is None


# --- upstream faults -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "fault", "status", "code", "event_status"),
    [
        *(
            (model, fault, status, code, event_status)
            for model in MODELS
            for fault, status, code, event_status in (
                ("http500", 502, "upstream_error", "upstream_error"),
                ("malformed", 502, "upstream_error", "malformed"),
                ("disconnect", 502, "upstream_error", "upstream_disconnected"),
            )
        ),
        # Waiting out the 2 s timeout once is enough (streams repeat it on the other dialect).
        ("gpt-sim", "timeout", 504, "upstream_timeout", "timeout"),
    ],
)
def test_upstream_fault_is_an_openai_error_and_one_event(
    api, sim, model, fault, status, code, event_status
):
    _, _, token = api.principal()
    response = httpx.post(
        f"{api.url}/v1/chat/completions",
        json={"model": model, "messages": user_message(f"x sim:fault={fault}")},
        headers={"authorization": f"Bearer {token['token']}"},
        timeout=30,
    )
    assert_error_shape(response, status, code)
    events = wait_events(api, token["id"], 1)
    assert len(events) == 1
    event = events[0]
    assert event["id"] == response.headers["x-request-id"]
    assert event["status"] == event_status
    assert event["stream"] is False
    if fault in ("http500", "timeout"):
        # The upstream refused or never answered: nothing to bill.
        assert Decimal(event["cost"]) == 0
        assert (event["prompt_tokens"], event["completion_tokens"]) == (0, 0)
        assert event["http_status"] == (500 if fault == "http500" else None)
    else:
        # It answered 200 and (as far as we know) billed the prompt: estimated, never free.
        assert event["usage_source"] == "estimated"
        prompt = estimate_prompt_tokens({"messages": user_message(f"x sim:fault={fault}")})
        assert event["prompt_tokens"] == prompt
        # A body cut half way is billed for the text that arrived; a malformed one for none.
        completion = event["completion_tokens"]
        assert completion > 0 if fault == "disconnect" else completion == 0
        assert Decimal(event["cost"]) == expected_cost(model, prompt, 0, completion)


# --- x-request-id ----------------------------------------------------------------------------


def test_every_response_carries_x_request_id(api, http):
    responses = [
        http.post("/v1/chat/completions", content=b"{"),
        http.get("/v1/models"),
        http.get("/v1/no-such-route"),
        httpx.get(f"{api.url}/v1/models", timeout=10),
        httpx.get(f"{api.url}/healthz", timeout=10),
    ]
    assert [r.status_code for r in responses] == [400, 200, 404, 401, 200]
    ids = [r.headers["x-request-id"] for r in responses]
    assert all(re.fullmatch(r"req_[0-9a-f]{32}", i) for i in ids)
    assert len(set(ids)) == len(ids)
    assert_error_shape(responses[2], 404, "not_found")


def test_x_request_id_is_the_ledger_event_id(api, token, http):
    response = http.post(
        "/v1/chat/completions",
        json={"model": "gpt-sim", "messages": user_message("hi sim:tokens=3")},
    )
    assert response.status_code == 200
    event = event_by_id(api, token["id"], response.headers["x-request-id"])
    assert event["upstream_id"] == response.json()["id"]


def test_models_lists_the_catalog(api, token):
    models = api.openai(token["token"]).models.list()
    assert sorted(m.id for m in models.data) == ["gpt-sim", "minimax-m2.1"]
