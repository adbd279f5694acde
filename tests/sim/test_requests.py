"""Each simulated provider refuses what its document says the real one refuses, with the
status and error body that document shows, and accepts what it says it takes."""

import httpx
import pytest

from metering.sim.app import SimServer

AUTH = {"Authorization": "Bearer test-key"}
HI = [{"role": "user", "content": "Hi."}]
SYSTEM_HI = [{"role": "system", "content": "Be brief."}, *HI]


@pytest.fixture(scope="module")
def sim():
    with SimServer() as server:
        yield server


@pytest.fixture
def http(sim):
    with httpx.Client(base_url=f"http://127.0.0.1:{sim.port}", headers=AUTH, timeout=5) as client:
        yield client


def post(http, dialect: str, body: dict) -> httpx.Response:
    return http.post(f"/{dialect}/v1/chat/completions", json=body)


def assert_nim_problem(response: httpx.Response, detail: str) -> None:
    """NIM's 422: the problem details of its OpenAPI `Errors` schema."""
    assert response.status_code == 422
    problem = response.json()
    assert set(problem) == {"type", "title", "status", "detail", "instance", "requestId"}
    assert problem["type"] == "urn:nvcf-worker-service:problem-details:unprocessable-entity"
    assert (problem["title"], problem["status"]) == ("Unprocessable Entity", 422)
    assert problem["detail"] == detail


def assert_openai_error(response: httpx.Response, message: str) -> None:
    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_request",
        }
    }


def assert_genesis_error(response: httpx.Response, message: str) -> None:
    """Genesis' documented error: message, type and code, no param."""
    assert response.status_code == 400
    assert response.json() == {
        "error": {"message": message, "type": "invalid_request", "code": "invalid_request"}
    }


# --- NVIDIA NIM: its OpenAPI schema -----------------------------------------------------------

NIM_REFUSED = {
    "stream-options": (
        {"stream": True, "stream_options": {"include_usage": True}},
        "stream_options: extra inputs are not permitted",
    ),
    "seed": ({"seed": 42}, "seed: extra inputs are not permitted"),
    "n": ({"n": 1}, "n: extra inputs are not permitted"),
    "max-completion-tokens": (
        {"max_completion_tokens": 10},
        "max_completion_tokens: extra inputs are not permitted",
    ),
    "tools": ({"tools": []}, "tools: extra inputs are not permitted"),
    "user": ({"user": "u1"}, "user: extra inputs are not permitted"),
    "system-role": ({"messages": SYSTEM_HI}, "messages[0].role: unsupported role 'system'"),
    "developer-role": (
        {"messages": [{"role": "developer", "content": "x"}, *HI]},
        "messages[0].role: unsupported role 'developer'",
    ),
    "tool-role": (
        {"messages": [*HI, {"role": "tool", "content": "x", "tool_call_id": "c"}]},
        "messages[1].role: unsupported role 'tool'",
    ),
    "message-name": (
        {"messages": [{"role": "user", "content": "Hi.", "name": "ann"}]},
        "messages[0].name: extra inputs are not permitted",
    ),
    "message-tool-calls": (
        {"messages": [*HI, {"role": "assistant", "content": None, "tool_calls": []}, *HI]},
        "messages[1].tool_calls: extra inputs are not permitted",
    ),
    "message-without-content": (
        {"messages": [{"role": "user"}]},
        "messages[0].content is required",
    ),
    "text-blocks": (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi."}]}]},
        "messages[0].content must be a string or null",
    ),
    "temperature-high": ({"temperature": 1.5}, "temperature must be a number in [0, 1]"),
    "temperature-low": ({"temperature": -0.1}, "temperature must be a number in [0, 1]"),
    "temperature-string": ({"temperature": "0.5"}, "temperature must be a number"),
    "top-p-zero": ({"top_p": 0}, "top_p must be a number in (0, 1]"),
    "frequency-penalty": (
        {"frequency_penalty": 2.5},
        "frequency_penalty must be a number in [-2, 2]",
    ),
    "presence-penalty": ({"presence_penalty": -3}, "presence_penalty must be a number in [-2, 2]"),
    "max-tokens-high": ({"max_tokens": 16385}, "max_tokens must be an integer in [1, 16384]"),
    "max-tokens-zero": ({"max_tokens": 0}, "max_tokens must be an integer in [1, 16384]"),
    "max-tokens-float": ({"max_tokens": 10.5}, "max_tokens must be an integer"),
    "max-tokens-bool": ({"max_tokens": True}, "max_tokens must be an integer"),
    "stream-string": ({"stream": "true"}, "stream must be a boolean"),
    "stop-number": ({"stop": 5}, "stop must be a string, a list of strings or null"),
    "model-number": ({"model": 5}, "model must be a string"),
}


