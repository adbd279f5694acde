"""The fault suite's fixtures: a primary and a synchronous standby of the test's own, the
catalog file, and `metering serve` replicas as subprocesses (tests/budgets/conftest.py)."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.budgets.conftest import replicas, to_toml
from tests.conftest import catalog_for
from tests.faults.cluster import Pair
from tests.resilience.private_pg import why_unavailable


@pytest.fixture(scope="session")
def catalog_file(sim, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("catalog") / "metering.toml"
    path.write_text(to_toml(catalog_for(sim)))
    return path


@pytest.fixture
def serve(catalog_file, tmp_path):
    """Factory: serve(database_url, **env) starts a replica; all are stopped at teardown."""
    with replicas(catalog_file, tmp_path) as start:
        yield start


@pytest.fixture
def pair():
    """A primary and its synchronous standby, both running; destroyed at the end."""
    reason = why_unavailable()
    if reason:
        pytest.fail(f"the fault suite needs PostgreSQL's server binaries: {reason}")
    root = Path(tempfile.mkdtemp(prefix="metering-pair-"))
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    cluster = Pair(root)
    try:
        yield cluster.start()
    finally:
        cluster.destroy()
