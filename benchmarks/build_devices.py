"""`duet build` on each device, side by side: wall time, images/s, where the time went (the
builder's own stage times) and whether the indexes agree.

    .venv/bin/python benchmarks/build_devices.py --devices cpu,cuda    # on a GPU host
    .venv/bin/python benchmarks/build_devices.py --devices cpu --images 256  # quick, CPU only
    .venv/bin/python benchmarks/build_devices.py --devices cpu --format jpeg --cpus '0;0,1'
    .venv/bin/python benchmarks/build_devices.py --corpus /tmp/m200k.jsonl \
        --runs 'cpu;cpu@0,1;cuda;cuda-nvjpeg'          # runs as listed, on a corpus file

Generates one synthetic corpus (`duet demo-corpus`: the world's 64-pixel PNGs, or with
`--format jpeg` photo-sized JPEGs that cost what users' photos cost to decode), or reuses
`--corpus` (a folder or a manifest file), then runs the same `duet build` command once per
device and CPU set (`--cpus`, `taskset -c`; or the runs `--runs` lists, each
`DEVICE[@CPUS]`), in turn, on that corpus (a fresh index directory each, Flat factory), timing
the whole command as a user runs it (model load, decoding, encoding, FAISS, writing). Each row
carries the build's stage times (`build.stages` of its manifest.json, `index_builder.stages`;
on CPU the encode stages add up the shard workers' seconds), the encode step's wall time
(`encode_wall`) and `other`: the wall time no stage covers (starting Python, loading the
model).

The first run is the reference: for each other one it reports the speed-up over it (of the
whole command, `speedup`, and of the encode step alone less its setup, `encode_speedup`:
about what a corpus large enough for the fixed costs not to count would show), the smallest
cosine between the two builds' vectors of the same image / caption and how many of each
caption's top 10 images by dot product the two builds share (CUDA encodes under autocast,
so the vectors differ in the last digits; the rankings should not). The device
`cuda-nvjpeg` is a CUDA build whose JPEGs the GPU decodes (`duet build --decode-jpeg gpu`,
torchvision's nvJPEG) instead of the decode workers, `cuda-nvjpeg:0.4` one that leaves that
share of them to the GPU and has the workers decode the rest (`--decode-jpeg 0.4`). Prints
one JSON line per run.
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


def build(
    corpus: Path,
    out: Path,
    device: str,
    batch: int,
    workers: int | None = None,
    cpus: str | None = None,
) -> float:
    """Seconds `duet build` takes on `device` (on CPUs `cpus` only, when given), as one
    command."""
    start = time.perf_counter()
    cmd = [*DUET, "build", "--corpus", str(corpus), "--out", str(out)]
    cmd += ["--device", device, "--factory", "Flat", "--batch-size", str(batch), "--no-progress"]
    if workers is not None:
        cmd += ["--workers", str(workers)]
    if device.startswith("cuda-nvjpeg"):  # the GPU decodes the JPEGs (or a share of them)
        cmd[cmd.index(device)] = "cuda"
        cmd += ["--decode-jpeg", device.partition(":")[2] or "gpu"]
    if cpus:
        cmd = ["taskset", "-c", cpus, *cmd]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


# the stages inside the encode step: with CPU shard workers they are the workers' seconds
# summed (more than the wall time), so the step counts by its wall time, `encode_seconds`;
# the last three are `index_builder.stages.EXTRA`, which overlap the others
ENCODE_STAGES = (
    "setup",
    "decode",
    "encode_images",
    "encode_texts",
    "shards",
    "decode_busy",
    "device_decode",
    "device_wait",
)


def stages(out: Path, seconds: float) -> dict[str, object]:
    """The build's own stage times and workers, the encode step's wall time, and the wall
    time outside the stages (starting Python, loading the model)."""
    manifest = json.loads(((out / "current").resolve() / "manifest.json").read_text())
    b = manifest.get("build") or {}
    times: dict[str, float] = b.get("stages") or {}
    encode = float(b.get("encode_seconds") or 0.0)
    inside = encode + sum(v for k, v in times.items() if k not in ENCODE_STAGES)
    return {
        "workers": b.get("workers"),
        "jpeg": b.get("jpeg"),  # where a CUDA build decoded its JPEGs
        "encode_wall": round(encode, 2),
        "stages": times,
        "other": round(seconds - inside, 2),
    }


def vectors(out: Path) -> tuple[np.ndarray, np.ndarray]:
    """The image and caption vectors a build wrote."""
    cur = (out / "current").resolve()
    return np.load(cur / "image_vectors.npy"), np.load(cur / "text_vectors.npy")


def top10(queries: np.ndarray, items: np.ndarray, chunk: int = 2048) -> np.ndarray:
    """Each query's 10 best items by dot product, best first, a chunk of queries at a time
    (100k captions x 20k images at once would be an 8 GB score matrix)."""
    k = min(10, len(items))
    out = np.empty((len(queries), k), dtype=np.int64)
    for lo in range(0, len(queries), chunk):
        scores = queries[lo : lo + chunk] @ items.T
        part = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(scores, part, axis=1), axis=1, kind="stable")
        out[lo : lo + chunk] = np.take_along_axis(part, order, axis=1)
    return out


AGREE_QUERIES = 20_000  # captions whose top 10 are compared (200k images x 1M: hours)


def agreement(ref: Path, other: Path) -> dict[str, float]:
    """Smallest cosines between the two builds' vectors, and their shared top-10 share over
    at most `AGREE_QUERIES` captions, evenly spaced through the corpus."""
    (ri, rt), (oi, ot) = vectors(ref), vectors(other)

    def min_cos(a: np.ndarray, b: np.ndarray) -> float:
        num = (a * b).sum(1)
        return float((num / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())

    pick = np.linspace(0, len(rt) - 1, min(len(rt), AGREE_QUERIES)).astype(np.int64)
    top_r, top_o = top10(rt[pick], ri), top10(ot[pick], oi)
    shared = [len(set(a) & set(b)) / len(a) for a, b in zip(top_r, top_o, strict=True)]
    return {
        "min_cos_image": round(min_cos(ri, oi), 6),
        "min_cos_text": round(min_cos(rt, ot), 6),
        "top10_shared": round(float(np.mean(shared)), 4),
        "top1_same": round(float(np.mean(top_r[:, 0] == top_o[:, 0])), 4),
    }


def make_corpus(args: argparse.Namespace, corpus: Path) -> None:
    """`duet demo-corpus` into `corpus`, as the options ask."""
    gen = [*DUET, "demo-corpus", "--out", str(corpus), "--images", str(args.images)]
    gen += ["--seed", str(args.seed), "--no-progress", "--format", args.format]
    if args.image_size:
        gen += ["--image-size", args.image_size]
    subprocess.run(gen, check=True, cwd=REPO, stdout=subprocess.DEVNULL)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--devices", default="cpu,cuda", help="comma-separated; the first is the reference"
    )
    p.add_argument(
        "--cpus",
        default="",
        help="semicolon-separated `taskset -c` CPU lists, each run for every device "
        "(e.g. '0;0,1' for a 1-core and a 2-core run; default: every CPU)",
    )
    p.add_argument("--images", type=int, default=20000)
    p.add_argument("--format", choices=("png", "jpeg"), default="png", help="the corpus images")
    p.add_argument("--image-size", default=None, help="JPEG WxH (default 512x384)")
    p.add_argument(
        "--corpus",
        type=Path,
        default=None,
        help="an existing corpus to use: a folder with manifest.jsonl, or a manifest file "
        "(e.g. benchmarks/repeat_corpus.py's)",
    )
    p.add_argument(
        "--no-agreement",
        dest="agreement",
        action="store_false",
        help="skip the vectors' agreement (for a repeated corpus: each caption's top 10 are "
        "its image's twins, so the figure would mean nothing)",
    )
    p.add_argument(
        "--runs",
        default="",
        help="semicolon-separated DEVICE[@CPUS] runs, in order, instead of --devices x --cpus "
        "(e.g. 'cpu;cpu@0,1;cuda;cuda-nvjpeg'; the first is the reference)",
    )
    p.add_argument("--workers", type=int, default=None, help="--workers for duet build")
    p.add_argument("--batch-size", type=int, default=64, help="images per forward pass (both)")
    p.add_argument("--seed", type=int, default=3)
    args = p.parse_args()
    args.devices = args.devices.split(",")
    if len(set(args.devices)) != len(args.devices):
        p.error(f"--devices names a device twice: {','.join(args.devices)}")
    args.cpus = [c for c in args.cpus.split(";") if c] or [None]
    if args.runs:
        specs = [r.strip() for r in args.runs.split(";") if r.strip()]
        args.runs = [(d, c or None) for d, _, c in (r.partition("@") for r in specs)]
    else:
        args.runs = [(d, c) for d in args.devices for c in args.cpus]
    for d, _ in args.runs:
        name, colon, share = d.partition(":")
        if name not in ("cpu", "cuda", "cuda-nvjpeg") or (
            colon and (name != "cuda-nvjpeg" or not _share(share))
        ):
            p.error(f"unknown device {d!r}: use cpu, cuda, cuda-nvjpeg or cuda-nvjpeg:SHARE")
    return args


def _share(text: str) -> bool:
    """Whether `text` is a share `duet build --decode-jpeg` takes (for `cuda-nvjpeg:SHARE`)."""
    try:
        return 0 < round(float(text) * 1000) < 1000
    except (ValueError, OverflowError):
        return False


def main() -> None:
    """Generate the corpus, build once per device and CPU set, print one JSON line each."""
    args = parse()
    with tempfile.TemporaryDirectory(prefix="duet-build-devices-") as tmp:
        corpus = args.corpus
        if corpus is None:
            make_corpus(args, Path(tmp) / "corpus")
            corpus = Path(tmp) / "corpus"
        if corpus.is_dir():
            corpus = corpus / "manifest.jsonl"
        n = sum(1 for line in corpus.open() if line.strip())
        runs = args.runs
        first: tuple[Path, float, float] | None = None  # its index, seconds, encode step
        for k, (d, cpus) in enumerate(runs):
            out = Path(tmp) / f"index-{k}"
            secs = build(corpus, out, d, args.batch_size, args.workers, cpus)
            row: dict[str, object] = {"device": d, "cpus": cpus or "all", "images": n}
            row |= {"seconds": round(secs, 2), "images_per_s": round(n / secs, 1)}
            row |= stages(out, secs)
            # the encode step less its setup (the model's copy on the device)
            times = row["stages"]
            setup = float(times.get("setup", 0.0)) if isinstance(times, dict) else 0.0
            encode = float(row["encode_wall"]) - setup  # type: ignore[arg-type]
            if first is None:
                first = (out, secs, encode)
            else:
                row["speedup"] = round(first[1] / secs, 2)
                # the encode step alone: what a corpus large enough that starting Python,
                # loading the model and writing the files no longer count would show
                row["encode_speedup"] = round(first[2] / encode, 2) if encode > 0 else None
                if args.agreement:
                    row |= agreement(first[0], out)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
