"""Each provider dialect end to end: official SDK -> proxy -> simulated upstream speaking it.

The ledger (GET /v1/usage) is compared with what the upstream reported (the sim's log):
Genesis (text blocks, its error shape, streams without usage: estimated), TokenChange
(streams only: assembled answers, cached tokens at the cached price, errors mid-stream,
`/ep/` pinning), NVIDIA NIM (202 polling, problem details, its documented ranges checked
before anything is spent), and the OpenAI and Exascale shapes alongside.
"""

import json
import random
from decimal import Decimal

import httpx
import openai
import pytest

from metering.proxy.estimate import estimate_prompt_tokens, estimate_text_tokens
from metering.sim.text import prose
from metering.sim.tokenizer import count_prompt_tokens, count_tokens
from tests.proxy.conftest import (
    assert_error_shape,
    data_of,
    provider_entry,
    serving,
    sim_log,
    sim_record,
    user,
    wait_events,
)

# model: (provider, dialect, upstream model, input, cached input, output) in USD per 1M tokens
MODELS = {
    "oa-m25": ("d-openai", "openai", "MiniMaxAI/MiniMax-M2.5", "0.15", "0.075", "0.60"),
    "ex-m21": ("d-exascale", "exascale", "MiniMaxAI/MiniMax-M2.1", "0.30", None, "1.20"),
    "gen-m25": ("d-genesis", "genesis", "MiniMax-M2.5", "0.28", None, "1.10"),
    "tc-m25": ("d-tokenchange", "tokenchange", "minimax/minimax-m2.5", "0.30", "0.03", "1.20"),
    "nim-m25": ("d-nim", "nim", "minimaxai/minimax-m2.5", "0.32", None, "1.25"),
}
# NIM with a short polling bound, for a result that never arrives in time.
SLOW_NIM = ("nim-slow", "d-nim-slow")
POLL = {"poll_interval_s": 0.05, "poll_timeout_s": 5}


def dialect_catalog(sim) -> dict:
    providers, models = {}, []
    for name, (provider, dialect, upstream, price_in, price_cached, price_out) in MODELS.items():
        extra = POLL if dialect == "nim" else {}
        providers[provider] = provider_entry(sim.base_url(dialect), dialect, **extra)
        entry = {
            "name": name,
            "provider": provider,
            "upstream_model": upstream,
            "input_usd_per_mtok": price_in,
            "output_usd_per_mtok": price_out,
            "max_output_tokens": 16384,
        }
        if price_cached is not None:
            entry["cached_input_usd_per_mtok"] = price_cached
        models.append(entry)
    providers[SLOW_NIM[1]] = provider_entry(
        sim.base_url("nim"), "nim", poll_interval_s=0.05, poll_timeout_s=0.4
    )
    models.append({**models[-1], "name": SLOW_NIM[0], "provider": SLOW_NIM[1]})
    return {"providers": providers, "models": models}


@pytest.fixture(scope="module")
def proxy(api, sim):
    with serving(api, dialect_catalog(sim)) as own:
        yield own


@pytest.fixture
def token(api):
    return api.principal()[2]


def price(model: str) -> tuple[Decimal, Decimal, Decimal]:
    _, _, _, price_in, price_cached, price_out = MODELS[model]
    return Decimal(price_in), Decimal(price_cached or price_in), Decimal(price_out)


def cost_of(model: str, prompt: int, cached: int, completion: int) -> Decimal:
    price_in, price_cached, price_out = price(model)
    return (
        (prompt - cached) * price_in + cached * price_cached + completion * price_out
    ) / Decimal(1_000_000)


def records_since(sim, before: int) -> list[dict]:
    return sim_log(sim)[before:]


def one_event(api, token: dict) -> dict:
    events = wait_events(api, token["id"], 1)
    assert len(events) == 1, events
    return events[0]


