"""benchmarks/serve_load.py's report: the markdown table, its plot and the raw figures."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from benchmarks.cell import Cell
from models.fusion import DEFAULT_FUSION_LAMBDA

REPO = Path(__file__).resolve().parent.parent
PRECISION = os.environ.get("DUET_PRECISION") or "auto"


def _device_name(device: str) -> str:
    """The device as a report names it: the GPU's model on a CUDA host."""
    if not device.startswith("cuda"):
        return device
    import torch

    return f"{device} ({torch.cuda.get_device_name(0)})"


def _shown(path: Path) -> str:
    """`path` as the report names it: relative to the repository when it lies inside it, so a
    report does not carry one machine's absolute paths."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def plot(results: dict[str, Cell], levels: list[int], path: Path) -> None:
    """Throughput and p50/p99 latency against concurrency, duet against the script."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for col, mode in enumerate(("re-ranked", "dot only")):
        if mode not in ran(results, levels):
            continue
        for srv, style in (("duet", "o-"), ("baseline", "s--")):
            if f"{srv}|{mode}|{levels[0]}" not in results:  # --no-baseline
                continue
            cells = [results[f"{srv}|{mode}|{c}"] for c in levels]
            axes[0][col].plot(levels, [c.throughput for c in cells], style, label=srv)
            axes[1][col].plot(levels, [c.q(50) for c in cells], style, label=f"{srv} p50")
            axes[1][col].plot(
                levels, [c.q(99) for c in cells], style, alpha=0.5, label=f"{srv} p99"
            )
        axes[0][col].set_title(f"{mode}: throughput (full answers/s)")
        axes[1][col].set_title(f"{mode}: latency (ms)")
        axes[1][col].set_yscale("log")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_xticks(levels, [str(c) for c in levels])
            ax.set_xlabel("concurrent clients")
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _warmed(seconds: float) -> str:
    """What the report says of `--warm-up`."""
    if seconds <= 0:
        return ""
    return (
        f", after {seconds:g} s of re-ranked load (8 clients, not counted) on each server, "
        "as a service that has run a while"
    )


