"""Request and response bodies of the identity API. Money arrives as decimal strings (floats
are refused) and leaves as decimal strings; times leave as RFC 3339 UTC text."""

from decimal import Decimal
from typing import Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, field_validator

from metering.budgets.windows import InvalidInterval, parse_interval
from metering.models import ApiToken, Budget, Team, User
from metering.money import MoneyError, format_usd, parse_usd
from metering.timefmt import rfc3339


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


# Responses


def _limits(budget: Budget | None) -> dict:
    if budget is None:
        return {"credit_limit": None, "reset_interval": "never"}
    return {
        "credit_limit": format_usd(budget.credit_limit),
        "reset_interval": budget.reset_interval,
    }


class TeamOut(BaseModel):
    id: str
    name: str
    credit_limit: str | None
    reset_interval: str
    created_at: str

    @classmethod
    def of(cls, team: Team, budget: Budget | None) -> "TeamOut":
        return cls(
            id=team.id, name=team.name, **_limits(budget), created_at=rfc3339(team.created_at)
        )


class UserOut(BaseModel):
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
            **_limits(budget),
            created_at=rfc3339(user.created_at),
        )


class TokenOut(BaseModel):
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
            **_limits(budget),
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
