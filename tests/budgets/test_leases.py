"""Credit leases: requests admitted in memory against slices of a budget's credit, never above
its limit, across replicas, and nothing lost or left reserved when a replica dies holding one.

The lease book is driven directly on both backends; then two `metering serve` replicas on one
PostgreSQL, one of them killed (`kill -9`) while it holds a slice and has streams in flight.
"""

import asyncio
import re
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from decimal import Decimal

import httpx
import openai
import pytest
from sqlalchemy import select, update

from metering.budgets.leases import MIN_REQUESTS, expire_leases
from metering.budgets.reserve import BudgetShortfall, reserve
from metering.budgets.runtime import BudgetRuntime
from metering.budgets.settle_queue import settle
from metering.budgets.views import lease_slack
from metering.db import Database, utcnow
from metering.jobs import expire_holds, sweep_interval_s
from metering.ledger.tables import LedgerEvent
from metering.models import BudgetLease, Hold
from tests.budgets.conftest import (
    budget,
    chat,
    chat_body,
    holds_of,
    marker,
    new_pg_database,
    pico,
    query,
    replicas,
    sim_records,
    usd,
    wait_for,
)
from tests.budgets.test_crash_recovery import (
    STREAMS,
    _add_budgets,
    _budgets,
    _count,
    _event,
    _spec,
    _stream_until_cut,
    _subjects,
)


def _runtime(db: Database, share: int = 8, ttl_s: int = 3600) -> BudgetRuntime:
    return BudgetRuntime(db, lease_share=share, hold_ttl_s=ttl_s, trusted=lambda: True)


async def _lease_rows(db: Database) -> dict[str, int]:
    async with db.sessions() as session:
        rows = await session.execute(select(BudgetLease.subject_id, BudgetLease.amount))
        return dict(rows.all())


@pytest.mark.anyio
async def test_a_lease_admits_in_memory_and_its_row_covers_every_hold(fresh_db):
    db = Database(fresh_db, 4)
    try:
        subjects = _subjects()
        await _add_budgets(db, subjects, "1", "never", utcnow())
        runtime = _runtime(db)
        book = runtime.leases
        first = await reserve(runtime, _spec(subjects), 3600, book)
        assert first.claim is not None  # admitted against a lease
        amount = first.amount
        leases = await _lease_rows(db)
        # A slice of each budget: 1/8 of the dollar, counted in reserved.
        assert set(leases) == set(subjects.values())
        assert set(leases.values()) == {pico("0.125")}
        for row in (await _budgets(db, subjects)).values():
            assert row.reserved == pico("0.125")
        # The next requests take no lock on the budgets: the same leases cover them.
        more = [await reserve(runtime, _spec(subjects), 3600, book) for _ in range(5)]
        assert all(r.claim is not None for r in more)
        assert book.taken == 1 and book.admitted == 6
        assert await _count(db, Hold, Hold.leased.is_(True)) == 6
        # The status shows what requests hold, not the lease's unused part.
        async with db.sessions() as session:
            slack = await lease_slack(session, list(subjects.values()))
        assert set(slack.values()) == {pico("0.125") - 6 * amount}

        # Settled: cost moves from the lease to spent; the row and the view move together.
        costs = 0
        for i, reservation in enumerate([first, *more]):
            event = _event(_spec(subjects), 10 + i, id=reservation.hold_id)
            assert await settle(runtime.settles, event, reservation) is True
            costs += event.cost
        for row in (await _budgets(db, subjects)).values():
            assert row.spent == costs
            assert row.reserved == pico("0.125") - costs
        lease = book.leases[subjects["token"]]
        assert (lease.amount, lease.inflight) == (pico("0.125") - costs, 0)
        assert set((await _lease_rows(db)).values()) == {lease.amount}

        # Idle: given back, nothing left reserved.
        assert await book.return_idle(idle_s=0) == 3
        assert await _lease_rows(db) == {}
        for row in (await _budgets(db, subjects)).values():
            assert (row.spent, row.reserved) == (costs, 0)
        assert await _count(db, LedgerEvent) == 6
    finally:
        await db.dispose()


