"""The clients' Responses API models (the Agents SDK's OpenAIResponsesModel, the Vercel AI SDK's
openai.responses(...)) against POST /v1/responses, on the four dialects: the answer, and the
usage the client reports (from response.completed, on a stream) equal to the ledger event's.
"""

import httpx
import pytest

from tests.clients.conftest import DIALECTS, started
from tests.clients.test_matrix import ledger_usage, one_event, reported
from tests.proxy.conftest import wait_events


@pytest.fixture(scope="module")
def has_responses(proxy) -> None:
    paths = httpx.get(f"{proxy.url}/openapi.json", timeout=30).json()["paths"]
    if "/v1/responses" not in paths:
        pytest.skip("this server has no POST /v1/responses yet")


@pytest.mark.parametrize("model", list(DIALECTS))
@pytest.mark.parametrize("op", ["responses_text", "responses_stream"])
def test_a_responses_answer_and_its_usage_are_the_ledgers(
    api, proxy, has_responses, responses_client, model, op
):
    token = api.principal()[2]
    answer = responses_client.ask(op, token, model)
    assert answer["ok"], answer
    assert answer["text"]
    event = one_event(api, token)
    assert (event["model"], event["status"]) == (model, "ok")
    assert answer["usage"] is not None, answer
    assert reported(answer) == ledger_usage(event), (answer, event)


def test_an_agent_with_a_function_tool_runs_through_the_proxy(
    api, proxy, requested_proxy, has_responses, tmp_path_factory
):
    """The Agents SDK's OpenAIResponsesModel with a function tool: two model calls (the call,
    then the answer to its output), each one ledger event of the Responses API."""
    token = api.principal()[2]
    for agents in started("openai-agents", proxy, requested_proxy, tmp_path_factory):
        answer = agents.ask("responses_tool", token, "m-openai")
    assert answer["ok"], answer
    assert answer["extra"]["tool_outputs"] == ["sunny in sim"]
    assert answer["text"] and answer["extra"]["requests"] == 2
    events = wait_events(api, token["id"], 2)
    assert len(events) == 2 and {e["endpoint"] for e in events} == {"responses"}
    assert answer["usage"]["total_tokens"] == sum(e["total_tokens"] for e in events)
