"""The `tag=<key>:<value>` filter of the reports: parsed with the bounds of a tag, and matched
in SQL on the event's tags (JSON text, metering.ledger.attribution) on either database.

PostgreSQL reads the text as jsonb and takes the key's value (`->>`); SQLite walks the object's
pairs (json_each) for the key, so a key holding any character (a quote, a dot) is a bound
parameter and never part of a JSON path."""

from typing import Any

from sqlalchemy import Boolean, String, bindparam
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import BindParameter, ColumnElement

from metering.errors import InvalidRequest
from metering.ledger.attribution import MAX_TAG_KEY_CHARS, MAX_TAG_VALUE_CHARS, MAX_TAGS

PARAM = "tag"


def parse_tags(values: list[str] | None) -> list[tuple[str, str]]:
    """`key:value` pairs, split at the first colon; 400 naming `tag` for any other form."""
    if not values:
        return []
    if len(values) > MAX_TAGS:
        raise InvalidRequest(
            f"at most {MAX_TAGS} tag filters (an event has at most {MAX_TAGS} tags)", param=PARAM
        )
    pairs = []
    for value in values:
        key, colon, wanted = value.partition(":")
        if not colon or not 1 <= len(key) <= MAX_TAG_KEY_CHARS:
            raise InvalidRequest(
                f"tag must be <key>:<value>, the key 1 to {MAX_TAG_KEY_CHARS} characters "
                f"(got {value[:80]!r})",
                param=PARAM,
            )
        if len(wanted) > MAX_TAG_VALUE_CHARS:
            raise InvalidRequest(
                f"tag {key!r}: the value must be at most {MAX_TAG_VALUE_CHARS} characters",
                param=PARAM,
            )
        pairs.append((key, wanted))
    return pairs


class TagIs(ColumnElement[bool]):
    """True where the tags `column` holds has `key` with `value`."""

    type = Boolean()
    inherit_cache = False  # a report's query, built per request: nothing to cache

    def __init__(self, column: ColumnElement[Any], key: str, value: str) -> None:
        self.column = column
        self.tag_key: BindParameter[str] = bindparam(None, key, String())
        self.tag_value: BindParameter[str] = bindparam(None, value, String())


@compiles(TagIs, "postgresql")
def _postgresql(element: TagIs, compiler: SQLCompiler, **kw: Any) -> str:
    column = compiler.process(element.column, **kw)
    key, value = compiler.process(element.tag_key, **kw), compiler.process(element.tag_value, **kw)
    return f"(CAST({column} AS JSONB) ->> {key}) = {value}"


@compiles(TagIs)
def _sqlite(element: TagIs, compiler: SQLCompiler, **kw: Any) -> str:
    column = compiler.process(element.column, **kw)
    key, value = compiler.process(element.tag_key, **kw), compiler.process(element.tag_value, **kw)
    return (
        f"EXISTS (SELECT 1 FROM json_each({column}) AS tag "
        f"WHERE tag.key = {key} AND tag.value = {value})"
    )


def tag_conditions(column: ColumnElement[Any], pairs: list[tuple[str, str]]) -> list[Any]:
    """One condition per pair: every one must match."""
    return [TagIs(column, key, value) for key, value in pairs]
