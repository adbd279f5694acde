"""MeteringError, the base of every error a service raises, and the handlers that turn it (and
FastAPI's own validation and HTTP errors) into OpenAI-shaped JSON: {"error": {...}}."""

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "insufficient_quota",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    502: "api_error",
    503: "api_error",
    504: "api_error",
}


class MeteringError(Exception):
    status = 400
    code = "invalid_request"

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code
        self.param = param
        self.headers = headers or {}


class InvalidRequest(MeteringError):
    status, code = 400, "invalid_request"


class Unauthorized(MeteringError):
    status, code = 401, "invalid_api_key"


class Forbidden(MeteringError):
    status, code = 403, "forbidden"


class NotFound(MeteringError):
    status, code = 404, "not_found"


class ModelNotFound(MeteringError):
    status, code = 404, "model_not_found"


class TooLarge(MeteringError):
    status, code = 413, "request_too_large"


class LedgerUnavailable(MeteringError):
    status, code = 503, "ledger_unavailable"


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str
    param: str | None


class ErrorResponse(BaseModel):
    """Every error's body, as OpenAI's API shapes it."""

    error: ErrorDetail


ERROR_DESCRIPTIONS = {
    400: "The request is invalid",
    401: "No credential, or one that is unknown, revoked or expired",
    402: "A budget cannot cover the request",
    403: "The credential may not do this",
    404: "Not found",
    409: "Conflicts with what exists",
    413: "The request body is too large",
    415: "The request body's encoding is not supported",
    429: "Too many attempts: retry after the retry-after header's seconds",
    502: "The upstream failed",
    503: "The ledger database cannot be reached; retry later",
    504: "The upstream did not answer in time",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route: the error statuses it gives, each with the error model."""
    return {
        status: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status]}
        for status in sorted(statuses)
    }


def error_body(status: int, code: str, message: str, param: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "code": code, "param": param}}


def error_response(
    status: int, code: str, message: str, param: str | None = None, headers=None
) -> JSONResponse:
    return JSONResponse(error_body(status, code, message, param), status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path")]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid value")
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    return (f"{param}: {message}" if param else message), param


def _schema_without_422(app: FastAPI) -> None:
    """Invalid input answers 400 (below), so the schema must not promise FastAPI's 422."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        schema = build()
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def install_error_handlers(app: FastAPI) -> None:
    _schema_without_422(app)

    @app.exception_handler(MeteringError)
    async def _metering(_: Request, exc: MeteringError) -> JSONResponse:
        return error_response(exc.status, exc.code, exc.message, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, "invalid_request", message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        return error_response(exc.status_code, code, str(exc.detail), None, exc.headers)
