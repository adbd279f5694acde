"""MeteringError, the base of every error a service raises, and the handlers that turn it (and
FastAPI's own validation and HTTP errors) into OpenAI-shaped JSON: {"error": {...}}."""

import re
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

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


# Text a client sent that is not valid Unicode (metering.text checks it; pydantic says it too).
NOT_UNICODE = "must be valid Unicode text (it holds a lone UTF-16 surrogate such as \\ud800)"


class InvalidText(ValueError):
    """A text field a client sent that cannot be taken (raised by metering.text's checks inside
    a request model's validation); `where` names it inside the body."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}" if where else problem)
        self.where, self.problem = where, problem


class MeteringError(Exception):
    status = 400
    code = "invalid_request"
    # Whether the same request may succeed later: None, as its status says (retry_headers).
    should_retry: bool | None = None

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


def retry_after(seconds: float) -> dict[str, str]:
    """`retry-after` in whole seconds and `retry-after-ms` (which the openai SDKs read first) in
    milliseconds, each rounded up and at least 1: a client that waits either finds the wait
    over."""
    micros = max(1, round(seconds * 1_000_000))
    return {
        "retry-after": str(-(-micros // 1_000_000)),
        "retry-after-ms": str(-(-micros // 1000)),
    }


# Statuses of a refusal that the same request may get past later (a deadline missed, a limit
# whose wait ends); every other 4xx answers the same request the same way until something else
# changes (the credential, the allow-list, the budget, the request).
_RETRIABLE_4XX = frozenset({408, 429})
NO_RETRY = {"x-should-retry": "false"}


def retry_headers(
    status: int, headers: Mapping[str, str] | None = None, should_retry: bool | None = None
) -> dict[str, str]:
    """An error answer's headers, with what clients' retry logic reads (docs/api/errors.md):
    `x-should-retry: false` on a refusal that waiting cannot change (a 4xx but 408 and 429, or
    `should_retry` False: a 429 whose wait never ends), honoured by the openai SDKs before
    anything else; `retry-after-ms` beside a `retry-after` of whole seconds."""
    out = dict(headers) if headers else {}
    if should_retry is None:
        should_retry = not 400 <= status < 500 or status in _RETRIABLE_4XX
    if not should_retry:
        out.update(NO_RETRY)
        return out
    seconds = out.get("retry-after")
    if seconds is not None and "retry-after-ms" not in out and _whole(seconds):
        out["retry-after-ms"] = str(int(seconds) * 1000)
    return out


def _whole(text: str) -> bool:
    """Whole seconds as retry-after writes them (not an HTTP date), within a day's reach."""
    return 0 < len(text) <= 9 and text.isascii() and text.isdigit()


# A request refused because the database cannot be reached (a restart, a failover) may be sent
# again after this many seconds: what the official SDKs wait before their retry.
LEDGER_RETRY_AFTER = retry_after(1)


class LedgerUnavailable(MeteringError):
    status, code = 503, "ledger_unavailable"

    def __init__(self, message: str, **kwargs: Any) -> None:
        kwargs.setdefault("headers", dict(LEDGER_RETRY_AFTER))
        super().__init__(message, **kwargs)


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
    429: "Too many attempts: retry after retry-after-ms (retry-after in whole seconds); "
    "x-should-retry: false when no wait helps",
    502: "The upstream failed",
    503: "The ledger database cannot be reached; retry later",
    504: "The upstream did not answer in time",
}


# On an operation's 400: the rules of its input that its schema cannot declare, each by the
# `param` its error names (null: the body as a whole). They depend on what is stored (a cursor
# of another listing, an id that names nothing), on the catalog or the settings (a model name,
# a webhook's address), or compare one field with another (start after end): a request its
# schema takes may still be refused by one of them, and by nothing else. docs/development/fuzzing.md
DATA_RULES = "x-data-rules"


