"""Compressed request bodies: gzip and deflate are decoded (within a bound on the decoded size),
other encodings are refused with 415, and a zip bomb answers 413 before it is inflated."""

import gzip
import json
import zlib

import pytest

from metering.encoding import ContentEncoding

CHAT = {"model": "gpt-sim", "messages": [{"role": "user", "content": "hi sim:tokens=3"}]}
RAW = json.dumps(CHAT).encode()


def raw_deflate(data: bytes) -> bytes:
    compressor = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return compressor.compress(data) + compressor.flush()


def post(api, token: str | None, body: bytes, encoding: str | None, path="/v1/chat/completions"):
    headers = {"content-type": "application/json"}
    if encoding is not None:
        headers["content-encoding"] = encoding
    return api.request("POST", path, key=token, content=body, headers=headers)


@pytest.mark.parametrize(
    ("encoding", "body"),
    [
        ("gzip", gzip.compress(RAW)),
        ("GZip", gzip.compress(RAW)),
        ("deflate", zlib.compress(RAW)),
        ("deflate", raw_deflate(RAW)),
        ("identity", RAW),
    ],
    ids=["gzip", "gzip-case", "deflate-zlib", "deflate-raw", "identity"],
)
def test_an_encoded_chat_body_is_served_and_metered_like_a_plain_one(api, encoding, body):
    _, user, token = api.principal()
    plain = post(api, token["token"], RAW, None)
    encoded = post(api, token["token"], body, encoding)
    assert plain.status_code == 200 and encoded.status_code == 200, encoded.text
    assert encoded.json()["usage"] == plain.json()["usage"]
    events = api.events(user_id=user["id"])
    assert [e["prompt_tokens"] for e in events] == [plain.json()["usage"]["prompt_tokens"]] * 2


def test_an_encoded_admin_body_is_decoded_too(api):
    body = gzip.compress(json.dumps({"name": "gz-team", "reset_interval": "never"}).encode())
    response = post(api, None, body, "gzip", path="/v1/teams")
    assert response.status_code == 201, response.text
    assert response.json()["name"] == "gz-team"


def test_a_zip_bomb_answers_413_and_reaches_no_upstream(api):
    _, user, token = api.principal()
    limit = api.settings.max_body_bytes
    bomb = gzip.compress(b" " * (limit + 1))  # a few KiB that inflate past the limit
    assert len(bomb) < limit // 100
    response = post(api, token["token"], bomb, "gzip")
    assert response.status_code == 413
    assert response.json()["error"] == {
        "message": f"request body decodes to more than {limit} bytes",
        "type": "invalid_request_error",
        "code": "request_too_large",
        "param": None,
    }
    assert api.events(user_id=user["id"]) == []


@pytest.mark.parametrize("encoding", ["br", "zstd", "compress", "gzip, gzip", "x-custom"])
def test_other_encodings_answer_415(api, encoding):
    _, _, token = api.principal()
    response = post(api, token["token"], RAW, encoding)
    assert response.status_code == 415
    error = response.json()["error"]
    assert error["code"] == "unsupported_content_encoding"
    assert error["type"] == "invalid_request_error"
    assert error["message"] == f"request bodies may be sent plain, gzip or deflate, not {encoding}"


@pytest.mark.parametrize(
    ("encoding", "body", "message"),
    [
        ("gzip", RAW, "request body is not valid gzip"),
        ("gzip", gzip.compress(RAW)[:-12], "request body is not one complete gzip stream"),
        (
            "gzip",
            gzip.compress(RAW) + b"trailing",
            "request body is not one complete gzip stream",
        ),
        ("deflate", b"\x00\x01garbage", "request body is not valid deflate"),
    ],
    ids=["not-gzip", "truncated", "trailing-bytes", "not-deflate"],
)
def test_a_body_that_does_not_decode_answers_400(api, encoding, body, message):
    _, user, token = api.principal()
    response = post(api, token["token"], body, encoding)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == message
    assert api.events(user_id=user["id"]) == []


def test_routes_with_larger_bodies_get_their_own_bound():
    middleware = ContentEncoding(None, 100, {"/v1/reconciliations": 5000})
    assert middleware.limit_for("/v1/reconciliations") == 5000
    assert middleware.limit_for("/v1/chat/completions") == 100


def test_a_plain_admin_body_above_the_limit_answers_413_and_creates_nothing(api):
    limit = api.settings.max_body_bytes
    name = f"big-{limit}"
    body = json.dumps({"name": name, "reset_interval": "never", "pad": " " * limit}).encode()
    response = post(api, None, body, None, path="/v1/teams")
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "request_too_large"
    teams = api.ok("GET", "/v1/teams")["data"]
    assert name not in [t["name"] for t in teams]


def test_a_plain_admin_body_within_the_limit_is_read_whole(api):
    body = json.dumps({"name": "plain-team", "reset_interval": "never"}).encode()
    response = post(api, None, body, None, path="/v1/teams")
    assert response.status_code == 201, response.text
    assert response.json()["name"] == "plain-team"
