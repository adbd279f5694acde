"""Rows as a reader or a script wants them: aligned columns, CSV or JSON."""

import csv
import io
import json
import re
import sys
from collections.abc import Iterable, Sequence
from typing import Any

NUMBER = re.compile(r"-?\d+(\.\d+)?")
EMPTY = "-"  # a table's empty cell (null: no limit, no expiry), so every column has a word


def cell(value: Any) -> str:
    """A value as text: lists comma-separated, objects as JSON, null as nothing."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(cell(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"), sort_keys=True)
    return str(value)


def table(rows: Sequence[dict], columns: Sequence[str], footer: dict | None = None) -> str:
    """Aligned columns under their names; numbers to the right, the rest to the left; a footer
    row (totals) under a rule."""
    body = [[cell(row.get(c)) or EMPTY for c in columns] for row in rows]
    tail = [cell(footer.get(c)) or EMPTY for c in columns] if footer is not None else None
    every = [*body, *([tail] if tail else [])]
    widths = [max([len(c), *(len(line[i]) for line in every)]) for i, c in enumerate(columns)]
    right = [
        all(NUMBER.fullmatch(line[i]) for line in every if line[i] != EMPTY)
        and any(line[i] != EMPTY for line in every)
        for i in range(len(columns))
    ]

    def line(cells: Sequence[str]) -> str:
        out = [
            text.rjust(width) if r else text.ljust(width)
            for text, width, r in zip(cells, widths, right, strict=True)
        ]
        return "  ".join(out).rstrip()

    lines = [line(columns), *(line(cells) for cells in body)]
    if tail is not None:
        lines.append("  ".join("-" * w for w in widths))
        lines.append(line(tail))
    return "\n".join(lines) + "\n"


def record(obj: dict) -> str:
    """One object as `field  value` lines."""
    width = max((len(k) for k in obj), default=0)
    return "".join(f"{k.ljust(width)}  {cell(v) or EMPTY}\n" for k, v in obj.items())


def csv_text(rows: Iterable[dict], columns: Sequence[str]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    writer.writerows([cell(row.get(c)) for c in columns] for row in rows)
    return out.getvalue()


def json_text(data: Any) -> str:
    return json.dumps(data, indent=2) + "\n"


def columns_of(rows: Sequence[dict], first: Sequence[str] = ()) -> list[str]:
    """Every key of the rows: those of `first` the rows have, then the others in the order
    they first appear."""
    seen: dict[str, None] = dict.fromkeys(c for c in first if any(c in row for row in rows))
    for row in rows:
        seen.update(dict.fromkeys(row))
    return list(seen)


def show(rows: Sequence[dict], format: str, columns: Sequence[str], data: Any = None) -> None:
    """A list: `columns` in a table, every field in CSV, `data` (default: the rows) in JSON."""
    if format == "json":
        write(json_text(rows if data is None else data))
    elif format == "csv":
        write(csv_text(rows, columns_of(rows, columns) or list(columns)))
    else:
        write(table(rows, columns))


def show_one(obj: dict, format: str, first: Sequence[str] = ()) -> None:
    """One object: its fields as the API gives them in JSON; those of `first` first."""
    if format == "json":
        write(json_text(obj))
        return
    ordered = {c: obj[c] for c in columns_of([obj], first)}
    write(csv_text([ordered], list(ordered)) if format == "csv" else record(ordered))


def write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def note(text: str) -> None:
    """A remark for the reader, on stderr: stdout stays the data a script reads."""
    print(text, file=sys.stderr, flush=True)
