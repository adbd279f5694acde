"""(a) The primary killed under 100 concurrent requests over two replicas, its synchronous
standby promoted: the replicas find the new primary through their multi-host URL without a
restart, every answer is a 2xx or a 503 (or the small token's 402 once its budget is spent), and
the three invariants hold (tests/faults/invariants.py)."""

import time
import uuid
from decimal import Decimal

from metering import migrate
from tests.budgets.conftest import pico, query, wait_for
from tests.faults import invariants
from tests.faults.figures import report
from tests.faults.load import Load

HOLD_TTL_S = 6
WORKERS = 100
SMALL_WORKERS = 10  # their token's budget runs out during the run
BEFORE = 300  # 2xx answers before the kill
AFTER = 300  # 2xx answers to requests sent after the promotion
MAX_S = 120  # the load must have recovered by then
ANSWERS_AGAIN_S = 30  # each replica answers a 2xx again this soon after the promotion


def test_primary_killed_under_load_and_standby_promoted(pair, serve, sim):
    name = f"metering_{uuid.uuid4().hex[:10]}"
    pair.create_database(name)
    url = pair.url(name)
    migrate.upgrade(url)
    replicas = [serve(url, METERING_HOLD_TTL_S=str(HOLD_TTL_S)) for _ in range(2)]
    api = replicas[0].api()
    _, _, token = api.principal(token_limit="1000", user_limit="1000", team_limit="1000")
    _, _, small = api.principal(token_limit="0.0005")
    tag = f"fo{uuid.uuid4().hex[:10]}"
    keys = [small["token"]] * SMALL_WORKERS + [token["token"]] * (WORKERS - SMALL_WORKERS)
    load = Load([r.url for r in replicas], keys, tag).start()
    try:
        wait_for(lambda: load.ok_since(0) >= BEFORE, timeout=MAX_S, message="load before")
        killed = time.monotonic()
        pair.primary.kill()
        pair.standby.promote()
        promoted = time.monotonic()
        for replica in replicas:  # each answers again
            wait_for(
                lambda r=replica: any(
                    x.url == r.url and x.status == 200 and x.started >= promoted
                    for x in load.snapshot()
                ),
                timeout=ANSWERS_AGAIN_S,
                message=f"{replica.url} answering after the promotion",
            )
        wait_for(lambda: load.ok_since(promoted) >= AFTER, timeout=MAX_S, message="load after")
    finally:
        load.stop()
    results = load.snapshot()

    small_key_requests = {r.marker for r in results if r.code == "budget_exceeded"}
    kinds = {(r.status, r.code) for r in results}
    assert kinds <= {(200, None), (503, "ledger_unavailable"), (402, "budget_exceeded")}, [
        r for r in results if (r.status, r.code) not in {(200, None), (503, "ledger_unavailable")}
    ][:3]
    assert small_key_requests, "the small budget was never exhausted"

    figures = invariants.check(url, sim, tag, results, HOLD_TTL_S)
    # The small token's budget was spent up to its limit, never past it.
    spent = query(url, "SELECT spent FROM budgets WHERE subject_id = :s", s=small["id"])[0][0]
    assert 0 < spent <= pico(str(Decimal("0.0005")))

    after_kill = [r for r in results if r.started >= killed]
    first_ok = min(r.ended for r in after_kill if r.status == 200)
    refused = [r for r in results if r.status == 503]
    assert {r.retry_after for r in refused} <= {"1"}  # as the SDKs read it
    report(
        "failover",
        {
            "requests": len(results),
            "answered_2xx": figures["answered"],
            "answered_503": len(refused),
            "events": figures["events"],
            "unsettled_events": figures["unsettled"],
            "promote_s": round(promoted - killed, 2),
            "answering_again_s": round(first_ok - killed, 2),
            "last_503_s": round(max((r.ended for r in refused), default=killed) - killed, 2),
        },
    )
