"""The demo keeps its admin key for the life of its database: made at the first start, kept in
the database, printed and served with at every start after (unless METERING_ADMIN_KEY says
another)."""

import os
import re
import subprocess
import sys

import httpx
import pytest

from metering.demo import kept_admin_key
from metering.testing import free_port
from tests.demo.test_demo import read_until

BANNER_END = re.compile(r"demo token\s+mtr_\S+\n|demo traffic failed|Traceback")


def test_the_kept_key_is_made_once_per_database(api):
    first = kept_admin_key(api.settings.database_url)
    assert re.fullmatch(r"demo-admin-[0-9a-f]{32}", first)
    assert kept_admin_key(api.settings.database_url) == first


def start_demo(tmp_path, database: str, **env: str) -> tuple[str, str]:
    """A `metering demo` started and stopped once its banner is out: (the admin key it printed
    and said where it came from, whether the API took that key while it ran)."""
    port = free_port()
    inherited = {k: v for k, v in os.environ.items() if k != "METERING_ADMIN_KEY"}
    process = subprocess.Popen(
        [sys.executable, "-m", "metering.cli", "demo", "--port", str(port)],
        cwd=tmp_path,
        env={**inherited, "METERING_DATABASE_URL": database, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output = read_until(process, BANNER_END, timeout=90)
        key, whose = re.search(r"admin key\s+(\S+)\s+\((.*)\)", output).groups()
        answer = httpx.get(
            f"http://127.0.0.1:{port}/v1/teams", headers={"authorization": f"Bearer {key}"}
        )
        assert answer.status_code == 200, answer.text
        return key, whose
    finally:
        process.terminate()
        process.wait(timeout=15)


@pytest.mark.e2e  # starts `metering demo` three times
def test_the_demo_keeps_its_admin_key_across_restarts(tmp_path):
    database = f"sqlite:///{tmp_path / 'demo.db'}"
    first, whose = start_demo(tmp_path, database)
    assert re.fullmatch(r"demo-admin-[0-9a-f]{32}", first)
    assert whose == "kept in the database: the same at every start"
    assert start_demo(tmp_path, database) == (first, whose)
    # A key given in the environment is served with, and leaves the kept one as it was.
    given = start_demo(tmp_path, database, METERING_ADMIN_KEY="my-own-demo-key")
    assert given == ("my-own-demo-key", "METERING_ADMIN_KEY")
    assert kept_admin_key(database) == first