def assert_reported(event: dict, record: dict, model: str, stream: bool) -> None:
    """The event holds exactly the upstream's usage, charged at the catalog's prices."""
    usage = record["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    provider, _, upstream_model, *_ = MODELS[model]
    assert (event["model"], event["provider"]) == (model, provider)
    assert event["upstream_model"] == upstream_model
    assert event["upstream_id"] == record["id"]
    assert event["usage_source"] == "reported"
    assert (event["status"], event["http_status"], event["stream"]) == ("ok", 200, stream)
    assert event["prompt_tokens"] == usage["prompt_tokens"] == record["prompt_tokens"]
    assert event["completion_tokens"] == usage["completion_tokens"]
    assert event["prompt_tokens_details"] == {"cached_tokens": cached}
    assert Decimal(event["cost"]) == cost_of(
        model, usage["prompt_tokens"], cached, usage["completion_tokens"]
    )


def within(estimate: int, actual: int, tolerance: float = 0.15) -> bool:
    return abs(estimate - actual) <= tolerance * actual


# --- every dialect, streamed and not --------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
@pytest.mark.parametrize("model", list(MODELS))
def test_each_dialect_is_metered_as_its_upstream_reported(api, sim, proxy, token, model, stream):
    client = proxy.openai(token["token"])
    messages = [
        {"role": "system", "content": "You answer in plain sentences."},
        {"role": "user", "content": f"Describe {model} sim:tokens=40 sim:cached=5"},
    ]
    before = len(sim_log(sim))
    if stream:
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=messages, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(raw.parse())
        content = "".join(
            c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].delta
        )
        usage = next((c.usage for c in chunks if c.usage), None)
    else:
        raw = client.chat.completions.with_raw_response.create(model=model, messages=messages)
        completion = raw.parse()
        content, usage = completion.choices[0].message.content, completion.usage
    [record] = records_since(sim, before)
    assert record["dialect"] == MODELS[model][1]
    assert content == record["content"]
    event = one_event(proxy, token)
    assert event["id"] == raw.headers["x-request-id"]
    if model in ("gen-m25", "nim-m25") and stream:
        # Genesis and NIM streams carry no usage, asked or not: the proxy estimates it, and
        # ends the stream with the estimate it charged (the client asked for usage).
        assert record["usage"] is None
        assert usage is not None and usage.model_extra == {"usage_source": "estimated"}
        assert (usage.prompt_tokens, usage.completion_tokens) == (
            event["prompt_tokens"],
            event["completion_tokens"],
        )
        assert "stream_options" not in record["received"]
        assert event["usage_source"] == "estimated" and event["status"] == "ok"
        assert within(event["prompt_tokens"], record["prompt_tokens"])
        assert within(event["completion_tokens"], record["completion_tokens"])
        assert event["prompt_tokens"] == estimate_prompt_tokens({"messages": messages})
        assert event["completion_tokens"] == estimate_text_tokens(content)
        assert Decimal(event["cost"]) == cost_of(
            model, event["prompt_tokens"], 0, event["completion_tokens"]
        )
        return
    assert usage is not None and usage.completion_tokens == record["usage"]["completion_tokens"]
    assert_reported(event, record, model, stream)
    if MODELS[model][1] in ("openai", "tokenchange"):
        assert event["prompt_tokens_details"]["cached_tokens"] == 5


# --- estimation on the simulator's text ------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_estimate_is_within_15_percent_on_the_simulators_text(seed):
    rng = random.Random(seed)
    for n_tokens in (40, 120, 400, 1500):
        text = prose(f"seed-{seed}-{n_tokens}", n_tokens)
        assert count_tokens(text) == n_tokens
        assert within(estimate_text_tokens(text), n_tokens), (estimate_text_tokens(text), n_tokens)
    messages = [
        {"role": rng.choice(["system", "user", "assistant"]), "content": prose(str(i), 60 + i)}
        for i in range(rng.randint(2, 6))
    ]
    actual = count_prompt_tokens(messages)
    assert within(estimate_prompt_tokens({"messages": messages}), actual)


