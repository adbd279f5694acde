"""On PostgreSQL, a group of settles in one statement: the holds taken, the budgets and leases
charged, the events inserted and every rollup kept, by one data-modifying WITH query inside
the group's transaction (one round trip instead of one per step).

It serves the settles whose holds this process wrote and knows whole: its amount and leases
are the reservation's, and it carries no rate claim and no run (those take the general path,
metering.budgets.service._settle_group). What each hold adds to each budget and lease is
worked out here from the reservation, as the general path works it out from the hold's row,
and the statement applies a hold's additions only if its row, taken by the same statement, is
the one expected (`ok`). A hold found but not as expected (never seen: it would be a bug) makes
the caller roll the whole group back and take the general path; a hold not found (swept while
its request ran) is charged by nothing here and settles alone afterwards, as in the general
path.

Budgets are locked in subject_id order before they are charged, as every writer here locks
them; the rollup rows in key order.
"""

from dataclasses import dataclass

import orjson

from metering.db import Prepared
from metering.ledger import rollup, writer
from metering.ledger.event import Event

# The holds taken, and those whose row is as the reservation says.
_TAKE = """
want AS (
  SELECT * FROM jsonb_to_recordset(CAST(:holds AS jsonb)) AS w(id text, amount bigint,
    leased boolean, token_lease text, user_lease text, team_lease text)
),
taken AS (
  DELETE FROM holds WHERE id = ANY(ARRAY(SELECT id FROM want))
  RETURNING id, amount, leased, token_lease, user_lease, team_lease, rate_kinds, run_id
),
ok AS (
  SELECT t.id FROM taken t JOIN want w ON w.id = t.id
  WHERE t.amount = w.amount AND t.leased = w.leased
    AND t.token_lease IS NOT DISTINCT FROM w.token_lease
    AND t.user_lease IS NOT DISTINCT FROM w.user_lease
    AND t.team_lease IS NOT DISTINCT FROM w.team_lease
    AND t.rate_kinds IS NULL AND t.run_id IS NULL
)"""

# Each hold's additions to its budgets (cost to spent, what it takes from reserved) and leases.
_CHARGE = """
adds AS (
  SELECT a.subject_id, a.cost, a.amount, a.lease_id
  FROM jsonb_to_recordset(CAST(:adds AS jsonb))
    AS a(hold_id text, subject_id text, cost bigint, amount bigint, lease_id text)
  WHERE a.hold_id IN (SELECT id FROM ok)
),
sums AS (
  SELECT subject_id, SUM(cost) AS cost, SUM(amount) AS amount FROM adds GROUP BY subject_id
),
locked AS (
  SELECT b.subject_id FROM budgets b WHERE b.subject_id IN (SELECT subject_id FROM sums)
  ORDER BY b.subject_id FOR UPDATE
),
charged AS (
  UPDATE budgets b SET spent = b.spent + s.cost, reserved = b.reserved - s.amount
  FROM sums s, locked l
  WHERE b.subject_id = s.subject_id AND l.subject_id = b.subject_id
  RETURNING b.subject_id, b.scope, b.credit_limit, b.soft_limit, b.alert_thresholds, b.spent,
    b.reserved, b.reset_interval, b.anchor_at, b.window_start
),
lease_sums AS (
  SELECT lease_id, SUM(cost) AS cost FROM adds WHERE lease_id IS NOT NULL GROUP BY lease_id
),
leases AS (
  UPDATE budget_leases l SET amount = l.amount - s.cost FROM lease_sums s
  WHERE l.id = s.lease_id
)"""

_RESULT = """
SELECT x.taken, x.ok, c.* FROM (
  SELECT (SELECT array_agg(id) FROM taken) AS taken, (SELECT array_agg(id) FROM ok) AS ok
) x LEFT JOIN charged c ON true"""

STATEMENT = Prepared(
    "WITH "
    + ",\n".join(
        [
            _TAKE.strip(),
            _CHARGE.strip(),
            writer.pg_insert_cte("ev", "ev_in.id IN (SELECT id FROM ok)"),
            rollup.pg_json_cte("e", "e_in.id IN (SELECT id FROM ok)"),
            *rollup.pg_upserts("e"),
        ]
    )
    + _RESULT
)


@dataclass(frozen=True, slots=True)
class Expected:
    """The hold a settle expects to take: what its reservation wrote."""

    id: str
    token_id: str | None
    user_id: str
    team_id: str
    amount: int
    leased: bool
    token_lease: str | None
    user_lease: str | None
    team_lease: str | None
    rate_kinds: None = None
    run_id: None = None


def parameters(events: list[Event], holds: list[Expected], adds: list[tuple]) -> dict:
    """The statement's parameters, each one JSON text: the holds expected, each hold's additions
    (hold id, subject, cost, amount, lease id), the events and their rollup increments."""
    return {
        "holds": _json(
            [
                {
                    "id": h.id,
                    "amount": h.amount,
                    "leased": h.leased,
                    "token_lease": h.token_lease,
                    "user_lease": h.user_lease,
                    "team_lease": h.team_lease,
                }
                for h in holds
            ]
        ),
        "adds": _json(
            [
                {"hold_id": h, "subject_id": s, "cost": c, "amount": a, "lease_id": lease}
                for h, s, c, a, lease in adds
            ]
        ),
        "events": _json(writer.pg_events(events)),
        "rollup_rows": _json(rollup.pg_rows(events)),
    }


def _json(value) -> str:
    return orjson.dumps(value).decode()
