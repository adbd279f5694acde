"""docs/operator/configuration.md, written from the settings class (metering.settings.Settings):
every setting's environment variable, type, bounds, default and meaning (the field's docstring).

    python -m scripts.reference          write the page (`make reference`)
    python -m scripts.reference --check  exit 1 if the page is not what the class says

tests/docs/test_reference.py fails while the committed page differs from what this writes."""

import argparse
import sys
import textwrap
import types
from pathlib import Path
from typing import Any, Union, get_args, get_origin

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic.fields import FieldInfo

from metering.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
CONFIGURATION = ROOT / "docs" / "operator" / "configuration.md"
PREFIX = "METERING_"

TYPES = {str: "text", int: "integer", float: "number", bool: "boolean"}
BOUNDS = ((Ge, "ge", ">="), (Gt, "gt", ">"), (Le, "le", "<="), (Lt, "lt", "<"))

HEAD = """\
# Configuration

<!-- Written by `make reference` from metering/settings.py: edit a setting's docstring there,
then run `make reference`; tests/docs/test_reference.py fails while this page differs. -->

Every setting is an environment variable `METERING_<NAME>`, read when a process starts; a `.env`
file in the working directory is read too (the environment wins). A value that does not parse,
or lies outside its bounds, stops `metering serve` before it listens: it names the variable and
exits 2. Durations are in seconds (`_S`), sizes in bytes (`_BYTES`). A boolean is `true` or
`false` (`1`/`0`, `yes`/`no` too). An unset setting takes its default; *unset* as a default
means the behaviour its meaning describes for no value.

The providers, models and prices are not settings: they are the TOML catalog that
`METERING_CONFIG` names (see [the catalog](catalog.md)).
Neither are traces: the standard `OTEL_*` variables turn them on and say where they go (see
[tracing](tracing.md)).

| variable | type | default |
| --- | --- | --- |
"""


def variable(name: str) -> str:
    return f"{PREFIX}{name.upper()}"


def anchor(name: str) -> str:
    """The heading's id as MkDocs makes it (its text lower-cased, `` ` `` dropped)."""
    return variable(name).lower()


def kind(field: FieldInfo) -> str:
    annotation: Any = field.annotation
    optional = False
    if get_origin(annotation) in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        optional = len(members) < len(get_args(annotation))
        [annotation] = members
    words = [TYPES[annotation]]
    for constraint in field.metadata:
        for cls, attribute, sign in BOUNDS:
            if isinstance(constraint, cls):
                words.append(f"{sign} {number(getattr(constraint, attribute))}")
    lengths = {type(c): c for c in field.metadata if isinstance(c, MinLen | MaxLen)}
    if lengths:
        shortest = lengths[MinLen].min_length if MinLen in lengths else 0
        longest = lengths[MaxLen].max_length if MaxLen in lengths else None
        words.append(
            f"{shortest} to {longest} characters" if longest else f"{shortest} characters or more"
        )
    text = words[0] + (f", {', '.join(words[1:])}" if len(words) > 1 else "")
    return f"{text}, or unset" if optional else text


def number(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def default(field: FieldInfo) -> str:
    value = field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{number(value)}`"


def meaning(field: FieldInfo, name: str) -> str:
    if not field.description:
        raise SystemExit(f"metering/settings.py: {name} has no docstring to say what it means")
    return textwrap.fill(
        " ".join(field.description.split()),
        width=100,
        break_long_words=False,
        break_on_hyphens=False,
    )


def configuration() -> str:
    fields = Settings.model_fields
    rows = [
        f"| [`{variable(name)}`](#{anchor(name)}) | {kind(field)} | {default(field)} |"
        for name, field in fields.items()
    ]
    sections = [
        f"## `{variable(name)}`\n\n{kind(field)}; default {default(field)}.\n\n"
        f"{meaning(field, name)}\n"
        for name, field in fields.items()
    ]
    return HEAD + "\n".join(rows) + "\n\n" + "\n".join(sections)


PAGES = {CONFIGURATION: configuration}


def stale() -> list[Path]:
    """The pages that are not what the code says."""
    return [
        path for path, write in PAGES.items() if not path.exists() or path.read_text() != write()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.reference", description=__doc__)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if stale")
    args = parser.parse_args(argv)
    if args.check:
        for path in stale():
            print(f"{path.relative_to(ROOT)} is stale: run `make reference`", file=sys.stderr)
        return 1 if stale() else 0
    for path, write in PAGES.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(write())
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
