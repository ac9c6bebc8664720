"""The service's threads named where the OS shows them.

Python before 3.14 names a thread for Python only: `top -H`, `ps -L`, `/proc/<pid>/task/<tid>/comm`
and the benchmarks' per-thread CPU (`benchmarks/serve_load.py`) see every thread of the
process as "python". A thread that calls `name_os_thread` shows as its Python name there
(Linux keeps 15 bytes), so a core held by the engine's worker can be told from one held by
the event loop or by torch's own threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading

_PR_SET_NAME = 15  # linux/prctl.h


def name_os_thread(name: str | None = None) -> None:
    """Name the calling thread for the OS: `name`, or its Python name. A no-op where the OS
    offers no such call; never raises (a name is worth no failure)."""
    if not sys.platform.startswith("linux"):
        return
    text = (name or threading.current_thread().name).encode("utf-8", "replace")[:15]
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(_PR_SET_NAME, ctypes.c_char_p(text), 0, 0, 0)
