"""The clients users bring, each as its users configure it, against a live server on the
simulator's four dialects (issue 40): an answer and a stream (the client asking for stream
usage its own way) whose usage, as the client reports it, is the ledger event's; every request
metered once; the model name each shows, the upstream's or (response_model = "requested") the
one it asked for; a 402 the client raises as its own error without retrying (one refusal row); a
429 that clears, retried after its retry-after and then served; a refusal that waiting cannot
fix (rpm_limit 0), tried once."""

from datetime import timedelta

import httpx
import pytest

from metering.budgets.rates import window_of
from tests.clients.conftest import DIALECTS, refusals_after_marker
from tests.proxy.conftest import wait_events

PLAIN = "m-openai"
# The error each client raises for a 402 and for a 429 it gave up on: its own type.
ERRORS = {
    "openai-python": ("openai.APIStatusError", "openai.RateLimitError"),
    "langchain-openai": (
        "openai.APIStatusError",
        "langchain_openai.chat_models.base.OpenAIRateLimitError",
    ),
    "litellm": ("litellm.exceptions.APIError", "litellm.exceptions.RateLimitError"),
    "openai-agents": ("openai.APIStatusError", "openai.RateLimitError"),
    "llm": ("openai.APIStatusError", "openai.RateLimitError"),
    "openai-node": ("APIError", "RateLimitError"),
    "vercel-ai": ("AI_APICallError", "AI_RetryError"),
}
# The clients whose answer keeps the usage object whole (its usage_source too).
RAW_USAGE = ("openai-python", "openai-node")


def one_event(api, token: dict) -> dict:
    events = wait_events(api, token["id"], 1)
    assert len(events) == 1, events
    return events[0]


def ledger_usage(event: dict) -> dict:
    return {
        "prompt_tokens": event["prompt_tokens"],
        "completion_tokens": event["completion_tokens"],
        "total_tokens": event["total_tokens"],
    }


def reported(answer: dict) -> dict:
    """The counts the client reported (a client that gives no total: the sum)."""
    usage = dict(answer["usage"])
    if usage["total_tokens"] is None and None not in (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    ):
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return usage


@pytest.mark.parametrize("model", list(DIALECTS))
@pytest.mark.parametrize("op", ["text", "stream"])
def test_answer_and_usage_are_the_ledgers(api, proxy, client, model, op):
    token = api.principal()[2]
    answer = client.ask(op, token, model)
    assert answer["ok"], answer
    assert answer["text"]
    event = one_event(api, token)
    assert (event["model"], event["status"], event["stream"]) == (model, "ok", op == "stream")
    # Every client reports the usage the ledger charged, on every dialect: the provider's own
    # counts, or (a stream from a provider that sends none) the proxy's estimate.
    assert answer["usage"] is not None, answer
    assert reported(answer) == ledger_usage(event), (answer, event)
    # The openai SDKs keep the usage object's other fields: an estimate says it is one.
    if client.name in RAW_USAGE:
        assert answer["extra"].get("usage_source") == (
            "estimated" if event["usage_source"] == "estimated" else None
        ), (answer, event)


def test_a_spent_budget_is_the_clients_own_error_and_is_not_retried(api, proxy, client):
    token = api.principal(token_limit="0")[2]
    answer = client.ask("text", token, PLAIN)
    assert not answer["ok"], answer
    assert (answer["error"], answer["status"]) == (ERRORS[client.name][0], 402), answer
    rows = refusals_after_marker(api, proxy, token, PLAIN)
    assert [(r["http_status"], r["reason"]) for r in rows] == [(402, "budget")], rows
    assert api.events(token_id=token["id"]) == []


def test_a_refusal_waiting_cannot_fix_is_tried_once(api, proxy, client):
    token = api.principal()[2]
    api.ok("PATCH", f"/v1/tokens/{token['id']}", json={"rpm_limit": 0})
    answer = client.ask("text", token, PLAIN)
    assert not answer["ok"], answer
    assert answer["error"] == ERRORS[client.name][1], answer
    assert answer["status"] == 429, answer
    rows = refusals_after_marker(api, proxy, token, PLAIN)
    # The answer says a retry cannot help (x-should-retry: false, no retry-after): every client
    # tries once, but the Vercel AI SDK, which decides by the status alone (any 429 is retried,
    # maxRetries 2, 2 s then 4 s) and ends in AI_RetryError: docs/getting-started/clients.md
    # says so. Should it learn the header, this fails: then it tries once too.
    attempts = 3 if client.name == "vercel-ai" else 1
    assert [(r["http_status"], r["reason"]) for r in rows] == [(429, "rpm")] * attempts, rows
    if client.name == "vercel-ai":
        assert answer["attempts"] == 3, answer
    assert api.events(token_id=token["id"]) == []


