"""Many requests at once against one limit: never a budget above its limit, never a lost cent.

On PostgreSQL the requests are spread over two `metering serve` replicas sharing one database;
on each backend a smaller run goes through the in-process test server.
"""

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from pathlib import Path

import httpx
import openai
import pytest

from tests.budgets.conftest import (
    budget,
    chat,
    marker,
    new_pg_database,
    replicas,
    to_toml,
    usd,
)
from tests.conftest import Api, catalog_for

MAX_TOKENS = 64
# gpt-sim: a request of about 20 prompt tokens and 64 completion tokens costs about 0.0000414.
COST_ESTIMATE = Decimal("0.0000414")


def _fire(clients: list[openai.OpenAI], requests: int, threads: int) -> list[int]:
    """`requests` chat completions from `threads` threads, cycling over the clients; the
    HTTP status of each."""
    tag = marker()

    def one(i: int) -> int:
        client = clients[i % len(clients)]
        try:
            client.chat.completions.create(
                model="gpt-sim",
                messages=[{"role": "user", "content": f"race {tag} {i} sim:tokens={MAX_TOKENS}"}],
                max_tokens=MAX_TOKENS,
            )
            return 200
        except openai.APIStatusError as exc:
            return exc.status_code

    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(one, range(requests)))


def _check_ledger(admin: Api, statuses: list[int], scopes: dict[str, str], limited: str) -> None:
    """The invariants after a burst; `scopes` maps scope -> id, `limited` is the one with a limit."""
    counts = Counter(statuses)
    assert set(counts) <= {200, 402}, counts
    served = counts[200]
    assert served >= 1 and counts[402] >= 1, counts  # the limit was reached, and bit

    events = admin.events(**{f"{limited}_id": scopes[limited]})
    assert len(events) == served
    assert all(event["status"] == "ok" for event in events)
    assert all(event["completion_tokens"] == MAX_TOKENS for event in events)
    total = sum(usd(event["cost"]) for event in events)
    for scope, subject in scopes.items():
        status = budget(admin, scope, subject)
        assert usd(status["reserved"]) == 0, status
        mine = [e for e in events if e[f"{scope}_id"] == subject]
        assert usd(status["spent"]) == sum(usd(e["cost"]) for e in mine), status
        if status["credit_limit"] is not None:
            assert usd(status["spent"]) <= usd(status["credit_limit"]), status
    limit = usd(budget(admin, limited, scopes[limited])["credit_limit"])
    assert total <= limit


def _token_burst(admin: Api, urls: list[str], limit: Decimal, requests: int, threads: int):
    team, user, token = admin.principal(token_limit=str(limit))
    clients = [
        openai.OpenAI(base_url=f"{url}/v1", api_key=token["token"], max_retries=0) for url in urls
    ]
    statuses = _fire(clients, requests, threads)
    scopes = {"token": token["id"], "user": user["id"], "team": team["id"]}
    _check_ledger(admin, statuses, scopes, "token")


def _team_burst(admin: Api, urls: list[str], limit: Decimal, requests: int, threads: int):
    team = admin.team(credit_limit=str(limit))
    users = [admin.user(team["id"]) for _ in range(3)]
    tokens = [admin.token(user["id"]) for user in users]
    # Each token goes through each replica in turn.
    clients = [
        openai.OpenAI(base_url=f"{url}/v1", api_key=token["token"], max_retries=0)
        for url in urls
        for token in tokens
    ]
    # One request of each user first, one at a time, so that every user's own budget rows are
    # checked against events below. Which user's requests of the burst find the team's credit
    # held by others' requests in flight is the scheduler's choice: a burst alone can leave a
    # user with nothing, which is the limit doing its work, not a fault.
    statuses = [_fire([client], 1, 1)[0] for client in clients[: len(tokens)]]
    assert statuses == [200] * len(tokens), statuses
    statuses += _fire(clients, requests, threads)
    _check_ledger(admin, statuses, {"team": team["id"]}, "team")
    events = admin.events(team_id=team["id"])
    for user, token in zip(users, tokens, strict=True):
        for scope, subject in (("user", user["id"]), ("token", token["id"])):
            status = budget(admin, scope, subject)
            mine = [e for e in events if e[f"{scope}_id"] == subject]
            assert mine, "every user got some of the team's credit"
            assert usd(status["spent"]) == sum(usd(e["cost"]) for e in mine)
            assert usd(status["reserved"]) == 0


