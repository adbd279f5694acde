"""Request and response bodies of the identity API. Money arrives as decimal strings (floats
are refused) and leaves as decimal strings; times leave as RFC 3339 UTC text."""

import re
from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import (
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from metering import limits
from metering.alerts.record import DEFAULT_THRESHOLDS, thresholds_of
from metering.budgets.windows import INTERVAL_PATTERN, InvalidInterval, parse_interval
from metering.models import ApiToken, Budget, Team, User
from metering.money import MoneyError, format_usd, usd_schema, usd_text
from metering.text import RequestBody
from metering.timefmt import BOUNDS, MOMENT_SCHEMA, bounded, rfc3339


def _usd(field: str):
    """A field validator (mode before) of an amount or null, as money.usd_text reads it."""

    def check(value: object) -> Decimal | None:
        if value is None:
            return None
        try:
            return usd_text(value, field)
        except MoneyError as exc:
            raise ValueError(str(exc)) from None

    return check


# An amount or null in a body, declared as usd_text checks it.
Usd = Annotated[Decimal | None, WithJsonSchema(usd_schema(nullable=True))]
_limit = _usd("credit_limit")


# A reset interval as parse_interval takes it, declared with its pattern.
INTERVAL: dict[str, Any] = {"pattern": INTERVAL_PATTERN}


def _interval(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError("reset_interval must be a string")
    try:
        return parse_interval(value).text
    except InvalidInterval as exc:
        raise ValueError(str(exc)) from None


class _Body(RequestBody):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)
    free_text = frozenset({"password"})


MAX_THRESHOLDS = 10


# _thresholds's rules, declared.
THRESHOLDS: dict[str, Any] = {
    "anyOf": [
        {
            "type": "array",
            "items": {"type": "integer", "minimum": 1, "maximum": 100},
            "maxItems": MAX_THRESHOLDS,
        },
        {"type": "null"},
    ]
}


def _thresholds(value: object) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > MAX_THRESHOLDS:
        raise ValueError(
            f"alert_thresholds must be a list of at most {MAX_THRESHOLDS} percentages (or null "
            "for the default [50, 80, 100])"
        )
    found: set[int] = set()
    for item in map(whole, value):
        if isinstance(item, bool) or not isinstance(item, int) or not 1 <= item <= 100:
            raise ValueError("alert_thresholds entries must be whole numbers from 1 to 100")
        found.add(item)
    return sorted(found)


_soft = _usd("soft_limit")


class _Limited(_Body):
    credit_limit: Usd = None
    reset_interval: str = Field(default="never", json_schema_extra=INTERVAL)
    alert_thresholds: Annotated[list[int] | None, WithJsonSchema(THRESHOLDS)] = Field(
        default=None,
        description="Percentages of credit_limit (1 to 100) at which budget.threshold_crossed "
        "is sent, once per window; null: [50, 80, 100]; []: none",
    )
    soft_limit: Usd = Field(
        default=None,
        description="An amount (USD) whose crossing sends budget.soft_limit_reached, once per "
        "window; it never refuses a request; null: none",
    )

    _check_limit = field_validator("credit_limit", mode="before")(_limit)
    _check_interval = field_validator("reset_interval", mode="before")(_interval)
    _check_thresholds = field_validator("alert_thresholds", mode="before")(_thresholds)
    _check_soft = field_validator("soft_limit", mode="before")(_soft)


def whole(value: object) -> object:
    """A JSON number with no fraction as an int: 5 and 5.0 are one JSON number, an `integer`
    to JSON Schema. Anything else is left as it came, for a strict int to refuse."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _bounded(high: int, description: str):
    # strict: a JSON whole number only (no string, no fraction, no boolean)
    return Annotated[
        int | None,
        Field(strict=True, ge=0, le=high, description=description),
        BeforeValidator(whole),
    ]


# A model name or a pattern of one (`*` any run of characters, `?` one): no spaces or brackets.
_PATTERN = re.compile(r"[A-Za-z0-9._:/@*?+=-]{1,%d}" % limits.PATTERN_CHARS)  # noqa: UP031


def _models(value: object) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise ValueError("allowed_models must be a list of model names (or null for all)")
    if len(value) > limits.MAX_MODELS:
        raise ValueError(f"allowed_models may list at most {limits.MAX_MODELS} names")
    out: list[str] = []
    for item in value:
        if not isinstance(item, str) or _PATTERN.fullmatch(item) is None:
            raise ValueError(
                "allowed_models entries must be model names of 1 to "
                f"{limits.PATTERN_CHARS} characters (letters, digits, . _ : / @ + = - and the "
                "wildcards * ?)"
            )
        if item not in out:
            out.append(item)
    return out


class _RateLimited(_Body):
    """Limits beyond credit (null: none at this scope)."""

    rpm_limit: _bounded(  # type: ignore[valid-type]
        limits.MAX_RPM, "Requests admitted per UTC minute (429 beyond); null: none"
    ) = None
    tpm_limit: _bounded(  # type: ignore[valid-type]
        limits.MAX_TPM,
        "Tokens per UTC minute: a request reserves its prompt's upper bound plus its output "
        "allowance, settled to its actual usage (429 beyond); null: none",
    ) = None
    max_parallel_requests: _bounded(  # type: ignore[valid-type]
        limits.MAX_PARALLEL, "Requests in flight at once, streams until they end; null: none"
    ) = None
    allowed_models: list[str] | None = Field(
        default=None,
        # _models's rules, declared: each entry _PATTERN, at most MAX_MODELS of them.
        json_schema_extra={
            "items": {"type": "string", "pattern": f"^{_PATTERN.pattern}$"},
            "maxItems": limits.MAX_MODELS,
        },
        description="Catalog model names (`*` and `?` as wildcards) this scope may call (403 "
        "model_not_allowed otherwise); every scope's list must allow a model; null: all",
    )

    _check_models = field_validator("allowed_models", mode="before")(_models)


MAX_LIFETIME_S = 100 * 365 * 86400


# Both expiries given, neither null: refused by _one_expiry, and declared so.
BOTH_EXPIRIES: dict[str, Any] = {
    "required": ["expires_at", "expires_in"],
    "properties": {"expires_at": {"type": "string"}, "expires_in": {"type": "integer"}},
}


class _Expiring(_Body):
    model_config = ConfigDict(json_schema_extra={"not": BOTH_EXPIRIES})

    expires_at: Annotated[
        AwareDatetime | None,
        # the bounds `bounded` checks, declared (timefmt.MOMENT_PATTERN)
        WithJsonSchema({"anyOf": [{"type": "string", **MOMENT_SCHEMA}, {"type": "null"}]}),
    ] = Field(
        default=None,
        description=f"When the token stops working (RFC 3339, {BOUNDS}); null: never",
    )
    expires_in: Annotated[
        int | None,
        Field(
            strict=True,
            ge=1,
            le=MAX_LIFETIME_S,
            description="The token's lifetime in seconds from now (instead of expires_at); "
            "both are capped by METERING_TOKEN_MAX_LIFETIME_S when it is set",
        ),
        BeforeValidator(whole),
    ] = None

    _bounded = field_validator("expires_at")(lambda v: None if v is None else bounded(v))

    @model_validator(mode="after")
    def _one_expiry(self):
        if self.expires_at is not None and self.expires_in is not None:
            raise ValueError("give expires_at or expires_in, not both")
        return self


_end_user_limit = _usd("end_user_credit_limit")


class _EndUserDefaults(_Body):
    """The default budget of each end user of a team (metering.budgets.end_users)."""

    end_user_credit_limit: Usd = Field(
        default=None,
        description="The credit limit (USD) of each end user of the team that has no override "
        "of its own; null: end users without an override are not limited",
    )
    end_user_reset_interval: str = Field(
        default="never",
        description="The reset interval of those end users' budgets",
        json_schema_extra=INTERVAL,
    )

    _check_end_user_limit = field_validator("end_user_credit_limit", mode="before")(_end_user_limit)
    _check_end_user_interval = field_validator("end_user_reset_interval", mode="before")(_interval)


class TeamCreate(_Limited, _RateLimited, _EndUserDefaults):
    name: str = Field(min_length=1, max_length=200)


class TeamPatch(_Limited, _RateLimited, _EndUserDefaults):
    name: str | None = Field(default=None, min_length=1, max_length=200)
    # A patch may leave out what a create defaults: these fields and their checks take None.
    reset_interval: str | None = Field(default=None, json_schema_extra=INTERVAL)  # type: ignore[assignment]
    end_user_reset_interval: str | None = Field(default=None, json_schema_extra=INTERVAL)  # type: ignore[assignment]

    _check_interval = field_validator("reset_interval", mode="before")(  # type: ignore[assignment]
        lambda v: None if v is None else _interval(v)
    )
    _check_end_user_interval = field_validator(  # type: ignore[assignment]
        "end_user_reset_interval", mode="before"
    )(lambda v: None if v is None else _interval(v))


# An address: one @ between two runs of characters that are no space and no control character
# (which RequestBody refuses anywhere, before this pattern is looked at).
EMAIL_PATTERN = r"^[^@\s\x00-\x1f\x7f]+@[^@\s\x00-\x1f\x7f]+$"


class UserCreate(_Limited, _RateLimited):
    email: str = Field(min_length=3, max_length=320, pattern=EMAIL_PATTERN)
    name: str = Field(min_length=1, max_length=200)
    team_id: str = Field(min_length=1, max_length=40)
    password: str | None = Field(default=None, min_length=8, max_length=1024)


class UserPatch(_Limited, _RateLimited):
    name: str | None = Field(default=None, min_length=1, max_length=200)
    email: str | None = Field(default=None, min_length=3, max_length=320, pattern=EMAIL_PATTERN)
    team_id: str | None = Field(default=None, min_length=1, max_length=40)
    password: str | None = Field(default=None, min_length=8, max_length=1024)
    # A patch may leave out what a create defaults: these fields and their checks take None.
    reset_interval: str | None = Field(default=None, json_schema_extra=INTERVAL)  # type: ignore[assignment]

    _check_interval = field_validator("reset_interval", mode="before")(  # type: ignore[assignment]
        lambda v: None if v is None else _interval(v)
    )


class TokenCreate(_Limited, _RateLimited, _Expiring):
    name: str = Field(default="default", min_length=1, max_length=200)


class TokenPatch(_Limited, _RateLimited, _Expiring):
    name: str | None = Field(default=None, min_length=1, max_length=200)
    # A patch may leave out what a create defaults: these fields and their checks take None.
    reset_interval: str | None = Field(default=None, json_schema_extra=INTERVAL)  # type: ignore[assignment]

    _check_interval = field_validator("reset_interval", mode="before")(  # type: ignore[assignment]
        lambda v: None if v is None else _interval(v)
    )


# Responses


def _limits(budget: Budget | None, subject) -> dict:
    credit = (
        {
            "credit_limit": None,
            "reset_interval": "never",
            "alert_thresholds": list(DEFAULT_THRESHOLDS),
            "soft_limit": None,
        }
        if budget is None
        else {
            "credit_limit": format_usd(budget.credit_limit),
            "reset_interval": budget.reset_interval,
            "alert_thresholds": list(thresholds_of(budget.alert_thresholds)),
            "soft_limit": format_usd(budget.soft_limit),
        }
    )
    models = limits.parse_models(subject.allowed_models)
    return {
        **credit,
        "rpm_limit": subject.rpm_limit,
        "tpm_limit": subject.tpm_limit,
        "max_parallel_requests": subject.max_parallel_requests,
        "allowed_models": list(models) if models is not None else None,
    }


class _LimitsOut(BaseModel):
    alert_thresholds: list[int]
    soft_limit: str | None
    rpm_limit: int | None
    tpm_limit: int | None
    max_parallel_requests: int | None
    allowed_models: list[str] | None


class TeamOut(_LimitsOut):
    id: str
    name: str
    credit_limit: str | None
    reset_interval: str
    end_user_credit_limit: str | None = Field(
        description="The default credit limit of each end user of the team (USD); null: none"
    )
    end_user_reset_interval: str
    created_at: str

    @classmethod
    def of(cls, team: Team, budget: Budget | None) -> "TeamOut":
        return cls(
            id=team.id,
            name=team.name,
            **_limits(budget, team),
            end_user_credit_limit=format_usd(team.end_user_credit_limit),
            end_user_reset_interval=team.end_user_reset_interval or "never",
            created_at=rfc3339(team.created_at),
        )


class UserOut(_LimitsOut):
    id: str
    email: str
    name: str
    team_id: str
    credit_limit: str | None
    reset_interval: str
    created_at: str

    @classmethod
    def of(cls, user: User, budget: Budget | None) -> "UserOut":
        return cls(
            id=user.id,
            email=user.email,
            name=user.name,
            team_id=user.team_id,
            **_limits(budget, user),
            created_at=rfc3339(user.created_at),
        )


class TokenOut(_LimitsOut):
    id: str
    user_id: str
    name: str
    prefix: str
    credit_limit: str | None
    reset_interval: str
    expires_at: str | None
    created_at: str
    revoked_at: str | None

    @classmethod
    def of(cls, token: ApiToken, budget: Budget | None) -> "TokenOut":
        return cls(
            id=token.id,
            user_id=token.user_id,
            name=token.name,
            prefix=token.prefix,
            **_limits(budget, token),
            expires_at=rfc3339(token.expires_at),
            created_at=rfc3339(token.created_at),
            revoked_at=rfc3339(token.revoked_at),
        )


class TokenCreated(TokenOut):
    """A new token, with its secret: shown this once."""

    token: str


class TeamList(BaseModel):
    object: Literal["list"] = "list"
    data: list[TeamOut]


class UserList(BaseModel):
    object: Literal["list"] = "list"
    data: list[UserOut]


class TokenList(BaseModel):
    object: Literal["list"] = "list"
    data: list[TokenOut]
