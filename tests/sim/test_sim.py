"""The simulated upstream, served on loopback and spoken to by httpx and the openai SDK."""

import json
import time

import httpx
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from metering.settings import DIALECTS
from metering.sim.app import SimServer, SimSettings
from metering.sim.providers import PROVIDERS
from metering.sim.text import parse_directives, prose, split_chunks
from metering.sim.tokenizer import count_prompt_tokens, count_tokens

AUTH = {"Authorization": "Bearer test-key"}
SDK_DIALECTS = ("openai", "exascale", "genesis", "nim")


@pytest.fixture(scope="module")
def sim():
    with SimServer() as server:
        yield server


@pytest.fixture
def http(sim):
    with httpx.Client(base_url=f"http://127.0.0.1:{sim.port}", headers=AUTH, timeout=5) as client:
        yield client


def sdk(sim, dialect):
    return openai.OpenAI(base_url=sim.base_url(dialect), api_key="test-key", max_retries=0)


def user(text, dialect=None):
    """A system prompt and a question; NIM's schema has no system role, so just the question."""
    question = {"role": "user", "content": text}
    return (
        [question] if dialect == "nim" else [{"role": "system", "content": "Be brief."}, question]
    )


def chat_path(dialect):
    return f"/{dialect}/v1/chat/completions"


def sse_data(text):
    """The data of each event, comments skipped, whatever the line ends."""
    events = text.replace("\r\n", "\n").split("\n\n")
    return [
        line.removeprefix("data: ")
        for event in events
        for line in event.split("\n")
        if line.startswith("data: ")
    ]