@pytest.mark.parametrize("tokens", [30, 200, 900])
def test_genesis_stream_estimate_is_within_15_percent_of_the_true_counts(
    api, sim, proxy, token, tokens
):
    client = proxy.openai(token["token"])
    messages = [
        {"role": "system", "content": prose("genesis system", 80)},
        {"role": "user", "content": f"{prose(f'q{tokens}', 50)} sim:tokens={tokens}"},
    ]
    before = len(sim_log(sim))
    chunks = list(client.chat.completions.create(model="gen-m25", messages=messages, stream=True))
    [record] = records_since(sim, before)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == record["content"] and record["completion_tokens"] == tokens
    event = one_event(proxy, token)
    assert event["usage_source"] == "estimated"
    assert within(event["prompt_tokens"], record["prompt_tokens"]), (event, record)
    assert within(event["completion_tokens"], record["completion_tokens"]), (event, record)


# --- Genesis -----------------------------------------------------------------------------------


def test_genesis_text_blocks_are_counted_and_metered(api, sim, proxy, token):
    client = proxy.openai(token["token"])
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "First block."},
                {"type": "text", "text": " Second block sim:tokens=9"},
            ],
        },
    ]
    before = len(sim_log(sim))
    raw = client.chat.completions.with_raw_response.create(model="gen-m25", messages=messages)
    completion = raw.parse()
    [record] = records_since(sim, before)
    assert record["received"]["messages"] == messages
    assert record["prompt_tokens"] == count_prompt_tokens(messages)
    assert completion.usage.completion_tokens == 9
    assert_reported(one_event(proxy, token), record, "gen-m25", stream=False)


def test_genesis_developer_role_goes_up_as_system(api, sim, proxy, token):
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Hello sim:tokens=4"},
    ]
    before = len(sim_log(sim))
    proxy.openai(token["token"]).chat.completions.create(model="gen-m25", messages=messages)
    [record] = records_since(sim, before)
    assert [m["role"] for m in record["received"]["messages"]] == ["system", "user"]


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "tool", "content": "x", "tool_call_id": "c1"}],
        [{"role": "user", "content": [{"type": "text", "text": ""}]}],
    ],
    ids=["tool-role", "empty-text-block"],
)
def test_genesis_refuses_what_its_document_does_not_allow_before_any_cost(
    api, sim, proxy, token, messages
):
    before = len(sim_log(sim))
    response = proxy.request(
        "POST",
        "/v1/chat/completions",
        key=token["token"],
        json={"model": "gen-m25", "messages": messages},
    )
    assert_error_shape(response, 400, "invalid_request")
    assert len(sim_log(sim)) == before
    assert proxy.events(token_id=token["id"]) == []


def test_genesis_error_reaches_the_client_in_the_openai_shape(api, sim, proxy, token):
    response = proxy.request(
        "POST",
        "/v1/chat/completions",
        key=token["token"],
        json={"model": "gen-m25", "messages": user("x sim:fault=http400")},
    )
    # Genesis' error has no `param` (and may lack `type`): the client still gets all four.
    error = assert_error_shape(response, 400, "invalid_request")
    assert error["message"] == "simulated fault http400"
    event = one_event(proxy, token)
    assert event["id"] == response.headers["x-request-id"]
    assert (event["status"], event["http_status"], Decimal(event["cost"])) == (
        "upstream_error",
        400,
        0,
    )


# --- TokenChange ----------------------------------------------------------------------------


