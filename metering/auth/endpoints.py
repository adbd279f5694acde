"""POST /v1/auth/login, /v1/auth/refresh, /v1/auth/logout. The credential is in the body."""

import logging

import anyio
from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import func, select

from metering.auth import sessions, throttle
from metering.auth.principal import open_access
from metering.db import utcnow
from metering.errors import Unauthorized
from metering.models import Team, User

log = logging.getLogger("metering.auth")

router = APIRouter(prefix="/v1/auth", dependencies=[Depends(open_access)])

WRONG_CREDENTIALS = "invalid email or password"
# Token answers must not be cached anywhere on the way (RFC 6749, section 5.1).
NO_STORE = {"cache-control": "no-store", "pragma": "no-cache"}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)


class Login(_Body):
    email: str = Field(min_length=1, max_length=320)
    password: str = Field(min_length=1, max_length=1024)


class RefreshBody(_Body):
    refresh_token: str = Field(min_length=1, max_length=200)


_dummy_hash: str | None = None


def _verify(passwords, password_hash: str | None, password: str) -> bool:
    """argon2 verify; an unknown email or a user without a password costs the same time."""
    global _dummy_hash
    if password_hash is None:
        _dummy_hash = _dummy_hash or passwords.hash("no password: the same work as a real one")
        passwords.verify(_dummy_hash, password)
        return False
    return passwords.verify(password_hash, password)


def _tokens(pair: sessions.TokenPair) -> JSONResponse:
    return JSONResponse(pair.out(), headers=NO_STORE)


@router.post("/login")
async def login(body: Login, request: Request) -> JSONResponse:
    state = request.app.state
    key = throttle.email_key(body.email)
    await throttle.admit(state.db, key, utcnow())
    async with state.db.sessions() as s:
        user = (
            await s.execute(
                select(User.id, User.password_hash)
                .join(Team, Team.id == User.team_id)
                .where(
                    func.lower(User.email) == body.email.strip().lower(),
                    User.deleted_at.is_(None),
                    Team.deleted_at.is_(None),
                )
            )
        ).first()
    password_hash = user.password_hash if user is not None else None
    # argon2 is slow on purpose: off the event loop.
    ok = await anyio.to_thread.run_sync(_verify, state.passwords, password_hash, body.password)
    if not ok:
        log.info("login refused: wrong email or password")
        raise Unauthorized(WRONG_CREDENTIALS)
    signing_key = await state.signer.key(state.db)
    async with state.db.transaction() as s:
        await throttle.clear(s, key)
        pair = await sessions.start(state, s, signing_key, user.id, password_hash)
    log.info("login: user %s", user.id)
    return _tokens(pair)


@router.post("/refresh")
async def refresh(body: RefreshBody, request: Request) -> JSONResponse:
    refreshed = await sessions.rotate(request.app.state, body.refresh_token)
    assert refreshed.pair is not None  # no leeway here: a spent token revokes the session
    return _tokens(refreshed.pair)


@router.post("/logout", status_code=204)
async def logout(body: RefreshBody, request: Request) -> Response:
    await sessions.logout(request.app.state, body.refresh_token)
    return Response(status_code=204)
