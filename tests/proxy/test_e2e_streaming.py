"""Streaming chat completions end to end: SSE relayed as sent, usage withheld unless asked for,
and exactly one ledger event however the stream ends (done, client gone, upstream broken)."""

import json
import re
import time
from decimal import Decimal

import httpx
import pytest

from metering.proxy.estimate import estimate_prompt_tokens, estimate_text_tokens
from metering.sim.text import split_chunks
from tests.proxy.conftest import (
    MODELS,
    ROUTES,
    assert_error_shape,
    assert_matches_upstream,
    data_of,
    event_by_id,
    expected_cost,
    sim_record,
    user_message,
    wait_events,
)

DIALECTS = {"gpt-sim": "openai", "minimax-m2.1": "exascale"}
# Fields whose value depends on the moment or the request, not on the prompt.
VOLATILE = re.compile(rb'"(id|created)": ("[^"]*"|\d+)|"sla_metrics": \{[^}]*\}')
EVENT = re.compile(rb"(.*?)(\r\n\r\n|\n\n)", re.S)
# The usage chunk alone: a keep-alive comment before it is an event of its own, relayed.
USAGE_EVENT = re.compile(rb'data: [^\r\n]*"usage": \{[^\r\n]*(\r\n|\n){2}')


def chunks_of(raw: bytes) -> list[dict]:
    return [json.loads(d) for d in data_of(raw) if d != "[DONE]"]


def without_volatile(chunk: dict) -> dict:
    return {k: v for k, v in chunk.items() if k not in ("id", "created", "sla_metrics")}


def delivered_text(chunks: list[dict]) -> str:
    """The generated text the chunks carry, in the order the proxy's observer reads it."""
    parts = []
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            parts += [p for p in (delta.get("content"), delta.get("reasoning_content")) if p]
    return "".join(parts)


def stream_body(model: str, text: str, include_usage: bool | None = None) -> dict:
    body = {"model": model, "messages": user_message(text), "stream": True}
    if include_usage is not None:
        body["stream_options"] = {"include_usage": include_usage}
    return body


def direct_stream(sim, model: str, body: dict) -> bytes:
    """The same upstream body sent straight to the simulated upstream."""
    response = httpx.post(
        f"{sim.base_url(DIALECTS[model])}/chat/completions",
        json=body,
        headers={"authorization": "Bearer sim-key"},
        timeout=10,
    )
    assert response.status_code == 200
    return response.content


# --- metered as reported ---------------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
def test_sdk_stream_with_include_usage_gets_the_usage_the_ledger_holds(api, sim, principal, model):
    token = principal[2]
    client = api.openai(token["token"])
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=user_message("Stream sim:tokens=13 sim:reasoning=5 sim:cached=7 sim:chunks=4"),
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(raw.parse())
    event = event_by_id(api, token["id"], raw.headers["x-request-id"])
    record = sim_record(sim, chunks[0].id)

    assert_matches_upstream(event, record, principal, model, stream=True)
    assert record["completed"] is True
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert all(c.usage is None for c in chunks[:-1])
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        event["prompt_tokens"],
        event["completion_tokens"],
        event["total_tokens"],
    )
    assert event["completion_tokens"] == 13
    assert usage.completion_tokens_details.reasoning_tokens == 5
    assert event["completion_tokens_details"]["reasoning_tokens"] == 5
    assert event["prompt_tokens_details"]["cached_tokens"] == (7 if model == "gpt-sim" else 0)
    assert event["ttft_ms"] is not None and event["ttft_ms"] <= event["latency_ms"]


