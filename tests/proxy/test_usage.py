import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metering.ledger.charge import Usage
from metering.proxy.estimate import estimate_text_tokens
from metering.proxy.reported import (
    COUNT_CEILING,
    StreamObserver,
    is_usage_only_chunk,
    parse_json_object,
    summarize_completion,
    usage_from_json,
)


def test_full_usage_object():
    usage = usage_from_json(
        {
            "prompt_tokens": 100,
            "completion_tokens": 50,
            "total_tokens": 150,
            "prompt_tokens_details": {"cached_tokens": 40, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": 20,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 3,
                "rejected_prediction_tokens": 1,
            },
        }
    )
    assert usage == Usage(
        prompt_tokens=100,
        completion_tokens=50,
        total_tokens=150,
        cached_tokens=40,
        reasoning_tokens=20,
        audio_tokens=0,
        accepted_prediction_tokens=3,
        rejected_prediction_tokens=1,
    )
    assert usage.text_tokens is None and usage.image_tokens is None


def test_usage_parsing_never_trusts_a_count_blindly():
    assert usage_from_json(None) is None
    assert usage_from_json([1, 2]) is None
    assert usage_from_json({}) is None
    assert usage_from_json({"total_tokens": 5}) is None  # neither prompt nor completion
    # Unusable: the ledger estimates instead.
    for bad in (
        {"prompt_tokens": "10", "completion_tokens": 2},
        {"prompt_tokens": True, "completion_tokens": 1},
        {"prompt_tokens": 9, "completion_tokens": -500},
        {"prompt_tokens": 9, "completion_tokens": 2.5},
        {"prompt_tokens": 9, "completion_tokens": float("inf")},
        {"prompt_tokens": [9], "completion_tokens": 1},
    ):
        usage = usage_from_json(bad)
        assert usage == Usage(anomaly="invalid_count") and not usage.usable, bad
    for missing in ({"prompt_tokens": 10}, {"prompt_tokens": 10, "completion_tokens": None}):
        assert usage_from_json(missing) == Usage(anomaly="missing_count")
    # Integral floats are whole numbers.
    assert usage_from_json({"prompt_tokens": 10.0, "completion_tokens": 2}) == Usage(
        prompt_tokens=10, completion_tokens=2, total_tokens=12
    )
    # A broken detail or total is dropped and flagged; the counts that matter are still used.
    usage = usage_from_json(
        {
            "prompt_tokens": 10,
            "completion_tokens": 0,
            "total_tokens": "x",
            "prompt_tokens_details": None,
            "completion_tokens_details": {"reasoning_tokens": False, "text_tokens": -3},
        }
    )
    assert usage == Usage(prompt_tokens=10, total_tokens=10, anomaly="invalid_detail")
    assert usage.usable


def test_counts_above_the_ceiling_are_kept_at_the_ceiling():
    for huge in (10**12, 10**20, 10**400, 1e300):
        usage = usage_from_json({"prompt_tokens": huge, "completion_tokens": 5})
        assert usage == Usage(
            prompt_tokens=COUNT_CEILING,
            completion_tokens=5,
            total_tokens=COUNT_CEILING + 5,
            anomaly="count_above_ceiling",
        )
        assert usage.usable


def test_inconsistent_details_are_flagged_and_kept():
    usage = usage_from_json(
        {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 9}, "completion_tokens": 1}
    )
    assert usage.cached_tokens == 9 and usage.anomaly == "cached_above_prompt"
    usage = usage_from_json(
        {"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": {"audio_tokens": 6}}
    )
    assert usage.anomaly == "details_above_prompt"
    usage = usage_from_json(
        {
            "prompt_tokens": 5,
            "completion_tokens": 4,
            "completion_tokens_details": {"reasoning_tokens": 5, "accepted_prediction_tokens": 4},
        }
    )
    assert usage.reasoning_tokens == 5 and usage.anomaly == "details_above_completion"
    usage = usage_from_json(
        {"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": -1}}
    )
    assert usage.cached_tokens == 0 and usage.anomaly == "invalid_detail"


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
        lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
    )
)
def test_usage_from_json_never_raises(obj):
    usage_from_json(obj)
    if isinstance(obj, dict):
        obj = {"usage": obj, "choices": obj}
    summarize_completion(json.dumps(obj).encode())
    StreamObserver().observe(json.dumps(obj))


