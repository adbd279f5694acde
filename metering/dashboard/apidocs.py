"""GET /docs: Swagger UI over /openapi.json, its files served by the service itself from the
packaged copy of the fastapi-offline distribution, so the page works without reaching any CDN
(an air-gapped host, a laptop offline). Open to anyone, like /openapi.json; both are off when
METERING_OPENAPI_ENABLED=false (create_app then leaves this router out)."""

from importlib.resources import files

from fastapi import APIRouter, Depends, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse

from metering.auth.principal import open_access
from metering.errors import NotFound

router = APIRouter(dependencies=[Depends(open_access)])

PAGE = "/docs"
OPENAPI = "/openapi.json"
STATIC = files("fastapi_offline") / "static"
# Swagger UI's own files, each by its exact name: nothing else in the package can be reached.
ASSETS = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "favicon.png": "image/png",
}
# The page loads and calls only this origin: a key given to Authorize cannot be sent elsewhere.
# Swagger UI's page starts it with an inline script and styles its elements inline.
HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self' 'unsafe-inline'; "
        "style-src 'self' 'unsafe-inline'; img-src 'self' data:; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}
PARAMETERS = {
    "dom_id": "#swagger-ui",
    "layout": "BaseLayout",
    "deepLinking": True,
    "showExtensions": True,
    "showCommonExtensions": True,
    # No badge fetched from the public validator.
    "validatorUrl": None,
    # The key given to Authorize stays in the page's memory, not in localStorage.
    "persistAuthorization": False,
}


@router.get(PAGE, include_in_schema=False)
async def page(request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "").rstrip("/")
    html = get_swagger_ui_html(
        openapi_url=f"{root}{OPENAPI}",
        title="metering: API",
        swagger_js_url=f"{root}{PAGE}/swagger-ui-bundle.js",
        swagger_css_url=f"{root}{PAGE}/swagger-ui.css",
        swagger_favicon_url=f"{root}{PAGE}/favicon.png",
        swagger_ui_parameters=PARAMETERS,
    )
    html.headers.update(HEADERS)
    return html


@router.get(f"{PAGE}/{{asset}}", include_in_schema=False)
async def asset(asset: str) -> FileResponse:
    if asset not in ASSETS:
        raise NotFound(f"no API documentation file {asset!r}")
    headers = {**HEADERS, "cache-control": "public, max-age=86400"}
    return FileResponse(str(STATIC / asset), media_type=ASSETS[asset], headers=headers)
