"""A response whose length is known goes out in one write (its status line, headers and body),
where uvicorn writes the head, then the body; everything else is written as uvicorn writes it.
First through uvicorn's own response cycle with a transport that records its calls, then
through the real server on a loopback socket."""

import asyncio
import logging
import socket

import pytest
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from metering import __version__
from metering.server import JoinedCycle
from tests.conftest import database_url
from tests.resilience.edge import connect, edge_server


class Recorder:
    """A transport that records what is asked of it."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.calls.append(("write", bytes(data)))

    def writelines(self, parts) -> None:
        self.calls.append(("writelines", tuple(bytes(p) for p in parts)))

    def close(self) -> None:
        self.closing = True
        self.calls.append(("close",))

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def cycle(method: str = "POST", keep_alive: bool = True) -> tuple[JoinedCycle, Recorder]:
    transport = Recorder()
    made = RequestResponseCycle(
        scope={"type": "http", "method": method, "path": "/", "http_version": "1.1"},
        transport=transport,
        flow=FlowControl(transport),
        logger=logging.getLogger("test"),
        access_logger=logging.getLogger("test.access"),
        access_log=False,
        default_headers=[],
        message_event=asyncio.Event(),
        expect_100_continue=False,
        keep_alive=keep_alive,
        on_response=lambda: None,
    )
    made.__class__ = JoinedCycle  # as GuardedProtocol does before the cycle starts
    return made, transport


def start(*headers: tuple[bytes, bytes], status: int = 200) -> dict:
    return {"type": "http.response.start", "status": status, "headers": list(headers)}


def body(data: bytes, more: bool = False) -> dict:
    return {"type": "http.response.body", "body": data, "more_body": more}


LENGTH = (b"content-length", b"5")
HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n"


@pytest.mark.anyio
async def test_a_response_of_known_length_is_one_write_of_head_and_body():
    joined, transport = cycle()
    await joined.send(start(LENGTH))
    assert transport.calls == []  # the head waits for the body
    await joined.send(body(b"hello"))
    assert transport.calls == [("writelines", (HEAD, b"hello"))]
    assert joined.response_complete and joined.transport is transport


@pytest.mark.anyio
async def test_a_body_sent_in_parts_joins_the_head_to_its_first_part_only():
    joined, transport = cycle()
    await joined.send(start(LENGTH))
    await joined.send(body(b"he", more=True))
    await joined.send(body(b"llo"))
    assert transport.calls == [("writelines", (HEAD, b"he")), ("write", b"llo")]


@pytest.mark.anyio
async def test_a_stream_writes_its_head_at_once():
    joined, transport = cycle()
    await joined.send(start((b"content-type", b"text/event-stream")))
    head = transport.calls[0][1]
    assert transport.calls == [("write", head)]
    assert b"transfer-encoding: chunked" in head
    await joined.send(body(b"data: 1\n\n", more=True))
    assert transport.calls[1] == ("write", b"9\r\ndata: 1\n\n\r\n")


@pytest.mark.anyio
async def test_a_response_that_ends_without_its_body_still_writes_its_head_before_closing():
    """uvicorn closes the connection when the app fails after the head: the head goes first,
    as it did when uvicorn wrote it at once."""

    joined, transport = cycle()
    await joined.send(start(LENGTH))
    joined.transport.close()
    assert transport.calls == [("write", HEAD), ("close",)]


@pytest.mark.anyio
async def test_a_body_longer_than_its_length_writes_the_head_and_raises_as_uvicorn_does():
    joined, transport = cycle()
    await joined.send(start(LENGTH))
    with pytest.raises(RuntimeError, match="longer than Content-Length"):
        await joined.send(body(b"too long"))
    assert transport.calls == [("write", HEAD)]
    assert joined.transport is transport


@pytest.mark.anyio
async def test_connection_close_writes_the_joined_answer_then_closes():
    joined, transport = cycle(keep_alive=False)
    await joined.send(start(LENGTH))
    await joined.send(body(b"hello"))
    head = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: close\r\n\r\n"
    assert transport.calls == [("writelines", (head, b"hello")), ("close",)]


@pytest.mark.anyio
async def test_a_head_request_is_written_as_uvicorn_writes_it():
    joined, transport = cycle(method="HEAD")
    await joined.send(start(LENGTH))
    assert transport.calls == [("write", HEAD)]


@pytest.fixture(scope="module")
def server(request, backend, sim):
    server = edge_server(database_url(request, backend), sim)
    yield server
    server.stop()


def test_the_server_answers_a_known_length_in_one_segment(server):
    """The first read of a client waiting for the answer holds all of it: head and body came
    in one write (with two, the first read often holds the head alone)."""
    for _ in range(5):
        with connect(server) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            first = sock.recv(65536)
        head, _, rest = first.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ")
        assert rest == b'{"status":"ok","version":"%s"}' % __version__.encode(), first
