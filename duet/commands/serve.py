"""`duet serve` (the HTTP service) and `duet healthcheck` (its probe)."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from duet.commands.common import HelpFormatter, fail, load_settings, log, setup_logging

# oneDNN (torch's CPU kernels) caches a primitive per input shape, up to 1,024 of them, each
# with its scratch memory; a search's shapes follow its candidates and caption lengths, so a
# mix of requests grew a replica from 0.8 to 3.4 GB (issue 36 row 4). It reads this variable
# once, before its first primitive: `duet serve` sets it before torch is imported (the
# Dockerfile too); an operator's own value wins. 8, not 0: with no cache a one-sentence encode
# took 2.24-2.29 ms against 1.88 with 8 and 1.86-1.88 with oneDNN's default 1,024 (1,000
# encodes on one thread); with 8, 160 image searches of mixed sizes levelled off at 530-640 MB.
ONEDNN_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
ONEDNN_CACHE_DEFAULT = "8"


def add(sub: Any) -> None:
    """serve, healthcheck"""
    s = sub.add_parser(
        "serve",
        formatter_class=HelpFormatter,
        help="run the HTTP service on INDEX_DIR/current",
        epilog="examples:\n\n  duet serve                        # ./indexes/current, :8000\n"
        "  DUET_IMAGES_DIR=data/demo duet serve --port 8080  # hits' images from data/demo",
        description="Run the HTTP service. Settings come from DUET_* environment "
        "variables (DUET_INDEX_DIR, DUET_HOST, DUET_PORT, DUET_ENCODER, "
        "DUET_RERANKER, DUET_REDIS_URL, ...; docs/configuration.md); the flags below "
        "override them. The HTTP API: docs/api.md, or GET /docs on the service.",
    )
    s.add_argument("--host", help="bind address (DUET_HOST, default 127.0.0.1)")
    s.add_argument("--port", type=int, help="port (DUET_PORT, default 8000)")
    s.add_argument(
        "--index-dir",
        type=Path,
        help="serves INDEX_DIR/current (DUET_INDEX_DIR, default ./indexes)",
    )
    s.set_defaults(fn=cmd_serve)

    f = sub.add_parser(
        "serve-front",
        formatter_class=HelpFormatter,
        help="(internal) one front of the process layout, started by `duet serve`",
        description="One front process of the process layout (DUET_FRONTENDS > 0): serves the "
        "search routes on the listening socket `duet serve` hands it and passes their model "
        "work, and every other path, to the `duet serve` process. Not run by hand.",
    )
    f.set_defaults(fn=cmd_serve_front)

    h = sub.add_parser(
        "healthcheck",
        formatter_class=HelpFormatter,
        help="exit 0 if the service answers /healthz",
        description="Probe a running service: exit 0 when GET /healthz answers "
        "200, else 1. Used by the Docker HEALTHCHECK.",
    )
    h.add_argument(
        "--url",
        default=None,
        help="URL to probe (default: http://127.0.0.1:$DUET_HEALTH_PORT/healthz when "
        "DUET_HEALTH_PORT is set, else http://127.0.0.1:$DUET_PORT/healthz)",
    )
    h.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    h.set_defaults(fn=cmd_healthcheck)


def cmd_serve(args: argparse.Namespace) -> int:
    os.environ.setdefault(ONEDNN_CACHE_ENV, ONEDNN_CACHE_DEFAULT)
    settings = load_settings(host=args.host, port=args.port, index_dir=args.index_dir)
    setup_logging(settings.log_level)
    check_port(settings.host, settings.port)  # in use: one line now, not after the load
    return _serve(settings)


def _serve(settings: Any) -> int:
    """Load the model and index, then serve: uvicorn in this process, or the fronts."""
    import uvicorn

    from app.limits import uvicorn_options
    from app.liveness import Heartbeat, LivenessServer
    from app.main import create_app, front_count, load_resources, queue_target_ms

    heartbeat = Heartbeat()
    if settings.health_port:  # up while the model loads: "starting" until the loop beats
        LivenessServer(
            settings.host, settings.health_port, heartbeat, settings.health_stall_s
        ).start()
    resources = load_resources(settings)
    paced = queue_target_ms(settings, resources.model)  # auto, resolved on the model's device
    settings = settings.model_copy(update={"http_queue_target_ms": paced})
    app = create_app(settings, resources)
    app.state.heartbeat = heartbeat
    fronts = front_count(settings, resources.model)
    log.info(
        "serving on http://%s:%s (index %s, model on %s, %d front process(es), paced "
        "in-flight cap: %s, %s=%s)",
        settings.host,
        settings.port or "<a free port, logged when it opens>",
        resources.index.version,
        getattr(resources.model, "device", "cpu"),
        fronts,
        f"{paced:g} ms of answers" if paced else "off",
        ONEDNN_CACHE_ENV,
        os.environ[ONEDNN_CACHE_ENV],
    )
    if fronts:
        _serve_with_fronts(settings, app, fronts)
        return 0
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.access_log,
        **uvicorn_options(settings, app.state.metrics),
    )
    return 0


def check_port(host: str, port: int) -> None:
    """UserError, before the model and index load, when `port` is in use or `host` is no
    address of this machine: a probe bound as uvicorn binds (address reuse on, IPv6 only for
    an IPv6 address), closed at once (the port opens when the service is ready). A port taken
    during the load fails as uvicorn fails (exit 3); any other error is uvicorn's to report."""
    import errno
    import socket

    from models.errors import UserError

    if port == 0:
        return
    try:
        probe = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError:
        return
    with probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if probe.family == socket.AF_INET6:
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UserError(
                    f"port {port} on {host} is already in use (another duet?); pass another "
                    "--port, or set DUET_PORT"
                ) from exc
            if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
                raise UserError(
                    f"cannot listen on {host}: {exc.strerror or exc}; pass an address this "
                    "host has (--host, DUET_HOST: 127.0.0.1, 0.0.0.0 for every interface)"
                ) from exc


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


