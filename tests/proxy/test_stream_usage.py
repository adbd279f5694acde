"""What a client reads of its answer, end to end through the simulated upstream's dialects:

- the usage chunk a stream that asked for usage ends with when the upstream sent none (Genesis,
  NIM, a TokenChange stream cut mid-way): the ledger event's counts exactly, marked
  `usage_source`; never when not asked; never twice when the upstream sent its own;
- `response_model = "requested"` (global in the catalog, `upstream` per provider over it): the
  name the client asked for in `model` of bodies and chunks, every other byte as the same request
  gets with `upstream`, the ledger's `upstream_model` unchanged.
"""

import json
import re

import httpx
import openai
import pytest

from metering.settings import CatalogError, parse_catalog
from tests.proxy.conftest import data_of, provider_entry, serving, sim_log, user, wait_events

# model: (provider, dialect, upstream model); `r-` providers take the catalog's global
# response_model (requested), the others set `upstream` over it.
MODELS = {
    "oa": ("p-openai", "openai", "MiniMaxAI/MiniMax-M2.5"),
    "gen": ("p-genesis", "genesis", "MiniMax-M2.5"),
    "tc": ("p-tokenchange", "tokenchange", "minimax/minimax-m2.5"),
    "nim": ("p-nim", "nim", "minimaxai/minimax-m2.5"),
    "ex": ("p-exascale", "exascale", "MiniMaxAI/MiniMax-M2.1"),
    "oa-r": ("r-openai", "openai", "MiniMaxAI/MiniMax-M2.5"),
    "gen-r": ("r-genesis", "genesis", "MiniMax-M2.5"),
    "tc-r": ("r-tokenchange", "tokenchange", "minimax/minimax-m2.5"),
    "nim-r": ("r-nim", "nim", "minimaxai/minimax-m2.5"),
    "ex-r": ("r-exascale", "exascale", "MiniMaxAI/MiniMax-M2.1"),
}
POLL = {"poll_interval_s": 0.05, "poll_timeout_s": 5}
DETAILS = (
    "text_tokens",
    "reasoning_tokens",
    "audio_tokens",
    "image_tokens",
    "video_tokens",
    "accepted_prediction_tokens",
    "rejected_prediction_tokens",
)


def catalog(sim) -> dict:
    providers, models = {}, []
    for name, (provider, dialect, upstream) in MODELS.items():
        extra = POLL if dialect == "nim" else {}
        if provider.startswith("p-"):
            extra = {**extra, "response_model": "upstream"}
        providers[provider] = provider_entry(sim.base_url(dialect), dialect, **extra)
        models.append(
            {
                "name": name,
                "provider": provider,
                "upstream_model": upstream,
                "input_usd_per_mtok": "0.30",
                "output_usd_per_mtok": "1.20",
                "max_output_tokens": 16384,
            }
        )
    return {"response_model": "requested", "providers": providers, "models": models}


# The longest SSE event taken from an upstream: small, so that one long chunk passes it.
EVENT_BOUND = 2048


@pytest.fixture(scope="module")
def proxy(api, sim):
    with serving(api, catalog(sim), max_sse_event_bytes=EVENT_BOUND) as own:
        yield own


@pytest.fixture
def token(api):
    return api.principal()[2]


def post(proxy, token: dict, body: dict) -> httpx.Response:
    return httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {token['token']}"},
        timeout=30,
    )


def stream_body(model: str, text: str, include_usage: bool | None = True) -> dict:
    body = {"model": model, "messages": user(text), "stream": True}
    if include_usage is not None:
        body["stream_options"] = {"include_usage": include_usage}
    return body


def one_event(proxy, token: dict) -> dict:
    events = wait_events(proxy, token["id"], 1)
    assert len(events) == 1, events
    return events[0]


def ledger_usage(event: dict) -> dict:
    """The usage object a chunk of the proxy's own must carry for this event."""
    usage = {
        "prompt_tokens": event["prompt_tokens"],
        "completion_tokens": event["completion_tokens"],
        "total_tokens": event["total_tokens"],
        "prompt_tokens_details": event["prompt_tokens_details"],
    }
    details = {k: v for k, v in event["completion_tokens_details"].items() if v is not None}
    if details:
        usage["completion_tokens_details"] = details
    return {**usage, "usage_source": event["usage_source"]}


def usage_chunks(data: list[str]) -> list[dict]:
    chunks = [json.loads(d) for d in data if d != "[DONE]"]
    return [c for c in chunks if c.get("usage") is not None]


