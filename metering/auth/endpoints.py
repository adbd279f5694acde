"""POST /v1/auth/login, /v1/auth/refresh, /v1/auth/logout. The credential is in the body."""

from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse

from metering.auth import service
from metering.auth.principal import AuthServicesDep, open_access
from metering.auth.schemas import Login, RefreshBody, TokenPairOut
from metering.auth.sessions import TokenPair
from metering.errors import error_responses

router = APIRouter(prefix="/v1/auth", dependencies=[Depends(open_access)])

# Token answers must not be cached anywhere on the way (RFC 6749, section 5.1).
NO_STORE = {"cache-control": "no-store", "pragma": "no-cache"}
ERRORS = error_responses(400, 401, 503)


def _tokens(pair: TokenPair) -> JSONResponse:
    return JSONResponse(pair.out(), headers=NO_STORE)


@router.post("/login", response_model=TokenPairOut, responses=error_responses(400, 401, 429, 503))
async def login(body: Login, services: AuthServicesDep) -> JSONResponse:
    return _tokens(await service.login(services, body.email, body.password))


@router.post("/refresh", response_model=TokenPairOut, responses=ERRORS)
async def refresh(body: RefreshBody, services: AuthServicesDep) -> JSONResponse:
    return _tokens(await service.refresh(services, body.refresh_token))


@router.post("/logout", status_code=204, responses=ERRORS)
async def logout(body: RefreshBody, services: AuthServicesDep) -> Response:
    await service.logout(services, body.refresh_token)
    return Response(status_code=204)
