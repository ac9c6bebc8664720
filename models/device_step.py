"""A batch of queries as one device step: token ids (or pixels) in, candidates and scores out.

The GPU layout's hot path (`DUET_LAYOUT=gpu`, the default on a CUDA host). Everything a
re-ranked text search computes runs on the model's device between one host-to-device copy
(the batch's token ids) and one device-to-host copy (each query's candidate rows, dot
products and cross-encoder logits), with no synchronisation in between:

* the text tower runs once per query: its states feed both the search vector and the
  cross-encoder (the host path tokenises and encodes the query twice);
* search is one matmul + top-k over the index's vectors, resident on the device;
* the candidates' image states are gathered from a token table resident on the device
  (`ResidentTables`, made when a version is loaded or swapped in, released with it);
* the cross-encoder runs at a few fixed shapes (`StepShapes`: queries, text length and
  candidates padded up to buckets, the padding masked), each built once at warm-up and, on
  CUDA, captured as a graph (`models.step_graphs`); text lengths make a pair's sequence a
  multiple of 8 positions, which masked attention kernels need for their fast path;
* its weights are cast once, at load, to the serving precision, and the attention backend
  is pinned (`sdpa_backends`).

Fusion and top-k run on the host from the copied-out (queries x candidates) arrays
(`models.fusion.fused_top_k`, as every other path). Image queries take the same step the
other way round (`launch_images`): the image tower, search over the captions' vectors, the
candidate captions' ids gathered from a resident table, the text tower and the
cross-encoder. The host path serves re-rankers other than the cross-encoder.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F

from models.inference import Precision
from models.joint import JointModel
from models.masked_cross import DTYPES, MaskedCrossEncoder, pin_attention, sdpa_backends
from models.step_graphs import StepGraphs, batch_key, by_work, image_key, shape_key
from models.step_tables import ResidentTables

log = logging.getLogger("duet.device_step")


def _bucket(sizes: Sequence[int], n: int) -> int:
    """The smallest size >= n, or n itself past the largest (correct, just not pre-built)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else n


@dataclass(frozen=True)
class StepShapes:
    """The padded shapes a step runs at: queries per batch, text length, candidates."""

    queries: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    texts: tuple[int, ...] = (8, 16, 24, 32)
    candidates: tuple[int, ...] = (10, 20, 50, 100, 200, 500, 1000)

    def aligned_texts(self, image_tokens: int, max_len: int) -> tuple[int, ...]:
        """Text lengths (at least each of `texts`, all of them covering `max_len`) for which
        [ITM] + text + image states is a multiple of 8 positions long."""
        out = {n + (-(1 + n + image_tokens)) % 8 for n in (*self.texts, max_len) if n <= max_len}
        return tuple(sorted(out))


@dataclass
class StepOutput:
    """One batch's result on the host: per query, its candidates best-first by dot product."""

    rows: np.ndarray  # (B, m) int64 index rows, -1 past the index's end
    dots: np.ndarray  # (B, m) float32 dot products
    logits: np.ndarray | None  # (B, m) float32 cross-encoder logits; None without re-ranking


