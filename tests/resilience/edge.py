"""Raw-socket clients on loopback (slow, silent, malformed, gone), and a server with short limits."""

import json
import logging
import os
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from metering import migrate
from metering.settings import Settings, parse_catalog
from metering.testing import ServerThread, metering_server
from tests.conftest import ADMIN_KEY, catalog_for

# Generous: the limits under test are a second or two; a busy machine must not fail the test.
CUT_WITHIN_S = 30.0
SIM_KEYS = {"SIM_EXASCALE_KEY": "sim-key", "SIM_OPENAI_KEY": "sim-key"}


def edge_server(database_url: str, sim, **limits) -> ServerThread:
    migrate.upgrade(database_url)
    settings = Settings(database_url=database_url, admin_key=ADMIN_KEY, _env_file=None, **limits)
    return metering_server(settings, parse_catalog(catalog_for(sim), environ=SIM_KEYS))


@dataclass
class Reply:
    data: bytes = b""
    closed: bool = False  # the server ended the connection (FIN or reset)
    reset: bool = False
    chunks_sent: int = 0
    notes: list = field(default_factory=list)

    @property
    def status(self) -> int | None:
        if not self.data.startswith(b"HTTP/1.1 "):
            return None
        return int(self.data[9:12])

    def json(self) -> dict:
        return json.loads(self.data.partition(b"\r\n\r\n")[2])


def connect(server: ServerThread) -> socket.socket:
    return socket.create_connection((server.host, server.port), timeout=5)


def trickle(sock: socket.socket, first: bytes, piece: bytes, every_s: float = 0.1) -> Reply:
    """Send `first`, then `piece` every `every_s` seconds, until the server closes the connection
    (or CUT_WITHIN_S passes); collect what it answered."""
    reply = Reply()
    sock.sendall(first)
    sock.settimeout(every_s)
    deadline = time.monotonic() + CUT_WITHIN_S
    sending = True
    while time.monotonic() < deadline:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            data = None
        except ConnectionResetError:
            reply.closed = reply.reset = True
            return reply
        if data == b"":
            reply.closed = True
            return reply
        if data:
            reply.data += data
            sending = False  # an answer came: read the rest of it
        if sending:
            try:
                sock.sendall(piece)
                reply.chunks_sent += 1
            except (BrokenPipeError, ConnectionResetError):
                sending = False
    return reply


def read_reply(sock: socket.socket) -> Reply:
    """Everything the server sends until it closes the connection (or CUT_WITHIN_S passes)."""
    return trickle(sock, b"", b"", every_s=CUT_WITHIN_S)


def server_socket_fds(server: ServerThread) -> int:
    """Descriptors this process holds for connections accepted by the server (its listening
    socket excluded): the server runs in a thread of this process."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                port = int(cols[1].rsplit(":", 1)[1], 16)
                if port == server.port and cols[3] != "0A":  # 0A: LISTEN
                    inodes.add(cols[9])
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            count += 1
    return count


def wait_until(condition, timeout: float = CUT_WITHIN_S) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self) -> list[str]:
        return [r.getMessage() for r in self.records]


@contextmanager
def server_log():
    """What uvicorn and the app log meanwhile (uvicorn's loggers do not reach pytest's)."""
    handler = Records()
    loggers = [logging.getLogger(n) for n in ("uvicorn.error", "metering", "fastapi")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