def error_responses(
    *statuses: int, rules: dict[str | None, str] | None = None
) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route: the error statuses it gives, each with the error model;
    `rules`, by param, those of its 400s that no schema can declare (DATA_RULES)."""
    responses: dict[int | str, dict[str, Any]] = {
        status: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status]}
        for status in sorted(statuses)
    }
    if rules:
        said = "; ".join(f"{param or 'the body'}: {rule}" for param, rule in rules.items())
        responses[400] = {
            **responses[400],
            "description": f"{ERROR_DESCRIPTIONS[400]}. Beyond its schema: {said}",
            DATA_RULES: [{"param": param, "rule": rule} for param, rule in rules.items()],
        }
    return responses


def _sendable(text: str | None) -> str | None:
    """Text as an answer can carry it: a lone surrogate a client sent, echoed in a message or a
    param, is written as its escape (\\ud800) instead of failing the answer."""
    if text is None or text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(status: int, code: str, message: str, param: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {
        "error": {
            "message": _sendable(message),
            "type": kind,
            "code": code,
            "param": _sendable(param),
        }
    }


def error_response(
    status: int,
    code: str,
    message: str,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
    should_retry: bool | None = None,
) -> JSONResponse:
    """Every error answer of the service: the OpenAI shape, and the retry headers of its status
    (retry_headers)."""
    return JSONResponse(
        error_body(status, code, message, param),
        status,
        headers=retry_headers(status, headers, should_retry),
    )


# pydantic's own words ahead of a validator's message: not for the person reading it.
_FRAMEWORK_PREFIXES = ("Value error, ", "Assertion failed, ")


def _param(loc) -> str | None:
    """A field's place as a client writes it: `events[3].idempotency_key`."""
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header", "cookie"):
        parts = parts[1:]
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    param = _param(first.get("loc", ()))
    message = str(first.get("msg", "invalid value"))
    for prefix in _FRAMEWORK_PREFIXES:
        message = message.removeprefix(prefix)
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, InvalidText):
        where = cause.where
        if param and where:
            where = f"{param}{where}" if where.startswith("[") else f"{param}.{where}"
        param, message = (where or param), cause.problem
    elif first.get("type") == "string_unicode":
        message = NOT_UNICODE
    return (f"{param}: {message}" if param else message), param


def _header(description: str, **schema: Any) -> dict[str, Any]:
    return {"description": description, "schema": {"type": "string", **schema}}


_RATE_HEADERS = {
    f"x-ratelimit-{what}-{kind}": _header(
        f"{text} of the tightest {kind} per minute limit (sent only where one applies)",
        **({"pattern": "^[0-9]+$"} if what != "reset" else {}),
    )
    for kind in ("requests", "tokens")
    for what, text in (
        ("limit", "The cap"),
        ("remaining", "What is left this minute"),
        ("reset", "The time until this minute ends (e.g. 41.2s)"),
    )
}
# The response headers the service sends, declared in components.headers and referred to by
# every response that carries them (each response also carries x-request-id).
HEADERS: dict[str, dict[str, Any]] = {
    "x-request-id": _header(
        "This request's id: a proxied request's ledger event, refusal and logs carry it"
    ),
    "retry-after": _header(
        "Whole seconds to wait before retrying, rounded up (a wait that ends)", pattern="^[0-9]+$"
    ),
    "retry-after-ms": _header(
        "The same wait in milliseconds, rounded up (the openai SDKs read it first)",
        pattern="^[0-9]+$",
    ),
    "x-should-retry": _header(
        "false: the same request gets the same refusal until something else changes (the "
        "credential, its limits or allow-list, the budget, the request): do not retry it",
        enum=["false"],
    ),
    "x-budget-scope": _header(
        "The budget that refused the request",
        enum=["token", "user", "team", "run", "end_user"],
    ),
    "x-budget-resets-at": _header(
        "When the refusing budget's window resets (absent when it never does)",
        format="date-time",
    ),
    "x-max-tokens-clamped": _header(
        "The max_tokens the request was lowered to so that its budgets could hold it (absent "
        "when it was not lowered)",
        pattern="^[0-9]+$",
    ),
    **_RATE_HEADERS,
}
# Beside x-request-id: the headers each status carries.
STATUS_HEADERS: dict[str, tuple[str, ...]] = {
    **{
        str(status): ("x-should-retry",)
        for status in ERROR_DESCRIPTIONS
        if 400 <= status < 500 and status not in _RETRIABLE_4XX
    },
    "402": ("x-budget-scope", "x-budget-resets-at", "x-should-retry"),
    "429": ("retry-after", "retry-after-ms", "x-should-retry", *_RATE_HEADERS),
    "503": ("retry-after", "retry-after-ms"),
}


