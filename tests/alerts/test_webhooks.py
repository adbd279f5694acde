"""The webhooks API: registration with safe URLs only, validation, listing without secrets,
deletion, the test delivery and the deliveries listing; the admin's only."""

import ipaddress

import pytest

from metering.alerts.signature import verify
from tests.alerts.conftest import body_json, hold, new_path, start_server, wait_for

CROSSED = "budget.threshold_crossed"


def test_a_webhook_is_registered_with_a_generated_secret_shown_once(alerts_api, receiver):
    url = receiver.url(new_path())
    created = hold(alerts_api, url, [CROSSED, "budget.exhausted", CROSSED])
    assert created["url"] == url and created["events"] == [CROSSED, "budget.exhausted"]
    assert created["team_id"] is None and created["id"].startswith("wh_")
    assert created["secret"].startswith("whsec_") and len(created["secret"]) == 70
    listed = alerts_api.ok("GET", "/v1/webhooks")["data"]
    mine = [w for w in listed if w["id"] == created["id"]]
    assert mine == [{k: v for k, v in created.items() if k != "secret"}]


def test_a_given_secret_is_kept(alerts_api, receiver):
    created = hold(alerts_api, receiver.url(new_path()), [CROSSED], secret="s" * 32)
    assert created["secret"] == "s" * 32


def test_the_test_delivery_is_signed_and_listed(alerts_api, receiver):
    path = new_path()
    created = hold(alerts_api, receiver.url(path), [CROSSED], alerts_api.team()["id"])
    sent = alerts_api.ok("POST", f"/v1/webhooks/{created['id']}/test", 202)
    (got,) = wait_for(lambda: receiver.at(path), message="the test delivery")
    assert got["headers"]["x-metering-event-id"] == sent["event_id"]
    assert verify(created["secret"], got["headers"]["x-metering-signature"], got["body"])
    assert not verify(
        "another-secret-of-length", got["headers"]["x-metering-signature"], got["body"]
    )
    body = body_json(got)
    assert body["type"] == "webhook.test" and body["data"]["subject_id"] == created["id"]
    (delivery,) = wait_for(
        lambda: [
            d
            for d in alerts_api.ok("GET", f"/v1/webhooks/{created['id']}/deliveries")["data"]
            if d["status"] == "delivered"
        ],
        message="the delivery recorded",
    )
    assert delivery["id"] == sent["delivery_id"] and delivery["event_type"] == "webhook.test"
    assert delivery["attempts"] == 1 and delivery["history"][0]["status_code"] == 200
    assert delivery["history"][0]["error"] is None


