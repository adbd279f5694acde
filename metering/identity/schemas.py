"""Request bodies of the identity API. Money arrives as decimal strings; floats are refused."""

from decimal import Decimal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, field_validator

from metering.budgets.windows import InvalidInterval, parse_interval
from metering.money import MoneyError, parse_usd


def _limit(value: object) -> Decimal | None:
    if value is None:
        return None
    try:
        return parse_usd(value, field="credit_limit")
    except MoneyError as exc:
        raise ValueError(str(exc)) from None


def _interval(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError("reset_interval must be a string")
    try:
        return parse_interval(value).text
    except InvalidInterval as exc:
        raise ValueError(str(exc)) from None


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)

    @field_validator("*")
    @classmethod
    def _no_nul(cls, value: object) -> object:
        # PostgreSQL cannot store NUL in text; refuse it on every backend alike.
        if isinstance(value, str) and "\x00" in value:
            raise ValueError("must not contain NUL characters")
        return value


class _Limited(_Body):
    credit_limit: Decimal | None = None
    reset_interval: str = "never"

    _check_limit = field_validator("credit_limit", mode="before")(_limit)
    _check_interval = field_validator("reset_interval", mode="before")(_interval)


class TeamCreate(_Limited):
    name: str = Field(min_length=1, max_length=200)


class TeamPatch(_Limited):
    name: str | None = Field(default=None, min_length=1, max_length=200)
    reset_interval: str | None = None

    _check_interval = field_validator("reset_interval", mode="before")(
        lambda v: None if v is None else _interval(v)
    )


class UserCreate(_Limited):
    email: str = Field(min_length=3, max_length=320, pattern=r"^[^@\s]+@[^@\s]+$")
    name: str = Field(min_length=1, max_length=200)
    team_id: str = Field(min_length=1, max_length=40)
    password: str | None = Field(default=None, min_length=8, max_length=1024)


class UserPatch(_Limited):
    name: str | None = Field(default=None, min_length=1, max_length=200)
    email: str | None = Field(
        default=None, min_length=3, max_length=320, pattern=r"^[^@\s]+@[^@\s]+$"
    )
    team_id: str | None = Field(default=None, min_length=1, max_length=40)
    password: str | None = Field(default=None, min_length=8, max_length=1024)
    reset_interval: str | None = None

    _check_interval = field_validator("reset_interval", mode="before")(
        lambda v: None if v is None else _interval(v)
    )


class TokenCreate(_Limited):
    name: str = Field(default="default", min_length=1, max_length=200)
    expires_at: AwareDatetime | None = None


class TokenPatch(_Limited):
    name: str | None = Field(default=None, min_length=1, max_length=200)
    reset_interval: str | None = None

    _check_interval = field_validator("reset_interval", mode="before")(
        lambda v: None if v is None else _interval(v)
    )
