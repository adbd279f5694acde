"""Webhook deliveries: retried with the same event id and valid signatures until a 2xx, then
never again; redirects not followed; a hanging receiver costs the proxy nothing; a replica
killed between the commit and the delivery leaves it to another; a host that points to an
internal address is never connected to."""

import ipaddress
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal

import pytest

from metering.alerts.signature import verify
from tests.alerts.conftest import (
    alerts,
    ask,
    body_json,
    hold,
    hold_of,
    new_path,
    start_server,
    wait_for,
)

CROSSED = "budget.threshold_crossed"


def tag() -> str:
    return f"t{uuid.uuid4().hex[:16]}"


def _crossing_team(api, thresholds=(50,)):
    """A team whose token crosses `thresholds` with its first request."""
    cost = Decimal(hold_of(api, tag()))
    team, user, token = api.principal()
    api.ok(
        "PATCH",
        f"/v1/tokens/{token['id']}",
        json={"credit_limit": str(cost * 3 / 2), "alert_thresholds": list(thresholds)},
    )
    return team, token


def _deliveries(api, webhook_id: str) -> list[dict]:
    return api.ok("GET", f"/v1/webhooks/{webhook_id}/deliveries")["data"]


def test_a_failing_receiver_gets_the_event_until_it_answers_2xx(alerts_api, receiver):
    path = new_path()
    receiver.script[path] = [500, 500, 500]
    team, token = _crossing_team(alerts_api)
    webhook = hold(alerts_api, receiver.url(path), [CROSSED], team["id"])
    ask(alerts_api, token["token"], tag())

    delivered = wait_for(
        lambda: [d for d in _deliveries(alerts_api, webhook["id"]) if d["status"] == "delivered"],
        message="the delivery succeeding",
    )
    (delivery,) = delivered
    got = receiver.at(path)
    assert len(got) == 4
    (event,) = alerts(alerts_api, subject_id=token["id"], type=CROSSED)
    assert {r["headers"]["x-metering-event-id"] for r in got} == {event["id"]}
    assert len({r["body"] for r in got}) == 1
    for record in got:
        assert verify(webhook["secret"], record["headers"]["x-metering-signature"], record["body"])
        assert record["headers"]["content-type"] == "application/json"
    assert body_json(got[0]) == event
    assert event["data"]["threshold"] == 50 and event["data"]["team_id"] == team["id"]

    assert delivery["event_id"] == event["id"] and delivery["attempts"] == 4
    assert [a["status_code"] for a in delivery["history"]] == [500, 500, 500, 200]
    assert delivery["next_attempt_at"] is None and delivery["last_status_code"] == 200
    # The answer's body is shown as a short excerpt only.
    assert delivery["history"][0]["error"].startswith("HTTP 500: receiver says x")
    assert len(delivery["history"][0]["error"]) <= 300

    # Later passes of the worker send nothing more: a test delivery to another webhook goes
    # through after it, and this receiver still has its four.
    other_path = new_path()
    other = hold(alerts_api, receiver.url(other_path), [CROSSED], team["id"])
    alerts_api.ok("POST", f"/v1/webhooks/{other['id']}/test", 202)
    wait_for(lambda: receiver.at(other_path), message="the test delivery")
    assert len(receiver.at(path)) == 4


def test_a_redirect_is_not_followed(alerts_api, receiver):
    path = f"/redirect/{uuid.uuid4().hex[:8]}"
    webhook = hold(alerts_api, receiver.url(path), [CROSSED], alerts_api.team()["id"])
    alerts_api.ok("POST", f"/v1/webhooks/{webhook['id']}/test", 202)
    (delivery,) = wait_for(
        lambda: [d for d in _deliveries(alerts_api, webhook["id"]) if d["attempts"] >= 1],
        message="the first attempt",
    )
    assert delivery["history"][0]["status_code"] == 302
    assert delivery["history"][0]["error"] == "HTTP 302: redirects are not followed"
    assert receiver.at("/elsewhere") == []


def test_a_hanging_receiver_does_not_hold_up_the_proxy(alerts_api, receiver):
    path = new_path()
    receiver.release.clear()
    receiver.hang.add(path)
    team, token = _crossing_team(alerts_api)
    hold(alerts_api, receiver.url(path), [CROSSED], team["id"])
    ask(alerts_api, token["token"], tag())
    wait_for(lambda: receiver.hanging >= 1, message="the receiver holding a delivery")
    try:
        _, _, other = alerts_api.principal()
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: ask(alerts_api, other["token"], tag()), range(8)))
        assert all(a.choices for a in answers)
        # Another receiver's deliveries go on meanwhile.
        other_path = new_path()
        other_hook = hold(alerts_api, receiver.url(other_path), [CROSSED], team["id"])
        alerts_api.ok("POST", f"/v1/webhooks/{other_hook['id']}/test", 202)
        wait_for(lambda: receiver.at(other_path), message="the other receiver's delivery")
        assert receiver.hanging >= 1  # still held while the proxy answered all of them
    finally:
        receiver.hang.discard(path)
        receiver.release.set()


