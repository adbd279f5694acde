"""RFC 3339 UTC timestamps in and out."""

from datetime import UTC, datetime


def rfc3339(value: datetime | None) -> str | None:
    if value is None:
        return None
    value = value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)
    return value.isoformat(timespec="microseconds").replace("+00:00", "Z")


def parse_rfc3339(text: str) -> datetime:
    value = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    if value.tzinfo is None:
        raise ValueError("timestamp needs a time zone (e.g. 2026-01-01T00:00:00Z)")
    return value.astimezone(UTC)
