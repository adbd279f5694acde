"""A PostgreSQL instance of a test's own (initdb into a temporary folder), so the test can stop
and restart it without touching the machine's shared cluster."""

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

from metering.testing import free_port


def find_bindir() -> Path | None:
    """The folder holding initdb and pg_ctl: on PATH, else Debian's /usr/lib/postgresql/N/bin."""
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    candidates = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
    )
    return Path(candidates[-1]).parent if candidates else None


def why_unavailable() -> str | None:
    """None when a private instance can be made here, else the reason it cannot."""
    if find_bindir() is None:
        return "initdb is not installed (no PostgreSQL server binaries on PATH or in /usr/lib)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no `postgres` user to run initdb as"
    return None


class PrivatePostgres:
    """initdb, pg_ctl start/stop/restart on a free loopback port; the socket in the data folder."""

    def __init__(self) -> None:
        bindir = find_bindir()
        assert bindir is not None, why_unavailable()
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="metering-private-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        # initdb and postgres refuse to run as root: run them as the postgres user then.
        self.run_as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.run_as:
            shutil.chown(self.root, "postgres", "postgres")

    @property
    def admin_dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def url(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, *argv: str, timeout: float = 120) -> None:
        command = [*self.run_as, str(self.bindir / argv[0]), *argv[1:]]
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}")

    def init(self) -> "PrivatePostgres":
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8")
        return self

    def start(self) -> None:
        options = (
            f"-c listen_addresses=127.0.0.1 -c port={self.port} "
            f"-c unix_socket_directories={self.root} -c fsync=off -c max_connections=100"
        )
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.root / "log"), "-o", options, "-w",
            "start",
        )  # fmt: skip
        self.wait_ready()

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def restart(self) -> None:
        """pg_ctl restart -m fast: every session is terminated, the server comes back."""
        # -l: without a log file the server would keep pg_ctl's output pipe open.
        log = str(self.root / "log")
        self._run("pg_ctl", "-D", str(self.data), "-l", log, "-m", "fast", "-w", "restart")
        self.wait_ready()

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(self.admin_dsn, connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def create_database(self, name: str) -> str:
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def log(self) -> str:
        try:
            return (self.root / "log").read_text(errors="replace")[-5000:]
        except OSError:
            return ""

    def destroy(self) -> None:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)