@pytest.mark.anyio
async def test_a_burst_against_leases_never_passes_the_limit_and_uses_the_last_credit(fresh_db):
    """Two lease books (two replicas) and many concurrent requests against a limit covering
    about fifty: slices shrink near the limit, the last requests take the database path."""

    dbs = [Database(fresh_db, 6) for _ in range(2)]
    try:
        subjects = _subjects()
        hold = _spec(subjects).amount(50)
        limit = 50 * hold + hold // 3
        await _add_budgets(dbs[0], subjects, str(Decimal(limit) / 10**12), "never", utcnow())
        runtimes = [_runtime(db) for db in dbs]
        books = [r.leases for r in runtimes]
        served, refused = [], 0

        async def one(i: int) -> bool:
            nonlocal refused
            runtime, book = runtimes[i % 2], books[i % 2]
            spec = _spec(subjects)
            try:
                reservation = await reserve(runtime, spec, 3600, book)
            except BudgetShortfall:
                refused += 1
                return False
            await asyncio.sleep(0.001 * (i % 7))
            event = _event(spec, 50, id=reservation.hold_id)
            assert await settle(runtime.settles, event, reservation) is True
            served.append(event.cost)
            return True

        # Waves of concurrent requests on both replicas until two whole waves are refused
        # (a replica refused gives its slices back, so the next wave can use their credit).
        refused_waves = 0
        for wave in range(100):
            admitted = await asyncio.gather(*(one(wave * 16 + i) for i in range(16)))
            for book in books:  # the upkeep's tick: dropped slices whose requests ended
                await book.return_idle(idle_s=3600)
            refused_waves = 0 if any(admitted) else refused_waves + 1
            if refused_waves == 2:
                break
        assert sum(b.admitted for b in books) > 0  # leases were used...
        assert refused > 0  # ...and the limit bit
        for book in books:
            await book.return_idle(idle_s=0)
        rows = await _budgets(dbs[0], subjects)
        for row in rows.values():
            assert row.spent == sum(served) <= limit
            assert row.reserved == 0
        # The last credit was used: what is left cannot cover one more request.
        assert limit - sum(served) < hold
        assert await _lease_rows(dbs[0]) == {}
        assert await _count(dbs[0], LedgerEvent) == len(served)
    finally:
        for db in dbs:
            await db.dispose()


@pytest.mark.anyio
async def test_a_slice_too_small_takes_the_database_path(fresh_db):
    db = Database(fresh_db, 4)
    try:
        subjects = _subjects()
        hold = _spec(subjects).amount(50)
        # 1/8 of what is left covers fewer than MIN_REQUESTS holds: no lease.
        limit = 8 * MIN_REQUESTS * hold - 1
        await _add_budgets(db, subjects, str(Decimal(limit) / 10**12), "never", utcnow())
        runtime = _runtime(db)
        book = runtime.leases
        reservation = await reserve(runtime, _spec(subjects), 3600, book)
        assert reservation.claim is None
        assert await _lease_rows(db) == {}
        for row in (await _budgets(db, subjects)).values():
            assert row.reserved == reservation.amount
        # For a while its requests go straight to the database path, without trying.
        assert set(book.too_small) == {subjects["token"]}
        again = await reserve(runtime, _spec(subjects), 3600, book)
        assert again.claim is None and book.taken == 0
        # A change to the budget (a raised limit) lets it lease again at once.
        book.drop(frozenset({f"budget:{subjects['token']}"}))
        assert book.too_small == {}
    finally:
        await db.dispose()


