"""On PostgreSQL, a group of settles in one statement: the holds taken, the budgets and leases
charged, the events inserted with their rollup increments, by one data-modifying WITH query run on its
own, with no BEGIN and COMMIT (one round trip for the whole group, and a statement is atomic).
The holds of leased requests admitted meanwhile ride along in the same statement
(`with_holds`), or are inserted alone (`insert_holds`) when no settle is waiting.

It serves the settles whose holds this process wrote and knows whole: its amount and leases
are the reservation's, and it carries no rate claim, no run and no end user's budget (those
take the general path, metering.budgets.settle.settle_group). What each hold adds to each
budget and lease is worked out here from the reservation, as the general path works it out from
the hold's row;
the statement deletes a hold only if its row is the one expected, and charges only the holds
it deleted (`ok`). A hold not taken is left to the caller, which settles it alone by the
general path: not found (swept while its request ran), as a settle after the sweep; found but
not as expected (never seen: it would be a bug), from its row, after looking for it (`FOUND`,
only then: a second read of `holds` in every statement was a tenth of its run time).

A charge that passes an alert threshold or a soft limit aborts the whole statement
(`metering_abort`, SQLSTATE MT001): the alert must be recorded in the charge's transaction,
which the general path does.

Budgets are locked in subject_id order before they are charged, as every writer here locks
them; no rollup row is locked (the increments are new rows of rollup_pending).
"""

import functools
from dataclasses import dataclass
from typing import Any

import orjson
from sqlalchemy import BigInteger, ColumnElement, Numeric, Text, cast, literal_column
from sqlalchemy.dialects import postgresql
from sqlalchemy.sql import ClauseElement

from metering.alerts.record import DEFAULT_THRESHOLDS, PERCENT, passes
from metering.db import Prepared
from metering.ledger import rollup, writer
from metering.ledger.event import Event
from metering.models import Hold

# The SQLSTATE metering_abort raises (migration 0014), and the message this statement gives it.
ABORTED = "MT001"
CROSSED_MESSAGE = "metering: the settle passed an alert threshold; the general path writes it"
_DEFAULT_THRESHOLDS = orjson.dumps(list(DEFAULT_THRESHOLDS)).decode()

# The holds expected and those taken: a hold is deleted only if its row is the one the
# reservation wrote.
_TAKE = """
want AS (
  SELECT * FROM json_to_recordset(CAST(:holds AS json)) AS w(id text, amount bigint,
    leased boolean, token_lease text, user_lease text, team_lease text)
),
ok AS (
  DELETE FROM holds t WHERE t.id = ANY(ARRAY(SELECT id FROM want))
    AND t.rate_kinds IS NULL AND t.run_id IS NULL AND t.end_user_budget IS NULL
    AND EXISTS (
      SELECT 1 FROM want w WHERE w.id = t.id AND w.amount = t.amount AND w.leased = t.leased
        AND w.token_lease IS NOT DISTINCT FROM t.token_lease
        AND w.user_lease IS NOT DISTINCT FROM t.user_lease
        AND w.team_lease IS NOT DISTINCT FROM t.team_lease
    )
  RETURNING t.id
)"""

# Each hold's additions to its budgets (cost to spent, what it takes from reserved) and leases.
_CHARGE = """
adds AS (
  SELECT a.subject_id, a.cost, a.amount, a.lease_id
  FROM json_to_recordset(CAST(:adds AS json))
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
  RETURNING b.subject_id, b.credit_limit, b.soft_limit, b.alert_thresholds, b.spent
),
lease_sums AS (
  SELECT lease_id, SUM(cost) AS cost FROM adds WHERE lease_id IS NOT NULL GROUP BY lease_id
),
leases AS (
  UPDATE budget_leases l SET amount = l.amount - s.cost FROM lease_sums s
  WHERE l.id = s.lease_id
)"""


def _sql(expression: ClauseElement) -> str:
    return str(
        expression.compile(dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True})
    )


