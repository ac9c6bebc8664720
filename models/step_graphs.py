"""CUDA graphs for the device step's text batches (`models.device_step`).

On an H100 the shipped model's device step is bound by launching kernels, not by running
them: a lone re-ranked query spent 4.2 ms in the step, a lone dot-only one 2.6 ms, for work
the card does in a fraction of that, and the thread feeding the device was busy 0.4-0.5 of
a core launching them. A CUDA graph records a shape's kernels once and replays them with
one launch. The step already runs at a few fixed shapes (`StepShapes`), so each shape it
builds at warm-up is captured too, once per index version: the graphs read that version's
resident tables at fixed addresses and are dropped with them.

Each graph has a static input (the batch's token ids, (queries, width) int64) and static
outputs (rows, dots, logits); a replay copies the ids in, replays, and clones the outputs,
all on the caller's stream under one lock, so two workers never interleave a graph's input
and outputs. The graphs of a version share one memory pool (their temporaries overlap,
which is safe because replays are serialised on one stream; each graph's outputs stay
alive, so no other graph writes over them).

Capture is checked: each graph is replayed once against the eager step's answer for the
same ids, and a graph that disagrees (or a capture that fails) turns graphs off for the
step, with a warning; the eager step then serves every shape, as it does without graphs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from models.device_step import DeviceStep, ResidentTables

log = logging.getLogger("duet.device_step")

Launched = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]
# (tok on the device, bucketed text length, candidates, re-ranked) -> the step's outputs
RunFn = Callable[[torch.Tensor, int, int, bool], Launched]
Key = tuple[int, int, int, bool]  # (queries, text length, candidates, re-ranked), padded


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    tok: torch.Tensor  # the static input: (queries, width) int64 on the device
    outputs: Launched  # the static outputs, alive as long as the graph


Answer = tuple[np.ndarray, np.ndarray, "np.ndarray | None"]  # rows, dots, logits on the host


def agree(a: Answer, b: Answer, tol: float = 1e-2) -> bool:
    """Whether two answers to the same batch (rows, dots, logits or None, on the host) are the
    same: rows equal for at least 99 % of the candidates (ties may swap), dots and logits equal
    to `tol` (a replay runs the eager step's kernels, so it differs by rounding at most; a
    graph reading a wrong input or table is off by whole units)."""
    rows_a, rows_b = a[0], b[0]
    if rows_a.shape != rows_b.shape or (rows_a == rows_b).mean() < 0.99:
        return False
    for x, y in zip(a[1:], b[1:], strict=True):
        if x is None or y is None:
            if x is not y:
                return False
        elif x.shape != y.shape or not np.allclose(x, y, rtol=tol, atol=tol):
            return False
    return True


class StepGraphs:
    """One index version's CUDA graphs, one per padded text shape, and the lock their
    replays share."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)  # capture (and its warm run) happen here
        self.lock = threading.Lock()
        self._graphs: dict[Key, _Graph] = {}
        self.broken = False  # a capture failed or disagreed: no graph serves any more

    def __len__(self) -> int:
        return len(self._graphs)

    def get(self, key: Key) -> _Graph | None:
        return None if self.broken else self._graphs.get(key)

    def replay(self, graph: _Graph, host: torch.Tensor) -> Launched:
        """The graph's answer for `host` ids ((queries, width) int64, pinned): device tensors
        of its own (clones of the static outputs), queued on the caller's stream."""
        with self.lock:
            graph.tok.copy_(host, non_blocking=True)
            graph.graph.replay()
            rows, dots, logits = graph.outputs
            return rows.clone(), dots.clone(), None if logits is None else logits.clone()

    def capture(self, key: Key, host: torch.Tensor, run: RunFn) -> _Graph:
        """Record `run` at `key` (its ids `host`, (queries, width) int64) as a graph: one warm
        run on the capture stream first (per-stream handles and workspaces are made outside
        the capture), then the capture, in thread-local mode so the workers serving meanwhile
        on other streams are not stopped."""
        _, length, m, rerank = key
        with self.lock:
            tok = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            caller = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(caller)
            with torch.cuda.stream(self.stream):
                tok.copy_(host, non_blocking=True)
                run(tok, length, m, rerank)
                self.stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    outputs = run(tok, length, m, rerank)
                finally:
                    graph.capture_end()
            caller.wait_stream(self.stream)
            captured = _Graph(graph, tok, outputs)
            self._graphs[key] = captured
            return captured

    def drop(self) -> None:
        """Forget every graph (their pool is freed once none is left)."""
        self._graphs = {}


def varied_ids(queries: int, width: int, vocab: int) -> list[list[int]]:
    """Token id rows unlike each other (and of every length up to `width`), so a graph's
    check compares answers that differ by row."""
    return [
        [2] + [3 + (i * 7 + j * 3) % (vocab - 3) for j in range(max(0, width - 1 - i % 3))]
        for i in range(queries)
    ]


@torch.inference_mode()
def capture_shapes(
    step: DeviceStep,
    tables: ResidentTables,
    shapes: Sequence[tuple[int, int, int, bool]],
    seconds: float,
) -> int:
    """Capture a graph for each text shape in `shapes` (smallest work first, within
    `seconds`), each checked against the eager step; returns how many `tables` holds. A
    failed or disagreeing capture turns its graphs off (`broken`) and returns 0."""
    graphs = tables.graphs
    if graphs is None or graphs.broken:
        return 0
    t0 = time.monotonic()
    vocab = int(step.model.cfg.vocab_size)
    for b, length, m, rerank in sorted(shapes, key=lambda s: (s[3], s[0] * s[2] * s[1])):
        if time.monotonic() - t0 > seconds:
            log.warning("graph capture stopped at %d of %d shapes", len(graphs), len(shapes))
            break
        key = (b, length, min(m, tables.rows), rerank)
        if graphs.get(key) is not None:
            continue
        host = step.pack(varied_ids(b, min(length, step.max_len), vocab), length, b)

        def run(tok: torch.Tensor, n: int, k: int, r: bool) -> Launched:
            return step.run(tables, tok, n, k, r)

        try:
            eager = step.collect(run(host.to(step.device), length, key[2], rerank), b)
            graph = graphs.capture(key, host, run)
            replayed = step.collect(graphs.replay(graph, host), b)
            same = agree(
                (eager.rows, eager.dots, eager.logits),
                (replayed.rows, replayed.dots, replayed.logits),
            )
        except Exception as exc:
            log.warning("CUDA graphs off: capturing shape %s failed: %s", key, exc)
            same = False
        else:
            if not same:
                log.warning("CUDA graphs off: shape %s replayed unlike the eager step", key)
        if not same:
            graphs.broken = True
            graphs.drop()
            return 0
    return len(graphs)
