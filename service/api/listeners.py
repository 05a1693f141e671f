"""The listening sockets of `shortlist serve`, bound before anything is loaded.

uvicorn binds its port after the app's start-up and gunicorn's arbiter after its bundle preload:
a port already taken stopped serve only after a whole bundle load (a 10^6-label bundle's load
takes tens of seconds), having logged `bundle_activated` for a server that never listened, and
under the arbiter with exit status 1 after five retries a second apart. Bound here first, a port
that cannot be had stops start-up at once with status 3. The sockets are then handed over
(uvicorn's `sockets=`, gunicorn's `fd://` binds), which listen on them once their start-up is
over, as they did on their own sockets: until then a connection is refused. (So a second server
may still bind the port meanwhile: Linux lets two SO_REUSEADDR sockets bind one port while
neither listens. The one that listens second then stops with status 3, as before.)
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
from collections.abc import Sequence

import uvicorn
from uvicorn.server import STARTUP_FAILURE

log = logging.getLogger("uvicorn.error")  # where uvicorn says it runs


class PortUnavailable(Exception):
    """A serve address that cannot be bound (taken, not this machine's, a privileged port)."""


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Sockets bound, not listening, on every address `host` resolves to ("" every address), as
    asyncio's create_server binds them for uvicorn: SO_REUSEADDR, IPv6 sockets IPv6-only.
    Raises PortUnavailable naming the address and why."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        raise PortUnavailable(f"cannot listen on {host}:{port}: {getattr(exc, 'strerror', None) or exc}") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):  # getaddrinfo may repeat one
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:  # a family this machine lacks (IPv6 off), skipped as asyncio skips it
                continue
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                raise PortUnavailable(f"cannot listen on {address_text(address)}: "
                                      f"{(exc.strerror or str(exc)).lower()}") from None
    except BaseException:
        close_all(sockets)
        raise
    if not sockets:
        raise PortUnavailable(f"cannot listen on {host}:{port}: no address of a family this machine has")
    return sockets


def address_text(address: tuple) -> str:
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def close_all(sockets: Sequence[socket.socket]) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.close()


def gunicorn_binds(sockets: Sequence[socket.socket]) -> list[str]:
    """gunicorn's `bind` setting for these sockets: each one's descriptor, handed over (gunicorn
    closes it once it has its own copy)."""
    return [f"fd://{sock.detach()}" for sock in sockets]


class BoundServer(uvicorn.Server):
    """uvicorn's server on sockets bound beforehand (`serve(sockets=...)`), saying where it runs
    as it does on its own sockets (it says nothing for given ones)."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        # listen() refused: another server bound the port beside this one (Linux lets two
        # SO_REUSEADDR sockets bind while neither listens) and listened first. asyncio raises;
        # uvloop closes the socket and carries on, listening nowhere. Either way stopped as uvicorn
        # stops when its own bind fails.
        try:
            await super().startup(sockets=sockets)
            refused = self.started and any(sock.fileno() == -1 for sock in sockets or [])
        except OSError as exc:
            log.error("cannot listen: %s", exc)
            refused = True
        if refused:
            log.error("cannot listen on port %s: another server listens there", self.config.port)
            await self.lifespan.shutdown()
            sys.exit(STARTUP_FAILURE)
        if self.started and sockets:
            for sock in sockets:
                log.info("Uvicorn running on http://%s (Press CTRL+C to quit)", address_text(sock.getsockname()))
