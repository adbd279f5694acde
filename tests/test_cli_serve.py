"""`metering serve` says in its log which catalog it loaded, with how many models and providers,
and warns when there is none (every chat request would be a 404)."""

import os
import re
import subprocess
import sys

import pytest

from metering import migrate
from metering.testing import free_port
from tests.demo.test_demo import read_until

CATALOG = """
[providers.upstream-a]
base_url = "http://127.0.0.1:9/a/v1"
api_key = "a"

[providers.upstream-b]
base_url = "http://127.0.0.1:9/b/v1"
api_key = "b"

[[models]]
name = "model-one"
provider = "upstream-a"
input_usd_per_mtok = "1"
output_usd_per_mtok = "2"

[[models]]
name = "model-one"
provider = "upstream-b"
input_usd_per_mtok = "1"
output_usd_per_mtok = "2"

[[models]]
name = "model-two"
provider = "upstream-b"
input_usd_per_mtok = "1"
output_usd_per_mtok = "2"
"""
# The test process's environment, without a catalog of its own.
INHERITED = {k: v for k, v in os.environ.items() if k != "METERING_CONFIG"}
STARTED = re.compile(r"Uvicorn running on|Traceback")


@pytest.fixture(scope="module")
def database(tmp_path_factory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('serve') / 'metering.db'}"
    migrate.upgrade(url)  # once: each serve below finds nothing to migrate
    return url


def serve(cwd, database: str, **env: str) -> str:
    """`metering serve`'s log up to the moment it listens."""
    process = subprocess.Popen(
        [sys.executable, "-m", "metering.cli", "serve", "--port", str(free_port())],
        cwd=cwd,
        env={**INHERITED, "METERING_DATABASE_URL": database, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        return read_until(process, STARTED, timeout=60)
    finally:
        process.terminate()
        process.wait(timeout=15)


@pytest.mark.e2e  # starts `metering serve`
def test_serve_says_which_catalog_it_loaded(tmp_path, database):
    (tmp_path / "prices.toml").write_text(CATALOG)
    log = serve(tmp_path, database, METERING_CONFIG=str(tmp_path / "prices.toml"))
    line = re.search(r"(INFO|WARNING) metering\.catalog: (.*)", log)
    assert line is not None, log
    assert line.groups() == (
        "INFO",
        f"catalog {tmp_path / 'prices.toml'} loaded: 2 models (3 routes) from 2 providers",
    )


@pytest.mark.e2e  # starts `metering serve`
def test_serve_warns_when_there_is_no_catalog(tmp_path, database):
    log = serve(tmp_path, database)  # no METERING_CONFIG, no ./metering.toml
    assert re.search(
        r" WARNING metering\.catalog: no catalog: METERING_CONFIG is unset and ./metering.toml "
        r"does not exist, so no model can be called",
        log,
    ), log


@pytest.mark.e2e  # starts `metering serve`
def test_serve_warns_when_the_catalog_has_no_model(tmp_path, database):
    (tmp_path / "metering.toml").write_text(CATALOG.split("[[models]]")[0])
    log = serve(tmp_path, database)
    assert " WARNING metering.catalog: catalog metering.toml has no models (2 providers): no " \
        "model can be called" in log, log  # fmt: skip