@pytest.fixture(scope="module")
def patient_catalog(sim, tmp_path_factory) -> Path:
    """The test catalog with a patient upstream timeout: these bursts test budgets, and 50
    client threads share this process with the simulated upstream, which a loaded machine can
    slow past the catalog's 2 s."""
    catalog = catalog_for(sim)
    for provider in catalog["providers"].values():
        provider["timeout_s"] = 60
    path = tmp_path_factory.mktemp("patient") / "metering.toml"
    path.write_text(to_toml(catalog))
    return path


@pytest.fixture(scope="module")
def two_replicas(patient_catalog, tmp_path_factory):
    """Two `metering serve` processes on one new PostgreSQL database, started at once (both
    race to apply the migrations; an advisory lock serializes them)."""
    with (
        new_pg_database() as url,
        replicas(patient_catalog, tmp_path_factory.mktemp("replicas")) as start,
        ThreadPoolExecutor(2) as pool,
    ):
        yield list(pool.map(lambda _: start(url), range(2)))


@pytest.mark.postgres
def test_token_limit_holds_across_two_postgres_replicas(two_replicas):
    admin = two_replicas[0].api()
    _token_burst(admin, [r.url for r in two_replicas], 50 * COST_ESTIMATE, 200, 50)


@pytest.mark.postgres
def test_identity_changes_reach_the_other_postgres_replica(two_replicas):
    """A change made through one replica applies to the very next request on the other."""
    a, b = (replica.api() for replica in two_replicas)
    for kind in ("token", "user", "team"):
        team, user, token = a.principal()
        key = token["token"]
        assert chat(b, key, f"live {marker()}", max_tokens=5).status_code == 200
        a.ok(
            "DELETE",
            f"/v1/{kind}s/" + {"token": token, "user": user, "team": team}[kind]["id"],
            204,
        )
        assert chat(b, key, f"gone {marker()}", max_tokens=5).status_code == 401, kind
    for scope in ("token", "user", "team"):
        team, user, token = b.principal()
        key = token["token"]
        subject = {"token": token, "user": user, "team": team}[scope]["id"]
        assert chat(a, key, f"live {marker()}", max_tokens=5).status_code == 200
        b.ok("PATCH", f"/v1/{scope}s/{subject}", json={"credit_limit": "0"})
        refused = chat(a, key, f"limited {marker()}", max_tokens=5)
        assert refused.status_code == 402, scope
        assert refused.headers["x-budget-scope"] == scope
        b.ok("PATCH", f"/v1/{scope}s/{subject}", json={"credit_limit": None})
        assert chat(a, key, f"again {marker()}", max_tokens=5).status_code == 200


@pytest.mark.postgres
def test_team_limit_holds_across_two_postgres_replicas(two_replicas):
    admin = two_replicas[1].api()
    _team_burst(admin, [r.url for r in two_replicas], 50 * COST_ESTIMATE, 200, 50)


def test_token_limit_under_concurrency_in_process(api):
    _token_burst(api, [api.url], 15 * COST_ESTIMATE, 60, 20)


def test_team_limit_under_concurrency_in_process(api):
    _team_burst(api, [api.url], 15 * COST_ESTIMATE, 60, 20)


def _fire_responses(clients: list[openai.OpenAI], requests: int, threads: int) -> list[int]:
    """`requests` Responses API requests, every other one streamed, from `threads` threads."""
    tag = marker()

    def one(i: int) -> int:
        client = clients[i % len(clients)]
        text = f"race {tag} {i} sim:tokens={MAX_TOKENS}"
        try:
            if i % 2:
                with client.responses.stream(
                    model="gpt-sim", input=text, max_output_tokens=MAX_TOKENS, store=False
                ) as stream:
                    stream.get_final_response()
            else:
                client.responses.create(
                    model="gpt-sim", input=text, max_output_tokens=MAX_TOKENS, store=False
                )
            return 200
        except openai.APIStatusError as exc:
            return exc.status_code

    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(one, range(requests)))


