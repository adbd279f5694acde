"""GET /v1/usage, /v1/spend, /v1/refusals and /v1/refusals/summary (admin, or self); GET
/v1/exports/focus, POST /v1/reconciliations and GET /v1/reconciliations/{id} (admin)."""

from collections.abc import AsyncIterator
from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import UploadFile

from metering.auth.principal import (
    RULE_ERRORS,
    AdminPrincipal,
    SelfPrincipal,
)
from metering.container import ServicesDep
from metering.errors import InvalidRequest, NotFound, TooLarge, error_responses
from metering.ledger.attribution import END_USER_PATTERN, MAX_TAGS, TAG_FILTER_PATTERN
from metering.reports import changes, focus, reconciliation, refusals, usage
from metering.reports.refusals import GROUP_BY_PATTERN as REFUSALS_GROUP_BY
from metering.reports.schemas import (
    ChangesOut,
    ReconciliationOut,
    RefusalsOut,
    RefusalSummaryOut,
    SpendOut,
    UsageOut,
)
from metering.reports.spend import (
    DEFAULT_ROWS,
    MAX_PAGE,
    MAX_REPORT_ROWS,
    MAX_ROWS,
    spend_report,
)
from metering.reports.spend import GROUP_BY_PATTERN as SPEND_GROUP_BY
from metering.reports.usage import check_text

router = APIRouter(prefix="/v1")

MAX_EXPORT_BYTES = 64 * 1024 * 1024
CSV = {"text/csv": {"schema": {"type": "string"}}}
# GET /v1/usage names no user, token or team in its path, so the self rule never answers 404.
USAGE_ERRORS = tuple(status for status in RULE_ERRORS["self"] if status != 404)
# The rules of a report's parameters that compare two of them or read what is stored (the
# document cannot declare them).
RANGE: dict[str | None, str] = {"start": "not after end"}
PAGED: dict[str | None, str] = {**RANGE, "cursor": "a next_cursor this listing gave"}
DEFAULT_USAGE_PAGE = 100
LABELS_DOC = (
    "true: each row also carries the names of its ids: team_name, user_email, token_name "
    "(for the ids the row has)"
)

# A report's start and end: any RFC 3339 date-time, read within the stored bounds
# (reports.usage.parse_time).
DATE_TIME = {"format": "date-time"}
# The FOCUS export's edges: whole UTC hours (focus.parse_range's rule, declared).
WHOLE_HOUR = {**DATE_TIME, "pattern": focus.WHOLE_HOUR_PATTERN}
# The repeatable tag filter, as reports.tag_filter parses it.
TAG_FILTERS = {"items": {"type": "string", "pattern": TAG_FILTER_PATTERN}, "maxItems": MAX_TAGS}

TAG_DOC = (
    "`<key>:<value>` (split at the first colon): the events whose tags have that key with that "
    "value. Repeatable: every one must match (at most 16)"
)


def _attachment(filename: str) -> dict[str, str]:
    return {"content-disposition": f'attachment; filename="{filename}"'}


def _csv_stream(rows: AsyncIterator[bytes], headers: dict[str, str]) -> StreamingResponse:
    """Every matching row, streamed: without `limit` and `cursor`, a report's CSV is all of it."""
    return StreamingResponse(rows, media_type="text/csv", headers=headers)


@router.get(
    "/usage/changes",
    response_model=ChangesOut,
    responses={
        200: {
            "description": "The events after the cursor in the order they became visible, as "
            "JSON or (format=csv) as CSV with the next cursor in `x-next-cursor`",
            "content": CSV,
        },
        **error_responses(400, *USAGE_ERRORS, rules={"after": "a `next` this feed gave"}),
    },
)
async def usage_changes(
    principal: SelfPrincipal,
    services: ServicesDep,
    after: str | None = Query(
        None,
        min_length=1,
        max_length=changes.MAX_CURSOR,
        description="the `next` of the last poll; none: from the oldest event kept",
    ),
    limit: int = Query(100, ge=1, le=1000),
    format: str = Query("json", pattern="^(json|csv)$"),
) -> Response:
    """The ledger's change feed, for an exporter: poll with `next` and every event comes once,
    in the order events became visible, however late each committed (admin: every event; a
    user's credential: its own)."""
    rows, next_cursor = await changes.changes(services.db, principal, after, limit)
    if format == "csv":
        headers = {
            **_attachment("changes.csv"),
            **({"x-next-cursor": next_cursor} if next_cursor else {}),
        }
        body = await usage.csv_page(services.db, rows, False)
        return Response(body, media_type="text/csv", headers=headers)
    return JSONResponse({"data": [usage.event_out(row) for row in rows], "next": next_cursor})


