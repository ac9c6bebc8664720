"""CUDA graphs for the device step's batches, text and image queries (`models.device_step`).

On an H100 the shipped model's device step is bound by launching kernels, not by running
them: a lone re-ranked query spent 4.2 ms in the step, a lone dot-only one 2.6 ms, for work
the card does in a fraction of that, and the thread feeding the device was busy 0.4-0.5 of
a core launching them. A CUDA graph records a shape's kernels once and replays them with
one launch. The step already runs at a few fixed shapes (`StepShapes`), so each shape it
builds at warm-up is captured too, once per index version: the graphs read that version's
resident tables at fixed addresses and are dropped with them. Image queries have no text
length: their graphs are kept at the text shapes' queries, candidates and modes (`IMAGE` in
the key's length), when the version's captions are resident.

Each graph has a static input (the batch's token ids, (queries, width) int64, or its
pixels, (queries, 3, S, S) uint8) and static outputs (rows, dots, logits); a replay copies
the input in, replays, and clones the outputs,
all on the caller's stream under one lock, so two workers never interleave a graph's input
and outputs. The graphs of a version share one memory pool (their temporaries overlap,
which is safe because replays are serialised on one stream; each graph's outputs stay
alive, so no other graph writes over them).

Capture is checked: each graph is replayed once against the eager step's answer for the
same input, and a graph that disagrees (or a capture that fails) turns graphs off for the
step, for this version and every later one, with a warning; the eager step then serves
every shape, as it does without graphs. At start-up, before any request, each shape's warm
run is made under `torch.cuda.set_sync_debug_mode("error")`, so a synchronisation that
would break a capture fails before it begins. A capture that fails once begun leaves
torch's allocator routing to its pool (its failed `capture_end` never ends that), so the
graph is kept alive and the log says to restart with DUET_CUDA_GRAPHS=0. Swapped-in versions
are captured while the workers serve the old one (on the default stream; the capture's
stream is a non-blocking one, in thread-local mode), only once the start-up's captures
succeeded. Graphs are replayed on the device's default stream, where the workers run.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from models.device_step import DeviceStep
    from models.step_tables import ResidentTables

log = logging.getLogger("duet.device_step")

Launched = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]
# (tok on the device, bucketed text length, candidates, re-ranked) -> the step's outputs
RunFn = Callable[[torch.Tensor, int, int, bool], Launched]
Key = tuple[int, int, int, bool]  # (queries, text length, candidates, re-ranked), padded


def by_work(shape: Key) -> tuple[bool, int]:
    """Sort key of shapes, smallest work first: dot-only ones, then by queries x candidates x
    text length (the order warm-up builds them and capture records them)."""
    b, length, m, rerank = shape
    return rerank, b * m * max(length, 1)  # an image query's (IMAGE: 0) by its pairs


def shape_key(tables: ResidentTables, shape: Key) -> Key:
    """The key a padded text shape's graph is kept under over `tables`: candidates no more
    than the version's rows."""
    b, length, m, rerank = shape
    return b, length, min(m, tables.rows), rerank


def batch_key(
    step: DeviceStep,
    tables: ResidentTables,
    ids: Sequence[Sequence[int]],
    candidates: int,
    rerank: bool,
) -> Key:
    """The padded shape a batch of `ids` runs at over `tables`: the key its graph is kept
    under."""
    b, length, m = step.padded(len(ids), max(len(r) for r in ids), candidates)
    return shape_key(tables, (b, length, m, rerank))


IMAGE = 0  # the text length in an image query's key (a text bucket is never 0)


def image_key(
    step: DeviceStep, tables: ResidentTables, queries: int, candidates: int, rerank: bool
) -> Key:
    """The padded shape a batch of `queries` image queries runs at over `tables`' captions."""
    assert tables.captions is not None
    b, _, m = step.padded(queries, 1, candidates)
    return b, IMAGE, min(m, tables.captions.rows), rerank