@pytest.mark.postgres
def test_responses_never_overspend_across_two_postgres_replicas(two_replicas):
    """40 Responses requests at once, streamed and not, over two replicas: the token's limit
    holds, every one served is one event, nothing stays reserved."""
    admin = two_replicas[0].api()
    team, user, token = admin.principal(token_limit=str(12 * COST_ESTIMATE))
    clients = [
        openai.OpenAI(base_url=f"{r.url}/v1", api_key=token["token"], max_retries=0)
        for r in two_replicas
    ]
    statuses = _fire_responses(clients, 40, 20)
    scopes = {"token": token["id"], "user": user["id"], "team": team["id"]}
    _check_ledger(admin, statuses, scopes, "token")
    assert {e["endpoint"] for e in admin.events(token_id=token["id"])} == {"responses"}


@pytest.mark.postgres
def test_the_change_feed_gives_every_event_once_across_replicas_and_a_restart(two_replicas):
    """Four long streams and twelve quick requests over two replicas, the feed polled every
    100 ms through either; one replica restarted meanwhile: every event of the ledger comes
    once, none twice, whatever order the events committed in."""
    first, second = two_replicas
    admin = first.api()
    _, _, token = admin.principal()
    oa = [
        openai.OpenAI(base_url=f"{r.url}/v1", api_key=token["token"], max_retries=0)
        for r in two_replicas
    ]
    seen: list[str] = []
    stop = threading.Event()
    ledger: set[str] = set()  # every event, once the requests are over

    def poll() -> None:
        cursor, turn, after_stop = None, 0, 0
        while True:
            done = stop.is_set()  # polls after the last request ended, until all came
            after_stop += done
            url = two_replicas[turn % 2].url
            turn += 1
            params = {"limit": 1000, **({"after": cursor} if cursor else {})}
            try:
                page = httpx.get(
                    f"{url}/v1/usage/changes",
                    params=params,
                    headers={"authorization": f"Bearer {token['token']}"},
                    timeout=10,
                ).json()
            except (httpx.HTTPError, ValueError):
                continue  # the replica restarting: the other answers next
            seen.extend(e["id"] for e in page["data"])
            cursor = page["next"] or cursor
            if done and not page["data"] and (ledger <= set(seen) or after_stop > 300):
                return
            time.sleep(0.1)

    def long_stream(i: int) -> None:
        text = f"long {i} sim:tokens=120 sim:chunks=40 sim:delay_ms=25"
        with oa[0].chat.completions.create(
            model="gpt-sim", messages=[{"role": "user", "content": text}], stream=True
        ) as stream:
            for _ in stream:
                pass

    def quick(i: int) -> None:
        oa[i % 2].chat.completions.create(
            model="gpt-sim", messages=[{"role": "user", "content": f"quick {i} sim:tokens=3"}]
        )

    poller = threading.Thread(target=poll)
    poller.start()
    with ThreadPoolExecutor(max_workers=12) as pool:
        streams = [pool.submit(long_stream, i) for i in range(4)]
        quicks = [pool.submit(quick, i) for i in range(12)]
        for job in quicks:
            job.result()
        second.stop()
        second.start()
        for job in [pool.submit(quick, 100 + i) for i in range(4)] + streams:
            job.result()
    # The last events' transactions are over once their answers ended; then one empty poll.
    for _ in range(100):
        ledger.update(e["id"] for e in admin.events(token_id=token["id"]))
        if len(ledger) == 20:
            break
        time.sleep(0.05)
    stop.set()
    poller.join(timeout=60)
    assert not poller.is_alive()
    assert len(ledger) == 20
    assert len(seen) == len(set(seen)), "an event came twice"
    assert set(seen) == ledger