@router.get(
    "/usage",
    response_model=UsageOut,
    responses={
        200: {"description": "Events newest first, as JSON or (format=csv) as CSV", "content": CSV},
        **error_responses(400, *USAGE_ERRORS, rules=PAGED),
    },
)
async def list_usage(
    principal: SelfPrincipal,
    services: ServicesDep,
    start: str | None = Query(None, max_length=64, json_schema_extra=DATE_TIME),
    end: str | None = Query(None, max_length=64, json_schema_extra=DATE_TIME),
    team_id: str | None = Query(None, max_length=40),
    user_id: str | None = Query(None, max_length=40),
    token_id: str | None = Query(None, max_length=40),
    model: str | None = Query(None, max_length=200),
    provider: str | None = Query(None, max_length=100),
    end_user: str | None = Query(
        None,
        min_length=1,
        max_length=256,
        description="the events of this end user only",
        json_schema_extra={"pattern": END_USER_PATTERN},
    ),
    tag: list[str] | None = Query(None, description=TAG_DOC, json_schema_extra=TAG_FILTERS),
    endpoint: Literal["chat.completions", "responses"] | None = Query(
        None, description="the events of requests to this API only"
    ),
    limit: int | None = Query(
        None,
        ge=1,
        le=1000,
        description="Events per page (default 100). With format=csv: at most this many rows "
        "(and `x-next-cursor` when there are more); without it the CSV streams every row.",
    ),
    cursor: str | None = Query(None, max_length=500),
    format: str = Query("json", pattern="^(json|csv)$"),
    labels: bool = Query(False, description=LABELS_DOC),
) -> Response:
    query = usage.events_query(
        principal,
        start=start,
        end=end,
        filters=dict(
            team_id=team_id,
            user_id=user_id,
            token_id=token_id,
            model=model,
            provider=provider,
            end_user=end_user,
            endpoint=endpoint,
        ),
        tags=tag,
    )
    attachment = _attachment("usage.csv")
    if format == "csv" and limit is None and cursor is None:
        return _csv_stream(usage.csv_stream(services.db, query, labels=labels), attachment)
    if format == "csv":
        events, next_cursor = await usage.page_events(
            services.db, query, limit=limit or DEFAULT_USAGE_PAGE, cursor=cursor
        )
        headers = {**attachment, **({"x-next-cursor": next_cursor} if next_cursor else {})}
        body = await usage.csv_page(services.db, events, labels)
        return Response(body, media_type="text/csv", headers=headers)
    # Sent as built: a page of events is not walked again by the response model.
    return JSONResponse(
        await usage.page(
            services.db, query, limit=limit or DEFAULT_USAGE_PAGE, cursor=cursor, labels=labels
        )
    )


SPEND_RULES: dict[str | None, str] = {
    **RANGE,
    "group_by": f"a report of at most {MAX_REPORT_ROWS:,} rows for what the range holds",
}
SPEND_ERROR = error_responses(400, rules=SPEND_RULES)[400]
SPEND_400 = (
    "A parameter is not valid, or the report could hold more than "
    f"{MAX_REPORT_ROWS:,} rows (code `report_too_large`, param `group_by`): the hours or days "
    "the range touches times the tokens (users, teams) and models (providers) it holds, by the "
    "keys grouped on. Narrow the range, group by day instead of hour, or filter."
)


