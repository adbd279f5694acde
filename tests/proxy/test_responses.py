"""The Responses API (POST /v1/responses) end to end: the official `openai` SDK's
`responses.*` -> the proxy's bridge -> each of the simulator's chat dialects, and back.

Every request that reaches an upstream is one ledger event whose counts are the answer's
`usage`; every refusal comes before anything is held; stored responses are their owner's."""

import csv
import io
import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import httpx
import openai
import pytest

from tests.proxy.conftest import provider_entry, serving, sim_log
from tests.proxy.test_dialects import MODELS, dialect_catalog, records_since

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def proxy(api, sim):
    with serving(api, dialect_catalog(sim)) as own:
        yield own


@pytest.fixture
def token(api):
    return api.principal()[2]


def client(proxy, token) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=token["token"], max_retries=0)


def events(proxy, token) -> list[dict]:
    return proxy.request("GET", "/v1/usage", params={"token_id": token["id"]}).json()["data"]


def sse(raw: bytes) -> list[tuple[str, dict]]:
    """Each event's `event:` name and its data."""
    out = []
    for block in raw.decode().split("\n\n"):
        lines = block.split("\n")
        names = [line[7:] for line in lines if line.startswith("event: ")]
        datas = [line[6:] for line in lines if line.startswith("data: ")]
        if datas:
            out.append((names[0] if names else "", json.loads("\n".join(datas))))
    return out