def _listen(host: str, port: int, backlog: int, reuse_port: bool = False) -> Any:
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
        return [_listen(host, port, backlog)]
    # A port is shared with any socket of this user that also asks to: a second duet (or
    # an old one still stopping) would silently take part of the traffic. A plain bind
    # first fails on a port anything listens on, as one shared socket would. (Between the
    # probe and the binds below the port could be taken: a start that fails, not a share.)
    probe = _bound(host, port)
    port = probe.getsockname()[1]  # the port itself when DUET_PORT=0 chose one
    probe.close()
    return [_listen(host, port, backlog, reuse_port=True) for _ in range(count)]


def _serve_with_fronts(settings: Any, app: Any, count: int) -> None:
    """The process layout: this process owns the model and serves on a loopback port of its
    own; `count` front processes (DUET_FRONTENDS) serve the public port, each on a socket
    of its own where the platform allows (`public_sockets`, `app.fronts`)."""
    import os
    import shutil
    import tempfile

    import uvicorn

    from app.fronts import OWNER_ENV, SOCKET_ENV
    from app.limits import uvicorn_options
    from app.remote import PARENT_ENV
    from models.errors import UserError

    try:
        public = public_sockets(settings.host, settings.port, settings.http_backlog, count)
    except OSError as exc:  # in use, or an address this host does not have
        raise UserError(
            f"cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}; stop "
            "what listens there (another duet?) or set DUET_PORT / DUET_HOST"
        ) from exc
    owner = _listen("127.0.0.1", 0, settings.http_backlog)
    run_dir = tempfile.mkdtemp(prefix="duet-")  # private (0700): the engine socket lives here
    path = os.path.join(run_dir, "engine.sock")
    env = {
        **os.environ,
        SOCKET_ENV: path,
        OWNER_ENV: f"http://127.0.0.1:{owner.getsockname()[1]}",
        PARENT_ENV: str(os.getpid()),
        # as this process resolved it: a front has no model to tell the device by
        "DUET_HTTP_QUEUE_TARGET_MS": str(settings.http_queue_target_ms),
    }
    host, port = settings.host, public[0].getsockname()[1]
    fronts = FrontProcesses(
        env,
        # a replacement's own socket where each front has one (SO_REUSEPORT)
        (lambda: _listen(host, port, settings.http_backlog, reuse_port=True))
        if len(public) == count > 1
        else None,
    )
    fronts.start(public, count)
    app.state.engine_socket = path
    app.state.stop_fronts = fronts.stop
    log.info("process layout: %d fronts on http://%s:%d, the model here", count, host, port)
    config = uvicorn.Config(
        app,
        log_level=settings.log_level,
        access_log=settings.access_log,
        **uvicorn_options(settings),
    )
    try:
        uvicorn.Server(config).run(sockets=[owner])
    finally:
        fronts.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