@router.get(
    "/spend",
    response_model=SpendOut,
    description="Spend summed by the keys of `group_by` over [start, end), exact to the "
    "picodollar for any start and end: whole days and hours are read from the rollups settle "
    f"keeps, partial hours from the ledger. A report holds at most {MAX_REPORT_ROWS:,} rows; "
    "a page at most `limit`, in the order of the group keys.",
    responses={
        200: {"description": "The report, as JSON or (format=csv) as CSV", "content": CSV},
        **error_responses(400, *RULE_ERRORS["self"]),
        400: {**SPEND_ERROR, "description": f"{SPEND_400} {SPEND_ERROR['description']}."},
    },
)
async def spend(
    principal: SelfPrincipal,
    services: ServicesDep,
    start: str | None = Query(None, max_length=64, json_schema_extra=DATE_TIME),
    end: str | None = Query(None, max_length=64, json_schema_extra=DATE_TIME),
    group_by: str | None = Query(
        None,
        max_length=200,
        json_schema_extra={"pattern": SPEND_GROUP_BY},
        description="Comma-separated keys among team, user, token, model, provider, day, hour, "
        "end_user, endpoint (chat.completions or responses; not with end_user or a tag) and "
        "tag:<key> (the value of that tag: row key `tag:<key>`; repeat for more "
        "keys). By end_user or tag:<key>, the row whose key is null sums the requests without an "
        f"end user or without that tag. A grouping that could give more than {MAX_REPORT_ROWS:,} "
        "rows over the range is a 400 (`report_too_large`).",
    ),
    team_id: str | None = Query(None, max_length=40),
    user_id: str | None = Query(None, max_length=40),
    token_id: str | None = Query(None, max_length=40),
    model: str | None = Query(None, max_length=200),
    provider: str | None = Query(None, max_length=100),
    end_user: str | None = Query(
        None,
        min_length=1,
        max_length=256,
        description="Only the requests made for this end user.",
        json_schema_extra={"pattern": END_USER_PATTERN},
    ),
    tag: list[str] | None = Query(
        None,
        description="`<key>:<value>` (split at the first colon): only the requests whose tag "
        "`<key>` has this value. Repeatable: every one must match.",
        json_schema_extra=TAG_FILTERS,
    ),
    format: str = Query("json", pattern="^(json|csv)$"),
    limit: int = Query(DEFAULT_ROWS, ge=1, le=MAX_ROWS),
    page: int = Query(1, ge=1, le=MAX_PAGE),
    adjustments: str = Query(
        "include",
        pattern="^(include|exclude)$",
        description="`include` (default): cost with the adjustment events (price corrections, "
        "credits); `exclude`: cost as the original events charged it.",
    ),
    labels: bool = Query(False, description=LABELS_DOC),
) -> StreamingResponse:
    report = await spend_report(
        services.db,
        principal,
        start=start,
        end=end,
        group_by=group_by,
        filters=dict(
            team_id=team_id, user_id=user_id, token_id=token_id, model=model, provider=provider
        ),
        limit=limit,
        page=page,
        adjusted=adjustments == "include",
        labels=labels,
        end_user=end_user,
        tags=tag,
    )
    if format == "csv":
        return StreamingResponse(
            report.csv(),
            media_type="text/csv",
            headers={
                "content-disposition": 'attachment; filename="spend.csv"',
                **report.paging(),
            },
        )
    return StreamingResponse(report.json(), media_type="application/json", headers=report.paging())


class CsvResponse(Response):
    media_type = "text/csv"


def _json_errors(*statuses: int, rules: dict[str | None, str] | None = None) -> dict:
    """error_responses() for a route whose own media type is not JSON: its errors still are."""
    error = {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}
    return {
        status: {
            **{k: v for k, v in spec.items() if k != "model"},
            "content": {"application/json": error},
        }
        for status, spec in error_responses(*statuses, rules=rules).items()
    }