def _crossed() -> str:
    """What record.passed decides in Python, made of the same rule (record.passes) as SQL, in
    exact numeric arithmetic: a charged budget went past its soft limit or one of its
    thresholds (percentages of credit_limit). Any such charge aborts the statement
    (metering_abort raises SQLSTATE MT001): nothing of it is kept."""
    after = literal_column("c.spent", BigInteger)
    before = after - literal_column("s.cost", BigInteger)
    soft = passes(before, after, literal_column("c.soft_limit", BigInteger))

    def exact(column: ColumnElement[Any]) -> ColumnElement[Any]:
        return cast(column, Numeric)

    level = exact(literal_column("c.credit_limit", BigInteger)) * exact(
        literal_column("p.percent", Text)
    )
    threshold = passes(exact(before), exact(after), level, PERCENT)
    return f"""
crossed AS (
  SELECT 1 FROM charged c JOIN sums s ON s.subject_id = c.subject_id
  WHERE s.cost > 0 AND (
    (c.soft_limit IS NOT NULL AND {_sql(soft)})
    OR (c.credit_limit > 0 AND EXISTS (
      SELECT 1 FROM jsonb_array_elements_text(
        CAST(COALESCE(c.alert_thresholds, '{_DEFAULT_THRESHOLDS}') AS jsonb)) AS p(percent)
      WHERE {_sql(threshold)}
    ))
  )
)"""


_CROSSED = _crossed()

# What the statement returns: the holds it took; a threshold passed aborts it.
RESULT = f"""
SELECT (SELECT array_agg(id) FROM ok) AS ok,
  CASE WHEN EXISTS (SELECT 1 FROM crossed) THEN metering_abort('{CROSSED_MESSAGE}') END
    AS aborted"""

# The statement's parts, in order (bench.statements measures it without some of them,
# made of PARTS and RESULT).
PARTS = {
    "take": _TAKE.strip(),
    "charge": _CHARGE.strip(),
    "crossed": _CROSSED.strip(),
    "events": writer.pg_insert_cte("ev", "ev_in.id IN (SELECT id FROM ok)", rollup.PENDING_SOURCE),
    "pending": rollup.pg_pending_insert("ev"),
}
_BODY = ",\n".join(PARTS.values())
STATEMENT = Prepared("WITH " + _BODY + RESULT)


# Which of the holds a statement did not take are there (as it left them): read only when some
# were not taken.
FOUND = "SELECT array_agg(id) FROM holds WHERE id = ANY($1::text[])"


def _hold_rows(columns: tuple[str, ...]) -> str:
    """A multi-row INSERT of holds with these columns, passed as one JSON array of objects
    (:new_holds): one parameter, whatever the number of rows."""
    table = Hold.__table__
    dialect = postgresql.dialect()
    record = ", ".join(f"{c} {table.c[c].type.compile(dialect=dialect)}" for c in columns)
    names = ", ".join(columns)
    return (
        f"INSERT INTO {table.name} ({names}) "
        f"SELECT {names} FROM json_to_recordset(CAST(:new_holds AS json)) AS h({record})"
    )


@functools.cache
def insert_holds(columns: tuple[str, ...]) -> Prepared:
    """New holds on their own, in one statement."""
    return Prepared(_hold_rows(columns))


@functools.cache
def with_holds(columns: tuple[str, ...]) -> Prepared:
    """The settle statement carrying new holds too (the holds of requests admitted while the
    writer was busy): one round trip for both. Atomic like the rest: a hold refused (its lease
    returned) or a threshold passed keeps nothing of either, and the caller writes them
    apart."""
    return Prepared(f"WITH new_holds AS ({_hold_rows(columns)}),\n{_BODY}{RESULT}")


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
    end_user_budget: None = None


def parameters(
    events: list[Event], holds: list[Expected], adds: list[tuple[Any, ...]]
) -> dict[str, Any]:
    """The statement's parameters, each one JSON text: the holds expected, each hold's additions
    (hold id, subject, cost, amount, lease id) and the events (whose rollup increments the
    statement makes of the rows it inserts)."""
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
    }


def _json(value: object) -> str:
    return orjson.dumps(value).decode()