@pytest.mark.anyio
async def test_a_dropped_lease_admits_nothing_and_is_given_back_when_its_requests_end(fresh_db):
    """A change to a budget (a lowered limit) drops its leases before it is acknowledged."""

    db = Database(fresh_db, 4)
    try:
        subjects = _subjects()
        await _add_budgets(db, subjects, "1", "never", utcnow())
        runtime = _runtime(db)
        book = runtime.leases
        inflight = await reserve(runtime, _spec(subjects), 3600, book)
        assert inflight.claim is not None
        book.drop(frozenset({f"budget:{subjects['team']}"}))
        assert subjects["team"] not in book.leases
        # The next request cannot use the dropped lease: it takes a new one.
        after = await reserve(runtime, _spec(subjects), 3600, book)
        assert after.claim is not None
        assert after.claim.leases[2] is not inflight.claim.leases[2]
        assert await _count(db, BudgetLease) == 4  # the dropped one waits for its request
        await book.return_idle(idle_s=3600)
        assert await _count(db, BudgetLease) == 4
        event = _event(_spec(subjects), 5, id=inflight.hold_id)
        assert await settle(runtime.settles, event, inflight) is True
        assert await book.return_idle(idle_s=3600) == 1
        assert await _count(db, BudgetLease) == 3
        # An untrusted book (its listener is down) admits nothing against leases.
        book.trusted = lambda: False
        direct = await reserve(runtime, _spec(subjects), 3600, book)
        assert direct.claim is None
    finally:
        await db.dispose()


@pytest.mark.anyio
async def test_a_dead_processs_leases_and_holds_are_swept_to_the_cent(fresh_db):
    """The process stopped extending: its holds are charged as unsettled from its leases, then
    its leases are returned; spent + reserved is what its requests were charged."""

    db = Database(fresh_db, 4)
    try:
        subjects = _subjects()
        await _add_budgets(db, subjects, "1", "never", utcnow())
        runtime = _runtime(db)
        dead = runtime.leases
        settled = await reserve(runtime, _spec(subjects), 3600, dead)
        event = _event(_spec(subjects), 7, id=settled.hold_id)
        assert await settle(runtime.settles, event, settled) is True
        lost = [await reserve(runtime, _spec(subjects), 3600, dead) for _ in range(3)]
        assert all(r.claim is not None for r in lost)
        # The process dies: nothing extends its holds and leases any more.
        past = utcnow() - timedelta(seconds=1)
        async with db.begin() as conn:
            await conn.execute(update(Hold).values(expires_at=past))
            await conn.execute(update(BudgetLease).values(expires_at=past))
        # A lease no hold names is returned only after its holds are charged.
        assert await expire_leases(db) == 0
        assert await expire_holds(db) == len(lost)
        assert await _lease_rows(db) == {}
        total = event.cost + sum(r.amount for r in lost)
        for row in (await _budgets(db, subjects)).values():
            assert (row.spent, row.reserved) == (total, 0)
        async with db.sessions() as session:
            events = {e.id: e for e in await session.scalars(select(LedgerEvent))}
        assert {events[r.hold_id].status for r in lost} == {"unsettled"}
        assert len(events) == 1 + len(lost)
        # A late settle of a swept leased hold replaces its event; its lease is gone.
        late = _event(_spec(subjects), 3, id=lost[0].hold_id)
        assert await settle(runtime.settles, late, lost[0]) is True
        assert lost[0].claim.swept
        for row in (await _budgets(db, subjects)).values():
            assert row.spent == total - lost[0].amount + late.cost
            assert row.reserved == 0
    finally:
        await db.dispose()


# --- two `metering serve` replicas on one PostgreSQL ---------------------------------------

MAX_TOKENS = 64
COST_ESTIMATE = Decimal("0.0000414")


def _reservations(url: str) -> Counter:
    text = chat_metrics(url)
    found = Counter()
    for path, value in re.findall(r'metering_reservations_total\{path="(\w+)"\} ([0-9.e+]+)', text):
        found[path] += float(value)
    return found


def chat_metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=10).text


@pytest.fixture
def two_replicas(catalog_file, tmp_path):
    with (
        new_pg_database() as url,
        replicas(catalog_file, tmp_path) as start,
        ThreadPoolExecutor(2) as pool,
    ):
        yield url, list(pool.map(lambda _: start(url), range(2)))


