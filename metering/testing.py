"""The real server in a background thread of this process, on a loopback port: for the tests."""

import asyncio
import socket
import threading
import time

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
