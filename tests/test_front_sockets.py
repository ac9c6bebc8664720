"""The fronts' listening sockets on the public port (`duet.commands.serve.public_sockets`): one
per front (SO_REUSEPORT), so the kernel spreads connections among them, and never on a port
something else listens on."""

from __future__ import annotations

import contextlib
import socket
import sys

import pytest

from duet.commands.serve import public_sockets


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_REUSEPORT spreads on Linux")
def test_each_front_has_a_socket_of_its_own_and_a_fair_share_of_connections() -> None:
    """The fronts' public sockets: one per front on one port, and connections opened at once
    spread among them (a shared socket gave one of six fronts 155 of 512, another 7)."""
    socks = public_sockets("127.0.0.1", 0, 512, 3)
    try:
        assert len(socks) == 3 and len({s.getsockname()[1] for s in socks}) == 1
        port = socks[0].getsockname()[1]
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(150)]
        counts = []
        for s in socks:
            s.setblocking(False)
            n = 0
            with contextlib.suppress(BlockingIOError):
                while True:
                    s.accept()[0].close()
                    n += 1
            counts.append(n)
        for c in clients:
            c.close()
        # 50 each on average; beyond 25..75 is 4 standard deviations of an even spread
        assert sum(counts) == 150 and min(counts) >= 25 and max(counts) <= 75, counts
    finally:
        for s in socks:
            s.close()


def test_the_fronts_sockets_refuse_a_port_something_listens_on() -> None:
    """As one shared socket would: a second duet on the port fails to start instead of
    silently taking part of the first one's connections."""
    first = public_sockets("127.0.0.1", 0, 16, 2)
    port = first[0].getsockname()[1]
    try:
        with pytest.raises(OSError, match="in use"):
            public_sockets("127.0.0.1", port, 16, 2)
    finally:
        for s in first:
            s.close()
    plain = socket.create_server(("127.0.0.1", 0))
    try:
        with pytest.raises(OSError, match="in use"):
            public_sockets("127.0.0.1", plain.getsockname()[1], 16, 2)
    finally:
        plain.close()
