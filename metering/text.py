"""Text from clients, checked in one place: every request body (RequestBody, the base of every
request model, walks what was sent, the raw events of POST /v1/events included), every query
parameter (`valid_parameters`, a dependency of the whole application) and the proxy's own body
(`first_problem`, on the rare body its fast JSON parser refused).

Text must be valid Unicode: JSON's `\\ud800` escape makes a lone UTF-16 surrogate, which no
UTF-8 column, driver or answer can carry. Control characters mean nothing in an id, a name, a
key, an email or a URL (none is taken there); free text (a reason) may hold tab, newline and
carriage return, no other C0 control and no DEL."""

import re
from typing import Any, ClassVar

from fastapi import Request
from pydantic import BaseModel, GetJsonSchemaHandler, model_validator
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from metering.errors import NOT_UNICODE, InvalidRequest, InvalidText

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_FREE_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
# What pydantic's str_strip_whitespace takes off both ends before a value is kept.
_EDGE_SPACE = "\t\n\x0b\x0c\r "

# The same rules as JSON Schema patterns, declared by every request body and query parameter
# in /openapi.json (RequestBody, declare_parameters): text without control characters; free
# text, which may hold tab, newline and carriage return; and either with the whitespace a
# model strips from both ends before it checks allowed there.
TEXT_PATTERN = r"^[^\x00-\x1f\x7f]*$"
FREE_TEXT_PATTERN = r"^[^\x00-\x08\x0b\x0c\x0e-\x1f\x7f]*$"
_EDGE = r"[\t\n\x0b\x0c\r ]*"
STRIPPED_TEXT_PATTERN = rf"^{_EDGE}[^\x00-\x1f\x7f]*{_EDGE}$"
STRIPPED_FREE_TEXT_PATTERN = rf"^{_EDGE}[^\x00-\x08\x0b\x0c\x0e-\x1f\x7f]*{_EDGE}$"

# What pydantic's str_strip_whitespace takes off as a field's length is checked: every Unicode
# space. _valid_text takes off only _EDGE_SPACE before it looks for controls, so the controls
# among those spaces (tab, newline...) are outermost.
_STRIPPED_START = rf"{_EDGE}[^\S\x00-\x1f]*"
_STRIPPED_END = rf"[^\S\x00-\x1f]*{_EDGE}"


def stripped_pattern(least: int, free: bool = False) -> str:
    """STRIPPED_(FREE_)TEXT_PATTERN for a field of at least `least` characters once stripped:
    that many, from the first character that is no space to the last."""
    inner = r"[^\x00-\x08\x0b\x0c\x0e-\x1f\x7f]" if free else r"[^\x00-\x1f\x7f]"
    solid = r"[^\s\x00-\x1f\x7f]"
    core = (
        rf"{solid}(?:{inner}*{solid})?" if least == 1 else rf"{solid}{inner}{{{least - 2},}}{solid}"
    )
    return rf"^{_STRIPPED_START}{core}{_STRIPPED_END}$"


CONTROL = "must not contain control characters"
FREE_CONTROL = "must not contain control characters other than tab, newline and carriage return"