def test_a_429_that_clears_is_retried_after_retry_after_and_served(api, proxy, client, clock):
    token = api.principal()[2]
    api.ok("PATCH", f"/v1/tokens/{token['id']}", json={"rpm_limit": 1})
    # The server's clock 2.5 s before its rate window ends: the one request the window allows
    # is spent here, the client's is refused with a retry-after of 2 or 3 s and, retried after
    # it, lands in the next window.
    _, end = window_of(clock.now())
    if end - clock.now() < timedelta(seconds=3):
        end += timedelta(seconds=60)
    clock.move_to(end - timedelta(seconds=2.5))
    spent = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        headers={"authorization": f"Bearer {token['token']}"},
        json={"model": PLAIN, "messages": [{"role": "user", "content": "hi sim:tokens=3"}]},
        timeout=30,
    )
    assert spent.status_code == 200, spent.text
    answer = client.ask("text", token, PLAIN)
    assert answer["ok"], answer
    events = wait_events(api, token["id"], 2)
    assert len(events) == 2, events
    # Exactly one refusal: the client waited what retry-after said before its one retry.
    rows = refusals_after_marker(api, proxy, token, PLAIN)
    assert [(r["http_status"], r["reason"]) for r in rows] == [(429, "rpm")], rows


# The clients that show the answer's model (the Agents SDK's result does not).
SHOWS_MODEL = ("openai-python", "langchain-openai", "litellm", "llm", "openai-node", "vercel-ai")


@pytest.mark.parametrize("op", ["text", "stream"])
@pytest.mark.parametrize("client", SHOWS_MODEL, indirect=True)
def test_the_model_a_client_shows_is_the_upstreams_or_the_one_it_asked_for(
    api, proxy, requested_proxy, client, op
):
    upstream = DIALECTS[PLAIN][2]
    token = api.principal()[2]
    # LiteLLM's stream names its chunks with the model it was asked for, whatever they say.
    shown = PLAIN if (client.name, op) == ("litellm", "stream") else upstream
    assert client.ask(op, token, PLAIN)["model"] == shown
    asked = client.ask(op, token, PLAIN, base_url=requested_proxy.url)
    assert asked["ok"], asked
    assert asked["model"] == PLAIN, asked
    # The ledger keeps the upstream's name either way.
    events = wait_events(api, token["id"], 2)
    assert [(e["model"], e["upstream_model"]) for e in events] == [(PLAIN, upstream)] * 2


# The clients that can stream without asking for usage (the others always ask).
ASKS_OR_NOT = ("openai-python", "langchain-openai", "openai-node")


@pytest.mark.parametrize("model", list(DIALECTS))
@pytest.mark.parametrize("client", ASKS_OR_NOT, indirect=True)
def test_a_stream_that_did_not_ask_for_usage_gets_none_and_is_metered_once(
    api, proxy, client, model
):
    token = api.principal()[2]
    answer = client.ask("stream_no_usage", token, model)
    assert answer["ok"], answer
    assert answer["text"] and answer["usage"] is None, answer
    event = one_event(api, token)
    assert (event["model"], event["status"], event["stream"]) == (model, "ok", True)


# The error each client raises for a 403 (a model outside the credential's allow-list).
FORBIDDEN = {
    "openai-python": "openai.PermissionDeniedError",
    "langchain-openai": "langchain_openai.chat_models.base.OpenAIPermissionDeniedError",
    "litellm": "litellm.exceptions.APIError",
    "openai-agents": "openai.PermissionDeniedError",
    "llm": "openai.PermissionDeniedError",
    "openai-node": "PermissionDeniedError",
    "vercel-ai": "AI_APICallError",
}


def test_a_model_outside_the_allow_list_is_tried_once(api, proxy, client):
    token = api.principal()[2]
    api.ok("PATCH", f"/v1/tokens/{token['id']}", json={"allowed_models": ["other-*"]})
    answer = client.ask("text", token, PLAIN)
    assert not answer["ok"], answer
    assert (answer["error"], answer["status"]) == (FORBIDDEN[client.name], 403), answer
    rows = refusals_after_marker(api, proxy, token, PLAIN)
    assert [(r["http_status"], r["reason"]) for r in rows] == [(403, "model")], rows
    assert api.events(token_id=token["id"]) == []
