"""Reading one event of POST /v1/events, field by field: its counts, its texts, its moment,
its end user and tags. Anything out of bounds raises Rejected, whose message names the field
(the event answers `rejected` with reason `invalid_event`, the batch's other events go on)."""

from datetime import datetime, timedelta
from typing import Any, Literal, overload

from metering.errors import InvalidRequest
from metering.ledger import attribution
from metering.ledger.charge import CACHED_ABOVE_PROMPT, DETAILS_ABOVE_COMPLETION, Usage
from metering.ledger.event import DETAIL_FIELDS
from metering.timefmt import parse_rfc3339

MAX_AGE = timedelta(days=35)  # the oldest occurred_at taken
MAX_AHEAD = timedelta(minutes=5)  # a client's clock ahead of ours
COUNT_CEILING = 10**9  # tokens in one count


class Rejected(ValueError):
    """An event that cannot be recorded, and why."""


@overload
def count_of(raw: dict, name: str, required: Literal[True] = ...) -> int: ...
@overload
def count_of(raw: dict, name: str, required: bool) -> int | None: ...
def count_of(raw: dict, name: str, required: bool = True) -> int | None:
    value = raw.get(name)
    if value is None:
        if required:
            raise Rejected(f"{name} is required")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise Rejected(f"{name} must be a whole number")
    if not 0 <= value <= COUNT_CEILING:
        raise Rejected(f"{name} must be between 0 and {COUNT_CEILING}")
    return value


def text_of(raw: dict, name: str, limit: int, required: bool = False) -> str | None:
    value = raw.get(name)
    if value is None:
        if required:
            raise Rejected(f"{name} is required")
        return None
    if not isinstance(value, str) or not value or len(value) > limit or "\x00" in value:
        raise Rejected(f"{name} must be a non-empty string of at most {limit} characters")
    return value


def usage_of(raw: dict) -> Usage:
    """The event's counts, checked against each other as an upstream's are
    (metering.proxy.reported): cached within prompt, each detail within completion."""
    prompt = count_of(raw, "prompt_tokens")
    completion = count_of(raw, "completion_tokens")
    cached = count_of(raw, "cached_tokens", required=False) or 0
    if cached > prompt:
        raise Rejected(
            f"{CACHED_ABOVE_PROMPT}: cached_tokens ({cached}) must be at most prompt_tokens "
            f"({prompt})"
        )
    details = raw.get("completion_tokens_details")
    if details is None:
        details = {}
    if not isinstance(details, dict):
        raise Rejected("completion_tokens_details must be an object")
    unknown = set(details) - set(DETAIL_FIELDS)
    if unknown:
        raise Rejected(f"completion_tokens_details: unknown field {sorted(unknown)[0]!r}")
    counts: dict[str, Any] = {
        name: count_of(details, name, required=False) for name in DETAIL_FIELDS
    }
    for name, count in counts.items():
        if count is not None and count > completion:
            raise Rejected(
                f"{DETAILS_ABOVE_COMPLETION}: completion_tokens_details.{name} ({count}) must "
                f"be at most completion_tokens ({completion})"
            )
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        cached_tokens=cached,
        **counts,
    )


def occurred_at(raw: dict, now: datetime) -> datetime | None:
    text = text_of(raw, "occurred_at", 64)
    if text is None:
        return None
    try:
        value = parse_rfc3339(text)
    except ValueError:
        raise Rejected("occurred_at must be an RFC 3339 timestamp with its zone") from None
    if value < now - MAX_AGE:
        raise Rejected(f"occurred_at is more than {MAX_AGE.days} days back")
    if value > now + MAX_AHEAD:
        raise Rejected("occurred_at is in the future")
    return value


def attributed(raw: dict) -> tuple[str | None, str]:
    """The event's end user and its tags as the ledger keeps them (metering.ledger.attribution:
    the bounds of a proxied request's)."""
    try:
        end_user = raw.get("end_user")
        if end_user is not None:
            end_user = attribution.end_user(end_user, "end_user")
        tags = raw.get("tags")
        if tags is None:
            return end_user, attribution.NO_TAGS
        return end_user, attribution.encode(attribution.tags(tags, "tags"))
    except InvalidRequest as exc:
        raise Rejected(exc.message) from None
