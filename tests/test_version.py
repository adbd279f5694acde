"""One version, written once (metering/__init__.py): `metering --version`, /healthz, the
OpenAPI document and CHANGELOG.md's latest release say it (the package metadata:
tests/deploy/test_install.py)."""

import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from metering import __version__
from metering.app import create_app
from metering.cli import main
from metering.settings import Catalog, Settings

CHANGELOG = Path(__file__).resolve().parents[1] / "CHANGELOG.md"


def test_the_version_is_a_release_number():
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)


def test_metering_version_prints_it(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"metering {__version__}\n"


def test_healthz_and_the_openapi_document_show_it():
    client = TestClient(create_app(Settings(_env_file=None), Catalog()))
    assert client.get("/healthz").json() == {"status": "ok", "version": __version__}
    assert client.get("/openapi.json").json()["info"]["version"] == __version__


def test_the_changelogs_latest_release_is_it():
    releases = re.findall(
        r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", CHANGELOG.read_text(), re.M
    )
    assert releases and releases[0] == __version__
