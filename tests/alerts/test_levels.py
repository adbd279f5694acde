"""When a charge passes an alert level, one rule (metering.alerts.record.reached and passes) in
every form: record.passed (the general settle's check), record.crossings (the events written),
the threshold a budget shows it has reached (BudgetView.threshold_passed, with record.reached
for the soft limit: a level is passed when reached after and not before) and the SQL the
one-statement settle aborts on (metering.budgets.settle_pg, PostgreSQL only: SQLite takes the
general path), each held to the same table of cases."""

from datetime import UTC, datetime

import psycopg
import pytest

from metering.alerts import record
from metering.budgets import settle_pg
from metering.budgets.views import BudgetView
from tests.conftest import PG_ADMIN_DSN

USD = 10**12
CEILING = 9_000_000 * USD  # the most a budget's counter keeps: L x p overflows BIGINT

# (case, spent before, spent after, credit_limit, thresholds stored (None: the defaults),
#  soft_limit, passed)
CASES = [
    ("nothing charged", 40, 40, 100, None, None, False),
    ("below the first threshold", 10, 49, 100, None, None, False),
    ("onto a threshold exactly", 10, 50, 100, None, None, True),
    ("from a threshold exactly", 50, 79, 100, None, None, False),
    ("past two thresholds at once", 10, 90, 100, None, None, True),
    ("onto the limit", 99, 100, 100, None, None, True),
    ("past the limit, from past it", 101, 150, 100, None, None, False),
    ("a credit back below a threshold", 60, 40, 100, None, None, False),
    ("a threshold between two whole amounts", 1, 2, 3, None, None, True),
    ("just short of it", 0, 1, 3, None, None, False),
    ("thresholds of its own", 60, 70, 100, "[50, 70, 80]", None, True),
    ("not one of its own", 40, 49, 100, "[50, 70, 80]", None, False),
    ("no thresholds", 0, 100, 100, "[]", None, False),
    ("no limit: no thresholds", 0, 10**6, None, None, None, False),
    ("a limit of 0: no thresholds", 0, 10, 0, None, None, False),
    ("onto the soft limit", 10, 30, None, None, 30, True),
    ("short of the soft limit", 10, 29, None, None, 30, False),
    ("from the soft limit", 30, 40, None, None, 30, False),
    ("the soft limit below every threshold", 10, 20, 100, None, 15, True),
    ("half of the ceiling exactly", CEILING // 2 - 1, CEILING // 2, CEILING, None, None, True),
    (
        "one short of half the ceiling",
        CEILING // 2 - 2,
        CEILING // 2 - 1,
        CEILING,
        None,
        None,
        False,
    ),
    ("the whole ceiling", CEILING - 1, CEILING, CEILING, None, None, True),
]


def _python(before, after, limit, stored, soft) -> bool:
    return record.passed(before, after, limit, record.thresholds_of(stored), soft)


def _events(before, after, limit, stored, soft) -> bool:
    figures = record.Figures("token", "tok_levels", "team_levels", limit, after, 0, None)
    now = datetime(2026, 1, 1, tzinfo=UTC)
    thresholds = record.thresholds_of(stored)
    return bool(record.crossings(figures, before, thresholds, soft, now, now, "usr_levels"))


def _view(before, after, limit, stored, soft) -> bool:
    def shown(spent: int) -> int | None:
        at = datetime(2026, 1, 1, tzinfo=UTC)
        thresholds = record.thresholds_of(stored)
        view = BudgetView("token", "tok_levels", limit, "never", at, None, spent, 0, thresholds)
        return view.threshold_passed

    soft_passed = soft is not None and not record.reached(before, soft)
    soft_passed = soft_passed and record.reached(after, soft)
    was, now = shown(before), shown(after)
    return soft_passed or (now is not None and (was is None or now > was))


def _postgres():
    """settle_pg's crossed part, run on PostgreSQL against one charged row and its sum."""
    conn = psycopg.connect(PG_ADMIN_DSN, autocommit=True)
    query = (
        "WITH charged AS (SELECT CAST(%(s)s AS text) AS subject_id, "
        "CAST(%(limit)s AS bigint) AS credit_limit, CAST(%(soft)s AS bigint) AS soft_limit, "
        "CAST(%(stored)s AS text) AS alert_thresholds, CAST(%(after)s AS bigint) AS spent), "
        "sums AS (SELECT CAST(%(s)s AS text) AS subject_id, CAST(%(cost)s AS bigint) AS cost), "
        f"{settle_pg.PARTS['crossed']} SELECT EXISTS (SELECT 1 FROM crossed)"
    )

    def crossed(before, after, limit, stored, soft) -> bool:
        row = {"s": "tok_levels", "limit": limit, "soft": soft, "stored": stored}
        row.update(after=after, cost=after - before)
        return conn.execute(query, row).fetchone()[0]

    return crossed, conn.close


@pytest.mark.parametrize(
    "form",
    [
        "record.passed",
        "record.crossings",
        "BudgetView.threshold_passed",
        pytest.param("settle_pg", marks=[pytest.mark.postgres, pytest.mark.e2e]),
    ],
)
def test_every_form_of_the_rule_passes_the_same_levels(form):
    close = None
    if form == "record.passed":
        decide = _python
    elif form == "record.crossings":
        decide = _events
    elif form == "BudgetView.threshold_passed":
        decide = _view
    else:
        decide, close = _postgres()
    try:
        got = {
            name: decide(before, after, limit, stored, soft)
            for name, before, after, limit, stored, soft, _ in CASES
        }
    finally:
        if close is not None:
            close()
    assert got == {name: expected for name, *_, expected in CASES}