def usage_equals_event(usage, event: dict) -> None:
    assert usage.input_tokens == event["prompt_tokens"]
    assert (
        usage.input_tokens_details.cached_tokens == event["prompt_tokens_details"]["cached_tokens"]
    )
    assert usage.output_tokens == event["completion_tokens"]
    reasoning = (event.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    assert usage.output_tokens_details.reasoning_tokens == reasoning
    assert usage.total_tokens == event["total_tokens"]


@pytest.mark.parametrize("model", list(MODELS))
def test_a_response_from_every_dialect_is_one_event_its_usage_the_ledgers(proxy, token, model):
    raw = client(proxy, token).responses.with_raw_response.create(
        model=model,
        instructions="Be brief.",
        input="Say hello sim:tokens=9",
        max_output_tokens=200,
    )
    response = raw.parse()
    assert response.id.startswith("resp_") and response.status == "completed"
    [message] = [item for item in response.output if item.type == "message"]
    assert message.id.startswith("msg_") and response.output_text
    [event] = events(proxy, token)
    assert event["id"] == raw.headers["x-request-id"]
    assert event["model"] == model and event["completion_tokens"] == 9
    usage_equals_event(response.usage, event)


@pytest.mark.parametrize("model", list(MODELS))
def test_a_streamed_response_from_every_dialect_reaches_the_sdk_s_final_response(
    proxy, token, model
):
    with client(proxy, token).responses.stream(
        model=model, input="Stream to me sim:tokens=12", store=False
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    [event] = events(proxy, token)
    assert event["stream"] is True
    # Genesis and NIM report no stream usage: the ledger's estimate is the client's usage.
    assert event["usage_source"] == ("estimated" if model in ("gen-m25", "nim-m25") else "reported")
    usage_equals_event(final.usage, event)
    assert final.output_text


def test_the_event_sequence_is_ordered_named_and_numbered(proxy, token):
    answer = httpx.post(
        f"{proxy.url}/v1/responses",
        json={"model": "oa-m25", "input": "Think sim:tokens=8 sim:reasoning=3", "stream": True},
        headers={"authorization": f"Bearer {token['token']}"},
        timeout=30,
    )
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/event-stream")
    stream = sse(answer.content)
    assert all(name == data["type"] for name, data in stream)
    numbers = [data["sequence_number"] for _, data in stream]
    assert numbers == list(range(len(numbers)))
    kinds = [data["type"] for _, data in stream]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed"
    first_text = kinds.index("response.output_text.delta")
    assert kinds.index("response.content_part.added") < first_text
    assert kinds.index("response.output_text.done") > first_text
    assert "response.reasoning_text.delta" in kinds
    done = stream[-1][1]["response"]
    assert [item["type"] for item in done["output"]] == ["reasoning", "message"]
    assert done["output"][0]["id"].startswith("rs_")
    assert "chatcmpl" not in answer.text
    assert stream[0][1]["response"]["id"] == done["id"]
    [event] = events(proxy, token)
    assert done["usage"]["output_tokens"] == event["completion_tokens"] == 8
    assert done["usage"]["output_tokens_details"]["reasoning_tokens"] == 3


def test_a_response_cut_by_max_output_tokens_is_incomplete(proxy, token):
    response = client(proxy, token).responses.create(
        model="oa-m25", input="Go on sim:tokens=50", max_output_tokens=5
    )
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"


def test_cached_and_reasoning_tokens_are_charged_at_their_prices(proxy, token):
    response = client(proxy, token).responses.create(
        model="oa-m25", input="Cache sim:tokens=10 sim:cached=6 sim:reasoning=4"
    )
    [event] = events(proxy, token)
    usage_equals_event(response.usage, event)
    assert response.usage.input_tokens_details.cached_tokens == 6
    _, _, _, price_in, price_cached, price_out = MODELS["oa-m25"]
    prompt = event["prompt_tokens"]
    expected = (
        (prompt - 6) * Decimal(price_in) + 6 * Decimal(price_cached) + 10 * Decimal(price_out)
    ) / 1_000_000
    assert Decimal(event["cost"]) == expected


def test_a_mid_stream_failure_ends_with_response_failed_and_bills_what_was_delivered(
    proxy, sim, token
):
    before = len(sim_log(sim))
    answer = httpx.post(
        f"{proxy.url}/v1/responses",
        json={
            "model": "tc-m25",
            "input": "Break sim:tokens=30 sim:fault=stream_error sim:fault_after=2",
            "stream": True,
        },
        headers={"authorization": f"Bearer {token['token']}"},
        timeout=30,
    )
    stream = sse(answer.content)
    assert stream[-1][0] == "response.failed"
    failed = stream[-1][1]["response"]
    assert failed["status"] == "failed" and failed["error"]["message"]
    assert not any(name == "" for name, _ in stream)  # never a bare error envelope
    [record] = records_since(sim, before)
    [event] = events(proxy, token)
    assert event["status"] == "stream_error"
    assert event["completion_tokens"] == record["delivered_completion_tokens"] > 0
    assert failed["usage"]["output_tokens"] == event["completion_tokens"]


def test_a_client_that_leaves_mid_stream_is_metered_once(proxy, token):
    with httpx.stream(
        "POST",
        f"{proxy.url}/v1/responses",
        json={"model": "oa-m25", "input": "Long sim:tokens=400 sim:delay_ms=5", "stream": True},
        headers={"authorization": f"Bearer {token['token']}"},
        timeout=30,
    ) as answer:
        for line in answer.iter_lines():
            if "output_text.delta" in line:
                break
    for _ in range(200):
        found = events(proxy, token)
        if found:
            break
        httpx.get(f"{proxy.url}/healthz")
    [event] = found
    assert event["status"] == "client_disconnected"


def test_function_tools_both_ways(proxy, token):
    oa = client(proxy, token)
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ]
    first = oa.responses.create(
        model="oa-m25",
        input="Weather in Paris? sim:tool=get_weather",
        tools=tools,
        tool_choice="required",
        store=False,
    )
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.id.startswith("fc_") and call.name == "get_weather"
    assert json.loads(call.arguments) is not None
    second = oa.responses.create(
        model="oa-m25",
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        ],
        tools=tools,
        store=False,
    )
    assert second.status == "completed" and second.output_text
    assert len(events(proxy, token)) == 2


def test_a_codex_shaped_request(proxy, token):
    answer = httpx.post(
        f"{proxy.url}/v1/responses",
        json={
            "model": "oa-m25",
            "instructions": "You are a coding agent.",
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "fix it sim:tokens=7"}],
                },
                {"type": "reasoning", "summary": [], "encrypted_content": "gAAAA"},
            ],
            "tools": [
                {
                    "type": "function",
                    "name": "shell",
                    "parameters": {"type": "object", "properties": {}},
                    "strict": False,
                }
            ],
            "tool_choice": "auto",
            "parallel_tool_calls": False,
            "reasoning": {"effort": "medium", "summary": "auto"},
            "store": False,
            "stream": True,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "session-1",
        },
        headers={"authorization": f"Bearer {token['token']}"},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    stream = sse(answer.content)
    assert stream[-1][0] == "response.completed"
    assert stream[-1][1]["response"]["id"].startswith("resp_")
    assert len(events(proxy, token)) == 1