@pytest.mark.parametrize("model", MODELS)
def test_sdk_stream_without_stream_options_gets_no_usage_chunk(api, sim, principal, model):
    token = principal[2]
    client = api.openai(token["token"])
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=user_message("Quiet sim:tokens=9 sim:reasoning=3 sim:cached=2"),
        stream=True,
    )
    chunks = list(raw.parse())
    assert chunks and all(c.usage is None and c.choices for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    event = event_by_id(api, token["id"], raw.headers["x-request-id"])
    record = sim_record(sim, chunks[0].id)
    assert text == record["content"]
    # The proxy asked for usage anyway, under the upstream's own model name, and billed it.
    assert record["received"]["stream_options"] == {"include_usage": True}
    assert record["received"]["model"] == ROUTES[model][1]
    assert_matches_upstream(event, record, principal, model, stream=True)


@pytest.mark.parametrize("model", MODELS)
def test_client_stream_options_false_still_asks_upstream_and_withholds(api, sim, http, model):
    response = http.post(
        "/v1/chat/completions", json=stream_body(model, "opt out sim:tokens=5", False)
    )
    assert response.status_code == 200
    chunks = chunks_of(response.content)
    assert all(c.get("usage") is None for c in chunks)
    record = sim_record(sim, chunks[0]["id"])
    assert record["received"]["stream_options"] == {"include_usage": True}
    assert record["usage"] is not None


# --- passthrough fidelity --------------------------------------------------------------------


@pytest.mark.parametrize("include_usage", [True, None])
@pytest.mark.parametrize("model", MODELS)
def test_stream_events_are_the_upstreams_events(api, sim, http, model, include_usage):
    body = stream_body(model, "Relay sim:tokens=12 sim:reasoning=4 sim:chunks=3", include_usage)
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert data_of(response.content)[-1] == "[DONE]"
    relayed = chunks_of(response.content)
    record = sim_record(sim, relayed[0]["id"])
    upstream = chunks_of(direct_stream(sim, model, record["received"]))
    if not include_usage:
        # The one chunk withheld: the usage the client did not ask for.
        assert upstream[-1]["choices"] == [] and upstream[-1]["usage"]
        upstream = upstream[:-1]
    assert [without_volatile(c) for c in relayed] == [without_volatile(c) for c in upstream]
    assert {c["id"] for c in relayed} == {record["id"]}
    if model == "minimax-m2.1":
        first = relayed[0]["choices"][0]["delta"]
        assert first["reasoning_details"][0]["type"] == "reasoning.text"
        assert all(c["system_fingerprint"] == "" for c in relayed)
        assert all(set(c["sla_metrics"]) == {"ttft_ms", "ts_us"} for c in relayed)


@pytest.mark.parametrize(
    "directives", ["sim:crlf=1", "sim:comments=1", "sim:crlf=1 sim:comments=1"]
)
@pytest.mark.parametrize("model", MODELS)
def test_crlf_and_comments_are_relayed_byte_for_byte(api, sim, http, model, directives):
    body = stream_body(model, f"Frame sim:tokens=8 sim:chunks=3 {directives}", True)
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    relayed = response.content
    record = sim_record(sim, chunks_of(relayed)[0]["id"])
    upstream = direct_stream(sim, model, record["received"])
    assert VOLATILE.sub(b"", relayed) == VOLATILE.sub(b"", upstream)
    if "crlf" in directives:
        assert b"\r\n\r\n" in relayed and b"\n\n" not in relayed.replace(b"\r\n", b"")
        assert relayed.endswith(b"data: [DONE]\r\n\r\n")
    if "comments" in directives:
        assert relayed.count(b": keep-alive") == len(data_of(relayed))


@pytest.mark.parametrize("model", MODELS)
def test_withheld_usage_chunk_leaves_the_other_bytes_untouched(api, sim, http, model):
    body = stream_body(model, "Frame sim:tokens=8 sim:chunks=3 sim:crlf=1 sim:comments=1")
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    relayed = response.content
    record = sim_record(sim, chunks_of(relayed)[0]["id"])
    upstream = direct_stream(sim, model, record["received"])
    assert len(USAGE_EVENT.findall(upstream)) == 1
    expected = USAGE_EVENT.sub(b"", upstream)
    assert VOLATILE.sub(b"", relayed) == VOLATILE.sub(b"", expected)


# --- the client leaves -----------------------------------------------------------------------


def test_client_disconnect_mid_stream_is_one_estimated_event(api, sim):
    _, _, token = api.principal()
    text = "Long sim:tokens=200 sim:chunks=20 sim:delay_ms=50"
    body = stream_body("gpt-sim", text)
    received = []
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST",
            f"{api.url}/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {token['token']}"},
        ) as response,
    ):
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]
        for line in response.iter_lines():
            if line.startswith("data: "):
                received.append(json.loads(line[6:]))
            if len(received) == 2:
                break
    events = wait_events(api, token["id"], 1)
    assert len(events) == 1
    event = events[0]
    assert event["id"] == request_id
    assert event["status"] == "client_disconnected"
    assert event["usage_source"] == "estimated"
    assert event["stream"] is True
    assert event["upstream_id"] == received[0]["id"]
    assert event["prompt_tokens"] == estimate_prompt_tokens(body)

    # The upstream's stream ends, let go before its 20 chunks (had it been read on, it would
    # have completed them).
    deadline = time.monotonic() + 10
    while sim_record(sim, received[0]["id"])["closed_at"] is None:
        assert time.monotonic() < deadline, "the upstream's stream was never let go"
        time.sleep(0.05)
    record = sim_record(sim, received[0]["id"])
    assert record["completed"] is False
    assert 1 <= record["delivered_chunks"] < 20
    # Billed for a prefix of the answer the proxy read before it saw the client go.
    pieces = split_chunks(record["content"], 20)
    possible = {
        estimate_text_tokens("".join(pieces[:k])): k
        for k in range(1, record["delivered_chunks"] + 2)
    }
    assert event["completion_tokens"] in possible
    assert 0 < event["completion_tokens"] < estimate_text_tokens(record["content"])
    assert event["total_tokens"] == event["prompt_tokens"] + event["completion_tokens"]
    assert Decimal(event["cost"]) == expected_cost(
        "gpt-sim", event["prompt_tokens"], 0, event["completion_tokens"]
    )
    assert len(api.events(token_id=token["id"])) == 1