def test_tokenchange_cached_tokens_are_charged_at_the_cached_price(api, sim, proxy, token):
    client = proxy.openai(token["token"])
    before = len(sim_log(sim))
    chunks = list(
        client.chat.completions.create(
            model="tc-m25",
            messages=user(f"{prose('cache me', 60)} sim:tokens=20 sim:cached=48"),
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    [record] = records_since(sim, before)
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens == 48 == record["cached_tokens"]
    event = one_event(proxy, token)
    assert_reported(event, record, "tc-m25", stream=True)
    prompt, completion = record["prompt_tokens"], record["completion_tokens"]
    exact = (
        Decimal(prompt - 48) * Decimal("0.30")
        + 48 * Decimal("0.03")
        + Decimal(completion) * Decimal("1.20")
    ) / 10**6
    assert Decimal(event["cost"]) == exact
    assert exact < cost_of("tc-m25", prompt, 0, completion)


def test_tokenchange_stream_without_include_usage_still_meters_reported_usage(
    api, sim, proxy, token
):
    before = len(sim_log(sim))
    response = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json={"model": "tc-m25", "messages": user("No usage for me sim:tokens=12"), "stream": True},
        headers={"authorization": f"Bearer {token['token']}"},
        timeout=30,
    )
    assert response.status_code == 200
    chunks = [json.loads(d) for d in data_of(response.content) if d != "[DONE]"]
    assert all(c.get("usage") is None for c in chunks)
    [record] = records_since(sim, before)
    assert record["received"]["stream_options"] == {"include_usage": True}
    assert_reported(one_event(proxy, token), record, "tc-m25", stream=True)


def test_tokenchange_non_streaming_request_is_streamed_up_and_answered_whole(
    api, sim, proxy, token
):
    before = len(sim_log(sim))
    raw = proxy.openai(token["token"]).chat.completions.with_raw_response.create(
        model="tc-m25", messages=user("Whole please sim:tokens=33 sim:cached=4 sim:chunks=7")
    )
    completion = raw.parse()
    [record] = records_since(sim, before)
    assert record["received"]["stream"] is True
    assert record["received"]["stream_options"] == {"include_usage": True}
    assert raw.headers["content-type"].startswith("application/json")
    assert completion.object == "chat.completion"
    assert completion.id == record["id"]
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content == record["content"]
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage.completion_tokens == 33
    assert completion.usage.prompt_tokens_details.cached_tokens == 4
    event = one_event(proxy, token)
    assert event["id"] == raw.headers["x-request-id"]
    assert_reported(event, record, "tc-m25", stream=False)


def test_tokenchange_error_mid_stream_is_relayed_then_done_and_delivered_output_billed(
    api, sim, proxy, token
):
    before = len(sim_log(sim))
    response = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json={
            "model": "tc-m25",
            "messages": user("Break sim:tokens=30 sim:fault=stream_error sim:fault_after=2"),
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        headers={"authorization": f"Bearer {token['token']}"},
        timeout=30,
    )
    assert response.status_code == 200
    data = data_of(response.content)
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2]) == {
        "error": {"message": "upstream stream interrupted", "type": "server_error"}
    }
    chunks = [json.loads(d) for d in data[:-2]]
    [record] = records_since(sim, before)
    assert record["completed"] is False and record["delivered_chunks"] == 2
    # What was delivered before the error: TokenChange reports it, and it is billed.
    assert chunks[-1]["usage"] == record["usage"]
    delivered = record["usage"]["completion_tokens"]
    assert 0 < delivered == record["delivered_completion_tokens"] < record["completion_tokens"]
    event = one_event(proxy, token)
    assert event["id"] == response.headers["x-request-id"]
    assert event["status"] == "stream_error" and event["usage_source"] == "reported"
    assert event["completion_tokens"] == delivered
    assert Decimal(event["cost"]) == cost_of("tc-m25", record["prompt_tokens"], 0, delivered) > 0


