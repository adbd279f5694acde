"""Bodies of the alerts and webhooks API. Money is a decimal string of USD."""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from metering.alerts.record import TYPES
from metering.text import RequestBody

MAX_URL_CHARS = 2048
# The form service.check_url takes, declared: http or https, a host (a name or an IPv4 address;
# no user name or password), a port, then any path, query and fragment. Whether http and an
# address literal are taken depends on the settings (METERING_WEBHOOKS_ALLOW_*): those are the
# endpoint's data rules. (An IPv6 literal, `[...]`, is taken but not declared.)
URL_PATTERN = (
    r"^[Hh][Tt][Tt][Pp][Ss]?://[A-Za-z0-9._~-]+(?::[0-9]{1,5})?"
    r"(?:[/?#][^\s\x00-\x1f\x7f]*)?$"
)


class WebhookCreate(RequestBody):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(
        min_length=1,
        max_length=MAX_URL_CHARS,
        json_schema_extra={"pattern": URL_PATTERN},
        description="https://..., or http:// to a loopback address when "
        "METERING_WEBHOOKS_ALLOW_LOOPBACK is true. Never to an internal address (loopback, "
        "private, shared, link-local, multicast, reserved, unspecified: a literal one is 400, a "
        "name resolving to one fails its deliveries unsent) but loopback with "
        "METERING_WEBHOOKS_ALLOW_LOOPBACK and private or shared with "
        "METERING_WEBHOOKS_ALLOW_PRIVATE; redirects are never followed",
    )
    events: list[str] = Field(
        min_length=1,
        max_length=len(TYPES),
        description=f"Event types to send: {', '.join(TYPES)}",
        # The types _known checks, as the document's enum (one declaration: TYPES).
        json_schema_extra={"items": {"type": "string", "enum": list(TYPES)}},
    )
    team_id: str | None = Field(
        default=None, min_length=1, max_length=40, description="Only this team's events; null: all"
    )
    secret: str | None = Field(
        default=None,
        min_length=16,
        max_length=200,
        pattern=r"^[\x21-\x7e]+$",
        description="The signing secret (printable ASCII); generated when not given",
    )

    @field_validator("events")
    @classmethod
    def _known(cls, value: list[str]) -> list[str]:
        unknown = [v for v in value if v not in TYPES]
        if unknown:
            raise ValueError(f"unknown event type {unknown[0]!r}: one of {', '.join(TYPES)}")
        return list(dict.fromkeys(value))


class WebhookOut(BaseModel):
    id: str
    url: str
    events: list[str]
    team_id: str | None
    created_at: str


class WebhookCreated(WebhookOut):
    """A new webhook, with its signing secret: shown this once."""

    secret: str


class WebhookList(BaseModel):
    object: Literal["list"] = "list"
    data: list[WebhookOut]


class AttemptOut(BaseModel):
    attempt: int
    at: str
    status_code: int | None = Field(description="The receiver's status; null: no answer")
    error: str | None = Field(description="What went wrong, with a short excerpt of the answer")
    duration_ms: int


class DeliveryOut(BaseModel):
    id: str
    event_id: str
    event_type: str
    status: Literal["pending", "delivered", "failed"]
    attempts: int
    created_at: str
    next_attempt_at: str | None = Field(description="The next retry (pending only)")
    last_status_code: int | None
    last_error: str | None
    finished_at: str | None
    history: list[AttemptOut]


class DeliveryList(BaseModel):
    object: Literal["list"] = "list"
    data: list[DeliveryOut]


class TestSent(BaseModel):
    event_id: str
    delivery_id: str


class AlertData(BaseModel):
    model_config = ConfigDict(extra="allow")

    scope: str
    subject_id: str
    team_id: str | None = None
    credit_limit: str | None = None
    spent: str | None = None
    reserved: str | None = None
    remaining: str | None = None
    threshold: int | None = None
    resets_at: str | None = None
    # Only in the events of scope end_user: a webhook's body and the same event listed here
    # stay alike for every other scope.
    end_user: str | None = Field(
        default=None,
        exclude_if=lambda value: value is None,
        description="Scope end_user only: the end user's own id, as the client sent it "
        "(subject_id is its budget's id)",
    )


class AlertOut(BaseModel):
    """An event as webhooks receive it."""

    id: str
    type: str
    created_at: str
    data: AlertData


class AlertList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AlertOut]


def alert_out(payload: dict[str, Any]) -> AlertOut:
    return AlertOut(**payload)
