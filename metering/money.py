"""Exact money. Amounts are integer picodollars (1e-12 USD) in the database.

Prices carry at most 6 decimals per 1M tokens, so a price is a whole number of
micro-dollars per 1M tokens, and tokens x that number is the cost in
picodollars: every cost is an exact integer, no rounding anywhere.
"""

import re
from decimal import Decimal
from typing import Any, overload

from metering.numbers import NumberError, parse_decimal

PICO = Decimal(10) ** 12
MICRO = Decimal(10) ** 6
# Largest amount a budget or price may hold: keeps every counter in a signed 64-bit column.
MAX_USD = Decimal("1000000")
# The most a counter of money (a budget's spent plus reserved, a closed window's total, a rollup's
# sum) may hold after a charge that can be refused, either way: 9,000,000 USD in picodollars. The
# columns (BIGINT) keep 9,223,372 USD; the rest is headroom for live requests settling meanwhile,
# whose charges are never refused.
COUNTER_CEILING = 9 * 10**18


class MoneyError(ValueError):
    pass


# An amount of USD as the API takes it in JSON: a decimal string from 0 to 1,000,000 (MAX_USD)
# with at most 12 decimals, no sign, exponent or spaces. The one declaration of it: usd_text
# checks it and /openapi.json carries it (USD_SCHEMA), so the two cannot differ.
_USD = r"(?:1000000(?:\.0{1,12})?|(?:0|[1-9][0-9]{0,5})(?:\.[0-9]{1,12})?)"
USD_PATTERN = f"^{_USD}$"
SIGNED_USD_PATTERN = f"^-?{_USD}$"
# A change of money (an adjustment): signed and never zero.
CHANGE_USD_PATTERN = f"^(?!-?0+(?:\\.0+)?$)-?{_USD}$"
# A ceiling (a request's most, a run's budget): more than zero.
POSITIVE_USD_PATTERN = f"^(?!0+(?:\\.0+)?$){_USD}$"
USD_RULE = 'a decimal string of USD such as "10.50" (0 to 1000000, at most 12 decimals)'


def usd_schema(*, signed: bool = False, nullable: bool = False) -> dict[str, Any]:
    """The JSON Schema of an amount usd_text takes."""
    text = {"type": "string", "pattern": SIGNED_USD_PATTERN if signed else USD_PATTERN}
    return {"anyOf": [text, {"type": "null"}]} if nullable else text


def usd_text(value: object, field: str, *, signed: bool = False) -> Decimal:
    """An amount a client sent in JSON, as USD_PATTERN (or SIGNED_USD_PATTERN) has it."""
    pattern = SIGNED_USD_PATTERN if signed else USD_PATTERN
    if not isinstance(value, str) or re.fullmatch(pattern, value) is None:
        rule = USD_RULE.replace("(0 to", "(-1000000 to") if signed else USD_RULE
        raise MoneyError(f"{field} must be {rule}")
    return Decimal(value)


def parse_usd(value: object, *, places: int = 12, field: str = "amount") -> Decimal:
    """A USD amount from a decimal string (or int); floats are refused, they are not exact."""
    if isinstance(value, bool) or not isinstance(value, (str, int, Decimal)):
        raise MoneyError(f'{field} must be a decimal string such as "10.00"')
    try:
        # Checked as text first (length, digits, exponent): no arithmetic on unbounded input.
        amount = parse_decimal(value, field, low=None, high=None)
    except NumberError as exc:
        raise MoneyError(str(exc)) from None
    if amount < 0:
        raise MoneyError(f"{field} must be a finite amount >= 0")
    if amount > MAX_USD:
        raise MoneyError(f"{field} must be at most {MAX_USD}")
    if amount != amount.quantize(Decimal(1).scaleb(-places)):
        raise MoneyError(f"{field} has more than {places} decimals")
    return amount


def usd_to_pico(amount: Decimal) -> int:
    return int(amount * PICO)


def pico_to_usd(pico: int) -> Decimal:
    return Decimal(pico) / PICO


def price_to_micro(price_per_mtok: Decimal) -> int:
    """USD per 1M tokens -> whole micro-dollars per 1M tokens (exact: at most 6 decimals)."""
    return int(price_per_mtok * MICRO)


@overload
def format_usd(pico: int) -> str: ...
@overload
def format_usd(pico: None) -> None: ...
@overload
def format_usd(pico: int | None) -> str | None: ...
def format_usd(pico: int | None) -> str | None:
    """The one money format (JSON, CSV, messages): the exact amount in plain decimal notation,
    no exponent, no trailing zeros and no trailing point: 360000000 -> "0.00036", 10**13 ->
    "10", 0 -> "0"."""
    if pico is None:
        return None
    sign = "-" if pico < 0 else ""
    whole, frac = divmod(abs(pico), 10**12)
    text = f"{frac:012d}".rstrip("0")
    return f"{sign}{whole}.{text}" if text else f"{sign}{whole}"


def format_price(micro: int) -> str:
    whole, frac = divmod(micro, 10**6)
    return f"{whole}.{frac:06d}".rstrip("0").rstrip(".") if frac else f"{whole}"


def cost_pico(
    prompt_tokens: int,
    cached_tokens: int,
    completion_tokens: int,
    input_micro: int,
    cached_micro: int,
    output_micro: int,
) -> int:
    """Prompt tokens not cached x input + cached x cached price + completion x output."""
    cached = min(max(cached_tokens, 0), max(prompt_tokens, 0))
    uncached = max(prompt_tokens, 0) - cached
    return uncached * input_micro + cached * cached_micro + max(completion_tokens, 0) * output_micro
