"""The clients' Responses API models (the Agents SDK's OpenAIResponsesModel, the Vercel AI SDK's
openai.responses(...)) against POST /v1/responses, on the four dialects: the answer, and the
usage the client reports (from response.completed, on a stream) equal to the ledger event's.
Skipped while the server has no /v1/responses (it lands with the Responses API, issue 40)."""

import httpx
import pytest

from tests.clients.conftest import DIALECTS
from tests.clients.test_matrix import ledger_usage, one_event, reported


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