# --- the usage chunk -------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["gen", "nim"])
def test_stream_without_upstream_usage_ends_with_the_ledgers_usage(proxy, token, model):
    response = post(proxy, token, stream_body(model, "Count me sim:tokens=21 sim:chunks=5"))
    assert response.status_code == 200
    data = data_of(response.content)
    assert data[-1] == "[DONE]"
    last = json.loads(data[-2])
    event = one_event(proxy, token)
    assert event["id"] == response.headers["x-request-id"]
    assert (event["status"], event["usage_source"]) == ("ok", "estimated")
    assert last["usage"] == ledger_usage(event)
    assert last["usage"]["usage_source"] == "estimated"
    assert last["choices"] == [] and last["object"] == "chat.completion.chunk"
    first = json.loads(data[0])
    if model == "gen":
        # Genesis' chunks have no id, model or created: the event's id (its x-request-id), its
        # upstream model, and when it started.
        assert set(first) == {"object", "choices"}
        assert (last["id"], last["model"]) == (event["id"], event["upstream_model"])
        assert isinstance(last["created"], int)
    else:
        assert (last["id"], last["model"], last["created"]) == (
            first["id"],
            first["model"],
            first["created"],
        )
    assert usage_chunks(data) == [last]


def test_the_openai_sdk_reads_the_ledgers_usage_from_a_genesis_stream(proxy, token):
    client = proxy.openai(token["token"])
    raw = client.chat.completions.with_raw_response.create(
        model="gen",
        messages=user("SDK sim:tokens=17"),
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(raw.parse())
    event = one_event(proxy, token)
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        event["prompt_tokens"],
        event["completion_tokens"],
        event["total_tokens"],
    )
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert usage.model_extra == {"usage_source": "estimated"}


def test_a_stream_cut_mid_way_sends_the_ledgers_usage_before_its_error(proxy, token):
    body = stream_body("tc", "Cut sim:tokens=30 sim:fault=disconnect sim:fault_after=2")
    response = post(proxy, token, body)
    assert response.status_code == 200
    data = data_of(response.content)
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["error"]["code"] == "upstream_error"
    usage_chunk = json.loads(data[-3])
    event = one_event(proxy, token)
    assert (event["status"], event["usage_source"]) == ("upstream_disconnected", "estimated")
    assert event["completion_tokens"] > 0
    assert usage_chunk["usage"] == ledger_usage(event)
    assert usage_chunk["choices"] == [] and usage_chunk["id"] == event["upstream_id"]
    assert usage_chunks(data) == [usage_chunk]


def test_a_stream_cut_by_a_bound_sends_the_ledgers_usage_then_its_error_and_no_done(proxy, token):
    body = stream_body("oa", "Long sim:tokens=2000 sim:chunks=2")
    response = post(proxy, token, body)
    assert response.status_code == 200
    data = data_of(response.content)
    assert json.loads(data[-1])["error"]["code"] == "upstream_event_too_large"
    usage_chunk = json.loads(data[-2])
    event = one_event(proxy, token)
    assert event["status"] == "event_too_large"
    assert usage_chunk["usage"] == ledger_usage(event)
    assert usage_chunk["choices"] == [] and "[DONE]" not in data
    assert usage_chunks(data) == [usage_chunk]


def test_the_sdk_reads_the_usage_of_a_cut_stream_then_raises(proxy, token):
    stream = proxy.openai(token["token"]).chat.completions.create(
        model="tc",
        messages=user("Cut again sim:tokens=30 sim:fault=disconnect sim:fault_after=1"),
        stream=True,
        stream_options={"include_usage": True},
    )
    seen = []
    with pytest.raises(openai.APIError, match="ended early"):  # noqa: PT012 - raised while read
        for chunk in stream:
            seen.append(chunk)
    event = one_event(proxy, token)
    assert seen[-1].usage is not None and seen[-1].usage.total_tokens == event["total_tokens"]


@pytest.mark.parametrize("include_usage", [None, False])
@pytest.mark.parametrize("model", ["gen", "nim", "tc"])
def test_no_usage_chunk_when_the_client_did_not_ask(proxy, token, model, include_usage):
    text = "Quiet sim:tokens=12" + (" sim:fault=disconnect" if model == "tc" else "")
    response = post(proxy, token, stream_body(model, text, include_usage))
    assert response.status_code == 200
    data = data_of(response.content)
    assert usage_chunks(data) == []
    assert one_event(proxy, token)["usage_source"] in ("estimated", "reported")


@pytest.mark.parametrize("model", ["oa", "tc", "ex"])
def test_the_upstreams_usage_is_relayed_once_and_nothing_added(proxy, token, model):
    response = post(proxy, token, stream_body(model, "Reported sim:tokens=11 sim:reasoning=3"))
    assert response.status_code == 200
    [chunk] = usage_chunks(data_of(response.content))
    event = one_event(proxy, token)
    assert event["usage_source"] == "reported"
    assert "usage_source" not in chunk["usage"]
    assert chunk["usage"]["completion_tokens"] == event["completion_tokens"] == 11


