"""POST /v1/reconciliations and GET /v1/reconciliations/{id} (admin)."""

from fastapi import APIRouter, Depends, Query, Request
from starlette.datastructures import UploadFile

from metering.auth.principal import Principal, admin_only
from metering.errors import InvalidRequest, NotFound, TooLarge
from metering.reports import reconciliation
from metering.reports.usage import check_text

router = APIRouter(prefix="/v1")

MAX_EXPORT_BYTES = 64 * 1024 * 1024


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


@router.post("/reconciliations", status_code=201)
async def create_reconciliation(
    request: Request,
    _: Principal = Depends(admin_only),
    provider: str = Query(..., min_length=1, max_length=100),
    tolerance: str | None = Query(None, max_length=32),
) -> dict:
    check_text(provider, "provider")
    parsed = reconciliation.parse_tolerance(tolerance)
    data = await read_export(request)
    return await reconciliation.reconcile(request.app.state.db, provider, parsed, data)


@router.get("/reconciliations/{reconciliation_id}")
async def get_reconciliation(
    request: Request, reconciliation_id: str, _: Principal = Depends(admin_only)
) -> dict:
    found = None
    if len(reconciliation_id) <= 40 and "\x00" not in reconciliation_id:
        found = await reconciliation.load(request.app.state.db, reconciliation_id)
    if found is None:
        raise NotFound(f"reconciliation {reconciliation_id} not found")
    return found