FRONT_WATCH_S = 1.0  # how often the owner looks for a front that died
FRONT_SETTLE_S = 10.0  # a front that dies sooner after its start is not replaced again


class FrontProcesses:
    """The process layout's front processes, which the owner starts and stops. One that dies
    while the service runs is replaced by a new front on a new listening socket of its own
    (`listen`; where each front has one, SO_REUSEPORT). The dead front's socket closed with
    it, so meanwhile the kernel spread new connections among the others. A front that dies
    within FRONT_SETTLE_S of its start is not replaced again: a crash at start would repeat."""

    def __init__(self, env: dict[str, str], listen: Any) -> None:
        self.env = env
        self._listen = listen  # () -> a new listening socket; None where fronts share one
        self.fronts: list[tuple[Any, float]] = []  # each front's process and start time
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    def start(self, sockets: list[Any], count: int) -> None:
        with self._lock:
            for i in range(count):  # its own socket, or the one they share
                self.fronts.append(self._spawn(sockets[i % len(sockets)]))
        for sock in sockets:
            sock.close()  # the fronts hold them now: a front's socket ends with the front
        if self._listen is not None:
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
                    try:
                        sock = self._listen()
                    except OSError as exc:
                        given_up.add(i)
                        log.error("cannot listen for a new front (%s); not replaced", exc)
                        continue
                    try:
                        self.fronts[i] = self._spawn(sock)
                    finally:
                        sock.close()  # the new front holds it

    def alive(self) -> int:
        return sum(p.poll() is None for p, _ in self.fronts)

    def stop(self) -> None:
        """SIGTERM to every front (they drain their requests), SIGKILL after 15 s."""
        import subprocess

        self._stopping.set()
        with self._lock:  # no front is being replaced now, and none will be
            procs = [p for p, _ in self.fronts]
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


def cmd_serve_front(args: argparse.Namespace) -> int:
    """One front of the process layout (see `app.fronts`)."""
    import os
    import socket

    import uvicorn

    from app.fronts import FD_ENV, OWNER_ENV, SOCKET_ENV, create_front_app
    from app.limits import uvicorn_options

    settings = load_settings()
    setup_logging(settings.log_level)
    if FD_ENV not in os.environ:
        print("duet serve-front is started by `duet serve` (DUET_FRONTENDS > 0)", file=sys.stderr)
        return 2
    sock = socket.socket(fileno=int(os.environ[FD_ENV]))
    app = create_front_app(settings, os.environ[SOCKET_ENV], os.environ[OWNER_ENV])
    config = uvicorn.Config(
        app,
        log_level=settings.log_level,
        access_log=settings.access_log,
        # its 429s at the in-flight cap counted by the owner, as its other metrics
        **uvicorn_options(settings, app.state.metrics),
    )
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def cmd_healthcheck(args: argparse.Namespace) -> int:
    """Exit 0 when the service answers /healthz with 200 (Docker HEALTHCHECK, k8s exec probes)."""
    import urllib.error
    import urllib.request

    if not args.timeout > 0:
        return fail("--timeout must be more than 0 seconds")
    settings = load_settings()
    url = args.url or f"http://127.0.0.1:{settings.health_port or settings.port}/healthz"
    if not url.startswith(("http://", "https://")):
        return fail(f"--url {url!r}: give an http:// or https:// URL")
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as resp:
            ok = resp.status == 200
    except (urllib.error.URLError, OSError, ValueError) as exc:  # ValueError: an unreadable URL
        print(f"duet: unhealthy: {url}: {exc}", file=sys.stderr)
        return 1
    return 0 if ok else 1