@router.get(
    "/exports/focus",
    response_class=CsvResponse,
    responses={
        200: {
            "description": "FOCUS 1.2 rows as CSV, or (format=parquet) as a Parquet file",
            "content": {**CSV, "application/vnd.apache.parquet": {"schema": {"type": "string"}}},
        },
        **_json_errors(400, *RULE_ERRORS["admin"], rules=RANGE),
    },
    description="Spend over [start, end) (whole UTC hours; default the last 30 days) as FinOps "
    "FOCUS 1.2 rows: per hour, team, user, token, model and provider, one Usage row per token "
    "kind (ConsumedQuantity in Tokens, ListUnitPrice from the price history) and an Adjustment "
    "row for corrections and credits. BilledCost sums to /v1/spend's cost. Streamed.",
)
async def focus_export(
    _: AdminPrincipal,
    services: ServicesDep,
    start: str | None = Query(None, max_length=64, json_schema_extra=WHOLE_HOUR),
    end: str | None = Query(None, max_length=64, json_schema_extra=WHOLE_HOUR),
    team_id: str | None = Query(None, max_length=40),
    format: str = Query("csv", pattern="^(csv|parquet)$"),
) -> StreamingResponse:
    start_at, end_at = focus.parse_range(start, end)
    filters = {}
    if team_id is not None:
        check_text(team_id, "team_id")
        filters["team_id"] = team_id
    account = services.settings.focus_billing_account
    if format == "parquet":
        return StreamingResponse(
            focus.parquet_stream(services.db, start_at, end_at, filters, account),
            media_type="application/vnd.apache.parquet",
            headers={"content-disposition": 'attachment; filename="focus.parquet"'},
        )
    return StreamingResponse(
        focus.csv_stream(services.db, start_at, end_at, filters, account),
        media_type="text/csv",
        headers={"content-disposition": 'attachment; filename="focus.csv"'},
    )


REASON = Query(None, pattern="^(budget|rpm|tpm|parallel|model)$")
SCOPE = Query(None, pattern="^(token|user|team|request|run)$")


@router.get(
    "/refusals",
    response_model=RefusalsOut,
    description="Requests refused before anything was reserved or sent (402 budget, 429 rate "
    "or parallel limit, 403 model), newest first: never in the ledger, never charged. A user's "
    "credential sees its own refusals only.",
    responses={
        200: {
            "description": "Refusals newest first, as JSON or (format=csv) as CSV",
            "content": CSV,
        },
        **error_responses(400, *USAGE_ERRORS, rules=PAGED),
    },
)
async def list_refusals(
    principal: SelfPrincipal,
    services: ServicesDep,
    start: str | None = Query(None, max_length=64, json_schema_extra=DATE_TIME),
    end: str | None = Query(None, max_length=64, json_schema_extra=DATE_TIME),
    team_id: str | None = Query(None, max_length=40),
    user_id: str | None = Query(None, max_length=40),
    token_id: str | None = Query(None, max_length=40),
    model: str | None = Query(None, max_length=200),
    reason: str | None = REASON,
    scope: str | None = SCOPE,
    limit: int | None = Query(
        None,
        ge=1,
        le=1000,
        description="Refusals per page (default 100). With format=csv: at most this many rows "
        "(and `x-next-cursor` when there are more); without it the CSV streams every row.",
    ),
    cursor: str | None = Query(None, max_length=500),
    format: str = Query("json", pattern="^(json|csv)$"),
    labels: bool = Query(False, description=LABELS_DOC),
) -> Response:
    filters = dict(
        team_id=team_id, user_id=user_id, token_id=token_id, model=model, reason=reason, scope=scope
    )
    query = refusals.refusals_query(principal, start=start, end=end, filters=filters)
    headers = _attachment("refusals.csv")
    if format == "csv" and limit is None and cursor is None:
        return _csv_stream(refusals.csv_stream(services.db, query, labels=labels), headers)
    found = await refusals.page(
        services.db, query, limit=limit or DEFAULT_USAGE_PAGE, cursor=cursor, labels=labels
    )
    if format == "csv":
        if found["next_cursor"]:
            headers["x-next-cursor"] = found["next_cursor"]
        return Response(
            refusals.as_csv(found["data"], labels), media_type="text/csv", headers=headers
        )
    return JSONResponse(found)


