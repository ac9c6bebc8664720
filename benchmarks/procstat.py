"""Where a served process's CPU went, from /proc: the server's own seconds, its children's
(duet's fronts) and its threads' by the names the OS shows (duet names its engine and
decode threads, `app.threadname`), for `serve_load`'s cores table."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.cell import Cell


@dataclass
class CpuSnapshot:
    """CPU seconds (user + system) so far: of the server process, of each of its children
    now alive (duet's fronts) and of each of the server's threads (by thread id, with the
    name the OS shows: duet names its engine and decode threads, `app.threadname`)."""

    own: float = 0.0
    kids: dict[int, float] = field(default_factory=dict)
    threads: dict[int, tuple[str, float]] = field(default_factory=dict)


def _spent(stat: Path, tick: float) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) from a /proc stat file; None when it is gone."""
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / tick


def cpu_seconds(pid: int) -> CpuSnapshot:
    """The server's CPU so far, from /proc (nothing where there is no /proc)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    snap = CpuSnapshot()
    for entry in Path("/proc").glob("[0-9]*"):
        got = _spent(entry / "stat", tick)
        if got is None:
            continue
        if entry.name == str(pid):
            snap.own = got[1]
        elif got[0] == pid:
            snap.kids[int(entry.name)] = got[1]
    for task in Path(f"/proc/{pid}/task").glob("[0-9]*"):
        got = _spent(task / "stat", tick)
        with contextlib.suppress(OSError):
            name = (task / "comm").read_text().strip()
            if got is not None:
                snap.threads[int(task.name)] = (name, got[1])
    return snap


def add_server_cpu(cell: Cell, before: CpuSnapshot, after: CpuSnapshot, pid: int) -> None:
    """The server's CPU in a cell: its own ("server"), its fronts' together ("fronts"), the
    busiest front's ("front max": one near a core caps the service while the others idle,
    as when one listening socket handed most connections to one front), and the server's
    threads: its event loop ("server loop", the thread whose id is the pid), the threads
    that serve the fronts' socket ("server wire", `app.owner`), its busiest engine thread
    ("engine max": the worker that feeds the model, or one of the CPU threads torch starts
    for it, which inherit its name; on a GPU these have little to do) and all the others
    ("server other": CUDA's own threads, the decoders, the loader). One thread near a core
    is the ceiling however many cores the process uses in all."""
    cell.add_cpu("server", after.own - before.own)
    spent = [t - before.kids.get(k, 0.0) for k, t in after.kids.items()]
    cell.add_cpu("fronts", sum(spent))
    cell.add_cpu("front max", max(spent, default=0.0))
    engine = [0.0]
    for tid, (name, t) in after.threads.items():
        d = t - before.threads.get(tid, (name, 0.0))[1]
        if tid == pid:
            cell.add_cpu("server loop", d)
        elif name.startswith("duet-engine"):
            engine.append(d)
        elif name.startswith("duet-wire"):
            cell.add_cpu("server wire", d)
        else:
            cell.add_cpu("server other", d)
    cell.add_cpu("engine max", max(engine))
