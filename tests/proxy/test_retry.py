"""A request the upstream dropped on a reused keep-alive connection, before answering a byte, is
sent once more on a new connection; a drop that cannot be retried says what happened (a closed
connection, not a timeout)."""

import asyncio
import errno
import json
import socket
import threading
import uuid
from decimal import Decimal

import aiohttp
import httpx
import pytest

from metering.proxy.upstreams import (
    Upstreams,
    dropped_unanswered,
    failure_kind,
    refused_at_connect,
)
from metering.settings import parse_catalog
from tests.proxy.conftest import assert_error_shape, provider_entry, serving

ANSWER = {
    "id": "chatcmpl-raw",
    "object": "chat.completion",
    "created": 0,
    "model": "raw",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
    ],
    "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10},
}


class RawUpstream:
    """An HTTP/1.1 server on a raw socket. `idle_close`: a connection's second request is met
    by closing it unread, as a server does with a connection it had timed out as idle.
    `close_all`: every request is met that way, a new connection's too."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.connections = 0
        self.answered = 0
        self.loop = asyncio.new_event_loop()
        self.started = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        assert self.started.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0)
        )
        self.port = self.server.sockets[0].getsockname()[1]
        self.started.set()
        self.loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if self.mode == "close_all" or served >= 1:
                    return  # closed without an answer
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                body = json.dumps(ANSWER).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    + f"content-length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
                served += 1
                self.answered += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def upstreams():
    servers = {mode: RawUpstream(mode) for mode in ("idle_close", "close_all")}
    yield servers
    for server in servers.values():
        server.stop()


@pytest.fixture(scope="module")
def proxy(api, upstreams):
    catalog = {
        "providers": {
            mode: provider_entry(server.url, "openai", timeout_s=10)
            for mode, server in upstreams.items()
        },
        "models": [
            {
                "name": mode,
                "provider": mode,
                "upstream_model": "raw",
                "input_usd_per_mtok": "0.15",
                "output_usd_per_mtok": "0.60",
                "max_output_tokens": 100,
            }
            for mode in upstreams
        ],
    }
    with serving(api, catalog) as own:
        yield own


def ask(proxy, token: dict, model: str) -> httpx.Response:
    return httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": uuid.uuid4().hex}]},
        headers={"authorization": f"Bearer {token['token']}"},
        timeout=30,
    )


def test_request_dropped_on_a_reused_connection_is_sent_again_on_a_new_one(proxy, upstreams):
    server = upstreams["idle_close"]
    _, _, token = proxy.principal(token_limit="1")
    answered = server.answered  # the module's other backend used this server too
    for n in range(1, 4):
        connections = server.connections
        response = ask(proxy, token, "idle_close")
        assert response.status_code == 200, response.text
        assert response.json()["usage"] == ANSWER["usage"]
        assert server.answered == answered + n
        # The first goes on a new connection; each later one meets the pooled connection
        # closed, and is answered on a new one.
        assert server.connections == connections + 1 if n == 1 else connections + 2
    events = proxy.events(token_id=token["id"])
    assert len(events) == 3
    assert {(e["status"], e["usage_source"], e["prompt_tokens"]) for e in events} == {
        ("ok", "reported", 9)
    }
    budget = proxy.ok("GET", f"/v1/tokens/{token['id']}/budget")
    assert Decimal(budget["reserved"]) == 0
    assert Decimal(budget["spent"]) == sum(Decimal(e["cost"]) for e in events)


def test_request_dropped_on_a_new_connection_is_a_502_saying_so_not_a_timeout(proxy, upstreams):
    server = upstreams["close_all"]
    _, _, token = proxy.principal(token_limit="1")
    connections = server.connections
    response = ask(proxy, token, "close_all")
    error = assert_error_shape(response, 502, "upstream_error")
    assert error["message"] == (
        "provider close_all closed the connection after the request was sent, without an answer"
    )
    assert server.connections == connections + 1  # sent once: it may have been read
    events = proxy.events(token_id=token["id"])
    assert [(e["status"], Decimal(e["cost"])) for e in events] == [("upstream_disconnected", 0)]


def _raised(exc: BaseException, cause: BaseException) -> BaseException:
    """`exc` as it is raised from `cause` (its __cause__ and __context__ set)."""
    try:
        try:
            raise cause
        except BaseException as inner:
            raise exc from inner
    except BaseException as outer:
        return outer


def test_a_connection_closing_as_the_request_is_written_counts_as_dropped_unanswered():
    """The race the retry is for, as aiohttp reports it when the upstream's idle timeout closed
    the pooled connection between its checkout and the write (seen under load against a
    uvicorn upstream, whose idle timeout is the client's): an errno-less ClientOSError whose
    cause is the write refused on a closing transport, mapped to httpx. It used to stop the
    search at the errno-less ClientOSError and answer 502."""
    reset = aiohttp.ClientConnectionResetError("Cannot write to closing transport")
    url = "http://127.0.0.1:1/openai/v1/chat/completions"
    written = _raised(aiohttp.ClientOSError(None, f"Can not write request body for {url}"), reset)
    mapped = _raised(httpx.ConnectTimeout(f"[Errno None] {written.strerror}"), written)
    assert dropped_unanswered(mapped)
    assert failure_kind(mapped) == "upstream_disconnected"
    # A reset by the peer (errno 104) as before; an errno that is not a drop, and a connect
    # failure, are not retried.
    reset_by_peer = _raised(
        aiohttp.ClientOSError(errno.ECONNRESET, "reset"), ConnectionResetError()
    )
    assert dropped_unanswered(_raised(httpx.ConnectTimeout("reset"), reset_by_peer))
    unreachable = aiohttp.ClientOSError(errno.EHOSTUNREACH, "no route")
    assert not dropped_unanswered(_raised(httpx.ConnectError("no route"), unreachable))
    assert not dropped_unanswered(httpx.ConnectTimeout("plain timeout"))


def test_a_refused_connection_is_made_once_more_then_reported_unreached(caplog):
    """Nothing listens on the provider's port: the connection is refused at once, nothing went
    out, so it is tried once more on a new connection (a burst can overflow a listener's queue
    for an instant); refused again, it is a connect failure, the kind the next provider is
    tried on. A connect timeout is not tried twice."""
    port = _closed_port()
    catalog = parse_catalog(
        {
            "providers": {"gone": provider_entry(f"http://127.0.0.1:{port}/v1", "openai")},
            "models": [],
        },
        environ={},
    )

    async def send() -> BaseException:
        upstreams = Upstreams(catalog, 4)
        try:
            request = upstreams.clients["gone"].build_request(
                "POST", f"http://127.0.0.1:{port}/v1/chat/completions", content=b"{}"
            )
            with pytest.raises(httpx.HTTPError) as raised:
                await upstreams.send("gone", request)
            return raised.value
        finally:
            await upstreams.close()

    with caplog.at_level("WARNING", logger="metering.proxy"):
        exc = asyncio.run(send())
    assert refused_at_connect(exc)
    assert failure_kind(exc) == "unreached"
    retries = [r for r in caplog.records if "once more on a new connection" in r.getMessage()]
    assert len(retries) == 1
    timeout = _raised(httpx.ConnectTimeout("slow"), aiohttp.ConnectionTimeoutError("slow"))
    assert not refused_at_connect(timeout)
    assert failure_kind(timeout) == "unreached"


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
