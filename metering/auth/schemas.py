"""Request and response bodies of /v1/auth and /v1/me."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from metering.text import RequestBody


class _Body(RequestBody):
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)
    free_text = frozenset({"password"})


class Login(_Body):
    email: str = Field(min_length=1, max_length=320)
    password: str = Field(min_length=1, max_length=1024)


class RefreshBody(_Body):
    refresh_token: str = Field(min_length=1, max_length=200)


class TokenPairOut(BaseModel):
    """A new access and refresh token (login, refresh)."""

    access_token: str
    refresh_token: str
    token_type: Literal["bearer"]
    expires_in: int
    user_id: str


class PrincipalOut(BaseModel):
    """Who a credential is (GET /v1/me)."""

    kind: Literal["admin", "api_token", "access"]
    user_id: str | None
    team_id: str | None
    token_id: str | None
