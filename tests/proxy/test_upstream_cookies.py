"""The upstream client keeps no cookie: one client serves every user, so a cookie an upstream
answer sets is never sent with a later request (anyone's), and none is kept."""

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from metering.proxy.upstreams import _client


class _SetsCookies(BaseHTTPRequestHandler):
    seen: list[str | None] = []

    def do_POST(self) -> None:  # the standard library's name
        self.seen.append(self.headers.get("cookie"))
        self.rfile.read(int(self.headers.get("content-length", 0)))
        body = b'{"ok": true}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("set-cookie", "session=user-a; Path=/")
        self.send_header("set-cookie", "tracker=1; Domain=127.0.0.1; Path=/")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.mark.e2e  # starts an upstream and a server of its own
def test_an_upstreams_cookie_is_never_kept_nor_sent():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SetsCookies)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/chat/completions"

    async def scenario() -> None:
        client = _client(10)
        try:
            for _ in range(3):
                # Both ways a request is made: built by the client, and built apart and sent.
                first = await client.post(url, json={"n": 1})
                assert first.headers.get_list("set-cookie")
                second = await client.send(httpx.Request("POST", url, json={"n": 2}))
                assert second.status_code == 200
                await second.aread()
            assert len(client.cookies) == 0
            assert not list(client.cookies.jar)
        finally:
            await client.aclose()

    try:
        asyncio.run(scenario())
    finally:
        server.shutdown()
        server.server_close()
    assert _SetsCookies.seen == [None] * 6
