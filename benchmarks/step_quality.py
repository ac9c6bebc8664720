"""The GPU layout's quality: served text->image R@1 on the test split through the device step,
in each precision, against the host path in fp32 (the answers the CPU layout gives).

Every caption of the test world (seed 1,002,026, as `paper_tables.py`; 1,000 images and
5,000 captions by default) is a query for its own image, served as the service does by
default: the dot product's top 50, the cross-encoder's logits through their sigmoid, ADD_λ,
top 10. Prints R@1 per path and how many first hits differ from the host path's.

    python benchmarks/step_quality.py --device cuda --out gpu-out/quality.md
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TEST_SEED = 1_002_026  # benchmarks/paper_tables.py's test split
M = 50


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--images", type=int, default=1000)
    p.add_argument("--seed", type=int, default=TEST_SEED)
    p.add_argument("--precisions", default="", help="default: fp32,fp16,bf16 on cuda; fp32")
    p.add_argument("--batch", type=int, default=64, help="queries per step")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    precisions = (args.precisions or ("fp32,fp16,bf16" if args.device == "cuda" else "fp32")).split(
        ","
    )
    with tempfile.TemporaryDirectory() as tmp:
        text = run(Path(tmp), args, precisions)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


def run(work: Path, args: argparse.Namespace, precisions: list[str]) -> str:
    from models.builtin import BuiltinModel
    from models.device_step import DeviceStep
    from models.fusion import DEFAULT_FUSION_LAMBDA, fused_top_k, sigmoid
    from models.step_graphs import batch_key, capture_shapes
    from store import ann
    from store.indexio import IndexVersion, resolve_current

    host = BuiltinModel.load(device=args.device, precision="fp32")
    index = IndexVersion.open(resolve_current(_build(work, args)))
    n_img, n_txt = index.image_index.ntotal, index.text_index.ntotal
    image_row = {r.id: i for i, r in enumerate(index.store.images(list(range(n_img))))}
    texts = [t for t in index.store.texts(list(range(n_txt))) if t.image_id is not None]
    gold = np.array([image_row[str(t.image_id)] for t in texts])
    n_txt = len(texts)
    captions = [t.text for t in texts]
    lam = DEFAULT_FUSION_LAMBDA

    def first(rows: np.ndarray, dots: np.ndarray, logits: np.ndarray) -> int:
        ranked = fused_top_k(rows, dots, np.asarray(sigmoid(logits), np.float32), "add", lam, 10)
        return int(ranked[0][0])

    # the host path: FAISS on the host, the serving runtime's logits, fp32
    top_host = []
    for a in range(0, n_txt, args.batch):
        batch = captions[a : a + args.batch]
        dots, rows = ann.search(index.image_index, host.encode_texts(batch), M)
        for q, r, d in zip(batch, rows, dots, strict=True):
            logits = host.score_pairs([q] * M, np.asarray(index.image_tokens[r], np.float32))
            top_host.append(first(r, d, logits))
    host_top = np.array(top_host)
    vectors = ann.flat_vectors(index.image_index)
    assert vectors is not None
    lines = [
        f"Served t2i R@1 on the test split (seed {args.seed}: {n_img} images, {n_txt} captions), "
        f"M = {M}, ADD_{lam}, device {_name(args.device)} (`benchmarks/step_quality.py`).",
        "",
        "| path | R@1 | first hits unlike the host path's |",
        "|---|---|---|",
        f"| host path, fp32 | {100 * float(np.mean(host_top == gold)):.2f} | - |",
    ]
    for prec in precisions:
        model = BuiltinModel.load(device=args.device, precision=prec)  # type: ignore[arg-type]
        # on CUDA as the service runs it: its shapes replayed from CUDA graphs
        step = DeviceStep(model.model, model.device, prec, graphs=True)  # type: ignore[arg-type]
        tables = step.tables(vectors, index.image_tokens)
        sizes = [b for b in step.shapes.queries if b <= args.batch] + [args.batch]
        shapes = [(*step.padded(b, 1, M)[:1], n, M, True) for b in sizes for n in step.text_buckets]
        capture_shapes(step, tables, shapes, 120.0)
        tops, graphed, batches = [], 0, 0
        for a in range(0, n_txt, args.batch):
            ids = [model.tokenizer.ids(c) for c in captions[a : a + args.batch]]
            key = batch_key(step, tables, ids, M, True)
            graphed += tables.graphs is not None and tables.graphs.get(key) is not None
            batches += 1
            out = step(tables, ids, M, True)
            assert out.logits is not None
            tops += [
                first(out.rows[i, :M], out.dots[i, :M], out.logits[i, :M]) for i in range(len(ids))
            ]
        graphs = f" (CUDA graphs: {graphed} of {batches} batches)" if graphed else ""
        top = np.array(tops)
        lines.append(
            f"| device step, {prec}{graphs} | {100 * float(np.mean(top == gold)):.2f} | "
            f"{int(np.sum(top != host_top))} of {n_txt} |"
        )
    index.close()
    return "\n".join(lines) + "\n"


def _build(work: Path, args: argparse.Namespace) -> Path:
    """The test split's corpus, built into an index by `duet build` on the CPU, as a user's
    index is made; its directory."""
    from models.world import write_corpus

    corpus = write_corpus(work / "corpus", args.images, args.seed, progress=False)
    cmd = [sys.executable, "-m", "duet.cli", "build", "--corpus", str(corpus)]
    cmd += ["--out", str(work / "index"), "--device", "cpu", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run(cmd, check=True, cwd=REPO, env=env)
    return work / "index"


def _name(device: str) -> str:
    if not device.startswith("cuda"):
        return device
    import torch

    return f"{device} ({torch.cuda.get_device_name(0)})"


if __name__ == "__main__":
    main()
