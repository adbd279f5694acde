"""Which stream events the lazy observer may leave unparsed: `matters` says what one regular
expression alternation said, on any text made of the pieces that decide it."""

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from metering.proxy.reported import matters

# The alternation `matters` replaces, kept here as its specification.
SPEC = re.compile(r'\\u|"(?:finish_reason"\s*:\s*"|usage"\s*:\s*\{|error")')

PIECES = st.sampled_from(
    [
        '"finish_reason"',
        '"usage"',
        '"error"',
        '"error',
        'error"',
        '"',
        ":",
        " ",
        "\t",
        "\n",
        "{",
        "}",
        "null",
        '"stop"',
        "\\",
        "u",
        "\\u00",
        "\\\\",
        ",",
        "finish_reason",
        '"delta":{"content":"hi"}',
    ]
)


@settings(max_examples=3000)
@given(st.lists(PIECES | st.text(max_size=3), max_size=24).map("".join))
def test_matters_is_the_alternation(data):
    assert matters(data) == (SPEC.search(data) is not None)


def test_typical_events():
    plain = '{"id":"c1","choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}'
    assert not matters(plain)
    assert matters(plain.replace("null", '"stop"'))
    assert matters(plain.replace('"finish_reason":null', '"finish_reason" :  "length"'))
    assert matters(plain[:-1] + ',"usage":{"prompt_tokens":1}}')
    assert not matters(plain[:-1] + ',"usage":null}')
    assert matters('{"error":{"message":"overloaded"}}')
    assert matters(plain.replace('"x"', '"\\u0041"'))
