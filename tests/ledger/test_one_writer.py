"""metering.ledger is the one writer of its tables: ledger_events, ledger_events_archive, every
rollup and rollup_pending. Every other module of metering/ calls it (the proxy's settles, the
sweeper, ingestion, rerating, manual adjustments) and never writes them itself: no INSERT,
UPDATE or DELETE of them in SQL text, and no SQLAlchemy insert(), update() or delete() (nor an
ORM add) on them. PostgreSQL's one-statement settle assembles its SQL from the ledger's own
parts (metering.ledger.writer.pg_insert_cte, metering.ledger.rollup.pg_pending_insert).

A walk over every module's code (ast, nothing imported) finds such writes: SQL in string
constants (docstrings and comments aside), and the write constructs applied to an expression
that names a ledger table, its ORM class, a rollup, or a local name bound to one of them in the
same scope. The walk is shown finding each form in a module written here to break the rule, and
finding the ledger's own writes.
"""

import ast
import re
from pathlib import Path

import pytest

from metering.ledger import rollup, tables
from metering.ledger.rollup import FOLDED, PENDING, Rollup
from tests.test_architecture import ROOT, parse

LEDGER = ROOT / "ledger"
TABLES = {
    tables.LedgerEvent.__table__.name,
    tables.LedgerEventArchive.__table__.name,
    PENDING.table.name,
    *(r.table.name for r in FOLDED),
}
# The names that stand for those tables in code: the ORM classes and tables of
# metering.ledger.tables, and metering.ledger.rollup's rollups (a Rollup, or a tuple of them).
NAMES = frozenset(
    [
        name
        for name, value in vars(tables).items()
        if getattr(getattr(value, "__table__", None), "name", None) in TABLES
    ]
    + [
        name
        for name, value in vars(rollup).items()
        if isinstance(value, Rollup)
        or (isinstance(value, tuple) and value and all(isinstance(v, Rollup) for v in value))
    ]
)
CLASSES = frozenset(name for name in NAMES if isinstance(getattr(tables, name, None), type))
WRITE_SQL = re.compile(
    r"\b(INSERT\s+INTO|UPDATE|DELETE\s+FROM|TRUNCATE(\s+TABLE)?)\s+(" + "|".join(TABLES) + r")\b",
    re.IGNORECASE,
)
WRITE_CALLS = {"insert", "update", "delete", "pg_insert", "sqlite_insert"}
WRITE_METHODS = {"insert", "update", "delete"}
ORM_ADDS = {"add", "add_all", "merge"}
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring constants (text about SQL is no SQL)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _own_nodes(scope: ast.AST):
    """The nodes of a scope's own code: nested functions and classes are scopes of their own."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, SCOPES):
            stack.extend(ast.iter_child_nodes(node))


def _names(node: ast.AST, bound: set[str]) -> bool:
    """Whether an expression names a ledger table: its class, a rollup, its SQL name as a
    string, or a name bound to one of them."""
    for part in ast.walk(node):
        if isinstance(part, ast.Name) and part.id in bound:
            return True
        if isinstance(part, ast.Attribute) and part.attr in NAMES:
            return True
        if isinstance(part, ast.Constant) and part.value in TABLES:
            return True
    return False


def _constructs(node: ast.AST) -> bool:
    """Whether an expression makes a row of a ledger table's ORM class (for session.add)."""
    return any(
        isinstance(part, ast.Call)
        and isinstance(part.func, ast.Name | ast.Attribute)
        and (part.func.id if isinstance(part.func, ast.Name) else part.func.attr) in CLASSES
        for part in ast.walk(node)
    )


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, ast.AnnAssign | ast.AugAssign | ast.For | ast.AsyncFor):
        return [node.target]
    if isinstance(node, ast.NamedExpr | ast.comprehension):
        return [node.target]
    if isinstance(node, ast.withitem) and node.optional_vars is not None:
        return [node.optional_vars]
    return []


def _source(node: ast.AST) -> ast.AST | None:
    """What a binding node binds its targets to."""
    if isinstance(node, ast.For | ast.AsyncFor | ast.comprehension):
        return node.iter
    if isinstance(node, ast.withitem):
        return node.context_expr
    if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign | ast.NamedExpr):
        return node.value
    return None


def _bound(scope: ast.AST, outer: set[str]) -> set[str]:
    """The names a scope binds to a ledger table, whatever the order (to a fixed point)."""
    bound = set(outer)
    while True:
        more = set()
        for node in _own_nodes(scope):
            value = _source(node)
            if value is None or not _names(value, bound):
                continue
            for target in _targets(node):
                more |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        if more <= bound:
            return bound
        bound |= more


