"""`duet build` on each device, side by side: wall time, images/s and whether the indexes agree.

    .venv/bin/python benchmarks/build_devices.py --devices cpu,cuda    # on a GPU host
    .venv/bin/python benchmarks/build_devices.py --devices cpu --images 256  # quick, CPU only

Generates one synthetic corpus (`duet demo-corpus`), then runs the same `duet build` command
once per device, in turn, on that corpus (a fresh index directory each, Flat factory), timing
the whole command as a user runs it (model load, decoding, encoding, FAISS, writing). The
first device is the reference: for each other one it reports the smallest cosine between
the two builds' vectors of the same image / caption and how many of each caption's top 10
images by dot product the two builds share (CUDA encodes under autocast, so the vectors
differ in the last digits; the rankings should not). Prints one JSON line per device.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DUET = [sys.executable, "-m", "duet.cli"]


def build(corpus: Path, out: Path, device: str, batch: int) -> float:
    """Seconds `duet build` takes on `device`, as one command."""
    start = time.perf_counter()
    cmd = [*DUET, "build", "--corpus", str(corpus / "manifest.jsonl"), "--out", str(out)]
    cmd += ["--device", device, "--factory", "Flat", "--batch-size", str(batch), "--no-progress"]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def vectors(out: Path) -> tuple[np.ndarray, np.ndarray]:
    """The image and caption vectors a build wrote."""
    cur = (out / "current").resolve()
    return np.load(cur / "image_vectors.npy"), np.load(cur / "text_vectors.npy")


def agreement(ref: Path, other: Path) -> dict[str, float]:
    """Smallest cosines between the two builds' vectors, and their shared top-10 share."""
    (ri, rt), (oi, ot) = vectors(ref), vectors(other)

    def min_cos(a: np.ndarray, b: np.ndarray) -> float:
        num = (a * b).sum(1)
        return float((num / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())

    top_r = np.argsort(-(rt @ ri.T), axis=1)[:, :10]
    top_o = np.argsort(-(ot @ oi.T), axis=1)[:, :10]
    shared = [len(set(a) & set(b)) / len(a) for a, b in zip(top_r, top_o, strict=True)]
    return {
        "min_cos_image": round(min_cos(ri, oi), 6),
        "min_cos_text": round(min_cos(rt, ot), 6),
        "top10_shared": round(float(np.mean(shared)), 4),
        "top1_same": round(float(np.mean(top_r[:, 0] == top_o[:, 0])), 4),
    }


def main() -> None:
    """Generate the corpus, build once per device, print one JSON line each."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--devices", default="cpu,cuda", help="comma-separated; the first is the reference"
    )
    p.add_argument("--images", type=int, default=20000)
    p.add_argument("--batch-size", type=int, default=64, help="images per forward pass (both)")
    p.add_argument("--seed", type=int, default=3)
    args = p.parse_args()
    devices = args.devices.split(",")
    if len(set(devices)) != len(devices):
        p.error(f"--devices names a device twice: {args.devices}")
    with tempfile.TemporaryDirectory(prefix="duet-build-devices-") as tmp:
        corpus = Path(tmp) / "corpus"
        gen = [*DUET, "demo-corpus", "--out", str(corpus), "--images", str(args.images)]
        subprocess.run(
            [*gen, "--seed", str(args.seed), "--no-progress"],
            check=True,
            cwd=REPO,
            stdout=subprocess.DEVNULL,
        )
        outs = {d: Path(tmp) / f"index-{d}" for d in devices}
        for d in devices:
            secs = build(corpus, outs[d], d, args.batch_size)
            row: dict[str, object] = {"device": d, "images": args.images, "seconds": round(secs, 2)}
            row["images_per_s"] = round(args.images / secs, 1)
            if d != devices[0]:
                row |= agreement(outs[devices[0]], outs[d])
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
