"""GET /docs works offline: every file the page references is served by the service itself, and
in headless Chromium with every request beyond loopback aborted the page lists every operation of
/openapi.json, and its Authorize button sends the key given to it."""

import re
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi.testclient import TestClient

from metering import migrate
from metering.app import create_app
from metering.settings import Catalog, Settings
from metering.testing import metering_server
from tests.conftest import ADMIN_KEY
from tests.dashboard.conftest import OUTPUT

LOOPBACK = {"127.0.0.1", "localhost", "[::1]", "::1"}


def referenced(html: str) -> list[str]:
    """Every URL the page loads: scripts, stylesheets, icons, images."""
    return re.findall(r'<(?:script|link|img)\b[^>]*?\b(?:src|href)="([^"]+)"', html)


@pytest.fixture(scope="module")
def client():
    return TestClient(create_app(Settings(_env_file=None), Catalog()))


def test_every_file_the_page_references_is_served_here(client):
    page = client.get("/docs")
    assert page.status_code == 200
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    urls = referenced(page.text)
    assert sorted(urls) == [
        "/docs/favicon.png",
        "/docs/swagger-ui-bundle.js",
        "/docs/swagger-ui.css",
    ]
    for url in urls:
        assert not urlsplit(url).netloc, url  # this origin, never a CDN
        served = client.get(url)
        assert served.status_code == 200, url
        assert len(served.content) > 1000, url
    # The stylesheet's own references (icons, fonts) are inline data, nothing fetched.
    css = client.get("/docs/swagger-ui.css").text
    outside = [u for u in re.findall(r"url\(\s*['\"]?([^'\")]+)", css) if not u.startswith("data:")]
    assert outside == []


def test_only_swagger_uis_own_files_are_served(client):
    for name in ("redoc.standalone.js", "core.py", "..%2Fcore.py", "%2E%2E%2F__init__.py", "x.js"):
        response = client.get(f"/docs/{name}")
        assert response.status_code == 404, name
        assert response.json()["error"]["code"] == "not_found"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('apidocs') / 'metering.db'}"
    migrate.upgrade(url)
    settings = Settings(database_url=url, admin_key=ADMIN_KEY, _env_file=None)
    server = metering_server(settings, Catalog())
    yield server
    server.stop()


@pytest.mark.e2e
def test_the_page_lists_every_operation_and_authorizes_offline(browser, server):
    schema = httpx.get(f"{server.url}/openapi.json").json()
    operations = sorted(
        f"{method.upper()} {path}"
        for path, methods in schema["paths"].items()
        for method in methods
    )
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    outside: list[str] = []
    errors: list[str] = []
    sent: dict[str, str | None] = {}

    def route(handle) -> None:
        if urlsplit(handle.request.url).hostname in LOOPBACK:
            handle.continue_()
        else:
            outside.append(handle.request.url)
            handle.abort()

    def note(request) -> None:
        if request.url.startswith(f"{server.url}/v1/"):
            sent[request.url] = request.headers.get("authorization")

    context.route("**/*", route)
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    page.on("request", note)
    try:
        page.goto(f"{server.url}/docs")
        page.wait_for_selector(".opblock")
        shown = sorted(
            page.eval_on_selector_all(
                ".opblock",
                """blocks => blocks.map(b => b.querySelector('.opblock-summary-method').textContent
                    + ' ' + b.querySelector('.opblock-summary-path').dataset.path)""",
            )
        )
        assert shown == operations
        assert len(operations) >= 40

        # Authorize: the bearer scheme takes the admin key; an operation run after sends it.
        page.click("button.authorize")
        page.fill("#auth-bearer-value", ADMIN_KEY)
        page.click(".auth-btn-wrapper button.authorize")
        page.click(".auth-btn-wrapper button.btn-done")
        path = page.locator(".opblock-summary-path[data-path='/v1/teams']")
        teams = page.locator(".opblock-get", has=path)
        teams.locator(".opblock-summary-control").click()
        teams.locator("button.try-out__btn").click()
        teams.locator("button.execute").click()
        status = teams.locator(".live-responses-table tr.response .response-col_status").first
        status.wait_for()
        assert status.inner_text().strip() == "200"
        OUTPUT.mkdir(exist_ok=True)
        page.screenshot(path=str(OUTPUT / "apidocs.png"), full_page=False)
    finally:
        context.close()
    assert [auth for url, auth in sent.items() if "/v1/teams" in url] == [f"Bearer {ADMIN_KEY}"]
    assert outside == []
    assert errors == []