@pytest.mark.postgres
def test_two_replicas_lease_one_limit_and_give_every_slice_back(two_replicas):
    url, servers = two_replicas
    admin = servers[0].api()
    team, user, token = admin.principal(token_limit=str(50 * COST_ESTIMATE))
    clients = [
        openai.OpenAI(base_url=f"{s.url}/v1", api_key=token["token"], max_retries=0)
        for s in servers
    ]
    tag = marker()

    def one(i: int) -> int:
        try:
            clients[i % 2].chat.completions.create(
                model="gpt-sim",
                messages=[{"role": "user", "content": f"lease {tag} {i} sim:tokens={MAX_TOKENS}"}],
                max_tokens=MAX_TOKENS,
            )
            return 200
        except openai.APIStatusError as exc:
            return exc.status_code

    with ThreadPoolExecutor(32) as pool:
        statuses = Counter(pool.map(one, range(160)))
    assert set(statuses) == {200, 402}, statuses
    # Both replicas admitted requests against leases.
    for server in servers:
        assert _reservations(server.url)["lease"] >= 1, server.url

    def all_given_back() -> None:
        wait_for(
            lambda: not query(url, "SELECT id FROM budget_leases"),
            timeout=10,
            message="idle leases given back",
        )

    # Every slice is given back once idle: nothing reserved, nothing leased.
    all_given_back()
    # The burst's last refusals depend on what was in flight then (holds are estimates, above
    # what their requests cost); the credit left is then still usable: one request at a time,
    # to one replica, until the first refusal.
    tail = Counter()
    for i in range(160, 260, 2):  # even numbers: the first replica
        tail[one(i)] += 1
        if tail[402]:
            break
    assert set(tail) <= {200, 402} and tail[402] == 1, tail
    all_given_back()
    events = admin.events(token_id=token["id"])
    assert len(events) == statuses[200] + tail[200]
    total = sum(usd(e["cost"]) for e in events)
    limit = 50 * COST_ESTIMATE
    for scope, subject in (("token", token["id"]), ("user", user["id"]), ("team", team["id"])):
        status = budget(admin, scope, subject)
        assert usd(status["reserved"]) == 0, status
        assert usd(status["spent"]) == total, status
    rows = query(url, "SELECT reserved FROM budgets WHERE subject_id = :id", id=token["id"])
    assert rows[0].reserved == 0
    assert total <= limit
    # The last credit was used: less than one more request's worth is left.
    assert limit - total < COST_ESTIMATE * 2


@pytest.mark.postgres
def test_a_replica_killed_holding_a_slice_loses_nothing(fresh_pg, serve, sim):
    ttl = 2
    first = serve(fresh_pg, METERING_HOLD_TTL_S=str(ttl))
    admin = first.api()
    team, user, token = admin.principal(token_limit="1", user_limit="1", team_limit="1")
    key, tag = token["token"], marker()
    done = chat(admin, key, f"lease {tag} done sim:tokens=5", max_tokens=5)
    assert done.status_code == 200, done.text
    threads = []
    for i in range(STREAMS):
        body = chat_body(
            f"lease {tag} stream {i} sim:delay_ms=200 sim:chunks=30 sim:tokens=60", stream=True
        )
        started = threading.Event()
        thread = threading.Thread(
            target=_stream_until_cut, args=(first.url, key, body, started), daemon=True
        )
        thread.start()
        threads.append((thread, started))
    for _, started in threads:
        assert started.wait(10), "a stream did not start"
    wait_for(
        lambda: (
            len([r for r in sim_records(sim, tag) if r["delivered_chunks"] >= 1]) == 1 + STREAMS
        ),
        message="all requests at the upstream",
    )
    holds = {row.id: row.amount for row in holds_of(fresh_pg, token["id"])}
    assert len(holds) == STREAMS
    leased = query(fresh_pg, "SELECT count(*) AS n FROM holds WHERE leased")[0].n
    assert leased == STREAMS  # admitted against the replica's slices
    assert len(query(fresh_pg, "SELECT id FROM budget_leases")) == 3
    first.kill()
    for thread, _ in threads:
        thread.join(10)

    second = serve(fresh_pg, METERING_HOLD_TTL_S=str(ttl))
    admin = second.api()
    wait_for(
        lambda: (
            not holds_of(fresh_pg, token["id"])
            and not query(fresh_pg, "SELECT id FROM budget_leases")
        ),
        timeout=ttl + 6 * sweep_interval_s(ttl) + 5,
        interval=0.2,
        message="the survivor charging the holds and returning the slices",
    )
    events = admin.events(token_id=token["id"])
    assert len(events) == len(sim_records(sim, tag)) == 1 + STREAMS
    unsettled = {e["id"]: e for e in events if e["usage_source"] == "unsettled"}
    assert set(unsettled) == set(holds)
    for hold_id, event in unsettled.items():
        assert pico(event["cost"]) == holds[hold_id]
    total = sum(usd(e["cost"]) for e in events)
    for scope, subject in (("token", token["id"]), ("user", user["id"]), ("team", team["id"])):
        status = budget(admin, scope, subject)
        assert usd(status["reserved"]) == 0, status
        assert usd(status["spent"]) == total, status
    rows = query(fresh_pg, "SELECT sum(reserved) AS r FROM budgets")
    assert rows[0].r == 0


