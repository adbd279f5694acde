"""GET /v1/usage/changes: every event once, in the order events became visible, whatever
commits late; a user's credential sees its own; a bad cursor is a 400."""

import time
import uuid

import psycopg
import pytest

from metering.ledger.event import NAMES

pytestmark = pytest.mark.e2e


def post_events(api, token_id: str, n: int) -> list[str]:
    events = [
        {
            "idempotency_key": f"k-{uuid.uuid4().hex}",
            "model": "gpt-sim",
            "token_id": token_id,
            "prompt_tokens": 10 + i,
            "completion_tokens": 5,
        }
        for i in range(n)
    ]
    answer = api.ok("POST", "/v1/events", json={"events": events})
    return [row["event_id"] for row in answer["data"]]


def drain(api, after=None, key=None, limit=3, until=(), most=600) -> tuple[list[dict], str | None]:
    """Poll with `next` until a poll finds nothing and every id of `until` has come: the events
    in the order given. An empty poll before then waits a moment (on PostgreSQL the feed holds
    behind any write transaction of the cluster still running, other tests' included)."""
    seen: list[dict] = []
    wanted = set(until)
    for _ in range(most):
        params = {"limit": limit, **({"after": after} if after else {})}
        page = api.ok("GET", "/v1/usage/changes", params=params, key=key)
        if not page["data"]:
            assert page["next"] == after  # nothing new: poll again with the same cursor
            if wanted <= {e["id"] for e in seen}:
                return seen, after
            time.sleep(0.05)
            continue
        seen += page["data"]
        after = page["next"]
    raise AssertionError(f"the feed never gave {sorted(wanted - {e['id'] for e in seen})}")


def in_order(api, ids: list[str]) -> list[str]:
    """The order one transaction's events come in: by id on PostgreSQL, as written on SQLite."""
    return sorted(ids) if api.backend == "postgresql" else ids


def test_every_event_once_in_pages_and_a_cursor_keeps_its_place(api):
    _, _, token = api.principal()
    _, start = drain(api)  # everything before this test
    first = post_events(api, token["id"], 5)
    seen, cursor = drain(api, start, until=first)
    # One batch is one transaction: its events come in id order (on SQLite, as written).
    assert [e["id"] for e in seen if e["token_id"] == token["id"]] == in_order(api, first)
    second = post_events(api, token["id"], 4)
    more, _ = drain(api, cursor, until=second)
    assert [e["id"] for e in more if e["token_id"] == token["id"]] == in_order(api, second)
    every = [e["id"] for e in seen + more]
    assert len(every) == len(set(every))


def test_a_users_credential_sees_its_own_events_only(api):
    _, _, mine = api.principal()
    _, _, other = api.principal()
    post_events(api, other["id"], 2)
    own = post_events(api, mine["id"], 3)
    seen, _ = drain(api, key=mine["token"], limit=100, until=own)
    assert {e["id"] for e in seen} == set(own)


@pytest.mark.parametrize("cursor", ["nope", "cDox", "x" * 300, "czp4", "cDoxOg"])
def test_a_cursor_the_feed_did_not_give_is_a_400(api, cursor):
    answer = api.request("GET", "/v1/usage/changes", params={"after": cursor})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "after"


def test_csv_pages_carry_the_next_cursor(api):
    _, _, token = api.principal()
    key = token["token"]  # its own events only: no other test's in between
    ids = in_order(api, post_events(api, token["id"], 3))
    drain(api, key=key, until=ids)  # visible (past every write transaction still running)
    answer = api.request("GET", "/v1/usage/changes", params={"format": "csv", "limit": 2}, key=key)
    lines = answer.text.strip().splitlines()
    assert lines[0].split(",")[0] == "id" and len(lines) == 3
    assert ids[0] in lines[1] and ids[1] in lines[2]
    rest = api.request(
        "GET",
        "/v1/usage/changes",
        params={"after": answer.headers["x-next-cursor"], "format": "csv"},
        key=key,
    )
    assert ids[2] in rest.text and ids[0] not in rest.text


@pytest.mark.postgres
def test_an_event_committed_late_is_still_returned_once_in_commit_visibility_order(api):
    """Transaction A writes an event and stays open; B writes one and commits. The feed holds
    at A until it ends, then returns A's event and B's, each once."""
    if api.backend != "postgresql":
        pytest.skip("the transaction horizon is PostgreSQL's")
    _, _, token = api.principal()
    [template] = post_events(api, token["id"], 1)
    _, start = drain(api)
    url = api.settings.database_url.replace("postgresql+asyncpg://", "postgresql://")
    columns = ", ".join(NAMES)
    copy = (
        f"INSERT INTO ledger_events ({columns}) SELECT "
        + ", ".join("%(id)s" if n == "id" else n for n in NAMES)
        + " FROM ledger_events WHERE id = %(template)s"
    )
    late, early = f"evt_late_{uuid.uuid4().hex[:20]}", f"evt_early_{uuid.uuid4().hex[:20]}"
    with psycopg.connect(url) as a, psycopg.connect(url, autocommit=True) as b:
        a.execute(copy, {"id": late, "template": template})  # A: open, its xid taken first
        b.execute(copy, {"id": early, "template": template})  # B: committed
        held, cursor = drain(api, start)
        assert [e["id"] for e in held] == []  # B waits behind A's horizon
        a.commit()
    seen, _ = drain(api, cursor, until=(late, early))
    assert [e["id"] for e in seen] == [late, early]
