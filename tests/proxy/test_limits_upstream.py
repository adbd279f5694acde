"""An upstream cannot make one request cost this process without bound: an SSE event or line
longer than METERING_MAX_SSE_EVENT_BYTES, an answer longer than METERING_MAX_RESPONSE_BYTES and
one running past METERING_MAX_RESPONSE_S each end the answer with an OpenAI-shaped error and one
ledger event naming the limit, billed for what was delivered. A non-streaming answer cut after
its headers is billed for what arrived."""

import asyncio
import json
import uuid
from decimal import Decimal

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from metering.proxy.answer_bounds import partial_text
from metering.proxy.estimate import estimate_prompt_tokens, estimate_text_tokens
from metering.proxy.sse import SSEParser
from metering.testing import ServerThread
from tests.proxy.conftest import assert_error_shape, data_of, provider_entry, serving, sim_record

MAX_EVENT = 64 * 1024
MAX_BYTES = 256 * 1024
MAX_S = 3
PRICE_IN, PRICE_OUT = Decimal("0.15"), Decimal("0.60")
WORDS = "the ledger keeps every token that was delivered "


def chunk(text: str) -> bytes:
    body = {
        "id": "chatcmpl-hostile",
        "object": "chat.completion.chunk",
        "model": "hostile",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def completion_body(content: str) -> bytes:
    return json.dumps(
        {
            "id": "chatcmpl-hostile",
            "object": "chat.completion",
            "model": "hostile",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10},
        }
    ).encode()


BIG_BODY = completion_body(WORDS * (4 * MAX_BYTES // len(WORDS)))


async def huge_line():
    yield chunk("Hello there")
    piece = b"x" * 16384
    yield b"data: " + piece
    for _ in range(4 * MAX_EVENT // len(piece)):
        yield piece
    await asyncio.Event().wait()  # the line never ends


async def endless():
    while True:
        yield chunk(WORDS)
        await asyncio.sleep(0.05)


async def big_stream():
    for _ in range(4 * MAX_BYTES // 1024):
        yield chunk(WORDS * 20)
    yield b"data: [DONE]\n\n"


STREAMS = {"huge_line": huge_line, "endless": endless, "big_stream": big_stream}


async def chat(request: Request) -> Response:
    body = await request.json()
    behaviour = body["messages"][-1]["content"]
    if behaviour in STREAMS:
        return StreamingResponse(STREAMS[behaviour](), media_type="text/event-stream")
    return Response(BIG_BODY, media_type="application/json")


@pytest.fixture(scope="module")
def hostile():
    server = ServerThread(Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])]))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def proxy(api, hostile, sim):
    catalog = {
        "providers": {
            "hostile": provider_entry(f"{hostile.url}/v1", "openai", timeout_s=30),
            "sim": provider_entry(sim.base_url("openai"), "openai"),
        },
        "models": [
            {
                "name": name,
                "provider": provider,
                "upstream_model": "hostile",
                "input_usd_per_mtok": str(PRICE_IN),
                "output_usd_per_mtok": str(PRICE_OUT),
                # A hold above anything delivered here: the estimate is charged as it is.
                "max_output_tokens": 200_000,
            }
            for name, provider in (("hostile", "hostile"), ("gpt-sim", "sim"))
        ],
    }
    limits = {
        "max_sse_event_bytes": MAX_EVENT,
        "max_response_bytes": MAX_BYTES,
        "max_response_s": MAX_S,
    }
    with serving(api, catalog, **limits) as own:
        yield own


def ask(proxy, token: dict, text: str, stream: bool, model: str = "hostile") -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "stream": stream}
    return httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {token['token']}"},
        timeout=60,
    )


def the_event(proxy, token: dict, response: httpx.Response) -> dict:
    events = proxy.events(token_id=token["id"])
    assert len(events) == 1
    assert events[0]["id"] == response.headers["x-request-id"]
    budget = proxy.ok("GET", f"/v1/tokens/{token['id']}/budget")
    assert Decimal(budget["reserved"]) == 0
    assert Decimal(budget["spent"]) == Decimal(events[0]["cost"])
    return events[0]


def assert_billed_for(event: dict, text: str, body_text: str) -> None:
    prompt = estimate_prompt_tokens(
        {"model": "hostile", "messages": [{"role": "user", "content": body_text}]}
    )
    completion = estimate_text_tokens(text)
    assert event["usage_source"] == "estimated"
    assert (event["prompt_tokens"], event["completion_tokens"]) == (prompt, completion)
    assert completion > 0
    assert Decimal(event["cost"]) == (prompt * PRICE_IN + completion * PRICE_OUT) / 10**6