def _call_name(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _write_call(call: ast.Call, bound: set[str]) -> str | None:
    """What a call writes to a ledger table, if it does: insert(table), table.delete(), an
    ORM add of a ledger row."""
    name = _call_name(call)
    func = call.func
    if name in WRITE_CALLS and any(_names(arg, bound) for arg in call.args):
        return f"{name}()"
    if (
        name in WRITE_METHODS
        and isinstance(func, ast.Attribute)
        and not call.args  # Table.insert(), not a dict's update(other)
        and _names(func.value, bound)
    ):
        return f".{name}()"
    if name in ORM_ADDS and any(_constructs(arg) for arg in call.args):
        return f".{name}()"
    return None


def _writes_in(scope: ast.AST, outer: set[str], docstrings: set[int]) -> list[tuple[int, str]]:
    bound = _bound(scope, outer)
    found = []
    for node in _own_nodes(scope):
        if isinstance(node, SCOPES):
            found += _writes_in(node, bound, docstrings)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = WRITE_SQL.search(node.value)
            if match and id(node) not in docstrings:
                found.append((node.lineno, " ".join(match.group(0).split())))
        elif isinstance(node, ast.Call) and (what := _write_call(node, bound)) is not None:
            found.append((node.lineno, what))
    return found


def ledger_writes(path: Path) -> list[tuple[int, str]]:
    """Where a module writes a ledger table: (line, what), in line order."""
    tree = parse(path)
    module_bound = set(NAMES)
    return sorted(set(_writes_in(tree, module_bound, _docstrings(tree))))


def test_the_tables_and_names_watched_are_the_ledgers():
    assert {"ledger_events", "ledger_events_archive", "rollup_pending", "spend_hourly"} <= TABLES
    assert {"spend_daily_end_user", "spend_daily_tag"} <= TABLES
    assert len(TABLES) == 3 + len(FOLDED)
    assert {"LedgerEvent", "LedgerEventArchive", "RollupPending", "SpendHourly"} <= NAMES
    assert {"ROLLUPS", "HOURLY", "DERIVED", "PENDING"} <= NAMES
    assert {"LedgerEvent", "RollupPending", "SpendDailyModel"} <= CLASSES


BAD = '''
"""A module that writes the ledger itself (INSERT INTO ledger_events in a docstring is fine)."""
from sqlalchemy import delete, insert, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert

from metering.ledger import rollup
from metering.ledger.tables import LedgerEvent, RollupPending, SpendDaily

_t = LedgerEvent.__table__
RAW = "INSERT INTO ledger_events (id) VALUES (:id)"


async def write(session, rows):
    await session.execute(text("UPDATE spend_hourly SET cost = 0"))
    await session.execute(insert(_t), rows)
    await session.execute(pg_insert(RollupPending).values(rows))
    await session.execute(SpendDaily.__table__.delete())
    for each in rollup.ROLLUPS:
        await session.execute(update(each.table).values(cost=0))
    pending = rollup.PENDING.table
    await session.execute(delete(pending))
    session.add(LedgerEvent(id="evt_x"))
    await session.execute(text(f"DELETE FROM rollup_pending WHERE id < {len(rows)}"))
'''
# Reads, other tables and words about the ledger: no write.
GOOD = '''
"""INSERT INTO ledger_events is what the ledger's writer runs; this module only reads."""
from sqlalchemy import insert, select, text

from metering.ledger.tables import LedgerEvent
from metering.models import Hold

table = Hold.__table__


async def read(session, row):
    # UPDATE ledger_events: never here.
    await session.execute(select(LedgerEvent).where(LedgerEvent.id == row["id"]))
    await session.execute(text("SELECT count(*) FROM spend_hourly"))
    await session.execute(insert(table), [row])
    session.add(Hold(id=row["id"]))


def other():
    table = LedgerEvent.__table__
    return select(table)


async def elsewhere(session, rows):
    await session.execute(insert(table), rows)  # the module's `table`: holds
'''


def test_the_walk_finds_every_form_of_a_write_in_a_module_that_breaks_the_rule(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(BAD)
    assert ledger_writes(bad) == [
        (10, "INSERT INTO ledger_events"),
        (14, "UPDATE spend_hourly"),
        (15, "insert()"),
        (16, "pg_insert()"),
        (17, ".delete()"),
        (19, "update()"),
        (21, "delete()"),
        (22, ".add()"),
        (23, "DELETE FROM rollup_pending"),
    ]
    good = tmp_path / "good.py"
    good.write_text(GOOD)
    assert ledger_writes(good) == []


def test_the_walk_finds_the_ledgers_own_writes():
    """Not vacuous: the writer, the rollups' fold and retention's move are found."""
    assert ledger_writes(LEDGER / "writer.py")
    assert ledger_writes(LEDGER / "rollup.py")
    found = ledger_writes(LEDGER / "retention.py")
    assert {what for _, what in found} == {"insert()", "delete()"}


@pytest.mark.parametrize(
    "path",
    sorted(p for p in ROOT.rglob("*.py") if LEDGER not in p.parents),
    ids=lambda p: str(p.relative_to(ROOT.parent)),
)
def test_no_module_outside_the_ledger_writes_its_tables(path):
    assert ledger_writes(path) == [], (
        f"{path.relative_to(ROOT.parent)} writes a ledger table: call metering.ledger "
        "(writer.append, append_many, replace_unsettled; retention; rollup.fold) instead"
    )
