"""The three invariants the fault suite checks after each fault, read from the database and the
simulated upstream's log:

1. every 2xx a client saw has its ledger event (its x-request-id is an event's id), each
   request that reached the upstream has exactly one event, and no event is there twice;
2. no budget ended a window above its limit (the live window and every closed one);
3. reserved returns to 0: no hold and no lease is left once the holds' TTL has passed.
"""

from collections import Counter

from metering.jobs import sweep_interval_s
from tests.budgets.conftest import query, sim_records, wait_for
from tests.faults.load import Result


def settled(database_url: str, hold_ttl_s: int) -> None:
    """Wait until every hold is settled or swept and every lease given back (invariant 3)."""

    def idle() -> bool:
        holds = query(database_url, "SELECT count(*) FROM holds")[0][0]
        leases = query(database_url, "SELECT count(*) FROM budget_leases")[0][0]
        reserved = query(database_url, "SELECT coalesce(sum(reserved), 0) FROM budgets")[0][0]
        return holds == 0 and leases == 0 and reserved == 0

    wait_for(
        idle,
        timeout=hold_ttl_s + 4 * sweep_interval_s(hold_ttl_s) + 30,
        interval=0.2,
        message="every hold settled or swept, every lease given back, reserved 0",
    )


def check(database_url: str, sim, tag: str, results: list[Result], hold_ttl_s: int) -> dict:
    """Invariants 1-3 (see the module's docstring); returns the counts they were checked on."""
    settled(database_url, hold_ttl_s)

    events = query(
        database_url, "SELECT id, usage_source FROM ledger_events WHERE corrects_event_id IS NULL"
    )
    ids = Counter(row[0] for row in events)
    assert [i for i, n in ids.items() if n > 1] == [], "an event recorded twice"

    ok = [r for r in results if 200 <= r.status < 300]
    assert all(r.request_id for r in ok)
    missing = [r.request_id for r in ok if r.request_id not in ids]
    assert missing == [], f"{len(missing)} answered requests have no ledger event"

    # Every request that reached the upstream was charged once, and nothing else was.
    received = Counter(
        rec["received"]["messages"][-1]["content"].split()[1] for rec in sim_records(sim, tag)
    )
    assert [m for m, n in received.items() if n > 1] == [], "a request reached the upstream twice"
    by_id = {r.request_id: r for r in results}
    extra = [
        (row[0], row[1], by_id.get(row[0]))
        for row in events
        if by_id.get(row[0]) is None or by_id[row[0]].marker not in received
    ]
    assert len(events) == sum(received.values()), (len(events), sum(received.values()), extra)

    over = query(
        database_url,
        "SELECT subject_id, spent, credit_limit FROM budgets "
        "WHERE credit_limit IS NOT NULL AND spent > credit_limit "
        "UNION ALL SELECT subject_id, spent, credit_limit FROM budget_windows "
        "WHERE credit_limit IS NOT NULL AND spent > credit_limit",
    )
    assert over == [], f"budgets above their limits: {over}"

    # Each token's spent (its live window's and its closed windows') is what its events cost:
    # nothing charged that is not in the ledger.
    unbalanced = query(
        database_url,
        "SELECT b.subject_id, b.spent + coalesce((SELECT sum(w.spent) FROM budget_windows w "
        "WHERE w.subject_id = b.subject_id), 0) AS charged, coalesce((SELECT sum(e.cost) "
        "FROM ledger_events e WHERE e.token_id = b.subject_id), 0) AS cost FROM budgets b "
        "WHERE b.scope = 'token'",
    )
    unbalanced = [row for row in unbalanced if row[1] != row[2]]
    assert unbalanced == [], f"tokens whose spent is not their events' cost: {unbalanced}"
    return {
        "events": len(events),
        "unsettled": sum(row[1] == "unsettled" for row in events),
        "answered": len(ok),
    }