def problem(value: str, *, free: bool = False, controls: bool = True) -> str | None:
    """Why `value` is not text this service takes, or None (`controls` false: only whether it
    is valid Unicode, for text that is passed on, such as a chat message)."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return NOT_UNICODE
    if controls and (_FREE_CONTROL if free else _CONTROL).search(value):
        return FREE_CONTROL if free else CONTROL
    return None


def check(value: str | None, name: str, *, free: bool = False) -> None:
    """A query parameter, a header or a body field checked by hand: 400 naming it."""
    if value is None:
        return
    found = problem(value, free=free)
    if found is not None:
        raise InvalidRequest(f"{name}: {found}", param=name)


def first_problem(
    value: Any,
    where: str = "",
    *,
    free: bool = False,
    strip: bool = False,
    controls: bool = True,
) -> InvalidText | None:
    """The first string of a JSON value (its keys included) that is not valid text, by its
    path (`events[3].idempotency_key`); None when every string is. `strip`: leading and
    trailing whitespace is not looked at (the model strips it before keeping the value)."""

    # Iterative, in document order: a body nested as deep as the JSON reader allows is walked
    # without recursion.
    pending: list[tuple[Any, str]] = [(value, where)]
    while pending:
        item, at = pending.pop()
        if isinstance(item, str):
            found = problem(
                item.strip(_EDGE_SPACE) if strip else item, free=free, controls=controls
            )
            if found is not None:
                return InvalidText(at, found)
        elif isinstance(item, dict):
            children = []
            for key, child in item.items():
                if isinstance(key, str) and (found := problem(key, controls=controls)):
                    return InvalidText(at, f"a field name {found}")
                children.append((child, f"{at}.{key}" if at else str(key)))
            pending.extend(reversed(children))
        elif isinstance(item, list):
            pending.extend((item[i], f"{at}[{i}]") for i in reversed(range(len(item))))
    return None


class RequestBody(BaseModel):
    """The base of every request body: each string it holds, nested and keys included, is
    valid text (400 naming the field otherwise), checked before any field is read.
    `free_text` names the fields whose text may hold tab, newline and carriage return."""

    free_text: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        """The text rules above, in the model's JSON Schema: a pattern on each string field
        that declares none of its own, and on field names where others are taken."""
        schema = handler(core_schema)
        target = handler.resolve_ref_schema(schema)
        strip = bool(cls.model_config.get("str_strip_whitespace"))
        for name, field in target.get("properties", {}).items():
            if {"pattern", "items", "enum", "format", "propertyNames"} & set(field):
                continue  # the field declares its own rule, stricter than this one
            free = name in cls.free_text
            pattern = (
                (STRIPPED_FREE_TEXT_PATTERN if free else STRIPPED_TEXT_PATTERN)
                if strip
                else (FREE_TEXT_PATTERN if free else TEXT_PATTERN)
            )
            for option in field.get("anyOf", [field]):
                least = option.get("minLength", 0) if option.get("type") == "string" else 0
                _text_pattern(option, stripped_pattern(least, free) if strip and least else pattern)
        if target.get("additionalProperties") is not False:
            target["propertyNames"] = {"pattern": TEXT_PATTERN}
        return schema

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        strip = bool(cls.model_config.get("str_strip_whitespace"))
        for name, value in data.items():
            if isinstance(name, str) and (found := problem(name)) is not None:
                raise InvalidText("", f"a field name {found}")
            bad = first_problem(value, str(name), free=name in cls.free_text, strip=strip)
            if bad is not None:
                raise bad
        return data


def _text_pattern(schema: dict[str, Any], pattern: str) -> None:
    """`pattern` on a string schema with no rule of its own, and on the strings of its items."""
    if schema.get("type") == "string" and not {"pattern", "enum", "const", "format"} & set(schema):
        schema["pattern"] = pattern
    elif schema.get("type") == "array" and isinstance(schema.get("items"), dict):
        _text_pattern(schema["items"], pattern)
    elif schema.get("type") == "object" and "properties" not in schema:  # a free mapping
        schema.setdefault("propertyNames", {"pattern": TEXT_PATTERN})
        if isinstance(schema.get("additionalProperties"), dict):
            _text_pattern(schema["additionalProperties"], pattern)


# Any JSON value whose strings and field names are valid text: what RequestBody takes where a
# body holds free JSON (the events of POST /v1/events, each then checked on its own). A
# component of /openapi.json, referred to as TEXT_JSON_REF.
TEXT_JSON = "TextJson"
TEXT_JSON_REF: dict[str, Any] = {"$ref": f"#/components/schemas/{TEXT_JSON}"}
TEXT_JSON_SCHEMA = {
    "description": "Any JSON value whose strings and field names hold no control character",
    "anyOf": [
        {"type": "string", "pattern": TEXT_PATTERN},
        {"type": ["number", "boolean", "null"]},
        {"type": "array", "items": TEXT_JSON_REF},
        {
            "type": "object",
            "propertyNames": {"pattern": TEXT_PATTERN},
            "additionalProperties": TEXT_JSON_REF,
        },
    ],
}


def declare_parameters(app: Any) -> None:
    """Wraps app.openapi: each string parameter (query and path) with no rule of its own
    declares TEXT_PATTERN, the rule valid_parameters (query) and the routes (path) apply."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        schema: dict[str, Any] = build()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components[TEXT_JSON] = TEXT_JSON_SCHEMA
        for body in components.values():
            # A field a RequestBody does not know is taken (and left unread) when its name and
            # every string it holds are valid text, as _valid_text checks them. (Declared here,
            # where TEXT_JSON is a component, not in the model's own schema.)
            if "properties" in body and "propertyNames" in body:
                body.setdefault("additionalProperties", dict(TEXT_JSON_REF))
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                for parameter in operation.get("parameters", []):
                    declared = parameter.get("schema", {})
                    if parameter.get("in") not in ("query", "path"):
                        continue
                    if {"pattern", "items", "enum", "format"} & set(declared):
                        continue  # a rule of its own, stricter than this one
                    for option in declared.get("anyOf", [declared]):
                        _text_pattern(option, TEXT_PATTERN)
        return schema

    app.openapi = openapi


async def valid_parameters(request: Request) -> None:
    """Every query parameter is an id, a name, a time, a number or a word: control characters
    are in none (a 400 naming it, before it reaches a query). A dependency of the whole app."""
    for name, value in request.query_params.multi_items():
        found = problem(name)
        if found is not None:
            raise InvalidRequest(f"a query parameter's name {found}")
        check(value, name)
