"""response_model = "requested" at the byte level (metering.proxy.rename.with_model): the top-level
object's `model` string, and only it, becomes the requested name; every other byte stays. The end
to end tests are in test_stream_usage.py."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metering.proxy.rename import with_model

NAME = json.dumps("gpt-sim").encode()

scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(["model", "id", 'm"odel', "x\\"]) | st.text(), inner, max_size=4
        )
    ),
    max_leaves=12,
)
SEPARATORS = [(",", ":"), (", ", ": "), (" ,  ", " :\t")]


ABSENT = object()


@settings(max_examples=400, deadline=None)
@given(
    before=st.dictionaries(st.text(), values, max_size=4),
    model=st.just(ABSENT) | st.text() | values,
    after=st.dictionaries(st.text(), values, max_size=4),
    separators=st.sampled_from(SEPARATORS),
    ascii_only=st.booleans(),
    sse=st.booleans(),
)
def test_only_the_top_level_model_string_changes(before, model, after, separators, ascii_only, sse):
    """Members before and after it, nested objects with `model` keys of their own, strings that
    spell `"model":` inside them, any spacing, escaped or raw Unicode, alone or in an SSE event."""
    obj = {k: v for k, v in before.items() if k != "model"}
    if model is not ABSENT:
        obj["model"] = model
    obj.update({k: v for k, v in after.items() if k != "model"})

    def dumps(value: dict) -> bytes:
        text = json.dumps(value, separators=separators, ensure_ascii=ascii_only)
        raw = text.encode("utf-8", "surrogatepass")
        return b"data: " + raw + b"\n\n" if sse else raw

    renamed = with_model(dumps(obj), NAME)
    if isinstance(obj.get("model"), str):
        assert renamed == dumps({**obj, "model": "gpt-sim"})
    else:
        assert renamed == dumps(obj)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (
            b'{"id":"x","created":1,"model":"sim/gpt","choices":[]}',
            b'{"id":"x","created":1,"model":"gpt-sim","choices":[]}',
        ),
        (
            b'{"choices":[{"model":"inner"}],"model" : "outer"}',
            b'{"choices":[{"model":"inner"}],"model" : "gpt-sim"}',
        ),
        (b'{"choices":[{"model":"inner"}]}', b'{"choices":[{"model":"inner"}]}'),
        (b'{"a":{"model":"x"}}', b'{"a":{"model":"x"}}'),
        (
            b'{"x":"\\"model\\":\\"y\\"","model":"m"}',
            b'{"x":"\\"model\\":\\"y\\"","model":"gpt-sim"}',
        ),
        (b'{"model":null}', b'{"model":null}'),
        (b"data: [DONE]\n\n", b"data: [DONE]\n\n"),
        (b": keep-alive\n\n", b": keep-alive\n\n"),
        (b"{not json", b"{not json"),
        (b'{"error":{"message":"m","model":"x"}}', b'{"error":{"message":"m","model":"x"}}'),
    ],
)
def test_examples(raw, expected):
    assert with_model(raw, NAME) == expected
