"""The request body and the upstream's JSON are read by a fast parser where it reads them as
the standard one does, and by the standard one otherwise: integers beyond 64 bits stay exact
integers (the fast parser would make them floats), NaN, a BOM and lone surrogates keep their
former meaning and messages."""

import math

import pytest

from metering.errors import InvalidRequest
from metering.proxy.reported import parse_json_object, summarize_completion
from metering.proxy.request import parse_json, validate

MESSAGES = b'"messages": [{"role": "user", "content": "hi"}]'


@pytest.mark.parametrize("number", [2**64, 2**63, -(2**63) - 1, 10**30])
def test_a_long_integer_stays_an_exact_integer(number):
    raw = b'{"model": "m", ' + MESSAGES + b', "max_tokens": ' + str(number).encode() + b"}"
    body = parse_json(raw)
    assert body["max_tokens"] == number and type(body["max_tokens"]) is int
    with pytest.raises(InvalidRequest) as caught:
        validate(body, len(raw))
    assert caught.value.message == "max_tokens must be between 1 and 10000000"


def test_upstream_usage_beyond_64_bits_stays_an_integer():
    body = b'{"id": "c1", "usage": {"prompt_tokens": 18446744073709551616}, "choices": []}'
    obj = parse_json_object(body)
    assert obj["usage"]["prompt_tokens"] == 2**64
    assert type(obj["usage"]["prompt_tokens"]) is int
    text = body.decode()
    assert parse_json_object(text)["usage"]["prompt_tokens"] == 2**64


def test_what_the_fast_parser_refuses_keeps_its_meaning():
    assert parse_json(b'\xef\xbb\xbf{"a": 1}') == {"a": 1}  # a BOM, as before
    with pytest.raises(InvalidRequest) as caught:  # a lone surrogate: refused at once, named
        parse_json(b'{"a": "\\ud800"}')
    assert caught.value.param == "a"
    with pytest.raises(InvalidRequest) as caught:
        parse_json(b'{"a": NaN}')
    assert caught.value.message == "request body is not valid JSON"
    assert math.isnan(parse_json_object(b'{"a": NaN}')["a"])  # an upstream's NaN is read
    assert parse_json_object(b'{"a": "\xff"}') == {"a": "\ufffd"}
    with pytest.raises(InvalidRequest) as caught:
        parse_json(b"[1]")
    assert caught.value.message == "request body must be a JSON object"
    assert parse_json_object(b"[1]") is None
    assert summarize_completion(b"not json") == (None, None, None, 0)