def stream_chunks(http, dialect, body):
    response = http.post(chat_path(dialect), json={**body, "stream": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    data = sse_data(response.text)
    assert data[-1] == "[DONE]"
    return [json.loads(item) for item in data[:-1]]


def streamed_text(chunks, field="content"):
    return "".join(
        choice["delta"].get(field) or "" for chunk in chunks for choice in chunk["choices"]
    )


def record_of(sim, completion_id):
    (record,) = [record for record in sim.log() if record["id"] == completion_id]
    return record


def wait_for(predicate, timeout=2.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "the simulated upstream never got there"
        time.sleep(0.02)


# --- the answer -----------------------------------------------------------------------------


@given(st.text(max_size=40), st.integers(min_value=0, max_value=400))
def test_prose_has_exactly_the_asked_number_of_tokens(seed, n_tokens):
    assert count_tokens(prose(seed, n_tokens)) == n_tokens


@given(st.text(max_size=40), st.integers(1, 200), st.one_of(st.none(), st.integers(1, 50)))
def test_chunks_rejoin_to_the_text_and_keep_its_token_count(seed, n_tokens, chunks):
    text = prose(seed, n_tokens)
    pieces = split_chunks(text, chunks)
    assert "".join(pieces) == text
    assert sum(count_tokens(piece) for piece in pieces) == n_tokens


def test_prose_reads_like_sentences():
    text = prose("seed", 60)
    assert text[0].isupper() and text.endswith(".")
    assert all(2 <= len(word.strip(",.")) <= 10 for word in text.split())


def test_directives_are_read_from_the_text():
    directives = parse_directives("hi sim:tokens=7 sim:fault=disconnect sim:crlf=1 sim:x=2")
    assert (directives.tokens, directives.fault, directives.crlf) == (7, "disconnect", True)
    assert directives.reasoning == 0 and directives.chunks is None


# --- every dialect --------------------------------------------------------------------------


@pytest.mark.parametrize("dialect", SDK_DIALECTS)
def test_completion_usage_equals_the_tokenizer_counts(sim, dialect):
    messages = user(f"Tell me about rivers in {dialect}. sim:tokens=31", dialect)
    completion = sdk(sim, dialect).chat.completions.create(model="m", messages=messages)
    content = completion.choices[0].message.content
    assert completion.usage.prompt_tokens == count_prompt_tokens(messages)
    assert completion.usage.completion_tokens == count_tokens(content) == 31
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 31
    assert completion.choices[0].finish_reason == "stop"
    assert record_of(sim, completion.id)["content"] == content


@pytest.mark.parametrize("dialect", SDK_DIALECTS)
def test_stream_carries_the_same_answer_as_the_completion(sim, dialect):
    messages = user("Describe a market. sim:tokens=20", dialect)
    client = sdk(sim, dialect)
    completion = client.chat.completions.create(model="m", messages=messages)
    # NIM's schema has no stream_options: its streams never carry usage.
    options = {} if dialect == "nim" else {"stream_options": {"include_usage": True}}
    stream = client.chat.completions.create(model="m", messages=messages, stream=True, **options)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == completion.choices[0].message.content
    usage = [chunk.usage for chunk in chunks if chunk.usage]
    if dialect in ("genesis", "nim"):
        assert usage == []
    else:
        assert usage == [completion.usage]


def test_tokenchange_streams_with_the_sdk(sim):
    messages = user("Name a village. sim:tokens=12 sim:cached=5")
    stream = sdk(sim, "tokenchange").chat.completions.create(
        model="m", messages=messages, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert count_tokens(text) == usage.completion_tokens == 12
    assert usage.prompt_tokens == count_prompt_tokens(messages)
    assert usage.prompt_tokens_details.cached_tokens == 5
    assert chunks[0].choices[0].delta.role == "assistant"


@pytest.mark.parametrize("dialect", ["openai", "tokenchange", "nim"])
def test_stream_has_no_usage_unless_asked(http, dialect):
    chunks = stream_chunks(http, dialect, {"model": "m", "messages": user("Hi.", dialect)})
    assert all(chunk.get("usage") is None for chunk in chunks)


def test_max_tokens_cuts_the_answer_with_finish_reason_length(sim):
    messages = user("Talk at length. sim:tokens=50")
    completion = sdk(sim, "openai").chat.completions.create(
        model="m", messages=messages, max_tokens=9
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == count_tokens(completion.choices[0].message.content)
    assert completion.usage.completion_tokens == 9


def test_max_completion_tokens_counts_reasoning_too(http):
    body = {
        "model": "m",
        "messages": user("Think. sim:tokens=50 sim:reasoning=6"),
        "max_completion_tokens": 10,
    }
    answer = http.post(chat_path("openai"), json=body).json()
    message, usage = answer["choices"][0]["message"], answer["usage"]
    assert answer["choices"][0]["finish_reason"] == "length"
    assert count_tokens(message["reasoning_content"]) == 6
    assert count_tokens(message["content"]) == 4
    assert usage["completion_tokens"] == 10
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 6


def test_the_same_prompt_gets_the_same_answer(http):
    body = {"model": "m", "messages": user("Same question, same answer.")}
    first = http.post(chat_path("openai"), json=body).json()
    second = http.post(chat_path("exascale"), json=body).json()
    assert first["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]
    assert first["id"] != second["id"]


def test_chunks_directive_sets_the_number_of_content_chunks(http):
    body = {"model": "m", "messages": user("sim:tokens=20 sim:chunks=4")}
    chunks = stream_chunks(http, "openai", body)
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) == 4


def test_crlf_and_comments_still_parse_with_the_sdk(sim, http):
    messages = user("Parse me. sim:crlf=1 sim:comments=1")
    raw = http.post(chat_path("openai"), json={"model": "m", "messages": messages, "stream": True})
    assert "\r\n\r\n" in raw.text and ": keep-alive" in raw.text
    completion = sdk(sim, "openai").chat.completions.create(model="m", messages=messages)
    stream = sdk(sim, "openai").chat.completions.create(model="m", messages=messages, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == completion.choices[0].message.content


def test_every_dialect_has_a_simulated_provider():
    assert tuple(PROVIDERS) == DIALECTS


def test_models_lists_in_the_openai_shape(sim):
    models = sdk(sim, "nim").models.list()
    assert [model.id for model in models.data] == ["minimaxai/minimax-m2.5"]


def test_a_request_without_bearer_is_refused(sim):
    response = httpx.post(sim.base_url("openai") + "/chat/completions", json={})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


# --- exascale -------------------------------------------------------------------------------


def test_exascale_completion_has_the_documented_shape(http):
    messages = [
        {"role": "developer", "content": "You are a helpful assistant."},
        {"role": "user", "content": "hello sim:reasoning=8"},
    ]
    body = {"model": "MiniMaxAI/MiniMax-M2.1", "messages": messages}
    answer = http.post(chat_path("exascale"), json=body).json()
    message, usage = answer["choices"][0]["message"], answer["usage"]
    assert answer["model"] == "minimax/minimax-m2.1"
    assert answer["system_fingerprint"] == ""
    assert message["name"] == "MiniMax AI"
    assert message["reasoning_details"][0]["text"] == message["reasoning_content"]
    assert usage["prompt_tokens_details"] is None
    assert usage["completion_tokens_details"] == {
        "text_tokens": 0,
        "reasoning_tokens": 8,
        "audio_tokens": 0,
        "image_tokens": 0,
        "video_tokens": 0,
        "accepted_prediction_tokens": 0,
        "rejected_prediction_tokens": 0,
    }
    assert (
        usage["completion_tokens"]
        == 24
        == (count_tokens(message["content"]) + count_tokens(message["reasoning_content"]))
    )


def test_exascale_stream_always_ends_with_usage_and_sla_metrics(http):
    body = {"model": "MiniMaxAI/MiniMax-M2.1", "messages": user("hello sim:reasoning=5")}
    chunks = stream_chunks(http, "exascale", body)
    assert all(set(chunk["sla_metrics"]) == {"ttft_ms", "ts_us"} for chunk in chunks)
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == 5
    assert "reasoning_details" in chunks[0]["choices"][0]["delta"]
    assert count_tokens(streamed_text(chunks, "reasoning_content")) == 5


# --- genesis --------------------------------------------------------------------------------


def test_genesis_counts_text_blocks(sim):
    blocks = [{"type": "text", "text": "Reply with OK."}, {"type": "text", "text": " Thanks"}]
    messages = [{"role": "user", "content": blocks}]
    completion = sdk(sim, "genesis").chat.completions.create(model="m", messages=messages)
    assert completion.usage.prompt_tokens == count_prompt_tokens(messages)
    assert record_of(sim, completion.id)["received"]["messages"] == messages


def test_genesis_missing_model_answers_the_documented_error(http):
    response = http.post(chat_path("genesis"), json={"messages": user("Hi.")})
    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "message": "missing required parameter: model",
            "type": "invalid_request",
            "code": "invalid_request",
        }
    }


def test_genesis_stream_has_no_id_and_no_usage_even_when_asked(http):
    body = {"model": "m", "messages": user("Hi."), "stream_options": {"include_usage": True}}
    chunks = stream_chunks(http, "genesis", body)
    assert all("id" not in chunk and "usage" not in chunk for chunk in chunks)
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "stop"}


# --- tokenchange ----------------------------------------------------------------------------


def test_tokenchange_rejects_a_request_that_does_not_stream(http):
    response = http.post(chat_path("tokenchange"), json={"model": "m", "messages": user("Hi.")})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "stream must be true"


def test_tokenchange_accepts_a_pinned_endpoint(sim, http):
    body = {"model": "minimax/minimax-m2.5/ep/fast", "messages": user("Hi.")}
    chunks = stream_chunks(http, "tokenchange", body)
    assert chunks[0]["model"] == "minimax/minimax-m2.5/ep/fast"
    assert record_of(sim, chunks[0]["id"])["received"]["model"] == body["model"]


# --- nim ------------------------------------------------------------------------------------


def test_nim_pending_answers_202_then_the_result_when_polled(sim, http):
    body = {"model": "minimaxai/minimax-m2.5", "messages": user("Wait. sim:pending=2", "nim")}
    first = http.post(chat_path("nim"), json=body)
    assert first.status_code == 202 and first.json() == {}
    request_id = first.headers["nvcf-reqid"]
    status_path = f"/nim/v2/nvcf/pexec/status/{request_id}"
    second = http.get(status_path)
    assert second.status_code == 202
    assert second.headers["nvcf-status"] == "pending-evaluation"
    third = http.get(status_path)
    assert third.status_code == 200
    record = record_of(sim, third.json()["id"])
    assert record["completed"] and record["usage"] == third.json()["usage"]
    assert http.get(status_path).status_code == 404


def test_nim_pending_polls_setting_applies_to_every_request():
    with (
        SimServer(SimSettings(nim_pending_polls=1)) as server,
        httpx.Client(headers=AUTH) as http,
    ):
        url = server.base_url("nim") + "/chat/completions"
        first = http.post(url, json={"messages": user("Hi.", "nim")})
        assert first.status_code == 202
        status_url = f"http://127.0.0.1:{server.port}/nim/v2/nvcf/pexec/status/"
        result = http.get(status_url + first.headers["nvcf-reqid"])
        assert result.status_code == 200
        prompt_tokens = count_prompt_tokens(user("Hi.", "nim"))
        assert result.json()["usage"]["prompt_tokens"] == prompt_tokens


def test_nim_stream_has_no_usage(http):
    chunks = stream_chunks(http, "nim", {"messages": user("Hi.", "nim")})
    assert all("usage" not in chunk for chunk in chunks)
    assert count_tokens(streamed_text(chunks)) == 24


# --- faults ---------------------------------------------------------------------------------


def test_http500_answers_an_openai_error(http):
    response = http.post(
        chat_path("openai"), json={"model": "m", "messages": user("sim:fault=http500")}
    )
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"


def test_http500_on_nim_answers_problem_details(http):
    response = http.post(chat_path("nim"), json={"messages": user("sim:fault=http500", "nim")})
    assert response.status_code == 500
    assert response.json()["title"] == "Internal Server Error"


def test_http429_says_when_to_retry(http):
    body = {"model": "m", "messages": user("sim:fault=http429")}
    response = http.post(chat_path("exascale"), json=body)
    assert response.status_code == 429 and response.headers["retry-after"] == "1"


def test_http400_uses_the_dialect_error_shape(http):
    response = http.post(
        chat_path("genesis"), json={"model": "m", "messages": user("sim:fault=http400")}
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request"


def test_nim422_fault(http):
    response = http.post(chat_path("nim"), json={"messages": user("sim:fault=nim422", "nim")})
    assert response.status_code == 422 and response.json()["status"] == 422


def test_timeout_hangs_until_the_client_gives_up(sim, http):
    body = {"model": "m", "messages": user("sim:fault=timeout")}
    with pytest.raises(httpx.ReadTimeout):
        http.post(chat_path("openai"), json=body, timeout=0.3)
    record = sim.log()[-1]
    assert record["fault"] == "timeout" and not record["completed"]


def test_malformed_completion_is_cut_json(http):
    body = {"model": "m", "messages": user("sim:fault=malformed")}
    response = http.post(chat_path("openai"), json=body)
    assert response.status_code == 200 and response.text == '{"id": "x", "choices": ['


def test_malformed_stream_has_a_bad_second_event_then_carries_on(sim, http):
    body = {"model": "m", "messages": user("sim:fault=malformed"), "stream": True}
    data = sse_data(http.post(chat_path("openai"), json=body).text)
    assert data[1] == "{not json" and data[-1] == "[DONE]"
    chunks = [json.loads(item) for item in data[:1] + data[2:-1]]
    record = record_of(sim, chunks[0]["id"])
    assert streamed_text(chunks) == record["content"] and record["completed"]


def test_disconnect_fault_drops_a_stream_after_fault_after_chunks(sim, http):
    body = {
        "model": "m",
        "messages": user("sim:fault=disconnect sim:fault_after=3"),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    received = []
    with (  # noqa: PT012 - the stream breaks as it is read
        pytest.raises(httpx.RemoteProtocolError),
        http.stream("POST", chat_path("openai"), json=body) as response,
    ):
        for line in response.iter_lines():
            received.append(line)
    record = sim.log()[-1]
    assert record["delivered_chunks"] == 3 and not record["completed"]
    assert record["usage"] is None
    assert "data: [DONE]" not in received


def test_disconnect_fault_drops_a_completion_midway(sim, http):
    body = {"model": "m", "messages": user("sim:fault=disconnect", "nim")}
    with pytest.raises(httpx.RemoteProtocolError):
        http.post(chat_path("nim"), json=body)
    assert sim.log()[-1]["completed"] is False


def test_stream_error_sends_an_error_event_then_done(sim, http):
    body = {"model": "m", "messages": user("sim:fault=stream_error"), "stream": True}
    data = sse_data(http.post(chat_path("openai"), json=body).text)
    assert json.loads(data[-2]) == {
        "error": {"message": "upstream stream interrupted", "type": "server_error"}
    }
    assert data[-1] == "[DONE]"
    record = sim.log()[-1]
    assert record["delivered_chunks"] == 2 and not record["completed"]


def test_tokenchange_bills_what_was_delivered_before_a_stream_error(sim, http):
    body = {
        "model": "m",
        "messages": user("sim:fault=stream_error sim:fault_after=3 sim:reasoning=4"),
        "stream_options": {"include_usage": True},
    }
    chunks = stream_chunks(http, "tokenchange", body)
    usage, error = chunks[-2]["usage"], chunks[-1]
    delivered = streamed_text(chunks[:-2]) + streamed_text(chunks[:-2], "reasoning_content")
    assert error["error"]["type"] == "server_error"
    assert usage["completion_tokens"] == count_tokens(delivered) < 24
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 4}
    assert record_of(sim, chunks[0]["id"])["usage"] == usage


def test_unknown_fault_is_refused(http):
    response = http.post(
        chat_path("openai"), json={"model": "m", "messages": user("sim:fault=nope")}
    )
    assert response.status_code == 400


# --- the log --------------------------------------------------------------------------------


def test_log_records_a_completed_stream(sim, http):
    headers = {"x-trace": "abc"}
    body = {
        "model": "m",
        "messages": user("Log me. sim:cached=3 sim:reasoning=2"),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = http.post(chat_path("openai"), json=body, headers=headers)
    chunks = [json.loads(item) for item in sse_data(response.text)[:-1]]
    record = record_of(sim, chunks[0]["id"])
    assert record["dialect"] == "openai" and record["received"] == body
    assert record["headers"]["x-trace"] == "abc" and "authorization" not in record["headers"]
    assert record["stream"] and record["completed"] and record["fault"] is None
    assert record["usage"] == chunks[-1]["usage"]
    assert (record["cached_tokens"], record["reasoning_tokens"]) == (3, 2)
    assert record["prompt_tokens"] == count_prompt_tokens(body["messages"])
    assert record["completion_tokens"] == 24
    assert record["content"] == streamed_text(chunks)
    assert record["reasoning"] == streamed_text(chunks, "reasoning_content")
    assert record["delivered_chunks"] == sum(
        1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")
    )


def test_log_endpoint_serves_the_log_and_delete_clears_it(sim, http):
    http.post(chat_path("openai"), json={"model": "m", "messages": user("Hi.")})
    assert http.get("/_sim/log").json() == sim.log()
    assert http.delete("/_sim/log").status_code == 204
    assert sim.log() == []


def test_client_going_away_mid_stream_is_recorded_as_incomplete(sim, http):
    body = {"model": "m", "messages": user("sim:tokens=12 sim:delay_ms=150"), "stream": True}
    with http.stream("POST", chat_path("openai"), json=body) as response:
        content_chunks = 0
        for line in response.iter_lines():
            if line.startswith("data: ") and '"content": "' in line and '"content": ""' not in line:
                content_chunks += 1
            if content_chunks == 2:
                break
    time.sleep(0.8)  # by now an unnoticed client would have had the whole stream
    record = sim.log()[-1]
    assert record["delivered_chunks"] == 2
    assert record["completed"] is False
