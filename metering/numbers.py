"""Numbers from clients and files, read with bounds before any arithmetic.

`Decimal` and `int` accept forms whose arithmetic has no bound: "1e500000" is eight
characters whose integral value has 500,001 digits (seconds of CPU to multiply or convert),
and `int()` takes any Unicode digit ("²", "٣"). Every number that arrives from outside is
first checked as text (length, ASCII digits, exponent range), then as a value (its range),
and only then used.
"""

import re
from decimal import Decimal

MAX_CHARS = 64  # a decimal text longer than this is refused before it is read
# ASCII digits only; an exponent of at most 4 digits (the range check comes next, at once).
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]{1,4})?")
_DIGITS = re.compile(r"[0-9]+")


class NumberError(ValueError):
    """The message names the field; the caller adds where it was (a parameter, a line)."""


def _range(value, name: str, low, high):
    if low is not None and value < low:
        raise NumberError(f"{name} must be at least {low}")
    if high is not None and value > high:
        raise NumberError(f"{name} must be at most {high}")
    return value


def parse_decimal(
    value: object,
    name: str,
    *,
    low: Decimal | int | None = 0,
    high: Decimal | int | None = None,
    floats: bool = False,
    max_chars: int = MAX_CHARS,
) -> Decimal:
    """An exact decimal from a decimal string or an int (a float only when `floats`), within
    [low, high]; NumberError otherwise, always fast whatever the input."""
    if isinstance(value, bool):
        raise NumberError(f"{name} must be a decimal number")
    if isinstance(value, int):
        return Decimal(_range(value, name, low, high))  # an int compares in time linear in size
    if isinstance(value, float) and floats:
        if value != value or value in (float("inf"), float("-inf")):
            raise NumberError(f"{name} must be a finite number")
        return Decimal(repr(_range(value, name, low, high)))
    if isinstance(value, Decimal):
        if not value.is_finite():
            raise NumberError(f"{name} must be a finite number")
        return _range(value, name, low, high)
    if not isinstance(value, str):
        kinds = "a number or a decimal string" if floats else 'a decimal string such as "10.00"'
        raise NumberError(f"{name} must be {kinds}")
    text = value.strip()
    if len(text) > max_chars:
        raise NumberError(f"{name} is longer than {max_chars} characters")
    if _DECIMAL.fullmatch(text) is None:
        raise NumberError(
            f"{name} must be a decimal number such as 10.50 (an exponent of at most 4 digits), "
            f"not {text[:20]!r}"
        )
    return _range(Decimal(text), name, low, high)


def parse_count(text: str, name: str, *, high: int) -> int:
    """A whole number >= 0 written in ASCII digits, at most `high`."""
    text = text.strip()
    if _DIGITS.fullmatch(text) is None:
        raise NumberError(f"{name} must be a whole number >= 0, not {text[:20]!r}")
    digits = text.lstrip("0")
    if len(digits) > len(str(high)):
        raise NumberError(f"{name} must be at most {high}")
    return _range(int(digits or "0"), name, None, high)


def upto_pattern(high: int) -> str:
    """A regular expression (no anchors) of the whole numbers 1 to `high` written without sign
    or leading zeros: a bound a JSON Schema `pattern` can carry for a number inside a text."""
    top = str(high)
    shorter = [f"[1-9][0-9]{{{n - 1}}}" if n > 1 else "[1-9]" for n in range(1, len(top))]
    same: list[str] = []
    for i, digit in enumerate(top):
        low = 1 if i == 0 else 0
        if int(digit) > low:
            rest = len(top) - i - 1
            tail = f"[0-9]{{{rest}}}" if rest else ""
            same.append(f"{top[:i]}[{low}-{int(digit) - 1}]{tail}")
    same.append(top)
    return "(?:" + "|".join(shorter + same) + ")"
