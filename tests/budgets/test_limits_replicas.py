"""Limits beyond credit across two `metering serve` replicas sharing one PostgreSQL: a burst
admits exactly the limit, parallel slots hold at the upstream, the openai SDK's own retry
succeeds after retry-after, a shortened lifetime is refused everywhere, and a killed replica's
slots come back within the hold TTL."""

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import httpx
import openai
import pytest

from metering.jobs import sweep_interval_s
from tests.budgets.conftest import (
    chat,
    chat_body,
    marker,
    new_pg_database,
    replicas,
    sim_records,
    wait_for,
)
from tests.budgets.test_limits import limits, patch

# The replicas run in processes of their own, on the wall clock: a run whose requests must share
# one rate window is run again, on a fresh token, when it straddled a minute boundary (a run takes
# seconds, so a second run is rare, a third rarer still).
RUNS = 3


def minute() -> datetime:
    return datetime.now(UTC).replace(second=0, microsecond=0)


@pytest.fixture(scope="module")
def two(catalog_file, tmp_path_factory):
    """Two replicas on a PostgreSQL database of the module's own (each test makes its own team,
    user and token): started once, not per test."""
    with (
        new_pg_database() as url,
        replicas(catalog_file, tmp_path_factory.mktemp("two")) as start,
    ):
        yield start(url), start(url)


def _post(url: str, key: str, body: bytes) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/chat/completions",
        content=body,
        headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
        timeout=30,
    )


def test_a_burst_of_three_times_rpm_admits_exactly_rpm(two, sim):
    first, second = two
    admin = first.api()
    rpm = 10
    urls = [first.url, second.url]
    for _ in range(RUNS):
        _, _, token = admin.principal()
        patch(admin, "token", token["id"], rpm_limit=rpm)
        key, tag = token["token"], marker()

        def one(i: int, key: str = key, tag: str = tag) -> int:
            body = chat_body(f"{tag} {i} sim:tokens=2", max_tokens=4)
            return _post(urls[i % 2], key, body).status_code

        window = minute()
        with ThreadPoolExecutor(max_workers=12) as pool:
            statuses = Counter(pool.map(one, range(3 * rpm)))
        if minute() == window:  # one window
            break
    else:
        pytest.fail(f"{RUNS} bursts each straddled a minute boundary")
    assert statuses == {200: rpm, 429: 2 * rpm}
    assert len(sim_records(sim, tag)) == rpm  # the refused never reached the upstream
    assert len(admin.events(token_id=token["id"])) == rpm


def _stream_until_served(url: str, key: str, body: bytes, refused: list) -> None:
    """Stream one request, waiting out every 429 as its retry-after says."""
    while True:
        with httpx.stream(
            "POST",
            f"{url}/v1/chat/completions",
            content=body,
            headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
            timeout=30,
        ) as response:
            if response.status_code == 200:
                for _ in response.iter_bytes():
                    pass
                return
            assert response.status_code == 429, response.read()
            refused.append(response.headers["retry-after"])
            time.sleep(0.2)