@pytest.mark.parametrize("change", NIM_REFUSED.values(), ids=NIM_REFUSED.keys())
def test_nim_refuses_what_its_schema_does_not_allow_with_422(sim, http, change):
    update, detail = change
    before = len(sim.log())
    response = post(http, "nim", {"model": "minimaxai/minimax-m2.5", "messages": HI, **update})
    assert_nim_problem(response, detail)
    [record] = sim.log()[before:]
    assert record["status"] == 422 and record["usage"] is None


def test_nim_accepts_every_field_of_its_schema_at_the_edges_of_its_ranges(http):
    body = {
        "model": "minimaxai/minimax-m2.5",
        "messages": [
            {"role": "user", "content": "Hi. sim:tokens=5"},
            {"role": "assistant", "content": None},
            {"role": "user", "content": "Again. sim:tokens=5"},
        ],
        "temperature": 0,
        "top_p": 1,
        "frequency_penalty": -2,
        "presence_penalty": 2,
        "max_tokens": 16384,
        "stream": False,
        "stop": ["\n\n", "END"],
    }
    response = post(http, "nim", body)
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 5


def test_nim_model_is_optional_as_its_schema_gives_a_default(http):
    response = post(http, "nim", {"messages": HI, "temperature": 1, "max_tokens": 1})
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 1


# --- Genesis: its parameters table and documented error ---------------------------------------

GENESIS_REFUSED = {
    "no-model": ({"model": None}, "missing required parameter: model"),
    "no-messages": ({"messages": []}, "messages must be a non-empty list"),
    "developer-role": (
        {"messages": [{"role": "developer", "content": "x"}, *HI]},
        "messages[0].role: unsupported role 'developer'",
    ),
    "tool-role": (
        {"messages": [*HI, {"role": "tool", "content": "x"}]},
        "messages[1].role: unsupported role 'tool'",
    ),
    "empty-text-block": (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
        "messages[0].content[0].text must be nonempty text",
    ),
    "text-block-without-text": (
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "messages[0].content[0].text must be nonempty text",
    ),
    "untyped-block": (
        {"messages": [{"role": "user", "content": [{"text": "Hi."}]}]},
        "messages[0].content[0] must be an object with a type",
    ),
    "max-tokens-zero": ({"max_tokens": 0}, "max_tokens must be an integer of at least 1"),
    "max-tokens-string": ({"max_tokens": "64"}, "max_tokens must be an integer"),
    "temperature-string": ({"temperature": "hot"}, "temperature must be a number"),
    "stream-string": ({"stream": "yes"}, "stream must be a boolean"),
}


@pytest.mark.parametrize("change", GENESIS_REFUSED.values(), ids=GENESIS_REFUSED.keys())
def test_genesis_refuses_what_its_document_does_not_allow(http, change):
    update, message = change
    body = {"model": "MiniMax-M2.5", "messages": HI, **update}
    if update.get("model", "") is None:
        del body["model"]
    assert_genesis_error(post(http, "genesis", body), message)


def test_genesis_accepts_image_blocks_and_fields_it_does_not_list(http):
    # "Fields for image input and tool calls are not expanded here": they exist.
    content = [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
    ]
    body = {"model": "MiniMax-M2.5", "messages": [{"role": "user", "content": content}]}
    response = post(http, "genesis", {**body, "seed": 3, "max_tokens": 64})
    assert response.status_code == 200


# --- TokenChange: streams only ------------------------------------------------------------------

TOKENCHANGE_REFUSED = {
    "no-stream": ({"stream": None}, "stream must be true"),
    "stream-false": ({"stream": False}, "stream must be true"),
    "no-model": ({"model": None}, "missing required parameter: model"),
    "max-tokens-zero": ({"max_tokens": 0}, "max_tokens must be an integer of at least 1"),
    "temperature-high": ({"temperature": 2.5}, "temperature must be a number in [0, 2]"),
    "include-usage-string": (
        {"stream_options": {"include_usage": "yes"}},
        "stream_options.include_usage must be a boolean",
    ),
}


