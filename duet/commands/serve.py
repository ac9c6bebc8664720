"""`duet serve` (the HTTP service) and `duet healthcheck` (its probe)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from duet.commands.common import (
    HelpFormatter,
    load_settings,
    log,
    setup_logging,
)

# oneDNN (torch's CPU kernels) caches a primitive per input shape, up to 1,024 of them, each
# with its scratch memory; a search's shapes follow its candidates and caption lengths, so a
# mix of requests grew a replica from 0.8 to 3.4 GB (issue 36 row 4). It reads this variable
# once, before its first primitive: `duet serve` sets it before torch is imported (and the
# Dockerfile sets it too); an operator's own value wins.
ONEDNN_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
ONEDNN_CACHE_DEFAULT = "0"


def add(sub: Any) -> None:
    """serve, healthcheck"""
    s = sub.add_parser(
        "serve",
        formatter_class=HelpFormatter,
        help="run the HTTP service on INDEX_DIR/current",
        description="Run the HTTP service. Settings come from DUET_* environment "
        "variables (DUET_INDEX_DIR, DUET_HOST, DUET_PORT, DUET_ENCODER, "
        "DUET_RERANKER, DUET_REDIS_URL, ...); the flags below override them.",
    )
    s.add_argument("--host", help="bind address (DUET_HOST, default 127.0.0.1)")
    s.add_argument("--port", type=int, help="port (DUET_PORT, default 8000)")
    s.add_argument(
        "--index-dir",
        type=Path,
        help="serves INDEX_DIR/current (DUET_INDEX_DIR, default ./indexes)",
    )
    s.set_defaults(fn=cmd_serve)

    h = sub.add_parser(
        "healthcheck",
        formatter_class=HelpFormatter,
        help="exit 0 if the service answers /healthz",
        description="Probe a running service: exit 0 when GET /healthz answers "
        "200, else 1. Used by the Docker HEALTHCHECK.",
    )
    h.add_argument(
        "--url", default=None, help="URL to probe (default: http://127.0.0.1:$DUET_PORT/healthz)"
    )
    h.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    h.set_defaults(fn=cmd_healthcheck)


def cmd_serve(args: argparse.Namespace) -> int:
    os.environ.setdefault(ONEDNN_CACHE_ENV, ONEDNN_CACHE_DEFAULT)
    import uvicorn

    from app.limits import uvicorn_options
    from app.main import create_app, load_resources

    settings = load_settings(host=args.host, port=args.port, index_dir=args.index_dir)
    setup_logging(settings.log_level)
    resources = load_resources(settings)
    app = create_app(settings, resources)
    log.info(
        "serving on http://%s:%d (index %s, model on %s, %s=%s)",
        settings.host,
        settings.port,
        resources.index.version,
        getattr(resources.model, "device", "cpu"),
        ONEDNN_CACHE_ENV,
        os.environ[ONEDNN_CACHE_ENV],
    )
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.access_log,
        **uvicorn_options(settings, app.state.metrics),
    )
    return 0


def cmd_healthcheck(args: argparse.Namespace) -> int:
    """Exit 0 when the service answers /healthz with 200 (Docker HEALTHCHECK, k8s exec probes)."""
    import urllib.error
    import urllib.request

    url = args.url or f"http://127.0.0.1:{load_settings().port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as resp:
            ok = resp.status == 200
    except (urllib.error.URLError, OSError) as exc:
        print(f"duet: unhealthy: {url}: {exc}", file=sys.stderr)
        return 1
    return 0 if ok else 1