# --- the upstream breaks ---------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["disconnect", "stream_error"])
@pytest.mark.parametrize("model", MODELS)
def test_broken_stream_ends_with_an_error_event_and_done(api, sim, model, fault):
    _, _, token = api.principal()
    body = stream_body(model, f"Break sim:tokens=30 sim:reasoning=6 sim:fault={fault}")
    response = httpx.post(
        f"{api.url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {token['token']}"},
        timeout=30,
    )
    assert response.status_code == 200
    data = data_of(response.content)
    assert data[-1] == "[DONE]"
    error = json.loads(data[-2])["error"]
    assert set(error) >= {"message", "type"}
    if fault == "stream_error":
        assert error == {"message": "upstream stream interrupted", "type": "server_error"}
    else:
        assert error["code"] == "upstream_error"
    chunks = [json.loads(d) for d in data[:-2]]
    assert all("error" not in c and c.get("usage") is None for c in chunks)

    events = wait_events(api, token["id"], 1)
    assert len(events) == 1
    event = events[0]
    assert event["id"] == response.headers["x-request-id"]
    assert event["status"] == {"disconnect": "upstream_disconnected"}.get(fault, fault)
    assert event["usage_source"] == "estimated"
    assert event["upstream_id"] == chunks[0]["id"]
    # Billed for what was delivered before the break, at the catalog's price.
    record = sim_record(sim, chunks[0]["id"])
    assert record["completed"] is False
    text = delivered_text(chunks)
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert content and record["content"].startswith(content) and content != record["content"]
    assert event["prompt_tokens"] == estimate_prompt_tokens(body)
    assert event["completion_tokens"] == estimate_text_tokens(text)
    assert Decimal(event["cost"]) == expected_cost(
        model, event["prompt_tokens"], 0, event["completion_tokens"]
    )


@pytest.mark.parametrize("model", MODELS)
def test_malformed_event_mid_stream_is_relayed_and_usage_still_counts(api, sim, principal, model):
    token = principal[2]
    body = stream_body(model, "Odd sim:tokens=10 sim:fault=malformed", True)
    response = httpx.post(
        f"{api.url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {token['token']}"},
        timeout=30,
    )
    assert response.status_code == 200
    data = data_of(response.content)
    assert data[1] == "{not json" and data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data if d not in ("{not json", "[DONE]")]
    event = event_by_id(api, token["id"], response.headers["x-request-id"])
    record = sim_record(sim, chunks[0]["id"])
    assert_matches_upstream(event, record, principal, model, stream=True)
    assert chunks[-1]["usage"]["completion_tokens"] == event["completion_tokens"] == 10


@pytest.mark.parametrize(
    ("fault", "status", "code", "event_status"),
    [
        ("http500", 502, "upstream_error", "upstream_error"),
        ("http400", 400, None, "upstream_error"),
        ("timeout", 504, "upstream_timeout", "timeout"),
    ],
)
def test_stream_refused_upstream_is_an_openai_error_and_one_free_event(
    api, sim, fault, status, code, event_status
):
    _, _, token = api.principal()
    response = httpx.post(
        f"{api.url}/v1/chat/completions",
        json=stream_body("minimax-m2.1", f"x sim:fault={fault}"),
        headers={"authorization": f"Bearer {token['token']}"},
        timeout=30,
    )
    error = assert_error_shape(response, status, code)
    if fault == "http400":
        assert error["message"] == "simulated fault http400"
    events = wait_events(api, token["id"], 1)
    assert len(events) == 1
    assert events[0]["id"] == response.headers["x-request-id"]
    assert events[0]["status"] == event_status
    assert events[0]["stream"] is True
    assert Decimal(events[0]["cost"]) == 0


def test_stream_stalling_mid_way_ends_with_an_error_event_and_one_event(api, sim):
    _, _, token = api.principal()
    # Exascale's first chunk carries text; the second comes after the provider's 2 s timeout.
    body = stream_body("minimax-m2.1", "Stall sim:tokens=6 sim:chunks=2 sim:delay_ms=2500")
    response = httpx.post(
        f"{api.url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {token['token']}"},
        timeout=30,
    )
    assert response.status_code == 200
    data = data_of(response.content)
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["error"]["code"] == "upstream_error"
    chunks = [json.loads(d) for d in data[:-2]]
    events = wait_events(api, token["id"], 1)
    assert len(events) == 1
    assert (events[0]["status"], events[0]["usage_source"]) == ("timeout", "estimated")
    assert events[0]["completion_tokens"] == estimate_text_tokens(delivered_text(chunks)) > 0
