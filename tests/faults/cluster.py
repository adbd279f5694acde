"""A PostgreSQL primary and its streaming standby, clusters of the test's own in a temporary
folder (Debian's server binaries: initdb, pg_basebackup -R, pg_ctl), on free loopback ports.
The primary waits for the standby at every commit (synchronous_standby_names = '*',
synchronous_commit = on): a commit it acknowledged is on the standby too."""

import contextlib
import glob
import shutil
from pathlib import Path

import psycopg

from tests.resilience.private_pg import PrivatePostgres


def server_bindir() -> Path:
    """The newest /usr/lib/postgresql/N/bin with the server's tools (Debian's layout)."""
    found = sorted(
        (Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/pg_basebackup")),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
    )
    assert found, "no /usr/lib/postgresql/N/bin/pg_basebackup (Debian's postgresql package)"
    return found[-1]


class Node(PrivatePostgres):
    """One cluster: PrivatePostgres with settings of its own and a kill instead of a stop."""

    def __init__(self, root: Path, name: str, settings: dict[str, str]) -> None:
        super().__init__()
        # Debian's server binaries, pg_basebackup among them, beside initdb and pg_ctl.
        self.bindir = server_bindir()
        shutil.rmtree(self.root, ignore_errors=True)
        self.root = root / name
        self.root.mkdir()
        if self.run_as:
            shutil.chown(self.root, "postgres", "postgres")
        self.data = self.root / "data"
        self.name = name
        self.settings = settings

    def start(self) -> None:
        options = " ".join(f"-c {key}={value}" for key, value in self.settings.items())
        options += (
            f" -c listen_addresses=127.0.0.1 -c port={self.port}"
            f" -c unix_socket_directories={self.root} -c max_connections=200"
            f" -c cluster_name={self.name}"
        )
        log = str(self.root / "log")
        self._run("pg_ctl", "-D", str(self.data), "-l", log, "-o", options, "-w", "start")
        self.wait_ready()

    def kill(self) -> None:
        """pg_ctl stop -m immediate: every backend ends at once, nothing is flushed or told."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def promote(self) -> None:
        """pg_ctl promote -w: returns once the standby accepts writes."""
        self._run("pg_ctl", "-D", str(self.data), "-w", "promote")

    def in_recovery(self) -> bool:
        with psycopg.connect(self.admin_dsn, connect_timeout=2) as conn:
            row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
            return bool(row and row[0])


class Pair:
    """A primary and a synchronous standby; url() names both, the writable one chosen."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.primary = Node(
            root, "primary", {"synchronous_standby_names": "'*'", "synchronous_commit": "on"}
        )
        self.standby = Node(root, "standby", {"hot_standby": "on"})

    def start(self) -> "Pair":
        self.primary.init()
        self.primary.start()
        self.standby._run(
            "pg_basebackup", "-h", "127.0.0.1", "-p", str(self.primary.port), "-U", "postgres",
            "-D", str(self.standby.data), "-R", "-X", "stream", "-c", "fast",
        )  # fmt: skip
        self.standby.start()
        # The primary's commits wait for the standby from here on: see it streaming, as `sync`.
        with psycopg.connect(self.primary.admin_dsn) as conn:
            for _ in range(300):
                row = conn.execute(
                    "SELECT sync_state FROM pg_stat_replication WHERE state = 'streaming'"
                ).fetchone()
                if row and row[0] == "sync":
                    break
                conn.execute("SELECT pg_sleep(0.1)")
            else:
                raise RuntimeError(f"the standby never streamed:\n{self.standby.log()}")
        return self

    def create_database(self, name: str) -> None:
        self.primary.create_database(name)

    def url(self, database: str) -> str:
        hosts = f"127.0.0.1:{self.primary.port},127.0.0.1:{self.standby.port}"
        return f"postgresql://postgres@{hosts}/{database}?target_session_attrs=read-write"

    def destroy(self) -> None:
        for node in (self.standby, self.primary):
            with contextlib.suppress(Exception):
                node.destroy()
        shutil.rmtree(self.root, ignore_errors=True)
