"""`metering` run in the test's process against the session's server (the `api` fixture), its
output read back: JSON parsed, CSV by the csv module, a table by its header."""

import csv
import io
import json

import pytest

from metering.cli import main
from tests.conftest import ADMIN_KEY


class Run:
    """`metering ARGS` in this process, against the api server, with the admin key's env."""

    def __init__(self, url: str, capsys, monkeypatch) -> None:
        self.url, self.capsys = url, capsys
        monkeypatch.setenv("METERING_URL", url)
        monkeypatch.setenv("METERING_ADMIN_KEY", ADMIN_KEY)

    def __call__(self, *argv: str, code: int = 0) -> str:
        got = main(list(argv))
        out, err = self.capsys.readouterr()
        assert got == code, (argv, out, err)
        self.err = err
        return out

    def json(self, *argv: str) -> dict:
        return json.loads(self(*argv, "--format", "json"))

    def csv(self, *argv: str) -> list[dict]:
        return list(csv.DictReader(io.StringIO(self(*argv, "--format", "csv"))))

    def table(self, *argv: str) -> list[dict]:
        return table_rows(self(*argv))

    def error(self, *argv: str) -> str:
        self(*argv, code=1)
        return self.err


def table_rows(text: str) -> list[dict]:
    """A table's rows by its header (its cells hold no two spaces in a row)."""
    header, *lines = text.splitlines()
    names = header.split()
    rows = [dict(zip(names, line.split(), strict=True)) for line in lines if line.strip()]
    return rows


@pytest.fixture
def cli(api, capsys, monkeypatch) -> Run:
    return Run(api.url, capsys, monkeypatch)
