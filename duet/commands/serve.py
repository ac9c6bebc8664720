"""`duet serve` (the HTTP service) and `duet healthcheck` (its probe)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

from duet.commands.common import HelpFormatter, fail, load_settings, log, setup_logging
from duet.commands.front_processes import FrontProcesses, listen_on, public_sockets

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
    if settings.health_port and settings.health_port == settings.port:
        return fail(
            f"DUET_HEALTH_PORT is the service's own port ({settings.port}): give the liveness "
            "port another (8001 in the images), or 0 for none"
        )
    check_port(settings.host, settings.port)  # in use: one line now, not after the load
    return _serve(settings)


def _serve(settings: Any) -> int:
    """Load the model and index, then serve: uvicorn in this process, or the fronts."""
    import uvicorn

    from app.limits import uvicorn_options
    from app.liveness import Heartbeat, LivenessServer
    from app.main import create_app, front_count, load_resources, queue_target_ms
    from models.errors import UserError

    heartbeat = Heartbeat()
    if settings.health_port:  # up while the model loads: "starting" until the loop beats
        try:
            liveness = LivenessServer(
                settings.host, settings.health_port, heartbeat, settings.health_stall_s
            )
        except OSError as exc:
            raise UserError(
                f"cannot listen on {settings.host}:{settings.health_port} for the liveness "
                f"port: {exc.strerror or exc}; set DUET_HEALTH_PORT to a free port, or 0 for none"
            ) from exc
        liveness.start()
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
        return _serve_with_fronts(settings, app, fronts)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.access_log,
        **uvicorn_options(settings, app.state.metrics),
    )
    server = quiet_forced_quit(uvicorn.Server(config))
    with contextlib.suppress(KeyboardInterrupt):  # raised again once uvicorn has shut down
        server.run()
    return 0 if server.started else 3  # as uvicorn.run: the port taken during the load


class _ForcedQuit(logging.Filter):
    """A second Ctrl-C is uvicorn's force quit: it skips the app's shutdown, and uvicorn
    logs the lifespan task it then cancels as a traceback. One line says it instead; any
    other traceback (a shutdown that fails) is left as it is."""

    def __init__(self, server: Any) -> None:
        super().__init__()
        self.server = server

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if (
            self.server.force_exit
            and text.startswith("Traceback")
            and text.rstrip().endswith("CancelledError")
        ):
            log.warning("forced to quit (a second Ctrl-C): requests in flight were cut")
            return False
        return True


def quiet_forced_quit(server: Any) -> Any:
    """`server` (a `uvicorn.Server`, made after its Config configured uvicorn's loggers),
    its force quit told in one line, and SIGHUP taken as SIGTERM: uvicorn leaves it alone, so
    a hang-up (a closed terminal, `kill -HUP` meant as a reload) ended the process at once,
    without a word, its requests under way cut and, with fronts, the service gone."""
    import signal

    logging.getLogger("uvicorn.error").addFilter(_ForcedQuit(server))
    captured = server.capture_signals

    def hung_up(sig: int, frame: Any) -> None:
        log.warning(
            "SIGHUP: stopping as for SIGTERM, the requests under way drained first (a new "
            "index is taken without a restart: DUET_INDEX_POLL_S, or POST /admin/reload)"
        )
        server.handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals() -> Any:
        with captured():  # uvicorn's: SIGINT, SIGTERM; raised again once it has stopped
            # not under `nohup`, which ignores SIGHUP so that the service outlives its terminal
            ours = threading.current_thread() is threading.main_thread() and (
                signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN
            )
            before = signal.signal(signal.SIGHUP, hung_up) if ours else None
            try:
                yield
            finally:
                if ours:  # one set from C reads None: the default then
                    signal.signal(signal.SIGHUP, before if before is not None else signal.SIG_DFL)

    server.capture_signals = capture_signals
    return server


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


def _serve_with_fronts(settings: Any, app: Any, count: int) -> int:
    """The process layout: this process owns the model and serves on a loopback port of its
    own; `count` front processes (DUET_FRONTENDS) serve the public port, each on a socket
    of its own where the platform allows (`public_sockets`, `app.fronts`). Exit status 1
    when it stopped because no front was left to serve."""
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
    owner = listen_on("127.0.0.1", 0, settings.http_backlog)
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
    config = uvicorn.Config(
        app,
        log_level=settings.log_level,
        access_log=settings.access_log,
        **uvicorn_options(settings),
    )
    server = quiet_forced_quit(uvicorn.Server(config))
    emptied = threading.Event()

    def on_empty() -> None:
        emptied.set()
        server.should_exit = True

    app.state.metrics.fronts.labels(state="wanted").set(count)
    fronts = FrontProcesses(
        env,
        # a replacement's own socket where each front has one (SO_REUSEPORT)
        lambda: listen_on(host, port, settings.http_backlog, reuse_port=True),
        on_empty,
        lambda: server.should_exit,
        app.state.metrics.fronts.labels(state="alive").set,
        settings.http_drain_s,
    )
    fronts.start(public, count)
    app.state.metrics.fronts_memory.set_function(fronts.resident_bytes)
    app.state.engine_socket = path
    app.state.stop_fronts = fronts.stop
    log.info("process layout: %d fronts on http://%s:%d, the model here", count, host, port)
    try:
        with contextlib.suppress(KeyboardInterrupt):  # a clean stop, as in one process
            server.run(sockets=[owner])
    finally:
        fronts.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    return 1 if emptied.is_set() else 0


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
    with contextlib.suppress(KeyboardInterrupt):  # as the owner
        quiet_forced_quit(uvicorn.Server(config)).run(sockets=[sock])
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
