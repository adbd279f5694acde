"""CSV cells a spreadsheet shows as data, never runs as formulas.

Text in our exports can come from outside (an upstream's response id and finish reason, a
client's model name, a provider's export): a cell starting with `=`, `+`, `-`, `@`, a tab or
a carriage return is a formula to Excel, LibreOffice and Google Sheets. Such a cell gets a
leading single quote, as OWASP recommends. A plain number (`-0.5`, `12`) is left alone: it
cannot run anything and must stay a number for the sheet.
"""

import re

FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_PLAIN_NUMBER = re.compile(r"[+-]?[0-9]+(?:\.[0-9]+)?")


def cell(value: object) -> object:
    """One CSV cell: None as empty, text neutralised when a spreadsheet would evaluate it."""
    if value is None:
        return ""
    if (
        isinstance(value, str)
        and value.startswith(FORMULA_START)
        and _PLAIN_NUMBER.fullmatch(value) is None
    ):
        return "'" + value
    return value


def row(values) -> list:
    return [cell(v) for v in values]
