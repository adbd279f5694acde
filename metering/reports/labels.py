"""Names beside ids (`labels=true` on GET /v1/usage and /v1/spend): a team's name, a user's
email and a token's name, so that a report reads without a second lookup. Looked up once per
chunk of rows (at most a few thousand ids, one query per kind); deleted teams, users and
revoked tokens keep their names."""

from sqlalchemy import select

from metering.db import Database
from metering.models import ApiToken, Team, User

# id key -> (label key, the table's id and label columns)
LABELS = {
    "team_id": ("team_name", Team.id, Team.name),
    "user_id": ("user_email", User.id, User.email),
    "token_id": ("token_name", ApiToken.id, ApiToken.name),
}
LABEL_KEYS = tuple(label for label, _, _ in LABELS.values())


def label_keys(keys) -> list[str]:
    """The label columns of a report grouped (or listed) by these keys, in LABELS' order."""
    return [LABELS[k][0] for k in LABELS if k in keys]


async def lookup(db: Database, ids: dict[str, set]) -> dict[str, dict[str | None, str]]:
    """id key -> {id: label} for the ids given (None and empty ids left out)."""
    found: dict[str, dict[str | None, str]] = {}
    async with db.reads() as session:
        for key, wanted in ids.items():
            wanted = {i for i in wanted if i}
            if not wanted:
                found[key] = {}
                continue
            _, id_column, label_column = LABELS[key]
            rows = await session.execute(
                select(id_column, label_column).where(id_column.in_(wanted))
            )
            found[key] = {row[0]: row[1] for row in rows}
    return found


async def label_rows(db: Database, rows: list[dict], keys) -> list[dict]:
    """The rows (dicts with some of team_id, user_id, token_id) with their labels added."""
    present = [k for k in LABELS if k in keys]
    if not present or not rows:
        return rows
    names = await lookup(db, {k: {row.get(k) for row in rows} for k in present})
    for row in rows:
        for k in present:
            row[LABELS[k][0]] = names[k].get(row.get(k))
    return rows