def test_parse_json_object():
    assert parse_json_object('{"a": 1}') == {"a": 1}
    assert parse_json_object(b'{"a": 1}') == {"a": 1}
    assert parse_json_object("[1]") is None
    assert parse_json_object("nope") is None
    assert parse_json_object("[" * 100_000) is None
    assert parse_json_object(b"\xff{") is None
    # Invalid UTF-8 inside a string does not hide the rest of the document.
    assert parse_json_object(b'{"a": "\xff\xfe", "n": 1}') == {"a": "\ufffd\ufffd", "n": 1}
    # An integer beyond Python's conversion limit reads as one above the count ceiling.
    assert parse_json_object('{"n": ' + "9" * 5000 + "}") == {"n": COUNT_CEILING + 1}
    assert parse_json_object('{"n": -' + "9" * 5000 + "}") == {"n": -1}


def test_is_usage_only_chunk():
    assert is_usage_only_chunk({"choices": [], "usage": {"prompt_tokens": 1}})
    assert is_usage_only_chunk({"usage": {"prompt_tokens": 1}})
    assert not is_usage_only_chunk({"choices": [], "usage": None})
    assert not is_usage_only_chunk({"choices": [{"delta": {}}], "usage": {"prompt_tokens": 1}})


def chunk(**fields) -> str:
    return json.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", **fields})


def test_stream_observer():
    observer = StreamObserver()
    events = [
        chunk(id="", choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}}]),
        chunk(choices=[{"index": 0, "delta": {"reasoning_content": "Hmm. "}}]),
        chunk(choices=[{"index": 0, "delta": {"content": "Héllo"}, "finish_reason": None}]),
        "not json",
        "[1, 2]",
        chunk(choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}], usage=None),
        chunk(choices=[], usage={"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}),
        "[DONE]",
    ]
    parsed = [observer.observe(data) for data in events]
    assert parsed[0]["object"] == "chat.completion.chunk"
    assert parsed[3] is None and parsed[-1] is None
    # Five chunks are JSON objects; two payloads are not.
    assert [obj is not None for obj in parsed] == [
        True,
        True,
        True,
        False,
        False,
        True,
        True,
        False,
    ]
    assert observer.upstream_id == "chatcmpl-1"
    assert observer.finish_reason == "stop"
    assert observer.usage == Usage(prompt_tokens=9, completion_tokens=4, total_tokens=13)
    assert observer.delivered_tokens() == estimate_text_tokens("Hmm. Héllo")
    assert observer.error is None
    assert observer.observe(None) is None


def test_stream_observer_reasoning_tool_calls_and_errors():
    observer = StreamObserver()
    # The same reasoning under both names counts once.
    observer.observe(chunk(choices=[{"delta": {"reasoning": "ab", "reasoning_content": "ab"}}]))
    observer.observe(chunk(choices=[{"delta": {"reasoning": "cd"}}]))
    call = {"index": 0, "function": {"name": "f", "arguments": '{"x":'}}
    observer.observe(chunk(choices=[{"delta": {"tool_calls": [call]}}]))
    observer.observe(json.dumps({"error": {"message": "overloaded", "type": "server_error"}}))
    assert observer.delivered_tokens() == estimate_text_tokens('abcdf{"x":')
    assert observer.error == {"message": "overloaded", "type": "server_error"}


def test_summarize_completion():
    body = {
        "id": "chatcmpl-9",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}],
                    "reasoning_content": "think",
                },
                "finish_reason": "length",
            },
            {"index": 1, "message": {"content": " two"}, "finish_reason": "stop"},
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4},
    }
    usage, finish, upstream_id, tokens = summarize_completion(json.dumps(body).encode())
    assert usage == Usage(prompt_tokens=3, completion_tokens=4, total_tokens=7)
    assert finish == "length"
    assert upstream_id == "chatcmpl-9"
    assert tokens == estimate_text_tokens("Hi!think two")


