"""Who a request comes from, for the per-client cap on requests held at once (scheduler.py).

A client is the peer's address. Every local process connects from 127.0.0.1, so on loopback the
client is the Unix user that owns the connecting socket, read from the kernel's socket table
(/proc/net/tcp, tcp6): one user's processes can already disturb each other, other users' cannot take
every slot. Behind a reverse proxy listed in --trusted-proxy (the nginx replicas of deploy/), the
client is the address the proxy writes last into X-Forwarded-For.
"""

from __future__ import annotations

import ipaddress
import logging

from .settings import ServerConfig, is_loopback_address

log = logging.getLogger(__name__)


def client_key(scope: dict, config: ServerConfig) -> tuple:
    client = scope.get("client")
    peer = client[0] if client else ""
    if peer and peer in config.trusted_proxies:
        forwarded = _forwarded_for(scope)
        if forwarded:
            return ("forwarded", forwarded)
    if peer and is_loopback_address(peer):
        uid = socket_owner(peer, client[1])
        return ("uid", uid) if uid is not None else ("loopback",)
    return ("addr", peer)


def _forwarded_for(scope: dict) -> str | None:
    """The last address in X-Forwarded-For (the one the trusted proxy itself appended)."""
    values = [v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"x-forwarded-for"]
    if not values:
        return None
    last = values[-1].split(",")[-1].strip()
    return last[:64] or None


def _hex_addr(ip: str, port: int) -> str | None:
    """An address as /proc/net/tcp writes it: the address's 32-bit words in host (little-endian) order."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return None
    raw = addr.packed
    words = "".join(raw[i:i + 4][::-1].hex().upper() for i in range(0, len(raw), 4))
    return f"{words}:{port:04X}"


def socket_owner(ip: str, port: int) -> int | None:
    """The uid owning the local TCP socket bound to ip:port (the client's end), or None."""
    want = _hex_addr(ip, port)
    if want is None:
        return None
    v4mapped = None
    if ":" not in ip:        # an IPv4 client of a dual-stack socket shows as ::ffff:a.b.c.d in tcp6
        v4mapped = _hex_addr(f"::ffff:{ip}", port)
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if len(fields) > 7 and fields[1] in (want, v4mapped):
                        return int(fields[7])
        except OSError:
            return None
    return None
