"""Webhook signatures in the style of Stripe's: `x-metering-signature: t=<unix>,v1=<hex>`, the
HMAC-SHA256 with the webhook's secret of f"{t}.{body}". A receiver checks the HMAC and that t
is recent (the tolerance), which stops a captured delivery from being replayed later."""

import hashlib
import hmac
import time

HEADER = "x-metering-signature"
EVENT_ID_HEADER = "x-metering-event-id"
TOLERANCE_S = 300


def sign(secret: str, body: bytes, timestamp: int | None = None) -> str:
    """The signature header's value for this body, now (or at `timestamp`)."""
    t = int(time.time()) if timestamp is None else timestamp
    mac = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={t},v1={mac}"


def verify(
    secret: str, header: str, body: bytes, tolerance_s: int = TOLERANCE_S, now: float | None = None
) -> bool:
    """Whether `header` signs `body` with `secret` within `tolerance_s` of now."""
    parts = dict(p.split("=", 1) for p in header.split(",") if "=" in p)
    try:
        t = int(parts["t"])
    except (KeyError, ValueError):
        return False
    now = time.time() if now is None else now
    if abs(now - t) > tolerance_s:
        return False
    expected = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, parts.get("v1", ""))