def test_max_parallel_requests_holds_at_the_upstream_across_replicas(two, sim):
    first, second = two
    admin = first.api()
    _, _, token = admin.principal()
    patch(admin, "token", token["id"], max_parallel_requests=3)
    key, tag = token["token"], marker()
    refused: list[str] = []
    threads = [
        threading.Thread(
            target=_stream_until_served,
            args=(
                (first.url, second.url)[i % 2],
                key,
                chat_body(f"{tag} {i} sim:tokens=8 sim:chunks=8 sim:delay_ms=40", stream=True),
                refused,
            ),
        )
        for i in range(20)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    records = sim_records(sim, tag)
    assert len(records) == 20 and all(r["closed_at"] is not None for r in records)
    edges = sorted(
        [(r["opened_at"], 1) for r in records] + [(r["closed_at"], -1) for r in records],
        key=lambda edge: (edge[0], edge[1]),
    )
    at_once, most = 0, 0
    for _, step in edges:
        at_once += step
        most = max(most, at_once)
    assert most == 3
    assert refused and set(refused) == {"1"}
    assert limits(admin, "token", token["id"])["in_flight"] == 0
    assert len(admin.events(token_id=token["id"])) == 20


def test_the_openai_sdks_own_retry_succeeds_after_retry_after(two, sim):
    first, second = two
    admin = first.api()
    _, _, token = admin.principal()
    patch(admin, "token", token["id"], max_parallel_requests=1)
    key, tag = token["token"], marker()
    body = chat_body(f"{tag} long sim:tokens=200 sim:chunks=200 sim:delay_ms=50", stream=True)
    release = threading.Event()
    seen: list[int] = []

    def hold_the_slot() -> None:
        with httpx.stream(
            "POST",
            f"{first.url}/v1/chat/completions",
            content=body,
            headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
            timeout=30,
        ) as response:
            assert response.status_code == 200
            chunks = response.iter_bytes()  # kept: a generator collected closes the stream
            next(chunks)
            held.set()
            release.wait(30)  # then the client leaves: the slot is given back

    held = threading.Event()
    holder = threading.Thread(target=hold_the_slot)
    holder.start()
    assert held.wait(30)

    def on_response(response: httpx.Response) -> None:
        seen.append(response.status_code)
        if response.status_code == 429:
            release.set()

    client = openai.OpenAI(
        base_url=f"{second.url}/v1",
        api_key=key,
        max_retries=5,
        http_client=httpx.Client(event_hooks={"response": [on_response]}),
    )
    answer = client.chat.completions.create(
        model="gpt-sim",
        messages=[{"role": "user", "content": f"{tag} retried sim:tokens=2"}],
        max_tokens=4,
    )
    holder.join(30)
    assert answer.choices[0].message.content
    assert seen[0] == 429 and seen[-1] == 200


def test_a_shortened_lifetime_is_refused_on_both_replicas(two):
    first, second = two
    admin = first.api()
    _, _, token = admin.principal()
    key = token["token"]
    for server in two:  # each replica has the credential cached
        assert chat(server.api(), key, "life sim:tokens=1", max_tokens=2).status_code == 200
    shortened = patch(admin, "token", token["id"], expires_in=1)
    wait_for(
        lambda: chat(admin, key, "life sim:tokens=1", max_tokens=2).status_code == 401,
        timeout=10,
        message="the lifetime ending",
    )
    for server in two:
        refused = chat(server.api(), key, "life sim:tokens=1", max_tokens=2)
        assert refused.status_code == 401
        assert refused.json()["error"]["message"] == (
            f"this API token expired at {shortened['expires_at']}"
        )


def test_a_killed_replicas_slots_come_back_within_the_ttl(fresh_pg, serve, sim):
    ttl = 2
    doomed = serve(fresh_pg, METERING_HOLD_TTL_S=str(ttl))
    admin = doomed.api()
    _, _, token = admin.principal()
    patch(admin, "token", token["id"], max_parallel_requests=2, tpm_limit=100_000)
    key, tag = token["token"], marker()
    started = [threading.Event() for _ in range(2)]

    def stream(i: int) -> None:
        body = chat_body(f"{tag} {i} sim:tokens=100 sim:chunks=100 sim:delay_ms=100", stream=True)
        try:
            with httpx.stream(
                "POST",
                f"{doomed.url}/v1/chat/completions",
                content=body,
                headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
                timeout=30,
            ) as response:
                started[i].set()
                for _ in response.iter_bytes():
                    pass
        except httpx.HTTPError:
            pass  # cut by the kill

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(2)]
    for thread in threads:
        thread.start()
    assert all(event.wait(10) for event in started)
    assert limits(admin, "token", token["id"])["in_flight"] == 2
    refused = chat(admin, key, f"{tag} third sim:tokens=1", max_tokens=2)
    assert refused.status_code == 429
    assert "max_parallel_requests of 2" in refused.json()["error"]["message"]
    doomed.kill()
    survivor = serve(fresh_pg, METERING_HOLD_TTL_S=str(ttl))
    admin = survivor.api()
    wait_for(
        lambda: limits(admin, "token", token["id"])["in_flight"] == 0,
        timeout=ttl + 6 * sweep_interval_s(ttl) + 5,
        interval=0.2,
        message="the survivor giving the slots back",
    )
    assert chat(admin, key, f"{tag} after sim:tokens=1", max_tokens=2).status_code == 200


def _tpm_run(first, second) -> dict:
    """Four requests that fit only when each is settled to its actual usage, then one refused
    while a reservation is held open on the other replica, then one admitted once it ended."""
    admin = first.api()
    _, _, token = admin.principal()
    key, tag = token["token"], marker()
    body = chat_body(f"{tag} sim:tokens=3", max_tokens=100)
    reserve = len(body) + 64 + 100  # the prompt's upper bound and the output allowance
    # Room for one reservation, not two: only settling to the actual usage admits the next.
    patch(admin, "token", token["id"], tpm_limit=2 * reserve - 1)
    run: dict = {"window": minute()}
    run["statuses"] = [
        _post(server.url, key, body).status_code for server in (first, second, first, second)
    ]
    events = admin.events(token_id=token["id"])
    run["actual"] = sum(e["prompt_tokens"] + e["completion_tokens"] for e in events)
    run["counted"] = limits(admin, "token", token["id"])["tokens"]
    # Held open on one replica, a reservation leaves the other no room.
    held = chat_body(
        f"{tag} held sim:tokens=40 sim:chunks=40 sim:delay_ms=50", stream=True, max_tokens=100
    )
    with httpx.stream(
        "POST",
        f"{first.url}/v1/chat/completions",
        content=held,
        headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
        timeout=30,
    ) as response:
        chunks = response.iter_bytes()  # kept: a generator collected closes the stream
        next(chunks)
        run["refused"] = _post(second.url, key, body)
        for _ in chunks:
            pass
    run["after"] = _post(second.url, key, body).status_code
    run["one_window"] = minute() == run["window"]
    return run


def test_tpm_settled_to_actual_usage_admits_the_next_on_either_replica(two):
    first, second = two
    for _ in range(RUNS):
        run = _tpm_run(first, second)
        if run["one_window"]:
            break
    else:
        pytest.fail(f"{RUNS} runs each straddled a minute boundary")
    assert run["statuses"] == [200, 200, 200, 200]
    assert run["counted"] == run["actual"]
    refused = run["refused"]
    assert refused.status_code == 429
    assert "over its tpm_limit" in refused.json()["error"]["message"]
    assert run["after"] == 200