def _declare_headers(schema: dict[str, Any]) -> None:
    schema.setdefault("components", {})["headers"] = HEADERS
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            for status, response in operation.get("responses", {}).items():
                names = ["x-request-id", *STATUS_HEADERS.get(status, ())]
                if status.startswith("2") and path == "/v1/chat/completions":
                    names += ["x-max-tokens-clamped", *_RATE_HEADERS]
                declared = response.setdefault("headers", {})
                for name in names:
                    declared.setdefault(name, {"$ref": f"#/components/headers/{name}"})


# Each create, by the path parameter its answer's `id` fills: a link from its answer to every
# operation that takes that parameter, so a client (or a stateful fuzzer) goes from the object
# it made to its reads, updates and deletes. The target's other path parameters come from the
# create's own path or its answer's field of the same name.
CREATES = {
    "team_id": ("/v1/teams", "post"),
    "user_id": ("/v1/users", "post"),
    "token_id": ("/v1/users/{user_id}/tokens", "post"),
    "key_id": ("/v1/teams/{team_id}/ingest-keys", "post"),
    "webhook_id": ("/v1/webhooks", "post"),
    "reconciliation_id": ("/v1/reconciliations", "post"),
}


def _declare_links(schema: dict[str, Any]) -> None:
    paths = schema.get("paths", {})
    for param, (create_path, create_method) in CREATES.items():
        create = paths.get(create_path, {}).get(create_method)
        if create is None:
            continue
        answer = create["responses"].get("201", {})
        ref = answer.get("content", {}).get("application/json", {}).get("schema", {}).get("$ref")
        made = schema["components"]["schemas"].get(str(ref).rsplit("/", 1)[-1], {})
        fields = set(made.get("properties", {}))
        links = answer.setdefault("links", {})
        for path, operations in paths.items():
            if "{" + param + "}" not in path:
                continue
            for method, operation in operations.items():
                values = {}
                for name in re.findall(r"{(\w+)}", path):
                    if name == param:
                        values[name] = "$response.body#/id"
                    elif "{" + name + "}" in create_path:
                        values[name] = f"$request.path.{name}"
                    elif name in fields:
                        values[name] = f"$response.body#/{name}"
                    else:  # a parameter the create does not know (an end user): no link
                        break
                else:
                    links[operation["operationId"]] = {
                        "operationId": operation["operationId"],
                        "parameters": values,
                        "description": f"{method.upper()} {path} of the object made",
                    }


def _schema_without_422(app: FastAPI) -> None:
    """Invalid input answers 400 (below), so the schema must not promise FastAPI's 422; each
    response declares the headers it carries."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        schema = build()
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        _declare_headers(schema)
        _declare_links(schema)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def install_error_handlers(app: FastAPI) -> None:
    _schema_without_422(app)

    @app.exception_handler(MeteringError)
    async def _metering(_: Request, exc: MeteringError) -> JSONResponse:
        return error_response(
            exc.status, exc.code, exc.message, exc.param, exc.headers, exc.should_retry
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, "invalid_request", message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        headers = exc.headers
        if exc.status_code == 405:
            headers = {"Allow": ", ".join(allowed_methods(app, request))}
        return error_response(exc.status_code, code, str(exc.detail), None, headers)


def allowed_methods(app: FastAPI, request: Request) -> list[str]:
    """Every method some route takes at this request's path. FastAPI makes one route per method,
    so Starlette's own 405 names only the first route that matched the path; each method is asked
    of the router as a request of that method would be."""
    return [
        method
        for method in HTTP_METHODS
        if any(
            route.matches({**request.scope, "method": method})[0] == Match.FULL
            for route in app.router.routes
        )
    ]


HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
