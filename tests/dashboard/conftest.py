"""Fixtures: headless Chromium (the demo site: tests.demo_site)."""

import os
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("METERING_TEST_CHROMIUM", "/usr/bin/chromium")
# What .ci/run and the test page (docs/development/tests.md) give Chromium: no sandbox (we run as root), nothing from outside.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
OUTPUT = Path(__file__).resolve().parents[2] / "test-output"


@pytest.fixture(scope="module")
def browser():
    """Debian's Chromium under Playwright. Without it the browser tests skip on a developer's
    machine, and fail in CI (CI set), where .ci/run installs it. Module-scoped: Playwright's sync
    API runs an event loop in this thread while it is open, which would break asyncio.run() in
    the tests of other modules."""
    missing = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing = "the playwright package is not installed (pip install -e '.[test]')"
    if missing is None and not Path(CHROMIUM).exists():
        missing = f"no Chromium at {CHROMIUM} (apt-get install -y chromium)"
    if missing:
        if os.environ.get("CI"):
            pytest.fail(missing)
        pytest.skip(missing)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()