def streamed_text(raw: bytes) -> str:
    out = []
    for data in data_of(raw):
        chunk = json.loads(data)
        for choice in chunk.get("choices") or []:
            out.append(choice["delta"].get("content") or "")
    return "".join(out)


@pytest.mark.parametrize(
    ("behaviour", "status", "code"),
    [
        ("huge_line", "event_too_large", "upstream_event_too_large"),
        ("endless", "response_too_long", "upstream_response_too_long"),
        ("big_stream", "response_too_large", "upstream_response_too_large"),
    ],
)
def test_stream_past_a_limit_ends_with_an_error_event_and_no_done(proxy, behaviour, status, code):
    _, _, token = proxy.principal(token_limit="1")
    response = ask(proxy, token, behaviour, stream=True)
    assert response.status_code == 200
    data = data_of(response.content)
    assert "[DONE]" not in data
    error = json.loads(data[-1])["error"]
    assert (error["code"], error["type"]) == (code, "api_error")
    assert error["message"].startswith("provider hostile: ")
    assert len(response.content) <= MAX_BYTES + 1024
    relayed = response.content.rsplit(b"data: ", 1)[0]
    event = the_event(proxy, token, response)
    assert event["status"] == status
    assert_billed_for(event, streamed_text(relayed), behaviour)


def test_non_streaming_body_past_the_size_limit_is_a_502_billed_for_what_arrived(proxy):
    _, _, token = proxy.principal(token_limit="1")
    response = ask(proxy, token, "big_body", stream=False)
    error = assert_error_shape(response, 502, "upstream_response_too_large")
    assert str(MAX_BYTES) in error["message"]
    event = the_event(proxy, token, response)
    assert (event["status"], event["http_status"]) == ("response_too_large", 200)
    # Read up to the limit, not beyond: the content of the first MAX_BYTES bytes.
    arrived = BIG_BODY[:MAX_BYTES].decode().split('"content": "', 1)[1]
    assert_billed_for(event, arrived, "big_body")


def test_non_streaming_answer_cut_after_its_headers_is_billed_for_what_arrived(proxy, sim):
    _, _, token = proxy.principal(token_limit="1")
    text = f"Cut {uuid.uuid4().hex} sim:tokens=400 sim:fault=disconnect"
    response = ask(proxy, token, text, stream=False, model="gpt-sim")
    assert_error_shape(response, 502, "upstream_error")
    event = the_event(proxy, token, response)
    assert (event["status"], event["http_status"]) == ("upstream_disconnected", 200)
    [record] = [r for r in sim.log() if r["received"]["messages"][-1]["content"] == text]
    record = sim_record(sim, record["id"])
    # The sim sends the first half of the body: a prefix of the answer arrived.
    prompt = estimate_prompt_tokens(
        {"model": "gpt-sim", "messages": [{"role": "user", "content": text}]}
    )
    possible = {estimate_text_tokens(record["content"][:k]) for k in range(len(record["content"]))}
    assert event["completion_tokens"] in possible
    assert 0 < event["completion_tokens"] < estimate_text_tokens(record["content"])
    assert event["prompt_tokens"] == prompt
    assert event["usage_source"] == "estimated"


# --- the pieces ------------------------------------------------------------------------------


def test_sse_parser_stops_at_a_line_longer_than_the_limit_without_keeping_it():
    parser = SSEParser(max_event_bytes=1024)
    events = parser.feed(chunk("ok") + b"data: " + b"y" * 600)
    assert [e.data for e in events] == [json.loads(chunk("ok")[6:]) and chunk("ok")[6:-2].decode()]
    assert not parser.too_large
    assert parser.feed(b"y" * 600) == []
    assert parser.too_large
    assert parser.pending == b""
    assert parser.feed(b"\n\n" + chunk("later")) == []
    assert parser.flush() == []


def test_sse_parser_returns_the_events_before_a_complete_event_over_the_limit():
    parser = SSEParser(max_event_bytes=1024)
    big = b"data: " + b"z" * 2000 + b"\n\n"
    events = parser.feed(chunk("a") + chunk("b") + big + chunk("c"))
    assert [json.loads(e.data)["choices"][0]["delta"]["content"] for e in events] == ["a", "b"]
    assert parser.too_large


def test_partial_text_reads_the_generated_strings_of_a_cut_body():
    body = completion_body('He said "hi" \u00e9 and more text here')
    cut = body[: body.index(b"more") + 2]
    assert partial_text(cut) == 'He said "hi" \u00e9 and mo'
    escaped = b'{"choices": [{"message": {"content": "ab\\u00e'
    assert partial_text(escaped) == "ab"
    both = b'{"message": {"reasoning_content": "think", "reasoning": "think", "content": "x"}}'
    assert sorted(partial_text(both)) == sorted("thinkx")
