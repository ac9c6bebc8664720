"""The cross-encoder's ceiling: pairs/s of the model's plain forward against duet's serving
paths, at several pairs per call and per precision, on one device.

Rows, each timed with the device synchronised, on the demo index's image states:

* plain forward: `JointModel.itm_logits` on a copy of the model cast to the precision, the
  sentence's text states computed once outside the timing (the compute bound a hand-written
  script reaches);
* host runtime: `BuiltinModel.score_pairs` (the CPU layout's path: tokenises, runs the text
  tower, copies the candidates' states in, buckets by text length);
* device step: `models.device_step.DeviceStep` (the GPU layout's whole step: ids in, text
  tower, search over the resident vectors, gather, cross-encoder, one copy out), at
  pairs / 50 queries of 50 candidates each;
* device step, graphs: the same, replayed from a CUDA graph of its shape as the service runs
  it on CUDA (`DUET_CUDA_GRAPHS=1`, `models.step_graphs`; "-" off CUDA);
* step cross-encoder: the step's `MaskedCrossEncoder` alone on the same pairs (like for like
  with the plain forward);
* image step, and image step, graphs: the step for image queries (`launch_images`: image
  tower, search over the captions, their ids gathered, text tower, cross-encoder) at
  pairs / 50 queries against 50 candidate captions each, eager and replayed from its graph.

    python benchmarks/ce_ceiling.py --device cuda --out gpu-out/ceiling.md
    python benchmarks/ce_ceiling.py --device cpu --pairs 50,400 --seconds 1   # a quick look
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

QUERY = "a small red circle left of a large blue square"


def _rate(fn: Callable[[], object], pairs: int, seconds: float, sync: Callable[[], None]) -> float:
    """Pairs/s of `fn` (one call scores `pairs`), after one untimed call."""
    fn()
    sync()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or n < 2:
        fn()
        n += 1
    sync()
    return n * pairs / (time.perf_counter() - t0)


def measure(
    index_dir: Path, device: str, precisions: list[str], sizes: list[int], seconds: float
) -> list[dict[str, object]]:
    from store import ann
    from store.indexio import IndexVersion, resolve_current

    index = IndexVersion.open(resolve_current(index_dir))
    vectors = ann.flat_vectors(index.image_index)
    if vectors is None:
        raise SystemExit("the index is not Flat: build the demo index (make demo-index)")
    captions = ann.flat_vectors(index.text_index)  # the image step's columns need them Flat
    texts = list(index.store.all_texts())
    rows: list[dict[str, object]] = []
    for prec in precisions:
        bench = _Bench(vectors, np.asarray(index.image_tokens), device, prec)
        if captions is not None:
            bench.with_captions(captions, texts)
        for size in sizes:
            row = bench.row(size, seconds)
            print(json.dumps(row), flush=True)
            rows.append(row)
    index.close()
    return rows


class _Bench:
    """One precision's four paths over one index's tables."""

    def __init__(self, vectors: np.ndarray, tokens: np.ndarray, device: str, prec: str) -> None:
        import torch

        from models.builtin import BuiltinModel
        from models.device_step import DeviceStep
        from models.masked_cross import DTYPES

        self.torch = torch
        self.model = BuiltinModel.load(device=device, precision=prec)  # type: ignore[arg-type]
        self.dev = self.model.device
        self.dtype = DTYPES[prec]
        self.prec = prec
        self.tokens = tokens
        self.plain = copy.deepcopy(self.model.model).to(self.dtype)
        self.step = DeviceStep(self.model.model, self.dev, prec)  # type: ignore[arg-type]
        self.tables = self.step.tables(vectors, tokens)
        self.graphed = DeviceStep(self.model.model, self.dev, prec, graphs=True)  # type: ignore[arg-type]
        # graphs run on CUDA only: elsewhere no second copy of the tables
        self.graphed_tables = self.graphed.tables(vectors, tokens) if self.graphed.graphs else None
        ids, self.pad = self.model.tokenizer.batch([QUERY])
        self.ids, self.pad = ids.to(self.dev), self.pad.to(self.dev)
        self.q_ids = self.model.tokenizer.ids(QUERY)
        with torch.inference_mode():
            self.text = self.model.model.text_tokens(self.ids, self.pad)

    def with_captions(self, vectors: np.ndarray, texts: list[str]) -> None:
        """The captions resident beside both steps' tables, as the service keeps them for
        image queries (ids zero-padded to the longest caption)."""
        from models.step_tables import CaptionTables, id_table

        ids = id_table([self.model.tokenizer.ids(t) for t in texts])
        for tables in (self.tables, self.graphed_tables):
            if tables is not None:
                tables.captions = CaptionTables(vectors, ids, self.dev)

    def _measured(self, column: str, graphed: bool, queries: int) -> bool:
        """Whether `column` has a rate at `queries` queries: the graphs' columns on CUDA only
        (an image query's graph when its capture, after the text shape's, was reached), the
        image step's with the captions resident."""
        from models.step_graphs import image_key

        if column.startswith("image step") and self.tables.captions is None:
            return False
        if column == "image step, graphs":
            held = self.graphed_tables.graphs if self.graphed_tables is not None else None
            key = image_key(self.step, self.tables, queries, 50, True)
            return held is not None and held.get(key) is not None
        return graphed or not column.endswith(", graphs")

    def sync(self) -> None:
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize(self.dev)

    def row(self, size: int, seconds: float) -> dict[str, object]:
        torch, step, text, pad = self.torch, self.step, self.text, self.pad
        pick = np.sort(np.arange(size) % self.tokens.shape[0])
        toks = np.asarray(self.tokens[pick], dtype=np.float32)
        img = torch.from_numpy(toks).to(self.dev).to(self.dtype)
        queries = max(1, size // 50)
        big_text, big_pad = text.to(self.dtype).expand(size, -1, -1), pad.expand(size, -1)
        # the step's text bucket: [ITM] + text + image a multiple of 8 positions
        grow = step.padded(1, text.shape[1], 50)[1] - text.shape[1]
        bucket_text = torch.nn.functional.pad(text, (0, 0, 0, grow))
        keep = torch.nn.functional.pad(~pad, (0, grow), value=False)
        owner = torch.zeros(size, dtype=torch.long, device=self.dev)

        def forward() -> object:
            with torch.inference_mode():
                return self.plain.itm_logits(big_text, big_pad, img)

        def runtime() -> object:
            return self.model.score_pairs([QUERY] * size, toks)

        def whole_step() -> object:
            return step(self.tables, [self.q_ids] * queries, 50, True)

        from models.step_graphs import capture_shapes, varied_pixels

        graphed = None
        if self.graphed.graphs and self.graphed_tables is not None:
            # the text shape and, the captions resident, the image queries' at its size
            shape = (*self.graphed.padded(queries, len(self.q_ids), 50), True)
            if capture_shapes(self.graphed, self.graphed_tables, [shape], 60.0):
                graphed = self.graphed
        pixels = varied_pixels(queries, self.model.model.cfg.image_size)

        def image_step() -> object:
            return step.collect(step.launch_images(self.tables, pixels, 50, True), queries)

        def graphed_images() -> object:
            assert graphed is not None and self.graphed_tables is not None
            launched = graphed.launch_images(self.graphed_tables, pixels, 50, True)
            return graphed.collect(launched, queries)

        def graphed_step() -> object:
            assert graphed is not None and self.graphed_tables is not None
            return graphed(self.graphed_tables, [self.q_ids] * queries, 50, True)

        def step_ce() -> object:
            with torch.inference_mode(), step._kernels():
                return step.cross.logits(bucket_text, keep, owner, img)

        row: dict[str, object] = {"precision": self.prec, "pairs": size}
        for name, fn, n in (
            ("plain forward", forward, size),
            ("host runtime", runtime, size),
            ("device step", whole_step, queries * 50),
            ("device step, graphs", graphed_step, queries * 50),
            ("step cross-encoder", step_ce, size),
            ("image step", image_step, queries * 50),
            ("image step, graphs", graphed_images, queries * 50),
        ):
            if not self._measured(name, graphed is not None, queries):
                row[name] = "-"
                continue
            try:
                row[name] = round(_rate(fn, n, seconds, self.sync))
            except RuntimeError as exc:  # out of memory at the largest sizes
                row[name] = f"failed: {str(exc).splitlines()[0][:60]}"
                if self.dev.type == "cuda":
                    torch.cuda.empty_cache()
        return row


def report(rows: list[dict[str, object]], device: str, gpu: str) -> str:
    cols = [
        "plain forward",
        "host runtime",
        "device step",
        "device step, graphs",
        "step cross-encoder",
        "image step",
        "image step, graphs",
    ]
    out = [
        f"Cross-encoder pairs/s on {gpu or device} (`benchmarks/ce_ceiling.py`); "
        "device step = the whole GPU-layout step (text tower, search, gather, cross-encoder, "
        "copy out) at pairs / 50 queries of 50 candidates; image step = the same for image "
        "queries (image tower, search over the captions, text tower, cross-encoder).",
        "",
        "| precision | pairs per call | " + " | ".join(cols) + " | step CE / plain |",
        "|---|---|" + "---|" * (len(cols) + 1),
    ]
    for r in rows:
        a, b = r.get("step cross-encoder"), r.get("plain forward")
        ratio = f"{a / b:.2f}x" if isinstance(a, int) and isinstance(b, int) and b else "-"
        vals = " | ".join(f"{r[c]:,}" if isinstance(r[c], int) else str(r[c]) for c in cols)
        out.append(f"| {r['precision']} | {r['pairs']} | {vals} | {ratio} |")
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--index-dir", type=Path, default=REPO / "indexes")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--precisions", default="", help="default: fp32,fp16,bf16 on cuda; fp32")
    p.add_argument("--pairs", default="50,400,3200,12800", help="pairs per call")
    p.add_argument("--seconds", type=float, default=1.5, help="per cell")
    p.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    args = p.parse_args()
    precisions = (args.precisions or ("fp32,fp16,bf16" if args.device == "cuda" else "fp32")).split(
        ","
    )
    sizes = [int(s) for s in args.pairs.split(",")]
    rows = measure(args.index_dir, args.device, precisions, sizes, args.seconds)
    gpu = ""
    if args.device.startswith("cuda"):
        import torch

        gpu = torch.cuda.get_device_name(0)
    text = report(rows, args.device, gpu)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
