"""The real server in a background thread of this process, on a loopback port: for the tests."""

import asyncio
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import uvicorn

from metering.app import create_app
from metering.server import server_config
from metering.settings import Catalog, Settings


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving one app in a background thread, with its own event loop."""

    def __init__(
        self,
        app,
        host: str = "127.0.0.1",
        port: int | None = None,
        settings: Settings | None = None,
    ) -> None:
        self.host, self.port = host, port or free_port(host)
        config = server_config(
            app,
            settings or Settings(_env_file=None),
            host=self.host,
            port=self.port,
            log_level="warning",
            timeout_graceful_shutdown=5,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.run(self.server.serve())

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def metering_server(settings: Settings, catalog: Catalog, **kwargs) -> ServerThread:
    return ServerThread(create_app(settings, catalog, **kwargs), settings=settings).start()


def _die_with_parent() -> None:
    """In the child, after it has taken its user: SIGTERM when the process that started it ends,
    however it ends (a test process killed leaves no pooler behind)."""
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class PgBouncer:
    """Debian's `pgbouncer` in transaction pooling mode (the managed poolers' mode), on a free
    loopback port, in front of the PostgreSQL server at `host:port`: every database name is that
    server's database of the same name, reached as the client's own user (trust);
    `connect_query` runs once on each server connection it opens. Its files live in a directory
    of its own, removed when it stops. Run as root, it runs as `user` (PgBouncer refuses root)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 5432,
        pool_size: int = 20,
        max_client_conn: int = 2000,
        user: str = "postgres",
        connect_query: str | None = None,
    ) -> None:
        # A directory of its own under /tmp: the user it runs as must reach it.
        self.workdir = Path(tempfile.mkdtemp(prefix="pgbouncer-"))
        self.port, self.user = free_port(), user
        self.ini = self.workdir / "pgbouncer.ini"
        auth = self.workdir / "userlist.txt"
        auth.write_text(f'"{user}" ""\n')
        self.ini.write_text(
            "[databases]\n"
            f"* = host={host} port={port}"
            + (f" connect_query='{connect_query}'" if connect_query else "")
            + "\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\n"
            f"unix_socket_dir =\nauth_type = trust\nauth_file = {auth}\n"
            f"pool_mode = transaction\ndefault_pool_size = {pool_size}\n"
            f"max_client_conn = {max_client_conn}\nadmin_users = {user}\n"
            # SQLAlchemy and asyncpg name no startup parameter PgBouncer 1.18 would refuse but
            # these (psycopg sends none by default); each is a session setting it cannot keep.
            "ignore_startup_parameters = extra_float_digits,options\n"
            f"logfile = {self.workdir / 'pgbouncer.log'}\n"
            f"pidfile = {self.workdir / 'pgbouncer.pid'}\n"
            # Idle server connections close soon: the tests' PostgreSQL serves other processes.
            "server_reset_query =\nserver_idle_timeout = 5\n"
            "log_connections = 0\nlog_disconnections = 0\n"
        )
        self.process: subprocess.Popen | None = None

    def url(self, database: str, user: str = "postgres") -> str:
        return f"postgresql://{user}@127.0.0.1:{self.port}/{database}"

    def start(self, timeout: float = 15.0) -> "PgBouncer":
        command = [shutil.which("pgbouncer") or "/usr/sbin/pgbouncer", str(self.ini)]
        user = None
        if os.geteuid() == 0:
            user = self.user
            shutil.chown(self.workdir, user)
            for path in self.workdir.iterdir():
                shutil.chown(path, user)
        # Its stderr to a file: a pipe nobody reads would fill, and stop it mid-write.
        with (self.workdir / "stderr.log").open("wb") as stderr:
            self.process = subprocess.Popen(
                command,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                user=user,
                preexec_fn=_die_with_parent,
            )
        deadline = time.monotonic() + timeout
        while True:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            if self.process.poll() is not None or time.monotonic() > deadline:
                logs = [self.workdir / "stderr.log", self.workdir / "pgbouncer.log"]
                err = "".join(log.read_text()[-1000:] for log in logs if log.exists())
                self.stop()
                raise RuntimeError(f"pgbouncer did not start: {err}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)