def test_tokenchange_error_mid_stream_with_the_sdk_raises_after_the_delivered_text(
    api, sim, proxy, token
):
    stream = proxy.openai(token["token"]).chat.completions.create(
        model="tc-m25",
        messages=user("Break again sim:tokens=30 sim:fault=stream_error"),
        stream=True,
    )
    received = []
    with pytest.raises(openai.APIError, match="upstream stream interrupted"):  # noqa: PT012 - raised while read
        for chunk in stream:
            received.append(chunk.choices[0].delta.content or "")
    assert "".join(received)
    assert one_event(proxy, token)["status"] == "stream_error"


def test_tokenchange_error_mid_stream_for_a_non_streaming_client(api, sim, proxy, token):
    before = len(sim_log(sim))
    response = proxy.request(
        "POST",
        "/v1/chat/completions",
        key=token["token"],
        json={
            "model": "tc-m25",
            "messages": user("Break whole sim:tokens=30 sim:fault=stream_error"),
        },
    )
    error = assert_error_shape(response, 502, "upstream_error")
    assert "upstream stream interrupted" in error["message"]
    [record] = records_since(sim, before)
    event = one_event(proxy, token)
    assert event["status"] == "stream_error" and event["stream"] is False
    delivered = record["usage"]["completion_tokens"]
    assert event["completion_tokens"] == delivered > 0
    assert Decimal(event["cost"]) == cost_of("tc-m25", record["prompt_tokens"], 0, delivered)


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
def test_tokenchange_endpoint_pin_passes_through(api, sim, proxy, token, stream):
    before = len(sim_log(sim))
    client = proxy.openai(token["token"])
    request = {"model": "tc-m25/ep/fast-eu", "messages": user("Pinned sim:tokens=6")}
    if stream:
        list(client.chat.completions.create(**request, stream=True))
    else:
        client.chat.completions.create(**request)
    [record] = records_since(sim, before)
    assert record["received"]["model"] == "minimax/minimax-m2.5/ep/fast-eu"
    assert record["received"]["model"].endswith("/ep/fast-eu")
    event = one_event(proxy, token)
    assert (event["model"], event["provider"]) == ("tc-m25", "d-tokenchange")
    assert event["upstream_model"] == "minimax/minimax-m2.5/ep/fast-eu"
    assert event["usage_source"] == "reported"


def test_endpoint_pin_on_a_provider_without_endpoints_is_refused(api, sim, proxy, token):
    before = len(sim_log(sim))
    response = proxy.request(
        "POST",
        "/v1/chat/completions",
        key=token["token"],
        json={"model": "oa-m25/ep/fast-eu", "messages": user("Pinned")},
    )
    assert_error_shape(response, 400, "invalid_request")
    assert len(sim_log(sim)) == before
    assert proxy.events(token_id=token["id"]) == []


# --- NVIDIA NIM -------------------------------------------------------------------------------


def test_nim_pending_result_is_polled_until_it_arrives(api, sim, proxy, token):
    before = len(sim_log(sim))
    raw = proxy.openai(token["token"]).chat.completions.with_raw_response.create(
        model="nim-m25", messages=user("Take your time sim:tokens=14 sim:pending=2")
    )
    assert raw.status_code == 200
    completion = raw.parse()
    [record] = records_since(sim, before)
    assert record["completed"] and record["status"] == 200
    assert completion.id == record["id"]
    assert completion.choices[0].message.content == record["content"]
    event = one_event(proxy, token)
    assert event["id"] == raw.headers["x-request-id"]
    assert_reported(event, record, "nim-m25", stream=False)


def test_nim_polling_is_bounded_by_the_providers_poll_timeout(api, sim, proxy, token):
    response = proxy.request(
        "POST",
        "/v1/chat/completions",
        key=token["token"],
        json={"model": SLOW_NIM[0], "messages": user("Never sim:pending=1000")},
    )
    assert_error_shape(response, 504, "upstream_timeout")
    event = one_event(proxy, token)
    assert event["id"] == response.headers["x-request-id"]
    assert event["status"] == "timeout" and Decimal(event["cost"]) == 0