@router.get(
    "/refusals/summary",
    response_model=RefusalSummaryOut,
    description="Refusals counted by the keys of `group_by` (team, user, token, model, reason, "
    "scope, day, hour; none: one total row) over [start, end), by default the last 30 days, "
    "paged like /v1/spend.",
    responses={
        200: {"description": "The counts, as JSON or (format=csv) as CSV", "content": CSV},
        **error_responses(400, *USAGE_ERRORS, rules=RANGE),
    },
)
async def refusal_summary(
    principal: SelfPrincipal,
    services: ServicesDep,
    start: str | None = Query(None, max_length=64, json_schema_extra=DATE_TIME),
    end: str | None = Query(None, max_length=64, json_schema_extra=DATE_TIME),
    group_by: str | None = Query(
        None, max_length=200, json_schema_extra={"pattern": REFUSALS_GROUP_BY}
    ),
    team_id: str | None = Query(None, max_length=40),
    user_id: str | None = Query(None, max_length=40),
    token_id: str | None = Query(None, max_length=40),
    model: str | None = Query(None, max_length=200),
    reason: str | None = REASON,
    scope: str | None = SCOPE,
    limit: int = Query(1000, ge=1, le=refusals.MAX_SUMMARY_ROWS),
    page: int = Query(1, ge=1, le=MAX_PAGE),
    format: str = Query("json", pattern="^(json|csv)$"),
    labels: bool = Query(False, description=LABELS_DOC),
) -> Response:
    report = await refusals.summary(
        services.db,
        principal,
        start=start,
        end=end,
        group_by=group_by,
        filters=dict(
            team_id=team_id,
            user_id=user_id,
            token_id=token_id,
            model=model,
            reason=reason,
            scope=scope,
        ),
        limit=limit,
        page=page,
        labels=labels,
    )
    if format == "csv":
        return Response(
            refusals.summary_csv(report, labels),
            media_type="text/csv",
            headers={"content-disposition": 'attachment; filename="refusals-summary.csv"'},
        )
    return JSONResponse(report)


def _too_large() -> TooLarge:
    return TooLarge(f"the export is larger than {MAX_EXPORT_BYTES} bytes")


async def read_export(request: Request) -> bytes:
    """The CSV: the body itself (text/csv), or the multipart field `file`."""
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("multipart/form-data"):
        async with request.form(max_files=1, max_fields=10) as form:
            upload = form.get("file")
            if not isinstance(upload, UploadFile):
                raise InvalidRequest("the multipart body needs the CSV in a field named file")
            data = await upload.read(MAX_EXPORT_BYTES + 1)
        if len(data) > MAX_EXPORT_BYTES:
            raise _too_large()
        return data
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_EXPORT_BYTES:
            raise _too_large()
        chunks.append(chunk)
    return b"".join(chunks)


# A CSV's header names its columns in any order and each row's fields are read by them: no
# schema of a text body declares that.
EXPORT_RULES: dict[str | None, str] = {
    None: f"CSV (UTF-8) whose header names the columns {', '.join(reconciliation.REQUIRED)} "
    "(any order, others ignored), with at least one row, each as wide as the header",
    **{
        column: "a valid value in every row (the error names the line)"
        for column in (*reconciliation.REQUIRED, "upstream_id")
    },
}


@router.post(
    "/reconciliations",
    status_code=201,
    response_model=ReconciliationOut,
    responses=error_responses(400, 413, 415, *RULE_ERRORS["admin"], rules=EXPORT_RULES),
    openapi_extra={
        "requestBody": {
            "description": "The provider's usage export: CSV as the body, or the multipart "
            "field `file`",
            "content": {
                "text/csv": {"schema": {"type": "string"}},
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "properties": {"file": {"type": "string", "format": "binary"}},
                        "required": ["file"],
                    }
                },
            },
        }
    },
)
async def create_reconciliation(
    request: Request,
    _: AdminPrincipal,
    services: ServicesDep,
    provider: str = Query(..., min_length=1, max_length=100),
    tolerance: str | None = Query(
        None, max_length=32, json_schema_extra={"pattern": reconciliation.TOLERANCE_PATTERN}
    ),
) -> JSONResponse:
    check_text(provider, "provider")
    parsed = reconciliation.parse_tolerance(tolerance)
    data = await read_export(request)
    result = await reconciliation.reconcile(services.db, provider, parsed, data)
    # Sent as built: a large comparison is not walked again by a response model.
    return JSONResponse(result, status_code=201)


@router.get(
    "/reconciliations/{reconciliation_id}",
    response_model=ReconciliationOut,
    responses=error_responses(404, *RULE_ERRORS["admin"]),
)
async def get_reconciliation(
    reconciliation_id: str,
    _: AdminPrincipal,
    services: ServicesDep,
) -> JSONResponse:
    found = None
    if len(reconciliation_id) <= 40 and "\x00" not in reconciliation_id:
        found = await reconciliation.load(services.db, reconciliation_id)
    if found is None:
        raise NotFound(f"reconciliation {reconciliation_id} not found")
    return JSONResponse(found)
