"""GET /dashboard and its assets: static files, open to anyone (the page holds no data until the
visitor gives a key, which stays in the browser's sessionStorage and goes only to the API)."""

from pathlib import Path

from fastapi import APIRouter, Depends
from fastapi.responses import FileResponse

from metering.auth.principal import open_access
from metering.errors import NotFound

router = APIRouter()

STATIC = Path(__file__).parent / "static"
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
# Only the page's own files, each by its exact name: nothing else on disk can be reached.
ASSETS = {p.name for p in STATIC.iterdir() if p.suffix in MEDIA_TYPES and p.name != "index.html"}
# The page runs only its own scripts and talks only to this origin: a script injected through
# data it shows (a team's name, say) could not run, nor send the key elsewhere.
HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


def _file(name: str) -> FileResponse:
    path = STATIC / name
    return FileResponse(path, media_type=MEDIA_TYPES[path.suffix], headers=HEADERS)


@router.get("/dashboard", include_in_schema=False, dependencies=[Depends(open_access)])
async def page() -> FileResponse:
    return _file("index.html")


@router.get("/dashboard/{asset}", include_in_schema=False, dependencies=[Depends(open_access)])
async def asset(asset: str) -> FileResponse:
    if asset not in ASSETS:
        raise NotFound(f"no dashboard file {asset!r}")
    return _file(asset)
