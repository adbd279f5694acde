"""(b) One of two replicas cut from the database mid-request: a TCP forwarder between it and
PostgreSQL (tests/resilience/link.py) drops every connection it has, with requests under way,
and refuses new ones for a while. That replica answers 503 ledger_unavailable meanwhile (the
other serves on), then serves again on new connections; the three invariants hold
(tests/faults/invariants.py)."""

import time
import uuid

from metering import migrate
from tests.budgets.conftest import new_pg_database, wait_for
from tests.faults import invariants
from tests.faults.figures import report
from tests.faults.load import Load
from tests.resilience.link import DatabaseLink

HOLD_TTL_S = 6
WORKERS = 40
BEFORE = 150
AFTER = 150
CUT_S = 3  # the replica stays cut this long: shorter than its settles' retry (30 s)
MAX_S = 120


def test_a_replica_cut_from_the_database_mid_request(serve, sim):
    with new_pg_database() as url:
        migrate.upgrade(url)
        link = DatabaseLink()
        try:
            cut_url = url.replace("127.0.0.1:5432", f"127.0.0.1:{link.port}")
            cut = serve(cut_url, METERING_HOLD_TTL_S=str(HOLD_TTL_S))
            other = serve(url, METERING_HOLD_TTL_S=str(HOLD_TTL_S))
            api = other.api()
            _, _, token = api.principal(token_limit="1000", user_limit="1000", team_limit="1000")
            tag = f"cut{uuid.uuid4().hex[:10]}"
            load = Load([cut.url, other.url], [token["token"]] * WORKERS, tag).start()
            try:
                wait_for(lambda: load.ok_since(0) >= BEFORE, timeout=MAX_S, message="before")
                down = time.monotonic()
                link.down()  # every connection dropped, with requests under way on them
                time.sleep(CUT_S)
                link.up()
                up = time.monotonic()
                wait_for(
                    lambda: any(
                        r.url == cut.url and r.status == 200 and r.started >= up
                        for r in load.snapshot()
                    ),
                    timeout=MAX_S,
                    message="the cut replica answering again",
                )
                wait_for(lambda: load.ok_since(up) >= AFTER, timeout=MAX_S, message="after")
            finally:
                load.stop()
            results = load.snapshot()
            figures = invariants.check(url, sim, tag, results, HOLD_TTL_S)
        finally:
            link.cut()

    kinds = {(r.status, r.code) for r in results}
    assert kinds <= {(200, None), (503, "ledger_unavailable")}, [
        r for r in results if r.status != 200
    ][:3]
    during = [r for r in results if down <= r.started < up]
    refused = [r for r in during if r.status == 503]
    assert refused and all(r.url == cut.url for r in refused)  # only the cut replica refused
    assert {r.retry_after for r in refused} == {"1"}
    assert any(r.status == 200 and r.url == other.url for r in during)  # the other served on
    first_ok = min(r.ended for r in results if r.url == cut.url and r.started >= up)
    report(
        "replica_cut",
        {
            "requests": len(results),
            "answered_2xx": figures["answered"],
            "answered_503": len([r for r in results if r.status == 503]),
            "events": figures["events"],
            "unsettled_events": figures["unsettled"],
            "cut_s": CUT_S,
            "answering_again_after_reconnect_s": round(first_ok - up, 2),
        },
    )
