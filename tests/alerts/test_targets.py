"""Where webhooks may be sent: which addresses are internal, in every form, and the delivery
transport connecting to a checked address while TLS is verified for the URL's host."""

import asyncio
import ipaddress
import ssl
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from metering.alerts.outbox.transport import GuardedTransport
from metering.alerts.targets import Reach, Refused, kind_of, literal


@pytest.mark.parametrize(
    ("host", "kind"),
    [
        ("127.0.0.1", "loopback"),
        ("127.255.255.254", "loopback"),
        ("127.1", "loopback"),
        ("2130706433", "loopback"),
        ("0x7f000001", "loopback"),
        ("017700000001", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),
        ("2002:7f00:1::", "loopback"),  # 6to4
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("172.31.255.255", "private"),
        ("192.168.0.1", "private"),
        ("fc00::1", "private"),
        ("fdff::1", "private"),
        ("::ffff:10.0.0.1", "private"),
        ("64:ff9b::a00:1", "private"),  # NAT64
        ("100.64.0.1", "shared"),
        ("100.127.255.254", "shared"),
        ("169.254.169.254", "link-local"),
        ("fe80::1", "link-local"),
        ("fe80::1%25eth0", "link-local"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("240.0.0.1", "reserved"),
        ("255.255.255.255", "reserved"),
        ("192.0.2.1", "reserved"),
        ("198.18.0.1", "reserved"),
        ("2001:db8::1", "reserved"),
        ("::127.0.0.1", "reserved"),
        ("fec0::1", "reserved"),
        ("0.0.0.0", "unspecified"),
        ("0.1.2.3", "unspecified"),
        ("::", "unspecified"),
        ("8.8.8.8", None),
        ("172.32.0.1", None),
        ("100.128.0.1", None),
        ("2606:4700::1", None),
        ("::ffff:8.8.8.8", None),
        ("64:ff9b::808:808", None),
    ],
)
def test_an_address_is_internal_in_every_form(host, kind):
    ip = literal(host)
    assert ip is not None
    assert kind_of(ip) == kind


@pytest.mark.parametrize("host", ["localhost", "example.com", "1.2.3.4.5", "127.0.0.1."])
def test_a_name_is_no_literal(host):
    assert literal(host) is None


def test_the_switches_allow_their_kinds_only():
    addresses = {
        k: ipaddress.ip_address(a)
        for k, a in (
            ("loopback", "::1"),
            ("private", "10.0.0.1"),
            ("shared", "100.64.0.1"),
            ("link-local", "169.254.169.254"),
        )
    }
    allowed = {
        reach: sorted(k for k, ip in addresses.items() if reach.refusal(ip) is None)
        for reach in (Reach(), Reach(loopback=True), Reach(private=True), Reach(True, True))
    }
    assert allowed == {
        Reach(): [],
        Reach(loopback=True): ["loopback"],
        Reach(private=True): ["private", "shared"],
        Reach(True, True): ["loopback", "private", "shared"],
    }


@pytest.fixture(scope="module")
def tls_receiver(tmp_path_factory):
    """An https receiver on 127.0.0.1 whose certificate (its own authority) names `localhost`
    only; it answers with the Host header and the TLS server name it was sent."""
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"]
        + ["-nodes", "-days", "1", "-subj", "/CN=localhost"]
        + ["-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    names: list[str | None] = []
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    context.sni_callback = lambda _socket, name, _context: names.append(name)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:  # the stdlib's name
            answer = f"{self.headers['host']} {names[-1]}".encode()
            self.send_response(200)
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], ssl.create_default_context(cafile=cert)
    server.shutdown()
    server.server_close()


def _post(reach: Reach, url: str, verify: ssl.SSLContext) -> httpx.Response:
    async def send() -> httpx.Response:
        transport = GuardedTransport(reach, httpx.Limits(), verify=verify)
        async with httpx.AsyncClient(transport=transport, timeout=10) as client:
            return await client.post(url, content=b"{}")

    return asyncio.run(send())


def test_tls_is_verified_for_the_name_while_the_checked_address_is_dialled(tls_receiver):
    port, verify = tls_receiver
    answer = _post(Reach(loopback=True), f"https://localhost:{port}/hook", verify)
    assert answer.status_code == 200 and answer.text == f"localhost:{port} localhost"
    # The certificate names localhost, not 127.0.0.1: verification is on, for the URL's host.
    with pytest.raises(httpx.ConnectError, match="certificate verify failed"):
        _post(Reach(loopback=True), f"https://127.0.0.1:{port}/hook", verify)


def test_the_transport_refuses_a_name_resolving_to_loopback(tls_receiver):
    port, verify = tls_receiver
    with pytest.raises(Refused, match=r"^localhost points to an internal address: "):
        _post(Reach(private=True), f"https://localhost:{port}/hook", verify)