def test_nim_problem_details_422_becomes_an_openai_error(api, sim, proxy, token):
    response = proxy.request(
        "POST",
        "/v1/chat/completions",
        key=token["token"],
        json={"model": "nim-m25", "messages": user("x sim:fault=nim422")},
    )
    error = assert_error_shape(response, 422, None)
    assert error["message"] == "simulated fault nim422"
    assert "urn:nvcf" not in response.text
    event = one_event(proxy, token)
    assert (event["status"], event["http_status"], Decimal(event["cost"])) == (
        "upstream_error",
        422,
        0,
    )


def test_nim_problem_details_500_becomes_an_openai_502(api, sim, proxy, token):
    response = proxy.request(
        "POST",
        "/v1/chat/completions",
        key=token["token"],
        json={"model": "nim-m25", "messages": user("x sim:fault=http500")},
    )
    error = assert_error_shape(response, 502, "upstream_error")
    assert "simulated fault http500" in error["message"]
    assert one_event(proxy, token)["http_status"] == 500


@pytest.mark.parametrize("role", ["system", "developer"])
def test_nim_first_system_message_is_folded_into_the_first_user_message(
    api, sim, proxy, token, role
):
    # NIM's role enum is user and assistant: a system message would be refused with 422.
    before = len(sim_log(sim))
    messages = [
        {"role": role, "content": "Be brief."},
        {"role": "user", "content": "Hi sim:tokens=3"},
    ]
    proxy.openai(token["token"]).chat.completions.create(model="nim-m25", messages=messages)
    [record] = records_since(sim, before)
    assert record["status"] == 200
    assert record["received"]["messages"] == [
        {"role": "user", "content": "Be brief.\n\nHi sim:tokens=3"}
    ]
    assert one_event(proxy, token)["status"] == "ok"


def test_nim_system_message_before_an_assistant_one_goes_up_as_a_user_message(
    api, sim, proxy, token
):
    before = len(sim_log(sim))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": "Ask me."},
        {"role": "user", "content": "Hi sim:tokens=3"},
    ]
    proxy.openai(token["token"]).chat.completions.create(model="nim-m25", messages=messages)
    [record] = records_since(sim, before)
    assert record["status"] == 200
    assert record["received"]["messages"] == [
        {"role": "user", "content": "Be brief."},
        {"role": "assistant", "content": "Ask me."},
        {"role": "user", "content": "Hi sim:tokens=3"},
    ]


@pytest.mark.parametrize(
    "change",
    [
        {"temperature": 1.5},
        {"temperature": -0.1},
        {"top_p": 0},
        {"max_tokens": 16385},
        {"max_completion_tokens": 20000},
        {"messages": [{"role": "tool", "content": "x", "tool_call_id": "c"}]},
        {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}]},
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        {"response_format": {"type": "json_object"}},
        {"n": 2},
        {"logprobs": True},
        {"stop": 5},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        {
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]},
            ]
        },
    ],
    ids=[
        "temp-high",
        "temp-low",
        "top-p-zero",
        "max-tokens",
        "max-completion",
        "tool",
        "sys-late",
        "tools",
        "response-format",
        "n",
        "logprobs",
        "stop",
        "image",
        "tool-calls",
    ],
)
def test_nim_documented_ranges_are_checked_before_any_cost(api, sim, proxy, token, change):
    before = len(sim_log(sim))
    body = {"model": "nim-m25", "messages": user("Hi"), **change}
    response = proxy.request("POST", "/v1/chat/completions", key=token["token"], json=body)
    assert_error_shape(response, 400, "invalid_request")
    assert len(sim_log(sim)) == before  # no upstream request
    assert proxy.events(token_id=token["id"]) == []  # no ledger event
    budget = proxy.ok("GET", f"/v1/tokens/{token['id']}/budget")
    assert Decimal(budget["spent"]) == Decimal(budget["reserved"]) == 0