def write_report(
    args: argparse.Namespace,
    levels: list[int],
    results: dict[str, Cell],
    bound: dict[str, float],
    over: dict[str, object] | None,
    offered: dict[str, Cell] | None = None,
) -> None:
    """The markdown report (and its plot) at --out, and the raw figures at --json."""
    png = args.out.with_suffix(".png")
    plot(results, levels, png)
    lines = [
        "# Serving performance: duet against the plain script",
        "",
        f"Written by `python benchmarks/serve_load.py --device {args.device}"
        f"{' --route image' if getattr(args, 'route', 'text') == 'image' else ''}"
        f"{f' --warm-up {args.warm_up:g}' if getattr(args, 'warm_up', 0.0) > 0 else ''}` "
        f"({time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores, "
        f"device {_device_name(args.device)}, duet's cross-encoder in "
        f"DUET_PRECISION={PRECISION}{', ' + args.duet_env if args.duet_env else ''}"
        f"{'; re-ranker ' + args.reranker.name + ' (BLIP ITM) on both' if args.reranker else ''}; "
        f"{args.procs} load process(es)"
        f"{'; duet alone, no plain script in this run' if args.no_baseline else ''}). "
        f"Index: `{_shown(args.index_dir)}/current`; "
        f"{args.candidates} candidates, top 10; closed-loop clients, {args.seconds:g} s per cell "
        f"x {args.rounds} interleaved rounds"
        f"{_warmed(getattr(args, 'warm_up', 0.0))}; {_queries(args)}.",
        "The baseline (`benchmarks/baseline_server.py`) is the script a user would write: a sync "
        "FastAPI endpoint running encode -> FAISS -> the model's PyTorch cross-encoder forward "
        f"-> ADD_{DEFAULT_FUSION_LAMBDA} per request, torch's default threads, no cache, no "
        "batching. Throughput counts full answers only (degraded and refused ones are counted "
        "apart).",
        "",
        f"![throughput and latency against concurrency]({png.name})",
        "",
        "| mode | clients | duet req/s | script req/s | duet / script | duet p50 ms | "
        "script p50 ms | duet p99 ms | script p99 ms | duet degraded / 429 | script errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in ran(results, levels):
        for c in levels:
            d, b = results[f"duet|{mode}|{c}"], results.get(f"baseline|{mode}|{c}")
            if b is None:  # --no-baseline
                script = ["-"] * 5
            else:
                ratio = d.throughput / b.throughput if b.throughput else float("nan")
                script = [f"{b.throughput:.1f}", f"{ratio:.2f}x", f"{b.q(50):.1f}"]
                script += [f"{b.q(99):.1f}", str(b.errors + b.refused)]
            lines.append(
                f"| {mode} | {c} | {d.throughput:.1f} | {script[0]} | {script[1]} | "
                f"{d.q(50):.1f} | {script[2]} | {d.q(99):.1f} | {script[3]} | "
                f"{d.degraded} / {d.refused} | {script[4]} |"
            )
    lines += _bound(args, bound)
    lines += _stages(results)
    lines += _cores(levels, results)
    if offered:
        plot_offered(offered, _open_png(args))
    lines += _offered(args, offered or {})
    if over is not None:
        lines += [
            "",
            f"Overload: {over['clients']} clients against duet for "
            f"{3 * args.seconds:g} s (a refused client waits out Retry-After, at most 1 s):",
            "",
            "```json",
            json.dumps(over, indent=1),
            "```",
        ]
    args.out.write_text("\n".join(lines) + "\n")
    if args.json:
        _write_json(args.json, results, bound, over)


STAGES = ("cache", "queue", "encode", "search", "device", "rerank", "lookup")


def ran(results: dict[str, Cell], levels: list[int]) -> list[str]:
    """The closed-loop modes measured (`serve_load --modes`), in order."""
    return [m for m in ("re-ranked", "dot only") if f"duet|{m}|{levels[0]}" in results]


def _stages(results: dict[str, Cell]) -> list[str]:
    """Where a lone request's time went, by duet's own clock: the client's p50 against the
    server's mean and its stages (the difference: HTTP, the socket, the event loop)."""
    rows = [(m, results.get(f"duet|{m}|1")) for m in ("re-ranked", "dot only")]
    if not any(cell is not None and cell.stages for _, cell in rows):
        return []
    lines = [
        "",
        "A lone request (1 client) by duet's own clock, mean ms per request that went through "
        "each stage (`duet_stage_seconds`, `duet_request_seconds` of /search/*, read from "
        "/metrics before and after the cell); the client's p50 beside them:",
        "",
        "| mode | client p50 | server | " + " | ".join(STAGES) + " |",
        "|---|---|---|" + "---|" * len(STAGES),
    ]
    for mode, cell in rows:
        if cell is None or not cell.stages:
            continue
        lines.append(
            f"| {mode} | {cell.q(50):.2f} | {cell.stage_ms('request'):.2f} | "
            + " | ".join(f"{cell.stage_ms(s):.2f}" for s in STAGES)
            + " |"
        )
    return lines


def _cores(levels: list[int], results: dict[str, Cell]) -> list[str]:
    """Where duet's CPU went in each cell: a process, or one thread of it, near one core busy
    is what caps the service (one GIL per process); the load generator's cores say whether
    it, sharing the machine, held the load back."""
    if not any(c.cpu for c in results.values()):
        return []
    lines = [
        "",
        "Where the cores went in duet's cells (CPU seconds / wall seconds; the server is "
        "the `duet serve` process, the one that owns the model, and of its threads the "
        'event loop ("loop"), the threads that read the fronts\' searches and send their '
        'answers ("wire"), the busiest engine thread ("engine": a worker feeding the '
        "model, or a CPU thread torch started for it; the other engine threads are what "
        '"server cores" holds beyond the columns beside it) and the threads that are none '
        'of these ("other": CUDA\'s threads, the decoders); '
        "fronts are its front processes, when there are any; the busiest front near one "
        "core while the fronts' total is well below their count: the connections are "
        "unevenly spread):",
        "",
        "| mode | clients | duet req/s | server cores | loop / wire / engine / other | "
        "fronts cores | "
        "busiest front cores | load generator cores | server CPU ms per answer | "
        "fronts CPU ms per answer |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in ran(results, levels):
        for c in levels:
            d = results[f"duet|{mode}|{c}"]
            # the server's cores over the full answers' rate (degraded ones counted too)
            rate = (len(d.latencies) + d.degraded) / d.seconds if d.seconds else 0.0
            per = 1000 * d.cores("server") / rate if rate else float("nan")
            fronts = 1000 * d.cores("fronts") / rate if rate else float("nan")
            threads = " / ".join(
                f"{d.cores(k):.2f}"
                for k in ("server loop", "server wire", "engine max", "server other")
            )
            lines.append(
                f"| {mode} | {c} | {d.throughput:.1f} | {d.cores('server'):.2f} | {threads} | "
                f"{d.cores('fronts'):.2f} | {d.cores('front max'):.2f} | "
                f"{d.cores('load'):.2f} | {per:.2f} | {fronts:.2f} |"
            )
    return lines


def _queries(args: argparse.Namespace) -> str:
    """What the clients sent."""
    if getattr(args, "route", "text") == "image":
        return (
            "every query an upload to /search/image of a rendered scene, its bytes its own "
            "(no cache hits)"
        )
    return "every query a different caption (no cache hits)"


def _bound(args: argparse.Namespace, bound: dict[str, float]) -> list[str]:
    """The cross-encoder alone (none with --skip-bound)."""
    if not bound:
        return []
    lines = [
        "",
        "Cross-encoder alone, one request's "
        f"{args.candidates} pairs per call, in the same run (the compute bound):",
        "",
    ]
    lines += [f"- {name}: {rate:.0f} pairs/s" for name, rate in bound.items()]
    if args.device != "cpu":
        lines += [
            "",
            "On a GPU duet's default layout serves from its device step, not the host "
            "path: the step's own pairs/s are `benchmarks/ce_ceiling.py`'s table.",
        ]
    return lines


def _offered(args: argparse.Namespace, offered: dict[str, Cell]) -> list[str]:
    """The offered-load table (none without an --open-loop run)."""
    if not offered:
        return []
    lines = [
        "",
        f"Offered load (open loop, re-ranked, {args.seconds:g} s; latency from when each "
        "request was due). duet's own: the bounds of the buckets of its histograms that hold "
        "the quantile, the time inside its request handling (`duet_request_seconds`), and of "
        "it the p99 of the queue before the engine and of the device step as each request saw "
        "them (`duet_stage_seconds`), and of each device step (`duet_device_step_seconds`). "
        "Slowest 1 %: when those answers' requests were due, in how many of the run's 100 ms "
        "windows, and the busiest window's share (a stall puts them in a few windows, "
        "queueing spreads them):",
        "",
        "| server | offered req/s | answered req/s | p50 ms | p99 ms | duet's own p50 / p99 "
        "ms (at most) | its queue / device / step p99 ms (at most) | slowest 1 %: windows "
        "(busiest share) | 429 | errors | unanswered 2 s after |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    tail = ["", f"![each answer's latency by when it was due]({_open_png(args).name})"]
    for key, oc in offered.items():
        srv, rate = key.split("|")
        o = oc.own
        own = f"{o['p50']:g} / {o['p99']:g}" if o else "-"
        parts = f"{o['queue p99']:g} / {o['device p99']:g} / {o['step p99']:g}" if o else "-"
        n, held, windows, busiest = oc.tail()
        spread = f"{n} in {held} of {windows} ({busiest:.0%})" if n else "-"
        lines.append(
            f"| {srv} | {rate} | {oc.throughput:.1f} | {oc.q(50):.1f} | {oc.q(99):.1f} | "
            f"{own} | {parts} | {spread} | {oc.refused} | {oc.errors} | {oc.late} |"
        )
    return lines + tail


def _open_png(args: argparse.Namespace) -> Path:
    return args.out.with_name(f"{args.out.stem}_open.png")


def plot_offered(offered: dict[str, Cell], path: Path) -> None:
    """Each answer's latency against when its request was due, one panel per offered rate
    (duet's answers; the script's beside them when it answered any)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({k.split("|")[1] for k in offered}, key=float)
    fig, axes = plt.subplots(len(rates), 1, figsize=(10, 3.2 * len(rates)), squeeze=False)
    for ax, rate in zip(axes[:, 0], rates, strict=True):
        for srv, color in (("duet", "tab:blue"), ("baseline", "tab:orange")):
            c = offered.get(f"{srv}|{rate}")
            if c is not None and c.due and len(c.due) == len(c.latencies):
                ms = [x * 1000 for x in c.latencies]
                ax.scatter(c.due, ms, s=2, alpha=0.4, color=color, label=srv)
                ax.axhline(c.q(99), color=color, lw=0.8, ls="--", label=f"{srv} p99")
        ax.set_yscale("log")
        ax.set_title(f"{rate} req/s offered: each answer's latency by when it was due")
        ax.set_xlabel("seconds into the run")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, markerscale=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _write_json(
    path: Path, results: dict[str, Cell], bound: dict[str, float], over: dict[str, object] | None
) -> None:
    raw = {
        k: {
            "throughput": v.throughput,
            "p50_ms": v.q(50),
            "p99_ms": v.q(99),
            "degraded": v.degraded,
            "refused": v.refused,
            "errors": v.errors,
            "cpu_s": v.cpu,
        }
        for k, v in results.items()
    }
    path.write_text(json.dumps({"cells": raw, "bound": bound, "overload": over}, indent=1))