BAD = [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "unknown_field": 1}, "unknown_field"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text"),
    ({"input": "x", "reasoning": {"effort": "huge"}}, "reasoning"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "x", "reasoning": {"effort": {"a": 1}}}, "reasoning"),
    ({"input": [{"role": ["user"], "content": "x"}]}, "input"),
    ({"input": [{"type": {"x": 1}}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "input"),
]


@pytest.mark.parametrize(("body", "param"), BAD)
def test_what_the_bridge_cannot_carry_is_a_400_before_anything_is_held(
    proxy, sim, token, body, param
):
    before = len(sim_log(sim))
    answer = httpx.post(
        f"{proxy.url}/v1/responses",
        json={"model": "oa-m25", **body},
        headers={"authorization": f"Bearer {token['token']}"},
        timeout=30,
    )
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
    assert answer.headers["x-should-retry"] == "false"
    assert len(sim_log(sim)) == before and events(proxy, token) == []


def test_an_image_goes_up_where_the_dialect_takes_one_and_is_refused_where_not(proxy, sim, token):
    image = {
        "role": "user",
        "content": [
            {"type": "input_text", "text": "What is this? sim:tokens=3"},
            {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="},
        ],
    }
    oa = client(proxy, token)
    assert oa.responses.create(model="oa-m25", input=[image], store=False).status == "completed"
    with pytest.raises(openai.BadRequestError):
        oa.responses.create(model="nim-m25", input=[image], store=False)
    assert len(events(proxy, token)) == 1


def test_budgets_refuse_before_the_upstream(proxy, sim, token):
    proxy.ok("PATCH", f"/v1/tokens/{token['id']}", json={"credit_limit": "0.000001"})
    before = len(sim_log(sim))
    with pytest.raises(openai.APIStatusError) as refused:
        client(proxy, token).responses.create(model="oa-m25", input="hi", max_output_tokens=500)
    assert refused.value.status_code == 402
    assert len(sim_log(sim)) == before and events(proxy, token) == []


def test_rpm_and_allow_lists_hold(proxy, token):
    proxy.ok("PATCH", f"/v1/tokens/{token['id']}", json={"allowed_models": ["gen-m25"]})
    with pytest.raises(openai.PermissionDeniedError):
        client(proxy, token).responses.create(model="oa-m25", input="hi")
    proxy.ok("PATCH", f"/v1/tokens/{token['id']}", json={"allowed_models": None, "rpm_limit": 0})
    with pytest.raises(openai.RateLimitError):
        client(proxy, token).responses.create(model="gen-m25", input="hi")
    assert events(proxy, token) == []


def test_every_event_says_its_endpoint_and_reports_split_by_it(proxy, token):
    oa = client(proxy, token)
    oa.chat.completions.create(model="oa-m25", messages=[{"role": "user", "content": "a"}])
    oa.responses.create(model="oa-m25", input="b sim:tokens=3", store=False)
    oa.responses.create(model="gen-m25", input="c sim:tokens=4", store=False)
    found = {e["id"]: e["endpoint"] for e in events(proxy, token)}
    assert sorted(found.values()) == ["chat.completions", "responses", "responses"]
    only = proxy.ok("GET", "/v1/usage", params={"token_id": token["id"], "endpoint": "responses"})
    assert len(only["data"]) == 2
    assert proxy.request("GET", "/v1/usage", params={"endpoint": "chat"}).status_code == 400
    report = proxy.ok(
        "GET", "/v1/spend", params={"token_id": token["id"], "group_by": "endpoint,model"}
    )
    rows = {(r["endpoint"], r["model"]): r for r in report["rows"]}
    assert set(rows) == {
        ("chat.completions", "oa-m25"),
        ("responses", "oa-m25"),
        ("responses", "gen-m25"),
    }
    for (endpoint, model), row in rows.items():
        mine = [e for e in events(proxy, token) if (e["endpoint"], e["model"]) == (endpoint, model)]
        assert row["requests"] == len(mine) == 1
        assert Decimal(row["cost"]) == sum(Decimal(e["cost"]) for e in mine)
    refused = proxy.request("GET", "/v1/spend", params={"group_by": "endpoint,end_user"})
    assert refused.status_code == 400
    csv = proxy.request(
        "GET", "/v1/usage", params={"token_id": token["id"], "format": "csv"}
    ).text.splitlines()
    assert "endpoint" in csv[0].split(",")


def test_ingested_usage_names_its_endpoint(proxy, token):
    sent = {
        "idempotency_key": f"k-{token['id']}",
        "model": "oa-m25",
        "token_id": token["id"],
        "prompt_tokens": 3,
        "completion_tokens": 4,
    }
    answer = proxy.ok(
        "POST",
        "/v1/events",
        json={
            "events": [
                sent,
                {**sent, "idempotency_key": f"r-{token['id']}", "endpoint": "responses"},
            ]
        },
    )
    assert [r["status"] for r in answer["data"]] == ["created", "created"], answer
    bad = proxy.ok(
        "POST",
        "/v1/events",
        json={"events": [{**sent, "idempotency_key": "x", "endpoint": "chat"}]},
    )
    assert bad["data"][0]["status"] == "rejected"
    assert sorted(e["endpoint"] for e in events(proxy, token)) == ["chat.completions", "responses"]


# --- native pass-through: a provider that serves the Responses API itself ----------------------


@pytest.fixture(scope="module")
def native(api, sim):
    catalog = dialect_catalog(sim)
    catalog["providers"]["d-native"] = provider_entry(
        sim.base_url("openai"), "openai", responses=True
    )
    catalog["models"].append(
        {
            "name": "native-m25",
            "provider": "d-native",
            "upstream_model": "MiniMaxAI/MiniMax-M2.5",
            "input_usd_per_mtok": "0.15",
            "cached_input_usd_per_mtok": "0.075",
            "output_usd_per_mtok": "0.60",
            "max_output_tokens": 16384,
        }
    )
    with serving(api, catalog) as own:
        yield own


def test_a_native_provider_gets_the_body_as_sent_and_its_usage_is_charged(native, sim, token):
    oa = client(native, token)
    before = len(sim_log(sim))
    raw = oa.responses.with_raw_response.create(
        model="native-m25",
        input="Native sim:tokens=9 sim:cached=4",
        metadata={"project": "x"},
        max_output_tokens=100,
    )
    response = raw.parse()
    [record] = records_since(sim, before)
    assert record["path"].endswith("/openai/v1/responses")
    sent = record["received"]
    assert (
        sent["model"] == "MiniMaxAI/MiniMax-M2.5"
        and sent["input"] == "Native sim:tokens=9 sim:cached=4"
    )
    assert "metadata" not in sent and sent["max_output_tokens"] == 100
    assert response.id == record["id"]  # relayed as it came
    [event] = events(native, token)
    assert event["id"] == raw.headers["x-request-id"] and event["endpoint"] == "responses"
    assert event["usage_source"] == "reported" and event["completion_tokens"] == 9
    usage_equals_event(response.usage, event)
    assert response.usage.input_tokens_details.cached_tokens == 4
    # Stored here, and continued: the conversation goes up whole, without our ids.
    second = oa.responses.create(
        model="native-m25", previous_response_id=response.id, input="More sim:tokens=3"
    )
    sent = sim_log(sim)[-1]["received"]
    assert "previous_response_id" not in sent and len(sent["input"]) == 3
    assert all("id" not in item for item in sent["input"])
    assert second.usage.input_tokens > response.usage.input_tokens


def test_a_native_stream_is_relayed_as_it_comes_and_metered_from_response_completed(native, token):
    with client(native, token).responses.stream(
        model="native-m25", input="Stream sim:tokens=11", store=False
    ) as stream:
        final = stream.get_final_response()
    [event] = events(native, token)
    assert event["stream"] is True and event["completion_tokens"] == 11
    usage_equals_event(final.usage, event)


def test_a_native_stream_that_fails_is_billed_for_what_was_delivered(native, sim, token):
    before = len(sim_log(sim))
    answer = httpx.post(
        f"{native.url}/v1/responses",
        json={
            "model": "native-m25",
            "input": "Break sim:tokens=30 sim:fault=stream_error sim:fault_after=2",
            "stream": True,
        },
        headers={"authorization": f"Bearer {token['token']}"},
        timeout=30,
    )
    stream = sse(answer.content)
    assert stream[-1][0] == "response.failed"
    [record] = records_since(sim, before)
    [event] = events(native, token)
    assert event["status"] == "stream_error"
    assert event["completion_tokens"] == record["delivered_completion_tokens"] > 0


def test_a_native_request_over_budget_is_refused_before_the_upstream(native, sim, token):
    native.ok("PATCH", f"/v1/tokens/{token['id']}", json={"credit_limit": "0.000001"})
    before = len(sim_log(sim))
    with pytest.raises(openai.APIStatusError) as refused:
        client(native, token).responses.create(
            model="native-m25", input="hi", max_output_tokens=500
        )
    assert refused.value.status_code == 402
    assert len(sim_log(sim)) == before and events(native, token) == []


def test_the_simulators_responses_api_refuses_chat_shaped_tools(sim):
    answer = httpx.post(
        f"{sim.base_url('openai')}/responses",
        json={
            "model": "m",
            "input": "x",
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
        headers={"authorization": "Bearer sim-key"},
    )
    assert answer.status_code == 400
    chat = httpx.post(
        f"{sim.base_url('openai')}/chat/completions",
        json={
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "name": "f"}],
        },
        headers={"authorization": "Bearer sim-key"},
    )
    assert chat.status_code == 400  # a Responses-shaped tool sent to chat, as a naive bridge would


def test_focus_rows_say_the_responses_api_and_add_up(proxy, token):
    oa = client(proxy, token)
    oa.chat.completions.create(model="oa-m25", messages=[{"role": "user", "content": "a"}])
    oa.responses.create(model="oa-m25", input="b sim:tokens=3", store=False)
    team_id = proxy.ok("GET", f"/v1/users/{events(proxy, token)[0]['user_id']}")["team_id"]
    now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    params = {
        "start": (now - timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "end": (now + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "team_id": team_id,
        "format": "csv",
    }
    answer = proxy.request("GET", "/v1/exports/focus", params=params)
    assert answer.status_code == 200, answer.text
    rows = list(csv.DictReader(io.StringIO(answer.text)))
    by_endpoint: dict[str, Decimal] = {}
    for row in rows:
        endpoint = json.loads(row["Tags"]).get("endpoint", "chat.completions")
        by_endpoint[endpoint] = by_endpoint.get(endpoint, Decimal(0)) + Decimal(row["BilledCost"])
    ledger: dict[str, Decimal] = {}
    for e in events(proxy, token):
        ledger[e["endpoint"]] = ledger.get(e["endpoint"], Decimal(0)) + Decimal(e["cost"])
    assert by_endpoint == ledger and set(ledger) == {"chat.completions", "responses"}


def test_max_output_tokens_is_clamped_as_max_tokens_is(proxy, token):
    proxy.ok("PATCH", f"/v1/tokens/{token['id']}", json={"credit_limit": "0.001"})
    raw = client(proxy, token).responses.with_raw_response.create(
        model="oa-m25", input="Fit sim:tokens=5", store=False
    )
    assert raw.parse().status == "completed"
    clamped = int(raw.headers["x-max-tokens-clamped"])
    assert 1 <= clamped < 16384
    [event] = events(proxy, token)
    assert event["max_tokens_clamped"] == clamped


def test_a_streamed_function_call(proxy, token):
    answer = httpx.post(
        f"{proxy.url}/v1/responses",
        json={
            "model": "oa-m25",
            "input": "Weather? sim:tool=get_weather",
            "tools": [
                {
                    "type": "function",
                    "name": "get_weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                }
            ],
            "stream": True,
            "store": False,
        },
        headers={"authorization": f"Bearer {token['token']}"},
        timeout=30,
    )
    stream = sse(answer.content)
    kinds = [data["type"] for _, data in stream]
    assert "response.function_call_arguments.delta" in kinds
    assert kinds[-1] == "response.completed"
    [call] = stream[-1][1]["response"]["output"]
    assert call["type"] == "function_call" and call["id"].startswith("fc_")
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "sim"}
    assert call["call_id"].startswith("call_")
    done = [d["item"] for _, d in stream if d["type"] == "response.output_item.done"]
    assert done == [call]
    assert len(events(proxy, token)) == 1