def graph_counts(graphs: StepGraphs | None) -> dict[str, int]:
    """How many graphs `graphs` holds for text queries and for image queries."""
    keys = graphs.shapes() if graphs is not None else []
    images = sum(1 for key in keys if key[1] == IMAGE)
    return {"text": len(keys) - images, "image": images}


class CaptureBroke(RuntimeError):
    """A capture failed after it began: torch's allocator may be left routing to its pool."""


_BROKEN: list[torch.cuda.CUDAGraph] = []  # graphs whose capture failed, kept alive


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    tok: torch.Tensor  # the static input on the device: token ids, or an image batch's pixels
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

    def shapes(self) -> list[Key]:
        """The keys of the graphs held."""
        return list(self._graphs)

    def get(self, key: Key) -> _Graph | None:
        return None if self.broken else self._graphs.get(key)

    def replay(self, graph: _Graph, host: torch.Tensor) -> Launched:
        """The graph's answer for `host` (its input's shape and type, pinned): device tensors
        of its own (clones of the static outputs), queued on the caller's stream."""
        if torch.cuda.current_stream(self.device) != torch.cuda.default_stream(self.device):
            raise RuntimeError("the step's CUDA graphs replay on the default stream only")
        with self.lock:
            graph.tok.copy_(host, non_blocking=True)
            graph.graph.replay()
            rows, dots, logits = graph.outputs
            return rows.clone(), dots.clone(), None if logits is None else logits.clone()

    def capture(self, key: Key, host: torch.Tensor, run: RunFn, check_syncs: bool) -> _Graph:
        """Record `run` at `key` (its input `host`: ids or pixels) as a graph: one warm
        run on the capture stream first (per-stream handles and workspaces are made outside
        the capture; under sync debug mode "error" when `check_syncs`, which is process-wide:
        only while nothing else runs), then the capture, in thread-local mode so the workers
        serving meanwhile on the default stream are not stopped. Raises `CaptureBroke` when
        the capture failed once begun."""
        _, length, m, rerank = key
        with self.lock:
            tok = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            caller = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(caller)
            with torch.cuda.stream(self.stream):
                tok.copy_(host, non_blocking=True)
                self.stream.synchronize()
                if check_syncs:
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    run(tok, length, m, rerank)
                finally:
                    if check_syncs:
                        torch.cuda.set_sync_debug_mode("default")
                self.stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    outputs = run(tok, length, m, rerank)
                    graph.capture_end()
                except Exception as exc:
                    _BROKEN.append(graph)  # the allocator may still point at it
                    with contextlib.suppress(Exception):  # the first error says why
                        graph.capture_end()
                    raise CaptureBroke(str(exc)) from exc
            caller.wait_stream(self.stream)
            captured = _Graph(graph, tok, outputs)
            self._graphs[key] = captured
            return captured

    def drop_images(self) -> None:
        """Forget the image queries' graphs (the text shapes' keep serving)."""
        self._graphs = {k: g for k, g in self._graphs.items() if k[1] != IMAGE}

    def drop(self) -> None:
        """Forget every graph, and hand their pool back to the device (torch frees a graph
        pool's blocks into its cache only; another version's capture may need them)."""
        self._graphs = {}
        torch.cuda.empty_cache()


def varied_ids(queries: int, width: int, vocab: int) -> list[list[int]]:
    """Token id rows unlike each other (and of every length up to `width`), so a graph's
    check compares answers that differ by row."""
    return [
        [2] + [3 + (i * 7 + j * 3) % (vocab - 3) for j in range(max(0, width - 1 - i % 3))]
        for i in range(queries)
    ]


def varied_pixels(queries: int, size: int) -> torch.Tensor:
    """Image queries unlike each other ((queries, 3, size, size) uint8, the same every call),
    for an image shape's check."""
    return torch.randint(
        0,
        256,
        (queries, 3, size, size),
        dtype=torch.uint8,
        generator=torch.Generator().manual_seed(7),
    )