def test_a_deleted_webhook_is_gone(alerts_api, receiver):
    created = hold(alerts_api, receiver.url(new_path()), [CROSSED])
    alerts_api.ok("DELETE", f"/v1/webhooks/{created['id']}", 204)
    assert created["id"] not in {w["id"] for w in alerts_api.ok("GET", "/v1/webhooks")["data"]}
    for method, path in (
        ("DELETE", f"/v1/webhooks/{created['id']}"),
        ("POST", f"/v1/webhooks/{created['id']}/test"),
        ("GET", f"/v1/webhooks/{created['id']}/deliveries"),
        ("GET", "/v1/webhooks/wh_unknown/deliveries"),
    ):
        answer = alerts_api.request(method, path)
        assert answer.status_code == 404, (method, path, answer.text)
        assert answer.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"url": "http://example.com/hook", "events": [CROSSED]}, "url"),
        ({"url": "http://10.0.0.1/hook", "events": [CROSSED]}, "url"),
        ({"url": "ftp://127.0.0.1/hook", "events": [CROSSED]}, "url"),
        ({"url": "https://user:pw@example.com/hook", "events": [CROSSED]}, "url"),
        ({"url": "not a url", "events": [CROSSED]}, "url"),
        ({"url": "https://example.com/hook", "events": []}, "events"),
        ({"url": "https://example.com/hook", "events": ["budget.nope"]}, "events"),
        ({"url": "https://example.com/hook", "events": CROSSED}, "events"),
        ({"url": "https://example.com/hook", "events": [CROSSED], "secret": "short"}, "secret"),
        ({"url": "https://example.com/hook", "events": [CROSSED], "extra": 1}, "extra"),
        ({"url": "https://" + "a" * 2100 + ".com", "events": [CROSSED]}, "url"),
        ({"url": "https://example.com/hook", "events": [CROSSED], "team_id": "team_x"}, "team_id"),
    ],
)
def test_a_bad_webhook_is_refused(alerts_api, body, param):
    answer = alerts_api.request("POST", "/v1/webhooks", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "invalid_request" and error["param"] == param, error


def test_an_https_url_is_accepted(alerts_api):
    created = hold(alerts_api, "https://hooks.example.com/metering", [CROSSED])
    alerts_api.ok("DELETE", f"/v1/webhooks/{created['id']}", 204)


def test_loopback_http_needs_the_setting(api, receiver):
    """The suite's shared server runs with METERING_WEBHOOKS_ALLOW_LOOPBACK unset."""
    answer = api.request(
        "POST", "/v1/webhooks", json={"url": receiver.url("/x"), "events": [CROSSED]}
    )
    assert answer.status_code == 400
    assert "METERING_WEBHOOKS_ALLOW_LOOPBACK" in answer.json()["error"]["message"]


def test_webhooks_are_the_admins(alerts_api):
    _, _, token = alerts_api.principal()
    for method, path in (
        ("GET", "/v1/webhooks"),
        ("POST", "/v1/webhooks"),
        ("GET", "/v1/webhooks/wh_x/deliveries"),
    ):
        answer = alerts_api.request(method, path, key=token["token"], json={})
        assert answer.status_code == 403, (method, path, answer.text)


LOOPBACK = "allowed with METERING_WEBHOOKS_ALLOW_LOOPBACK=true"


def mapped(ipv4: str) -> str:
    """How this Python prints an IPv4-mapped IPv6 address (3.13 prints it dotted)."""
    return str(ipaddress.ip_address(f"::ffff:{ipv4}"))


PRIVATE = "allowed with METERING_WEBHOOKS_ALLOW_PRIVATE=true"


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("https://127.0.0.1:5432/hook", f"127.0.0.1 (loopback; {LOOPBACK})"),
        ("https://127.1/hook", f"127.0.0.1 (loopback; {LOOPBACK})"),
        ("https://2130706433/hook", f"127.0.0.1 (loopback; {LOOPBACK})"),
        ("https://0x7f000001/hook", f"127.0.0.1 (loopback; {LOOPBACK})"),
        ("https://[::1]/hook", f"::1 (loopback; {LOOPBACK})"),
        ("https://[::ffff:127.0.0.1]/hook", f"{mapped('127.0.0.1')} (loopback; {LOOPBACK})"),
        ("https://10.0.0.1/hook", f"10.0.0.1 (private; {PRIVATE})"),
        ("https://172.16.0.1/hook", f"172.16.0.1 (private; {PRIVATE})"),
        ("https://192.168.1.1/hook", f"192.168.1.1 (private; {PRIVATE})"),
        ("https://[fd00::1]/hook", f"fd00::1 (private; {PRIVATE})"),
        ("https://100.64.0.1/hook", f"100.64.0.1 (shared; {PRIVATE})"),
        ("https://169.254.169.254/latest", "169.254.169.254 (link-local; never allowed)"),
        (
            "https://[::ffff:a9fe:a9fe]/hook",
            f"{mapped('169.254.169.254')} (link-local; never allowed)",
        ),
        ("https://[fe80::1]/hook", "fe80::1 (link-local; never allowed)"),
        ("https://224.0.0.1/hook", "224.0.0.1 (multicast; never allowed)"),
        ("https://[ff02::1]/hook", "ff02::1 (multicast; never allowed)"),
        ("https://240.0.0.1/hook", "240.0.0.1 (reserved; never allowed)"),
        ("https://255.255.255.255/hook", "255.255.255.255 (reserved; never allowed)"),
        ("https://0.0.0.0/hook", "0.0.0.0 (unspecified; never allowed)"),
        ("https://[::]/hook", ":: (unspecified; never allowed)"),
    ],
)
def test_an_https_webhook_to_an_internal_address_is_refused(api, url, reason):
    """The suite's shared server runs with both switches off."""
    answer = api.request("POST", "/v1/webhooks", json={"url": url, "events": [CROSSED]})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "invalid_request" and error["param"] == "url"
    assert error["message"] == f"url points to an internal address: {reason}"


def test_the_loopback_switch_allows_loopback_only(alerts_api):
    created = hold(alerts_api, "https://127.0.0.1:8443/hook", [CROSSED])
    alerts_api.ok("DELETE", f"/v1/webhooks/{created['id']}", 204)
    for url in ("https://10.0.0.1/hook", "https://169.254.169.254/"):
        answer = alerts_api.request("POST", "/v1/webhooks", json={"url": url, "events": [CROSSED]})
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == "url"


def test_the_private_switch_allows_private_and_shared_addresses(fresh_db, sim):
    server, api = start_server(
        fresh_db, sim, webhooks_allow_loopback=False, webhooks_allow_private=True
    )
    try:
        for url in (
            "https://10.0.0.1/hook",
            "https://172.31.255.1/hook",
            "https://192.168.0.10/hook",
            "https://[fd00::1]/hook",
            "https://100.64.0.1/hook",
        ):
            assert hold(api, url, [CROSSED])["url"] == url
        for url, message in (
            (
                "https://127.0.0.1/hook",
                f"url points to an internal address: 127.0.0.1 (loopback; {LOOPBACK})",
            ),
            (
                "https://169.254.169.254/",
                "url points to an internal address: 169.254.169.254 (link-local; never allowed)",
            ),
            (
                "http://10.0.0.1/hook",
                "url must be https (http only to a loopback address with METERING_WEBHOOKS_ALLOW_LOOPBACK=true)",
            ),
        ):
            answer = api.request("POST", "/v1/webhooks", json={"url": url, "events": [CROSSED]})
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["message"] == message
    finally:
        server.stop()