class DeviceStep:
    """Text queries -> (candidate rows, dots, cross-encoder logits) in one device step.

    Thread-safe: it holds no per-call state. `launch` queues the work and returns device
    tensors without waiting; `collect` is the one copy back (and the one wait).
    """

    def __init__(
        self,
        model: JointModel,
        device: torch.device,
        precision: Precision,
        shapes: StepShapes | None = None,
        rerank: bool = True,
        graphs: bool = False,
    ) -> None:
        self.model = model  # its towers run in fp32, as the index's vectors were made
        self.reranks = rerank  # whether the model's cross-encoder is the service's `ce`
        self.device = device
        self.precision = precision
        self.dtype = DTYPES[precision]
        self.shapes = shapes or StepShapes()
        cfg = model.cfg
        self.max_len = cfg.max_text_len
        self.image_tokens = cfg.grid * cfg.grid
        self.text_buckets = self.shapes.aligned_texts(self.image_tokens, self.max_len)
        self.cross = MaskedCrossEncoder(model, self.dtype)
        self.backends = sdpa_backends(device)
        pin_attention(device)  # what `_kernels` restores on leaving, whichever worker leaves
        # batches replayed as CUDA graphs (`models.step_graphs`); on CUDA only
        self.graphs = graphs and device.type == "cuda"
        self.image_graphs = self.graphs  # off alone when an image query's capture fails

    # -- tables ---------------------------------------------------------------------
    def free_bytes(self) -> int | None:
        """Free memory on the device (None on the CPU, where the tables share host RAM)."""
        if self.device.type == "cuda":
            return int(torch.cuda.mem_get_info(self.device)[0])
        return None

    def tables(self, vectors: np.ndarray, tokens: np.ndarray) -> ResidentTables:
        made = ResidentTables(vectors, tokens, self.device, self.dtype)
        made.graphs = StepGraphs(self.device) if self.graphs else None
        return made

    # -- shapes -----------------------------------------------------------------------
    def padded(self, queries: int, longest: int, candidates: int) -> tuple[int, int, int]:
        """(queries, text length, candidates) a batch runs at."""
        return (
            _bucket(self.shapes.queries, queries),
            _bucket(self.text_buckets, longest),
            _bucket(self.shapes.candidates, candidates),
        )

    def pack(self, ids: Sequence[Sequence[int]], longest: int, queries: int) -> torch.Tensor:
        """Token id rows -> (queries, width) int64 on the host (pinned on a CUDA host),
        zero-padded; a padding row holds one [UNK] so no row is all padding."""
        width = min(longest, self.max_len)
        out = np.zeros((queries, width), dtype=np.int64)  # numpy: ~15x torch's per-row cost
        for i, row in enumerate(ids):
            out[i, : min(len(row), width)] = row[:width]
        out[len(ids) :, 0] = 1
        host = torch.from_numpy(out)
        return host.pin_memory() if self.device.type == "cuda" else host

    # -- the step ---------------------------------------------------------------------
    @torch.inference_mode()
    def launch(
        self,
        tables: ResidentTables,
        ids: Sequence[Sequence[int]],
        candidates: int,
        rerank: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Queue one batch: (rows, dots, logits or None), each (B, m) on the device, for the
        padded batch (the first len(ids) rows are the queries')."""
        b, length, m, _ = key = batch_key(self, tables, ids, candidates, rerank)
        host = self.pack(ids, length, b)
        graphs = tables.graphs
        if graphs is not None and (graph := graphs.get(key)):
            return graphs.replay(graph, host)
        tok = host.to(self.device, non_blocking=True)
        return self.run(tables, tok, length, m, rerank)

    def run(
        self, tables: ResidentTables, tok: torch.Tensor, length: int, m: int, rerank: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The device part of `launch`: `tok` (B, width) ids already on the device."""
        net = self.model
        b = tok.shape[0]
        pad = tok == 0
        states = net.text_tokens(tok, pad)  # (B, width, d) fp32
        vec = F.normalize(net.embed_texts(states, pad), dim=-1)
        top = (vec @ tables.vectors.T).topk(m, dim=1)
        dots, rows = top.values, top.indices
        if not rerank or m == 0:
            return rows, dots, None
        keep = ~pad
        if states.shape[1] < length:  # the text bucket is wider than the tower's positions
            grow = length - states.shape[1]
            states = F.pad(states, (0, 0, 0, grow))
            keep = F.pad(keep, (0, grow), value=False)
        owner = torch.arange(b, device=tok.device)[:, None].expand(b, m).reshape(-1)
        img = tables.tokens[rows.reshape(-1)]
        with self._kernels():
            logits = self.cross.logits(states, keep, owner, img)
        return rows, dots, logits.view(b, m)

    @torch.inference_mode()
    def launch_images(
        self,
        tables: ResidentTables,
        pixels: torch.Tensor,
        candidates: int,
        rerank: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Queue a batch of image queries (`pixels`: (n, 3, S, S) uint8 on the host) against
        the captions: (caption rows, dots, logits or None), each (B, m) on the device, for
        the padded batch."""
        assert tables.captions is not None, "the version's captions are not resident"
        b, _, m, _ = key = image_key(self, tables, pixels.shape[0], candidates, rerank)
        host = torch.zeros((b, *pixels.shape[1:]), dtype=torch.uint8)
        host[: pixels.shape[0]] = pixels
        if self.device.type == "cuda":
            host = host.pin_memory()
        graphs = tables.graphs
        if graphs is not None and (graph := graphs.get(key)):
            return graphs.replay(graph, host)
        return self.run_images(tables, host.to(self.device, non_blocking=True), m, rerank)

    def run_images(
        self, tables: ResidentTables, pixels: torch.Tensor, m: int, rerank: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The device part of `launch_images` (`pixels` already on the device): the image
        tower once per query; its states (rounded to float16, as the host path's are) read
        with each candidate caption, whose ids are gathered from the caption table and run
        through the text tower at the table's fixed width."""
        caps = tables.captions
        assert caps is not None, "the version's captions are not resident"
        b = pixels.shape[0]
        x = pixels.float() / 255.0
        net = self.model
        toks = net.image_tokens(x)
        vec = F.normalize(net.embed_images(toks).float(), dim=-1)
        top = (vec @ caps.vectors.T).topk(m, dim=1)
        dots, rows = top.values, top.indices
        if not rerank or m == 0:
            return rows, dots, None
        ids = caps.ids[rows.reshape(-1)].long()  # (P, width)
        pad = ids == 0
        states = net.text_tokens(ids, pad)
        keep = ~pad
        length = _bucket(self.text_buckets, caps.width)
        if states.shape[1] < length:
            grow = length - states.shape[1]
            states = F.pad(states, (0, 0, 0, grow))
            keep = F.pad(keep, (0, grow), value=False)
        pairs = ids.shape[0]
        query = torch.arange(b, device=x.device)[:, None].expand(b, m).reshape(-1)
        img = toks.half()[query]  # the query's states, as stored states are: float16
        owner = torch.arange(pairs, device=x.device)
        with self._kernels():
            logits = self.cross.logits(states, keep, owner, img)
        return rows, dots, logits.view(b, m)

    def collect(
        self,
        launched: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
        queries: int,
    ) -> StepOutput:
        """The one copy back (and the one wait) of a launched batch, its padding dropped."""
        rows, dots, logits = launched
        parts = [rows.double(), dots.double()] + ([] if logits is None else [logits.double()])
        host = torch.stack(parts)[:, :queries].cpu().numpy()
        return StepOutput(
            host[0].astype(np.int64),
            host[1].astype(np.float32),
            None if logits is None else host[2].astype(np.float32),
        )

    def __call__(
        self, tables: ResidentTables, ids: Sequence[Sequence[int]], candidates: int, rerank: bool
    ) -> StepOutput:
        return self.collect(self.launch(tables, ids, candidates, rerank), len(ids))

    @contextmanager
    def _kernels(self) -> Iterator[None]:
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(self.backends):  # type: ignore[arg-type]
            yield

    # -- warm-up ----------------------------------------------------------------------
    def shapes_within(
        self, pair_budget: int, max_queries: int, max_top_k: int = 100
    ) -> list[tuple[int, int, int, bool]]:
        """Every (queries, text length, candidates, re-ranked) a batch can run at when cut at
        `pair_budget` pairs and `max_queries` queries: re-ranked batches within the budget (a
        lone query may exceed it), dot-only ones up to `max_top_k` candidates."""
        out = []
        for b in self.shapes.queries:
            if b > _bucket(self.shapes.queries, max_queries):
                break
            for m in self.shapes.candidates:
                runs = [
                    rerank
                    for rerank, fits in (
                        (True, self.reranks and (b == 1 or b * m <= pair_budget)),
                        (False, m <= _bucket(self.shapes.candidates, max_top_k)),
                    )
                    if fits
                ]
                out += [(b, n, m, rerank) for rerank in runs for n in self.text_buckets]
        return out

    def warm_up(
        self, tables: ResidentTables, shapes: Sequence[tuple[int, int, int, bool]], seconds: float
    ) -> int:
        """Run each shape once (smallest work first) within `seconds`; returns how many were
        built. A shape not built still runs, only its first time slower. A shape captured as
        a graph in `tables` was built by the capture's check (the eager step): not run again."""
        import time

        t0 = time.monotonic()
        done = 0
        graphs = tables.graphs
        for b, length, m, rerank in sorted(shapes, key=by_work):
            if graphs is not None and graphs.get(shape_key(tables, (b, length, m, rerank))):
                done += 1
                continue
            if time.monotonic() - t0 > seconds:
                log.warning(
                    "warm-up stopped after %d of %d shapes (%.0fs budget)",
                    done,
                    len(shapes),
                    seconds,
                )
                break
            ids = [[2] + [3] * (min(length, self.max_len) - 1)] * b
            self.collect(self.launch(tables, ids, min(m, tables.rows), rerank), b)
            done += 1
        if tables.captions is not None:  # image queries: no text length to vary
            size = self.model.cfg.image_size
            for b, m, rerank in sorted({(b, m, r) for b, _, m, r in shapes}):
                if time.monotonic() - t0 > seconds:
                    break
                if graphs is not None and graphs.get(image_key(self, tables, b, m, rerank)):
                    continue
                pixels = torch.zeros((b, 3, size, size), dtype=torch.uint8)
                self.collect(self.launch_images(tables, pixels, m, rerank), b)
        return done


def text_ids_of(model: object) -> Callable[[str], list[int]] | None:
    """The builtin model's tokenizer as the step reads texts (token ids), from the service's
    models (`models.loading.Models`: its joint model's) or a `BuiltinModel`; None for any
    other model."""
    joint = getattr(model, "joint", model)
    ids = getattr(joint, "text_ids", None)
    return ids if callable(ids) else None


def step_for(
    models: object, shapes: StepShapes | None = None, graphs: bool = False
) -> DeviceStep | None:
    """The GPU layout's step over the service's models when the builtin model is their
    encoder (re-ranking too when it is also the cross-encoder); None otherwise."""
    joint: Any = getattr(models, "joint", None)
    if joint is None or getattr(models, "encoder", None) is not joint:
        return None
    built = cast(Any, joint)
    rerank = getattr(models, "cross", None) is built
    return DeviceStep(built.model, built.device, built.cross.precision, shapes, rerank, graphs)