def _inputs(
    step: DeviceStep, tables: ResidentTables, shapes: Sequence[Key], images: bool
) -> Iterator[tuple[Key, torch.Tensor, RunFn]]:
    """Each graph to capture for `shapes`, smallest work first: its key, varied inputs (on the
    host, as a batch brings them) and the device run it records. The text shapes, then, with
    `images`, the captions resident and image graphs not turned off (`step.image_graphs`),
    image queries at the same queries, candidates and modes."""
    vocab = int(step.model.cfg.vocab_size)

    def text(tok: torch.Tensor, n: int, k: int, r: bool) -> Launched:
        return step.run(tables, tok, n, k, r)

    def image(pixels: torch.Tensor, _: int, k: int, r: bool) -> Launched:
        return step.run_images(tables, pixels, k, r)

    for shape in sorted(shapes, key=by_work):
        b, length = shape[:2]
        host = step.pack(varied_ids(b, min(length, step.max_len), vocab), length, b)
        yield shape_key(tables, shape), host, text
    if tables.captions is None or not images or not step.image_graphs:
        return
    size = int(step.model.cfg.image_size)
    for key in sorted({image_key(step, tables, b, m, r) for b, _, m, r in shapes}, key=by_work):
        pixels = varied_pixels(key[0], size)
        yield key, pixels.pin_memory() if step.device.type == "cuda" else pixels, image


def _check(
    step: DeviceStep, graphs: StepGraphs, key: Key, host: torch.Tensor, run: RunFn, syncs: bool
) -> str:
    """Capture `key` and replay it against the eager step: "" when they agree, else why not.
    Raises `CaptureBroke` (a capture failed once begun)."""
    b, length, m, rerank = key
    try:
        eager = step.collect(run(host.to(step.device), length, m, rerank), b)
        graph = graphs.capture(key, host, run, syncs)
        replayed = step.collect(graphs.replay(graph, host), b)
    except CaptureBroke:
        raise
    except Exception as exc:
        return f"failed: {exc}"
    if not agree(
        (eager.rows, eager.dots, eager.logits), (replayed.rows, replayed.dots, replayed.logits)
    ):
        return "replayed unlike the eager step"
    return ""


@torch.inference_mode()
def capture_shapes(
    step: DeviceStep,
    tables: ResidentTables,
    shapes: Sequence[Key],
    seconds: float,
    check_syncs: bool = False,
    images: bool = True,
) -> int:
    """Capture a graph for each text shape in `shapes`, and with `images` and the captions
    resident for image queries at the same queries, candidates and modes (smallest work
    first, within `seconds`), each checked against the eager step; returns how many `tables`
    holds. A failed or disagreeing text capture turns graphs off for the step
    (`step.graphs`: no later version gets any) and for `tables`, and returns 0; an image
    capture's turns off image queries' graphs alone (`step.image_graphs`), unless it failed
    once begun. `check_syncs`: see `StepGraphs.capture` (start-up only)."""
    graphs = tables.graphs
    if graphs is None or graphs.broken or not step.graphs or not tables.rows:
        return 0
    t0 = time.monotonic()
    for key, host, run in _inputs(step, tables, shapes, images):
        if time.monotonic() - t0 > seconds:
            log.warning("graph capture stopped at %d graphs (%.0fs budget)", len(graphs), seconds)
            break
        if graphs.get(key) is not None:
            continue
        broke = False
        try:
            why = _check(step, graphs, key, host, run, check_syncs)
        except CaptureBroke as exc:
            log.error(
                "CUDA graphs off: capturing shape %s failed once begun (%s); torch's allocator "
                "may be left in capture mode: restart with DUET_CUDA_GRAPHS=0",
                key,
                exc,
            )
            why, broke = "failed", True
        if not why:
            continue
        if key[1] == IMAGE and not broke:
            log.warning("CUDA graphs off for image queries: shape %s %s", key, why)
            step.image_graphs = False
            graphs.drop_images()
            break
        log.warning("CUDA graphs off: shape %s %s; the eager step serves", key, why)
        step.graphs = False
        graphs.broken = True
        graphs.drop()
        break
    torch.cuda.empty_cache()  # the capture stream's warm runs' blocks, a broken pool
    return len(graphs)
