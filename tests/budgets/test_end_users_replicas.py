"""One end user's budget across two `metering serve` replicas sharing one PostgreSQL: 100
requests at once never end its window above the limit, and the ledger's sum for the end user
is its budget's spent. Also the hold of a request whose replica died is charged to the end
user's budget once, when it expires."""

from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal

import pytest
from sqlalchemy import func, select

from metering.ledger.tables import LedgerEvent
from metering.models import Hold
from tests.budgets.conftest import new_pg_database, pico, query, replicas, usd
from tests.budgets.test_end_users import call, end_user_budget, end_user_team, member

LIMIT = "0.001"  # about 15 requests' holds, 24 requests' costs


@pytest.fixture(scope="module")
def two(catalog_file, tmp_path_factory):
    """Two replicas on a PostgreSQL database of the module's own."""
    with (
        new_pg_database() as url,
        replicas(catalog_file, tmp_path_factory.mktemp("two")) as start,
    ):
        yield start(url), start(url)


def ledger_sum(url: str, team_id: str, end_user: str) -> tuple[int, int]:
    (row,) = query(
        url,
        select(func.count(), func.coalesce(func.sum(LedgerEvent.__table__.c.cost), 0)).where(
            LedgerEvent.__table__.c.team_id == team_id,
            LedgerEvent.__table__.c.end_user == end_user,
        ),
    )
    return int(row[0]), int(row[1])


def test_100_concurrent_requests_of_one_end_user_over_two_replicas_stay_within_it(two):
    first, second = two
    admin = first.api()
    team = end_user_team(admin, LIMIT)
    _, token = member(admin, team)
    clients = [first.api().openai(token["token"]), second.api().openai(token["token"])]

    def one(i: int):
        # Every fifth request has no end user: served beside the others, held by leases.
        return call(clients[i % 2], None if i % 5 == 4 else "olga")

    with ThreadPoolExecutor(50) as pool:
        answers = list(pool.map(one, range(100)))
    mine = [a for i, a in enumerate(answers) if i % 5 != 4]
    others = [a for i, a in enumerate(answers) if i % 5 == 4]
    assert {status for status, _, _ in others} == {200}
    statuses = sorted(status for status, _, _ in mine)
    assert set(statuses) == {200, 402}, statuses
    for status, headers, _ in mine:
        if status == 402:
            assert headers["x-budget-scope"] == "end_user"

    olga = end_user_budget(admin, team["id"], "olga")
    assert usd(olga["reserved"]) == 0
    assert 0 < usd(olga["spent"]) <= Decimal(LIMIT)
    events, spent = ledger_sum(first.database_url, team["id"], "olga")
    assert events == statuses.count(200)
    assert spent == pico(olga["spent"])
    assert not query(first.database_url, select(Hold.id).where(Hold.team_id == team["id"]))
