"""The process layout's fronts, as the owner (`duet serve`) runs them: their listening sockets
on the public port (`public_sockets`) and their processes (`FrontProcesses`), each replaced
when it dies; with none left to serve, the owner stops so that its supervisor restarts it."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("duet")

FRONT_WATCH_S = 1.0  # how often the owner looks for a front that died
FRONT_SETTLE_S = 10.0  # a front that dies sooner after its start is not replaced again


def _bound(host: str, port: int, reuse_port: bool = False) -> Any:
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def listen_on(host: str, port: int, backlog: int, reuse_port: bool = False) -> Any:
    sock = _bound(host, port, reuse_port)
    sock.listen(backlog)
    return sock


def public_sockets(host: str, port: int, backlog: int, count: int) -> list[Any]:
    """The fronts' listening sockets on the public port: on Linux one per front
    (SO_REUSEPORT), among which the kernel spreads new connections evenly; elsewhere one that
    every front accepts from. A shared socket goes to whichever front accepts first: with six
    fronts, 512 keep-alive connections opened at once landed 155 on one front and 7 on
    another (the busiest front then caps the service at about half what six can answer)."""
    import socket

    if count < 2 or not sys.platform.startswith("linux") or not hasattr(socket, "SO_REUSEPORT"):
        return [listen_on(host, port, backlog)]
    # A port is shared with any socket of this user that also asks to: a second duet (or
    # an old one still stopping) would silently take part of the traffic. A plain bind
    # first fails on a port anything listens on, as one shared socket would. (Between the
    # probe and the binds below the port could be taken: a start that fails, not a share.)
    probe = _bound(host, port)
    port = probe.getsockname()[1]  # the port itself when DUET_PORT=0 chose one
    probe.close()
    return [listen_on(host, port, backlog, reuse_port=True) for _ in range(count)]


class FrontProcesses:
    """The process layout's front processes, which the owner starts and stops. One that dies
    while the service runs is replaced by a new front: on a new listening socket of its own
    where each front has one (SO_REUSEPORT; the dead front's socket closed with it, so
    meanwhile the kernel spread new connections among the others), else on the socket they
    share, which the owner keeps open for that (meanwhile connections wait in its backlog).
    A front that dies within FRONT_SETTLE_S of its start is not replaced again (a crash at
    start would repeat); when no front is left, `on_empty` is called (the owner stops)."""

    def __init__(
        self,
        env: dict[str, str],
        listen: Callable[[], Any],
        on_empty: Callable[[], None],
        ending: Callable[[], bool] = lambda: False,
        told: Callable[[int], None] = lambda alive: None,
        drain_s: float = 10.0,  # DUET_HTTP_DRAIN_S's default (app.config.DRAIN_S)
    ) -> None:
        self.env = env
        self._drain_s = drain_s  # DUET_HTTP_DRAIN_S: a front's own uvicorn drains this long
        self._told = told  # of the fronts alive, at each look (duet_fronts{state="alive"})
        self._listen = listen  # () -> a new listening socket of its own for a front
        self._on_empty = on_empty
        self._ending = ending  # the service is shutting down (a Ctrl-C reaches the fronts too)
        self._shared: Any = None  # the socket every front accepts from, where they share one
        self.fronts: list[tuple[Any, float]] = []  # each front's process and start time
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    def start(self, sockets: list[Any], count: int) -> None:
        if len(sockets) == 1:
            self._shared = sockets[0]  # kept for a replacement, closed by `stop`
        with self._lock:
            for i in range(count):  # its own socket, or the one they share
                self.fronts.append(self._spawn(sockets[i % len(sockets)]))
        if self._shared is None:
            for sock in sockets:
                sock.close()  # the fronts hold them now: a front's socket ends with the front
        self._told(count)
        threading.Thread(target=self._watch, name="duet-fronts-watch", daemon=True).start()

    def _spawn(self, sock: Any) -> tuple[Any, float]:
        import subprocess

        from app.fronts import FD_ENV

        sock.set_inheritable(True)
        proc = subprocess.Popen(
            [sys.executable, "-m", "duet.cli", "serve-front"],
            env={**self.env, FD_ENV: str(sock.fileno())},
            pass_fds=(sock.fileno(),),
        )
        return proc, time.monotonic()

    def _watch(self) -> None:
        given_up: set[int] = set()
        while not self._stopping.wait(FRONT_WATCH_S):
            if self._ending():
                return
            with self._lock:
                for i, (proc, started) in enumerate(self.fronts):
                    if self._stopping.is_set() or i in given_up or proc.poll() is None:
                        continue
                    if time.monotonic() - started < FRONT_SETTLE_S:
                        given_up.add(i)
                        log.error(
                            "front %d exited (status %s) within %gs of its start; not replaced "
                            "(see its log above); %d fronts serve",
                            proc.pid,
                            proc.returncode,
                            FRONT_SETTLE_S,
                            self.alive(),
                        )
                        continue
                    log.error(
                        "front %d exited (status %s); starting another", proc.pid, proc.returncode
                    )
                    if not self._replace(i):
                        given_up.add(i)
                alive = self.alive()
                self._told(alive)
                empty = alive == 0 and not self._stopping.is_set()
            if empty:
                log.error(
                    "no front serves the public port: stopping, for the supervisor to start "
                    "duet again (exit status 1)"
                )
                self._on_empty()
                return

    def _replace(self, i: int) -> bool:
        """Front `i` started again, on a socket of its own or the shared one; False when no
        socket could be had."""
        if self._shared is not None:
            self.fronts[i] = self._spawn(self._shared)
            return True
        try:
            sock = self._listen()
        except OSError as exc:
            log.error("cannot listen for a new front (%s); not replaced", exc)
            return False
        try:
            self.fronts[i] = self._spawn(sock)
        finally:
            sock.close()  # the new front holds it
        return True

    def alive(self) -> int:
        return sum(p.poll() is None for p, _ in self.fronts)

    def resident_bytes(self) -> float:
        """The fronts' resident memory together, read from /proc at each scrape (0 where
        there is none): the owner's process_resident_memory_bytes leaves them out, ~280 MB
        each, up to six of them."""
        import os

        total = 0
        for p, _ in list(self.fronts):
            try:
                with open(f"/proc/{p.pid}/statm") as statm:
                    total += int(statm.read().split()[1])
            except (OSError, ValueError, IndexError):
                continue  # gone, or no /proc here
        return float(total * os.sysconf("SC_PAGE_SIZE")) if total else 0.0

    def stop(self) -> None:
        """SIGTERM to every front (they drain their requests for DUET_HTTP_DRAIN_S), SIGKILL
        5 s after that."""
        import subprocess

        self._stopping.set()
        with self._lock:  # no front is being replaced now, and none will be
            procs = [p for p, _ in self.fronts]
            if self._shared is not None:  # new connections refused now, not held while
                self._shared.close()  # the fronts drain
                self._shared = None
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=self._drain_s + 5)
            except subprocess.TimeoutExpired:
                p.kill()
