"""POST /v1/chat/completions is dispatched ahead of the application's middleware and router
(metering.proxy.dispatch.DirectChat): what those layers did for it is done there, and it answers as the
general stack answers. A compressed body, another method or another path takes the general
stack."""

import gzip
import json
import time

import pytest

from tests.budgets.conftest import chat_body, marker

PATH = "/v1/chat/completions"


def _post(api, body: bytes, key: str, **headers):
    headers = {"content-type": "application/json", "authorization": f"Bearer {key}", **headers}
    if not key:
        headers["authorization"] = ""  # no credential
    return api.request("POST", PATH, content=body, headers=headers)


def _one_request_id(response) -> str:
    ids = response.headers.get_list("x-request-id")
    assert len(ids) == 1, ids
    assert ids[0].startswith("req_")
    return ids[0]


def test_answers_and_errors_carry_one_request_id(api):
    team, user, token = api.principal(token_limit="0.000001")
    key = token["token"]
    ok = _post(api, chat_body(f"direct {marker()} sim:tokens=2", max_tokens=2), key)
    # The limit is too small for this request's hold: refused before the upstream.
    assert ok.status_code == 402, ok.text
    assert ok.json()["error"]["code"] == "budget_exceeded"
    assert ok.headers["x-budget-scope"] == "token"
    _one_request_id(ok)

    api.ok("PATCH", f"/v1/tokens/{token['id']}", json={"credit_limit": None})
    served = _post(api, chat_body(f"direct {marker()} sim:tokens=2", max_tokens=2), key)
    assert served.status_code == 200, served.text
    request_id = _one_request_id(served)
    assert [e["id"] for e in api.events(token_id=token["id"])] == [request_id]

    for body, key_, status, code in (
        (b"{not json", key, 400, "invalid_request"),
        (chat_body("x"), "", 401, "invalid_api_key"),
        (chat_body("x"), "mtr_" + "0" * 40, 401, "invalid_api_key"),
        (chat_body("x", model="no-such-model"), key, 404, None),
    ):
        response = _post(api, body, key_)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        if code is not None:
            assert error["code"] == code, error
        _one_request_id(response)


def test_request_ids_follow_the_order_requests_were_made(api):
    """Each answer's id is its ledger event's, and ids sort in the order their requests came
    (metering.ids): new events go to the right edge of the ledger's primary key."""
    _team, _user, token = api.principal()
    key = token["token"]
    sent = []
    for n in range(5):
        served = _post(api, chat_body(f"ordered {n} {marker()} sim:tokens=2", max_tokens=2), key)
        assert served.status_code == 200, served.text
        sent.append(_one_request_id(served))
        time.sleep(0.002)  # the next millisecond at least
    assert sorted(sent) == sent
    assert sorted(e["id"] for e in api.events(token_id=token["id"])) == sent


def test_a_compressed_body_takes_the_general_stack(api):
    _, _, token = api.principal()
    raw = chat_body(f"gzip {marker()} sim:tokens=3", max_tokens=3)
    response = _post(api, gzip.compress(raw), token["token"], **{"content-encoding": "gzip"})
    assert response.status_code == 200, response.text
    request_id = _one_request_id(response)
    assert response.json()["usage"]["completion_tokens"] == 3
    assert [e["id"] for e in api.events(token_id=token["id"])] == [request_id]


@pytest.mark.parametrize("method", ["GET", "PUT"])
def test_other_methods_are_refused_by_the_router(api, method):
    _, _, token = api.principal()
    response = api.request(method, PATH, key=token["token"])
    assert response.status_code == 405, response.text
    assert response.json()["error"]["code"] == "method_not_allowed"


def test_the_route_is_still_in_the_openapi_document(api):
    document = api.ok("GET", "/openapi.json")
    assert "post" in document["paths"][PATH]
    assert json.dumps(document["paths"][PATH]["post"]["responses"]).count("402") >= 1


def test_a_bug_answers_an_openai_shaped_500_with_one_request_id(api, monkeypatch, caplog):
    """What the application's last-resort handler answers: the error's shape holds, the request
    id is given once, and the failure is logged."""
    from metering.proxy import service

    async def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(service, "serve", broken)
    _, _, token = api.principal()
    response = _post(api, chat_body(f"bug {marker()}"), token["token"])
    assert response.status_code == 500, response.text
    assert response.json()["error"]["code"] == "internal_error"
    _one_request_id(response)
    assert "a bug" in caplog.text