def test_a_hanging_receiver_holds_its_own_slots_only(fresh_db, sim, receiver):
    # Four slots, at most two of them to one webhook; the hanging one has six to send.
    server, api = start_server(fresh_db, sim, webhook_concurrency=4, webhook_per_endpoint=2)
    path, healthy_path = new_path(), new_path()
    receiver.release.clear()
    receiver.hang.add(path)
    try:
        team = api.team()
        hanging = hold(api, receiver.url(path), [CROSSED], team["id"])
        for _ in range(6):
            api.ok("POST", f"/v1/webhooks/{hanging['id']}/test", 202)
        wait_for(lambda: len(receiver.at(path)) >= 2, message="two deliveries hanging")
        healthy = hold(api, receiver.url(healthy_path), [CROSSED], team["id"])
        for _ in range(3):
            api.ok("POST", f"/v1/webhooks/{healthy['id']}/test", 202)
        delivered = wait_for(
            lambda: [d for d in _deliveries(api, healthy["id"]) if d["status"] == "delivered"][2:],
            message="the healthy receiver's deliveries",
        )
        assert delivered and len(receiver.at(healthy_path)) == 3
        # The hanging receiver still holds exactly its two; its other four wait their turn.
        assert len(receiver.at(path)) == 2
        waiting = _deliveries(api, hanging["id"])
        assert len(waiting) == 6 and {d["status"] for d in waiting} == {"pending"}
        assert sorted(d["attempts"] for d in waiting) == [0] * 6
    finally:
        receiver.hang.discard(path)
        receiver.release.set()
        server.stop()


@pytest.mark.postgres
def test_a_replica_killed_after_the_commit_leaves_the_delivery_to_another(
    fresh_pg, serve, receiver
):
    from metering import migrate

    migrate.upgrade(fresh_pg)
    # This replica looks for work once an hour: it commits the event and dies before sending.
    first = serve(fresh_pg, METERING_WEBHOOKS_ALLOW_LOOPBACK="true", METERING_WEBHOOK_POLL_S="3600")
    api = first.api()
    path = new_path()
    team, token = _crossing_team(api)
    hold(api, receiver.url(path), [CROSSED], team["id"])
    ask(api, token["token"], tag())
    (event,) = alerts(api, subject_id=token["id"], type=CROSSED)
    first.kill()
    assert receiver.at(path) == []

    serve(fresh_pg, METERING_WEBHOOKS_ALLOW_LOOPBACK="true", METERING_WEBHOOK_POLL_S="0.1")
    (got,) = wait_for(lambda: receiver.at(path), message="the survivor delivering")
    assert got["headers"]["x-metering-event-id"] == event["id"]
    assert body_json(got) == event


def _finished(api, webhook_id: str) -> list[dict]:
    return [d for d in _deliveries(api, webhook_id) if d["status"] != "pending"]


def test_a_name_resolving_to_loopback_is_never_connected_to(fresh_db, sim):
    """With the loopback switch off, https://localhost:... is registered (a name is checked
    when it is resolved) and its delivery fails at once, no connection opened."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    first = socket.getaddrinfo("localhost", port, type=socket.SOCK_STREAM)[0][4][0]
    server, api = start_server(fresh_db, sim, webhooks_allow_loopback=False)
    try:
        webhook = hold(api, f"https://localhost:{port}/hook", [CROSSED])
        sent = api.ok("POST", f"/v1/webhooks/{webhook['id']}/test", 202)
        (delivery,) = wait_for(lambda: _finished(api, webhook["id"]), message="the refusal")
        reason = (
            f"not sent: localhost points to an internal address: {ipaddress.ip_address(first)} "
            "(loopback; allowed with METERING_WEBHOOKS_ALLOW_LOOPBACK=true)"
        )
        assert delivery["id"] == sent["delivery_id"] and delivery["status"] == "failed"
        assert delivery["attempts"] == 1 and delivery["next_attempt_at"] is None
        assert delivery["last_status_code"] is None and delivery["last_error"] == reason
        assert [(a["status_code"], a["error"]) for a in delivery["history"]] == [(None, reason)]
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever connected
    finally:
        server.stop()
        listener.close()


def test_a_webhook_registered_while_allowed_is_not_sent_once_disallowed(fresh_db, sim, receiver):
    allowed, api = start_server(fresh_db, sim)
    path = new_path()
    webhook = hold(api, receiver.url(path), [CROSSED])
    allowed.stop()
    server, api = start_server(fresh_db, sim, webhooks_allow_loopback=False)
    try:
        api.ok("POST", f"/v1/webhooks/{webhook['id']}/test", 202)
        (delivery,) = wait_for(lambda: _finished(api, webhook["id"]), message="the refusal")
        assert delivery["status"] == "failed" and delivery["attempts"] == 1
        assert delivery["last_error"] == (
            "not sent: 127.0.0.1 points to an internal address: 127.0.0.1 "
            "(loopback; allowed with METERING_WEBHOOKS_ALLOW_LOOPBACK=true)"
        )
        assert receiver.at(path) == []
    finally:
        server.stop()