# --- response_model = "requested" ------------------------------------------------------------

# Fields that differ between two answers to the same prompt.
VOLATILE = re.compile(
    rb'"(id|created)": ?("[^"]*"|\d+)|"sla_metrics": ?\{[^}]*\}|"ts_us": ?\d+|"ttft_ms": ?\d+'
)


def normal(raw: bytes) -> bytes:
    return VOLATILE.sub(b"", raw)


def renamed(raw: bytes, old: str, new: str) -> tuple[bytes, int]:
    """`raw` with every `"model": <old>` member's value made `new`, and how many there were."""
    member = re.compile(rb'("model": ?)' + re.escape(json.dumps(old).encode()))
    return member.subn(lambda m: m.group(1) + json.dumps(new).encode(), raw)


@pytest.mark.parametrize("model", ["oa", "gen", "tc", "nim", "ex"])
def test_requested_model_in_a_stream_changes_that_field_only(proxy, token, model):
    text = "Rename me sim:tokens=14 sim:chunks=4"
    upstream = post(proxy, token, stream_body(model, text, include_usage=None))
    requested = post(proxy, token, stream_body(f"{model}-r", text, include_usage=None))
    assert upstream.status_code == requested.status_code == 200
    data = data_of(upstream.content)
    name = json.loads(data[0]).get("model", "none")  # the upstream's own (Genesis: none)
    expected, count = renamed(normal(upstream.content), name, f"{model}-r")
    assert count == (0 if model == "gen" else len(data) - 1)  # every chunk's, not [DONE]
    assert normal(requested.content) == expected
    events = wait_events(proxy, token["id"], 2)
    assert {e["upstream_model"] for e in events} == {MODELS[model][2]}
    assert {e["model"] for e in events} == {model, f"{model}-r"}


@pytest.mark.parametrize("model", ["oa", "gen", "tc", "nim", "ex"])
def test_requested_model_in_a_body_changes_that_field_only(proxy, token, model):
    text = "Rename the body sim:tokens=9"
    upstream = post(proxy, token, {"model": model, "messages": user(text)})
    requested = post(proxy, token, {"model": f"{model}-r", "messages": user(text)})
    assert upstream.status_code == requested.status_code == 200
    assert requested.json()["model"] == f"{model}-r"
    expected, count = renamed(normal(upstream.content), upstream.json()["model"], f"{model}-r")
    assert count == 1
    assert normal(requested.content) == expected
    assert [e["upstream_model"] for e in wait_events(proxy, token["id"], 2)] == [
        MODELS[model][2]
    ] * 2


def test_requested_model_reaches_the_sdk_and_the_estimated_usage_chunk(proxy, sim, token):
    before = len(sim_log(sim))
    client = proxy.openai(token["token"])
    chunks = list(
        client.chat.completions.create(
            model="nim-r",
            messages=user("SDK rename sim:tokens=8"),
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert {c.model for c in chunks} == {"nim-r"}
    assert chunks[-1].usage is not None
    [record] = sim_log(sim)[before:]
    assert record["received"]["model"] == "minimaxai/minimax-m2.5"
    completion = client.chat.completions.create(model="oa-r", messages=user("Again sim:tokens=3"))
    assert completion.model == "oa-r"


# --- the setting -----------------------------------------------------------------------------


def test_response_model_is_global_and_per_provider_and_defaults_to_upstream():
    def providers(data: dict) -> dict[str, str]:
        entry = {"base_url": "http://127.0.0.1:1/v1", "dialect": "openai"}
        data = {**data, "providers": {"a": {**entry, **data.get("a", {})}, "b": entry}}
        data.pop("a", None)
        return {n: p.response_model for n, p in parse_catalog(data, environ={}).providers.items()}

    assert providers({}) == {"a": "upstream", "b": "upstream"}
    assert providers({"response_model": "requested"}) == {"a": "requested", "b": "requested"}
    assert providers({"response_model": "requested", "a": {"response_model": "upstream"}}) == {
        "a": "upstream",
        "b": "requested",
    }
    assert providers({"a": {"response_model": "requested"}}) == {"a": "requested", "b": "upstream"}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"response_model": "client"}, "^response_model must be one of upstream, requested$"),
        ({"response_model": 1}, "^response_model must be"),
        (
            {"providers": {"a": {"base_url": "http://x/v1", "response_model": "x"}}},
            "^providers.a.response_model must be one of upstream, requested$",
        ),
    ],
)
def test_response_model_takes_its_two_values_only(data, message):
    with pytest.raises(CatalogError, match=message):
        parse_catalog(data, environ={})
