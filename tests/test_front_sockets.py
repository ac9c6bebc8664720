"""The fronts' listening sockets on the public port (`front_processes.public_sockets`): one per
front (SO_REUSEPORT), so the kernel spreads connections among them, and never on a port
something else listens on; and the owner's care of the fronts (`FrontProcesses`)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from duet.commands.front_processes import public_sockets
from tests.conftest import child_pids, process_alive

REPO = Path(__file__).resolve().parents[1]


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


def test_a_front_whose_owner_died_while_loading_lets_go_of_the_port(tmp_path: Path) -> None:
    """An owner killed before it opened its engine socket (SIGKILL while the model loads)
    never stops its fronts; a front notices its owner is gone and exits, closing its public
    socket, instead of waiting ten minutes for a socket that will never open."""
    from app.fronts import FD_ENV, OWNER_ENV, SOCKET_ENV
    from app.remote import PARENT_ENV

    sock = public_sockets("127.0.0.1", 0, 16, 1)[0]
    port = sock.getsockname()[1]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        SOCKET_ENV: str(tmp_path / "never.sock"),
        OWNER_ENV: "http://127.0.0.1:9",
        FD_ENV: str(sock.fileno()),
    }
    # a stand-in owner: starts the front (as `duet serve` does) and dies at once
    owner = (
        "import os, subprocess, sys; fd = int(os.environ[sys.argv[1]]); "
        f"os.environ['{PARENT_ENV}'] = str(os.getpid()); "
        "p = subprocess.Popen([sys.executable, '-m', 'duet.cli', 'serve-front'], pass_fds=(fd,), "
        "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
        "print(p.pid, flush=True); os._exit(0)"
    )
    sock.set_inheritable(True)
    out = subprocess.run(
        [sys.executable, "-c", owner, FD_ENV],
        env=env,
        pass_fds=(sock.fileno(),),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    sock.close()
    front = int(out.stdout.split()[0])
    deadline = time.monotonic() + 60
    while Path(f"/proc/{front}").exists() and process_alive(front) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not process_alive(front), "the front still runs without its owner"
    with socket.socket() as probe:  # nothing holds the port now
        probe.bind(("127.0.0.1", port))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_REUSEPORT: a socket each")
@pytest.mark.parametrize("count", ["2", "1"])
def test_a_front_that_dies_is_replaced(index_dir: Path, tmp_path: Path, count: str) -> None:
    """A front killed while the service runs: the owner starts another, says so in its log,
    and every new connection is answered meanwhile and after. With two, on a new socket of
    the public port (the dead front's socket closed with it, so none waits on a socket nobody
    accepts from); a lone front's replacement on the socket the owner kept, where connections
    waited meanwhile (before, a lone front was never replaced: the port refused every
    connection while the health port still said ok)."""
    import signal

    import httpx

    from duet.commands.front_processes import FRONT_SETTLE_S
    from tests.conftest import start_service, stop_service
    from tests.test_fronts import _listening

    log = tmp_path / "svc.log"
    svc = start_service(index_dir, log, DUET_FRONTENDS=count)
    try:
        port = int(svc.url.rsplit(":", 1)[1])
        fronts = child_pids(svc.proc.pid)
        assert len(fronts) == int(count)
        time.sleep(FRONT_SETTLE_S + 1)  # past its start, which came before they were seen
        os.kill(fronts[0], signal.SIGKILL)
        while process_alive(fronts[0]):  # gone, its socket closed: no connection lands there
            time.sleep(0.01)
        body = {"query": "two blue squares", "top_k": 3, "rerank": False}
        codes = []
        deadline = time.monotonic() + 30
        new: list[int] = []
        while time.monotonic() < deadline:
            # a new connection each; a lone front's first waits for its replacement's start
            with httpx.Client(base_url=svc.url, timeout=30) as c:
                codes.append(c.post("/search/text", json=body).status_code)
            new = [p for p in child_pids(svc.proc.pid) if p not in fronts and process_alive(p)]
            if new and _listening(new[0], port) and "starting another" in log.read_text():
                break
            time.sleep(0.2)
        assert new and _listening(new[0], port), log.read_text()[-2000:]
        assert set(codes) == {200}, codes
        for _ in range(20):  # both fronts answer new connections
            with httpx.Client(base_url=svc.url, timeout=10) as c:
                assert c.post("/search/text", json=body).status_code == 200
        assert f"front {fronts[0]} exited" in log.read_text()
        with httpx.Client(base_url=svc.url, timeout=10) as c:  # replaced: as many as wanted
            said = c.get("/metrics").text
        for state in ("wanted", "alive"):
            assert f'duet_fronts{{state="{state}"}} {float(count)}' in said, said
    finally:
        stop_service(svc)


def test_the_owner_stops_when_no_front_is_left_to_serve(tmp_path: Path) -> None:
    """Fronts that crash at their start are not started again; with none left, the owner is
    told (`duet serve` then stops with status 1, for its supervisor to start it again)."""
    import threading

    from duet.commands.front_processes import FrontProcesses

    sockets = public_sockets("127.0.0.1", 0, 16, 2)
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # no owner to reach: each front fails
    emptied = threading.Event()

    def listen() -> socket.socket:  # a front slower than FRONT_SETTLE_S to fail: none either
        raise OSError("no socket for a replacement")

    told: list[int] = []  # duet_fronts{state="alive"}, as the owner sets it
    fronts = FrontProcesses(env, listen, emptied.set, told=told.append)
    fronts.start(sockets, 2)
    try:
        assert emptied.wait(120), "never told that no front was left"
        assert fronts.alive() == 0 and told[0] == 2 and told[-1] == 0
    finally:
        fronts.stop()
