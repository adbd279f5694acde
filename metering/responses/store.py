"""Keeping, reading, chaining and forgetting stored responses.

A stored response is visible to the user whose credential made it (any of that user's tokens)
and to the admin; to anyone else it does not exist: 404, never 403, never its text. One older
than the retention is gone, whether or not the sweep has deleted it yet."""

import json
import os
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, select

from metering.db import Database, utcnow
from metering.errors import InvalidRequest, NotFound
from metering.responses.tables import StoredResponse

MAX_DEPTH = 32  # nesting of the stored input items' JSON
MAX_CHAIN = 1_000  # links followed back from previous_response_id
SWEEP_BATCH = 1_000
ITEM_PREFIX = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}


class ResponseNotFound(NotFound):
    code = "response_not_found"


def _depth(value: Any, limit: int) -> int:
    """How deep `value` nests (lists and objects), stopping past `limit`."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return depth
        deepest = max(deepest, depth)
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    return deepest


def check_storable(
    items: list[Any], instructions: str | None, max_bytes: int, store_enabled: bool
) -> None:
    """400 for a response that asks to be stored where storing is off, or whose input is
    past the bounds of what is kept: `max_bytes` of JSON, MAX_DEPTH levels."""
    if not store_enabled:
        raise InvalidRequest(
            "this gateway stores no responses (METERING_RESPONSES_STORE=false): send "
            '"store": false',
            param="store",
        )
    if _depth(items, MAX_DEPTH) > MAX_DEPTH:
        raise InvalidRequest(
            f"input nests deeper than {MAX_DEPTH} levels: too deep to store (send "
            '"store": false to keep nothing)',
            param="input",
        )
    size = len(json.dumps(items, ensure_ascii=False).encode()) + len((instructions or "").encode())
    if size > max_bytes:
        raise InvalidRequest(
            f"input and instructions are {size} bytes: more than the {max_bytes} a stored "
            'response may keep (send "store": false to keep nothing)',
            param="input",
        )


def normalized(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input items as they are kept and listed: each with a type and an id, a message's
    string content as one input_text part."""
    out = []
    for item in items:
        item = dict(item)
        kind = item.setdefault("type", "message")
        if kind == "message":
            content = item.get("content")
            if isinstance(content, str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": content}]
        if not isinstance(item.get("id"), str):
            item["id"] = f"{ITEM_PREFIX.get(kind, 'item')}_{os.urandom(12).hex()}"
        out.append(item)
    return out


def _visible(row: StoredResponse | None, principal: Any, oldest: datetime) -> bool:
    if row is None or row.created_at < oldest:
        return False
    return principal.is_admin or (
        principal.user_id is not None and row.user_id == principal.user_id
    )


async def save(
    db: Database,
    *,
    response: dict[str, Any],
    input_items: list[dict[str, Any]],
    instructions: str | None,
    principal: Any,
) -> None:
    """Keep a finished response; saving it twice keeps it once."""
    row = {
        "id": response["id"],
        "team_id": principal.team_id,
        "user_id": principal.user_id,
        "token_id": principal.token_id,
        "created_at": utcnow(),
        "previous_response_id": response.get("previous_response_id"),
        "model": str(response.get("model") or "")[:256],
        "instructions": instructions,
        "input_items": json.dumps(normalized(input_items), ensure_ascii=False),
        "response": json.dumps(response, ensure_ascii=False),
    }
    async with db.begin() as conn:
        existing = await conn.execute(
            select(StoredResponse.id).where(StoredResponse.id == row["id"])
        )
        if existing.first() is None:
            await conn.execute(StoredResponse.__table__.insert().values(**row))


async def _row(db: Database, response_id: str) -> StoredResponse | None:
    if not response_id or len(response_id) > 40:
        return None
    async with db.begin() as conn:
        result = await conn.execute(
            select(StoredResponse.__table__).where(StoredResponse.id == response_id)
        )
        return result.first()  # type: ignore[return-value]


def _not_found(response_id: str, param: str | None = None) -> ResponseNotFound:
    return ResponseNotFound(f"no response {response_id[:64]!r}", param=param)


async def visible(
    db: Database, principal: Any, response_id: str, retention_days: int, param: str | None = None
) -> Any:
    """The stored response's row, if this principal may see it; 404 otherwise."""
    row = await _row(db, response_id)
    if not _visible(row, principal, utcnow() - timedelta(days=retention_days)):
        raise _not_found(response_id, param)
    return row


async def load_chain(
    db: Database, principal: Any, response_id: str, retention_days: int, max_bytes: int
) -> list[dict[str, Any]]:
    """The conversation that ends with `response_id`, oldest first: each stored response's
    input items, then its output items. Every link must be visible; instructions are not
    carried. 400 past MAX_CHAIN links or `max_bytes` of items."""
    oldest = utcnow() - timedelta(days=retention_days)
    turns: list[list[dict[str, Any]]] = []
    size, seen = 0, set()
    current: str | None = response_id
    while current is not None:
        if len(turns) >= MAX_CHAIN or current in seen:
            raise InvalidRequest(
                f"the conversation before {response_id[:64]} is longer than {MAX_CHAIN} responses",
                param="previous_response_id",
            )
        seen.add(current)
        row = await _row(db, current)
        if not _visible(row, principal, oldest):
            raise _not_found(current, "previous_response_id")
        assert row is not None
        size += len(row.input_items) + len(row.response)
        if size > max_bytes:
            raise InvalidRequest(
                f"the conversation before {response_id[:64]} is more than {max_bytes} bytes",
                param="previous_response_id",
            )
        output = json.loads(row.response).get("output") or []
        turns.append(
            json.loads(row.input_items) + [item for item in output if isinstance(item, dict)]
        )
        current = row.previous_response_id
    return [item for turn in reversed(turns) for item in turn]


async def delete_response(
    db: Database, principal: Any, response_id: str, retention_days: int
) -> None:
    await visible(db, principal, response_id, retention_days)
    async with db.begin() as conn:
        await conn.execute(delete(StoredResponse.__table__).where(StoredResponse.id == response_id))


async def sweep(db: Database, retention_days: int, batch: int = SWEEP_BATCH) -> int:
    """Delete the responses older than the retention, `batch` at a time; how many."""
    cutoff = utcnow() - timedelta(days=retention_days)
    deleted = 0
    while True:
        async with db.begin() as conn:
            ids = list(
                (
                    await conn.execute(
                        select(StoredResponse.id)
                        .where(StoredResponse.created_at < cutoff)
                        .limit(batch)
                    )
                ).scalars()
            )
            if not ids:
                return deleted
            await conn.execute(delete(StoredResponse.__table__).where(StoredResponse.id.in_(ids)))
        deleted += len(ids)