@pytest.mark.postgres
def test_a_lowered_limit_stops_the_other_replicas_leases_even_with_its_listener_cut(
    two_replicas,
):
    url, (a, b) = two_replicas
    admin = a.api()
    for cut in (False, True):
        team, user, token = admin.principal(token_limit="1")
        key = token["token"]
        for _ in range(3):  # b takes a slice of the token's dollar and serves from it
            assert chat(b.api(), key, f"warm {marker()}", max_tokens=5).status_code == 200
        assert query(url, "SELECT id FROM budget_leases WHERE subject_id = :id", id=token["id"])
        if cut:
            wait_for(
                lambda: (
                    query(
                        url,
                        "SELECT count(*) AS n FROM pg_stat_activity WHERE application_name = "
                        "'metering-auth' AND datname = current_database()",
                    )[0].n
                    >= 2
                ),
                message="both listeners connected",
            )
            killed = query(
                url,
                "SELECT count(pg_terminate_backend(pid)) AS n FROM pg_stat_activity "
                "WHERE application_name = 'metering-auth' AND datname = current_database()",
            )
            assert killed[0].n >= 2
        a.api().ok("PATCH", f"/v1/tokens/{token['id']}", json={"credit_limit": "0"})
        refused = chat(b.api(), key, f"lowered {marker()}", max_tokens=5)
        assert refused.status_code == 402, refused.text
        assert refused.headers["x-budget-scope"] == "token"


@pytest.mark.anyio
async def test_leases_can_be_turned_off(fresh_db):
    db = Database(fresh_db, 4)
    try:
        subjects = _subjects()
        await _add_budgets(db, subjects, "1", "never", utcnow())
        runtime = _runtime(db, share=0)
        book = runtime.leases
        reservation = await reserve(runtime, _spec(subjects), 3600, book)
        assert reservation.claim is None
        assert await _lease_rows(db) == {}
        for row in (await _budgets(db, subjects)).values():
            assert row.reserved == reservation.amount
        # Off: not even tried.
        assert book.too_small == {} and book.taken == 0
    finally:
        await db.dispose()


@pytest.mark.anyio
async def test_a_lease_returned_while_its_process_stalled_is_never_used_again(fresh_db):
    db = Database(fresh_db, 4)
    try:
        subjects = _subjects()
        await _add_budgets(db, subjects, "1", "never", utcnow())
        runtime = _runtime(db)
        book = runtime.leases
        first = await reserve(runtime, _spec(subjects), 3600, book)
        event = _event(_spec(subjects), 5, id=first.hold_id)
        assert await settle(runtime.settles, event, first) is True
        # The process stalls past the TTL: a sweeper returns its leases.
        past = utcnow() - timedelta(seconds=1)
        async with db.begin() as conn:
            await conn.execute(update(BudgetLease).values(expires_at=past))
        assert await expire_leases(db) == 3
        # Back, its upkeep finds them gone: no request is admitted against them.
        await book.extend()
        assert book.leases == {}
        again = await reserve(runtime, _spec(subjects), 3600, book)
        assert again.claim is not None and book.taken == 2
        for row in (await _budgets(db, subjects)).values():
            assert row.spent == event.cost
            assert row.reserved == (pico("1") - event.cost) // 8  # only the new slice
    finally:
        await db.dispose()