def test_nim_edges_of_its_ranges_are_accepted(api, sim, proxy, token):
    before = len(sim_log(sim))
    proxy.openai(token["token"]).chat.completions.create(
        model="nim-m25",
        messages=[{"role": "system", "content": "S"}, *user("Edge sim:tokens=2")],
        temperature=1,
        top_p=1,
        max_tokens=16384,
    )
    [record] = records_since(sim, before)
    assert record["status"] == 200 and record["received"]["max_tokens"] == 16384


# --- what goes up is what each provider accepts ---------------------------------------------

# A request using much of the OpenAI API: each provider gets it in a shape it accepts.
RICH_MESSAGES = [
    {"role": "developer", "content": "Be brief."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "First part."}, {"type": "text", "text": " Second"}],
        "name": "ann",
    },
    {"role": "assistant", "content": "Earlier answer.", "tool_calls": [], "refusal": None},
    {"role": "user", "content": "And now? sim:tokens=7"},
]
RICH_PARAMS = {
    "temperature": 0.5,
    "top_p": 0.9,
    "max_completion_tokens": 50,
    "stop": ["END"],
    "seed": 7,
    "user": "u-1",
    "n": 1,
}
# What NIM's schema lets through: the rest left out, the system prompt folded, parts joined.
NIM_RICH_BODY = {
    "model": "minimaxai/minimax-m2.5",
    "messages": [
        {"role": "user", "content": "Be brief.\n\nFirst part. Second"},
        {"role": "assistant", "content": "Earlier answer."},
        {"role": "user", "content": "And now? sim:tokens=7"},
    ],
    "temperature": 0.5,
    "top_p": 0.9,
    "stop": ["END"],
    "max_tokens": 50,
}


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
@pytest.mark.parametrize("model", list(MODELS))
def test_what_the_proxy_sends_each_provider_is_accepted_by_it(
    api, sim, proxy, token, model, stream
):
    dialect = MODELS[model][1]
    body = {"model": model, "messages": RICH_MESSAGES, **RICH_PARAMS, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    before = len(sim_log(sim))
    response = proxy.request("POST", "/v1/chat/completions", key=token["token"], json=body)
    assert response.status_code == 200, response.text
    [record] = records_since(sim, before)
    assert record["status"] == 200 and record["completed"] is True
    received = record["received"]
    if dialect == "nim":
        assert received == {**NIM_RICH_BODY, "stream": stream}
    elif dialect == "openai":
        assert received["max_completion_tokens"] == 50 and "max_tokens" not in received
    else:
        # These document max_tokens only: the limit the hold was sized for is the one sent.
        assert received["max_tokens"] == 50 and "max_completion_tokens" not in received
    if dialect == "exascale":
        assert received["stream"] is stream
    event = one_event(proxy, token)
    assert (event["status"], event["http_status"], event["stream"]) == ("ok", 200, stream)
    estimated = stream and dialect in ("genesis", "nim")
    assert event["usage_source"] == ("estimated" if estimated else "reported")
    if estimated:
        assert event["completion_tokens"] == estimate_text_tokens(record["content"])
    else:
        assert (event["prompt_tokens"], event["completion_tokens"]) == (record["prompt_tokens"], 7)


def test_stream_options_of_a_non_streaming_request_are_not_sent_up(api, sim, proxy, token):
    # OpenAI refuses stream_options without a stream.
    before = len(sim_log(sim))
    body = {
        "model": "oa-m25",
        "messages": user("No stream sim:tokens=4"),
        "stream_options": {"include_usage": True},
    }
    response = proxy.request("POST", "/v1/chat/completions", key=token["token"], json=body)
    assert response.status_code == 200, response.text
    [record] = records_since(sim, before)
    assert record["status"] == 200 and "stream_options" not in record["received"]
    assert one_event(proxy, token)["completion_tokens"] == 4


def test_nim_stream_is_sent_without_stream_options_and_metered_from_an_estimate(
    api, sim, proxy, token
):
    before = len(sim_log(sim))
    stream = proxy.openai(token["token"]).chat.completions.create(
        model="nim-m25",
        messages=user("Stream me sim:tokens=30"),
        stream=True,
        stream_options={"include_usage": True},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    [record] = records_since(sim, before)
    assert record["status"] == 200 and record["completed"] is True
    assert record["received"] == {
        "model": "minimaxai/minimax-m2.5",
        "messages": user("Stream me sim:tokens=30"),
        "stream": True,
        "max_tokens": 16384,
    }
    assert text == record["content"]
    event = one_event(proxy, token)
    assert (event["status"], event["usage_source"]) == ("ok", "estimated")
    assert event["completion_tokens"] == estimate_text_tokens(text)
    assert event["prompt_tokens"] == estimate_prompt_tokens(
        {"messages": user("Stream me sim:tokens=30")}
    )


@pytest.mark.parametrize(
    "change",
    [
        {"top_k": 201},
        {"top_k": 1.5},
        {"repetition_penalty": 0},
        {"repetition_penalty": 2.5},
        {"messages": [{"role": "user"}]},
    ],
    ids=["top-k-high", "top-k-float", "repetition-zero", "repetition-high", "no-content"],
)
def test_exascale_documented_ranges_are_checked_before_any_cost(api, sim, proxy, token, change):
    before = len(sim_log(sim))
    body = {"model": "ex-m21", "messages": user("Hi"), **change}
    response = proxy.request("POST", "/v1/chat/completions", key=token["token"], json=body)
    assert_error_shape(response, 400, "invalid_request")
    assert len(sim_log(sim)) == before
    assert proxy.events(token_id=token["id"]) == []


def test_exascale_edges_of_its_ranges_are_accepted(api, sim, proxy, token):
    before = len(sim_log(sim))
    body = {
        "model": "ex-m21",
        "messages": user("Edge sim:tokens=2"),
        "top_k": -1,
        "repetition_penalty": 0.01,
    }
    response = proxy.request("POST", "/v1/chat/completions", key=token["token"], json=body)
    assert response.status_code == 200, response.text
    [record] = records_since(sim, before)
    assert record["status"] == 200
    assert (record["received"]["top_k"], record["received"]["stream"]) == (-1, False)


def test_a_nim_hold_without_max_tokens_is_sized_for_what_nim_takes(api, sim):
    """A catalog maximum above NIM's 16384 bounds nothing: the hold and the max_tokens sent
    are 16384, so a budget that covers 16384 output tokens is not clamped (and the header does
    not name a limit NIM was never sent); asking for more than 16384 is refused."""
    entry = {
        "name": "nim-big",
        "provider": "big-nim",
        "upstream_model": "minimaxai/minimax-m2.5",
        "input_usd_per_mtok": "1",
        "output_usd_per_mtok": "1",
        "max_output_tokens": 32768,
    }
    catalog = {
        "providers": {"big-nim": provider_entry(sim.base_url("nim"), "nim", **POLL)},
        "models": [entry],
    }
    with serving(api, catalog) as own:
        # 16384 output tokens and the prompt's bound fit in 0.02 USD; 32768 would not.
        _, _, token = own.principal(token_limit="0.02")
        body = {"model": "nim-big", "messages": user("Hi sim:tokens=3")}
        response = own.request("POST", "/v1/chat/completions", key=token["token"], json=body)
        assert response.status_code == 200, response.text
        assert "x-max-tokens-clamped" not in response.headers
        record = sim_record(sim, response.json()["id"])
        assert record["received"]["max_tokens"] == 16384
        refused = own.request(
            "POST", "/v1/chat/completions", key=token["token"], json={**body, "max_tokens": 16385}
        )
        error = assert_error_shape(refused, 400, "invalid_request")
        assert error["param"] == "max_tokens"
        assert error["message"] == "max_tokens 16385 is above the model's maximum of 16384"