def test_summarize_completion_reads_usage_from_a_body_that_is_not_utf8():
    body = b'{"choices": [{"message": {"content": "\xff\xfeHi"}}], '
    body += b'"usage": {"prompt_tokens": 30, "completion_tokens": 700}}'
    usage, _, _, tokens = summarize_completion(body)
    assert usage == Usage(prompt_tokens=30, completion_tokens=700, total_tokens=730)
    assert tokens == estimate_text_tokens("\ufffd\ufffdHi")


def test_summarize_completion_falls_back_to_last_finish_reason():
    body = {"choices": [{"message": None}, {"finish_reason": "stop"}, {"finish_reason": None}]}
    assert summarize_completion(json.dumps(body).encode()) == (None, "stop", None, 0)


def test_summarize_completion_garbage():
    for body in (b"", b"garbage", b"[]", b"\xff\xfe", b'{"choices": 5, "id": 3}', b"null"):
        assert summarize_completion(body)[1:] == (None, None, 0)
        assert summarize_completion(body)[0] is None


def _read(observer: StreamObserver, events: list[str]) -> tuple:
    for data in events:
        observer.observe(data)
    return (
        observer.upstream_id,
        observer.finish_reason,
        observer.usage,
        observer.error,
        observer.delivered_tokens(),
    )


LAZY_STREAMS = {
    "plain": [
        chunk(choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}}]),
        *(
            chunk(choices=[{"delta": {"content": f"word{i} "}, "finish_reason": None}])
            for i in range(30)
        ),
        chunk(choices=[{"delta": {"content": "end."}, "finish_reason": "stop"}]),
        chunk(choices=[], usage={"prompt_tokens": 9, "completion_tokens": 31}),
        "[DONE]",
    ],
    # No usage: the estimate needs every event's text, in order, runs cut across events.
    "no usage": [
        chunk(choices=[{"delta": {"content": "Hel"}}]),
        chunk(choices=[{"delta": {"content": "lo wor"}}]),
        chunk(choices=[{"delta": {"reasoning_content": "ld 12"}}]),
        chunk(choices=[{"delta": {"content": "34"}, "finish_reason": "length"}]),
        chunk(choices=[{"text": " legacy"}]),
    ],
    # Keys spelled with escapes, spaces around the colon, an error in the middle.
    "escapes": [
        chunk(choices=[{"delta": {"content": "a"}}]),
        '{"id": "x", "choices": [{"delta": {"content": "b"}, "finish_reason" :  "stop"}]}',
        '{"id": "x", "\\u0075sage": {"prompt_tokens": 3, "completion_tokens": 2}}',
        '{"id": "x", "error": {"message": "overloaded"}}',
        chunk(choices=[{"delta": {"content": "c"}}], usage=None),
        "not json",
    ],
    # More text than the count holds unread: read in its turn, in bounded memory.
    "long": [chunk(choices=[{"delta": {"content": "x" * 3000 + f" {i} "}}]) for i in range(40)],
    # No id until the third event: events are read until it comes.
    "late id": [
        json.dumps({"choices": [{"delta": {"content": "one "}}]}),
        json.dumps({"id": "", "choices": [{"delta": {"content": "two "}}]}),
        json.dumps({"id": "late", "choices": [{"delta": {"content": "three"}}]}),
        json.dumps({"id": "other", "choices": [{"delta": {"content": " four"}}]}),
    ],
}


@pytest.mark.parametrize("name", sorted(LAZY_STREAMS))
def test_a_lazy_observer_reads_a_stream_as_an_eager_one(name):
    events = LAZY_STREAMS[name]
    eager = _read(StreamObserver(), events)
    lazy_observer = StreamObserver(lazy=True)
    assert _read(lazy_observer, events) == eager
    # The events that only add text were left unparsed (for all but the unusual streams).
    if name == "plain":
        observer = StreamObserver(lazy=True)
        returned = [observer.observe(data) for data in events]
        assert sum(obj is not None for obj in returned) == 3  # the first, the finish, the usage
    assert eager[4] > 0