@pytest.mark.parametrize("change", TOKENCHANGE_REFUSED.values(), ids=TOKENCHANGE_REFUSED.keys())
def test_tokenchange_refuses_what_its_document_does_not_allow(http, change):
    update, message = change
    body = {"model": "minimax/minimax-m2.5", "messages": HI, "stream": True, **update}
    body = {key: value for key, value in body.items() if value is not None}
    assert_openai_error(post(http, "tokenchange", body), message)


def test_tokenchange_passes_other_openai_fields_to_the_endpoint(http):
    body = {
        "model": "minimax/minimax-m2.5",
        "messages": SYSTEM_HI,
        "stream": True,
        "top_p": 0.5,
        "seed": 1,
        "tools": [],
        "max_completion_tokens": 8,
    }
    assert post(http, "tokenchange", body).status_code == 200


# --- Exascale: its body parameters table ------------------------------------------------------

EXASCALE_REFUSED = {
    "top-k-high": ({"top_k": 201}, "top_k must be an integer in [-1, 200]"),
    "top-k-low": ({"top_k": -2}, "top_k must be an integer in [-1, 200]"),
    "top-k-float": ({"top_k": 1.5}, "top_k must be an integer"),
    "repetition-penalty-zero": (
        {"repetition_penalty": 0},
        "repetition_penalty must be a number in [0.01, 2]",
    ),
    "repetition-penalty-high": (
        {"repetition_penalty": 2.5},
        "repetition_penalty must be a number in [0.01, 2]",
    ),
    "temperature-high": ({"temperature": 2.1}, "temperature must be a number in [0, 2]"),
    "top-p-high": ({"top_p": 1.1}, "top_p must be a number in [0, 1]"),
    "presence-penalty": ({"presence_penalty": 3}, "presence_penalty must be a number in [-2, 2]"),
    "max-tokens-zero": ({"max_tokens": 0}, "max_tokens must be an integer of at least 1"),
    "message-without-content": (
        {"messages": [{"role": "user"}]},
        "messages[0].content is required",
    ),
    "stream-string": ({"stream": "true"}, "stream must be a boolean"),
}


@pytest.mark.parametrize("change", EXASCALE_REFUSED.values(), ids=EXASCALE_REFUSED.keys())
def test_exascale_refuses_what_its_document_does_not_allow(http, change):
    update, message = change
    body = {"model": "MiniMaxAI/MiniMax-M2.1", "messages": HI, "stream": False, **update}
    assert_openai_error(post(http, "exascale", body), message)


def test_exascale_accepts_its_documented_examples_and_range_edges(http):
    # The document's curl example: a developer message, and no `stream` at all.
    messages = [{"role": "developer", "content": "You are a helpful assistant."}, HI[0]]
    body = {"model": "MiniMaxAI/MiniMax-M2.1", "messages": messages}
    assert post(http, "exascale", body).status_code == 200
    edges = {"top_k": -1, "repetition_penalty": 0.01, "temperature": 2, "presence_penalty": -2}
    assert post(http, "exascale", {**body, **edges, "stream": False}).status_code == 200


# --- OpenAI: its API reference ----------------------------------------------------------------

OPENAI_REFUSED = {
    "unknown-field": ({"foo": 1}, "foo: extra inputs are not permitted"),
    "routing-field": (
        {"max_input_usd_per_mtok": "1"},
        "max_input_usd_per_mtok: extra inputs are not permitted",
    ),
    "stream-options-without-stream": (
        {"stream_options": {"include_usage": True}},
        "stream_options is only allowed when stream is true",
    ),
    "temperature-high": ({"temperature": 3}, "temperature must be a number in [0, 2]"),
    "n-zero": ({"n": 0}, "n must be an integer in [1, 128]"),
    "stream-string": ({"stream": "yes"}, "stream must be a boolean"),
    "unknown-role": (
        {"messages": [{"role": "robot", "content": "x"}]},
        "messages[0].role: unsupported role 'robot'",
    ),
    "content-number": (
        {"messages": [{"role": "user", "content": 5}]},
        "messages[0].content must be a string or a list",
    ),
}


@pytest.mark.parametrize("change", OPENAI_REFUSED.values(), ids=OPENAI_REFUSED.keys())
def test_openai_refuses_what_its_reference_does_not_allow(http, change):
    update, message = change
    body = {"model": "MiniMaxAI/MiniMax-M2.5", "messages": HI, **update}
    assert_openai_error(post(http, "openai", body), message)
