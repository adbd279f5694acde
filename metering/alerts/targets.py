"""Where webhooks may be sent. An address is internal when it is loopback, private, shared,
link-local, multicast, reserved or unspecified (IPv4, IPv6, and IPv4 carried in IPv6); webhooks
never reach an internal address but for two switches: loopback with
METERING_WEBHOOKS_ALLOW_LOOPBACK, private and shared with METERING_WEBHOOKS_ALLOW_PRIVATE.
Link-local (the cloud metadata address 169.254.169.254 among them), multicast, reserved and
unspecified addresses are never reached.

A literal address is checked when the webhook is registered; every address a name resolves to
is checked when a connection is opened (metering.alerts.outbox.transport)."""

import ipaddress
import socket
from dataclasses import dataclass

from metering.settings import Settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

LOOPBACK = "loopback"
PRIVATE = "private"
SHARED = "shared"
PRIVATE_NETWORKS = tuple(
    ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7")
)
SHARED_NETWORK = ipaddress.ip_network("100.64.0.0/10")
# "This network": Linux connects a socket to 0.0.0.0 to the host itself.
THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")
NAT64 = ipaddress.ip_network("64:ff9b::/96")
SWITCHES = {
    LOOPBACK: "METERING_WEBHOOKS_ALLOW_LOOPBACK",
    PRIVATE: "METERING_WEBHOOKS_ALLOW_PRIVATE",
    SHARED: "METERING_WEBHOOKS_ALLOW_PRIVATE",
}


class Refused(Exception):
    """A connection not opened: the address it would reach is internal."""


def literal(host: str) -> IPAddress | None:
    """The address a URL's host spells, in any form the resolver reads as one (`127.1` and
    `0x7f000001` too); None for a name."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        pass
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except (OSError, UnicodeError, ValueError):
        return None


def _carried(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv4-mapped (::ffff:a.b.c.d, the same socket on a dual stack), 6to4
    or NAT64 address leads to."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def kind_of(ip: IPAddress) -> str | None:
    """What makes an address internal (`loopback`, `private`, ...); None for a public one."""
    if isinstance(ip, ipaddress.IPv6Address):
        carried = _carried(ip)
        if carried is not None:
            return kind_of(carried)
    if ip.is_loopback:
        return LOOPBACK
    if ip.is_unspecified or ip in THIS_NETWORK:
        return "unspecified"
    if ip.is_link_local:
        return "link-local"
    if ip.is_multicast:
        return "multicast"
    if any(ip in network for network in PRIVATE_NETWORKS):
        return PRIVATE
    if ip in SHARED_NETWORK:
        return SHARED
    if ip.is_reserved or getattr(ip, "is_site_local", False) or not ip.is_global:
        return "reserved"  # documentation, benchmarking, broadcast, 240.0.0.0/4, ...
    return None


def is_loopback(host: str) -> bool:
    if host.lower().rstrip(".") == "localhost":
        return True
    ip = literal(host)
    return ip is not None and kind_of(ip) == LOOPBACK


@dataclass(frozen=True, slots=True)
class Reach:
    """The internal addresses webhooks may reach: loopback with one switch, private and shared
    with the other; never the rest."""

    loopback: bool = False
    private: bool = False

    @classmethod
    def of(cls, settings: Settings) -> "Reach":
        return cls(settings.webhooks_allow_loopback, settings.webhooks_allow_private)

    def refusal(self, ip: IPAddress) -> str | None:
        """Why webhooks may not reach this address; None when they may."""
        kind = kind_of(ip)
        if kind is None:
            return None
        if (kind == LOOPBACK and self.loopback) or (kind in (PRIVATE, SHARED) and self.private):
            return None
        switch = SWITCHES.get(kind)
        allowed = f"allowed with {switch}=true" if switch else "never allowed"
        return f"{ip} ({kind}; {allowed})"
