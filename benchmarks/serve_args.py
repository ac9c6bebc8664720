"""benchmarks/serve_load.py's command line."""

from __future__ import annotations

import argparse
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODES = (("re-ranked", True), ("dot only", False))  # the closed loop's modes, in order


def parse(description: str) -> argparse.Namespace:
    """serve_load.py's command line."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--index-dir",
        type=Path,
        default=REPO / "indexes",
        help="serves INDEX_DIR/current (default: the demo index, `make demo-index`)",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda (both servers)")
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--seconds", type=float, default=6.0, help="per cell and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--warm-up",
        type=float,
        default=0.0,
        help="seconds of re-ranked load (8 clients) on each server before the cells, not "
        "counted: a long-running service's state (e.g. the image route's kept caption "
        "states); every query still different, so no response cache answers",
    )
    p.add_argument("--candidates", type=int, default=50)
    p.add_argument(
        "--overload",
        type=int,
        default=256,
        help="clients for the overload run against duet (0 = skip)",
    )
    p.add_argument(
        "--procs",
        type=int,
        default=1,
        help="load-generating processes (one Python process sends at most a few thousand "
        "requests/s; a GPU host needs several)",
    )
    p.add_argument(
        "--open-loop",
        default="",
        help="offered loads in requests/s (e.g. 500,2000): re-ranked requests sent at that rate "
        "whatever the answers do, latency counted from when each was due, duet and the script",
    )
    p.add_argument(
        "--duet-env",
        default="",
        help="extra settings for duet, KEY=VALUE,... (e.g. DUET_LAYOUT=cpu to A/B the layouts)",
    )
    p.add_argument(
        "--modes",
        default=",".join(m for m, _ in MODES),
        type=_modes,
        help="the closed-loop modes to run, comma-separated (default: both)",
    )
    p.add_argument(  # image: benchmarks/image_queries.py, each upload its own bytes
        "--route", choices=("text", "image"), default="text", help="text: sentences; image: uploads"
    )
    p.add_argument("--skip-bound", action="store_true", help="skip the cross-encoder-alone figure")
    p.add_argument(
        "--no-baseline",
        action="store_true",
        help="duet alone, no plain script (an A/B of duet's settings against another run that "
        "had the script: half the cells, and no second server to start)",
    )
    p.add_argument(
        "--reranker",
        type=Path,
        default=None,
        help="a BLIP ITM directory both servers re-rank with (DUET_RERANKER; the index must "
        "be built with it): the heavy re-ranker's row (benchmarks/blip_base.py makes one)",
    )
    p.add_argument("--out", type=Path, default=REPO / "docs" / "performance.md")
    p.add_argument("--json", type=Path, default=None, help="also write the raw figures here")
    return p.parse_args()


def _modes(text: str) -> list[str]:
    """--modes: names of `MODES`, comma-separated."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    known = [m for m, _ in MODES]
    if not names or any(m not in known for m in names):
        raise argparse.ArgumentTypeError(f"{text!r}: use {', '.join(known)} (comma-separated)")
    return names
