"""A large corpus from a smaller one: each item listed `--times` times under new ids.

Rendering a million distinct photo-sized JPEGs takes hours on one host; decoding and encoding
a million of them is what a scale run measures. This writes a manifest that lists every item
of a `duet demo-corpus` folder (or any corpus manifest) `--times` times, as `ID-rK`, with
absolute image paths, so `duet build` reads, decodes and encodes each listed image as if it
were another one. Search quality over repeats means nothing (each image has K twins); costs
per item, and the build's and service's speed, are what the corpus is for (docs/scale.md).

    python benchmarks/repeat_corpus.py /tmp/c20k --times 50 --out /tmp/m1m.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def repeat(manifest: Path, times: int, out: Path) -> int:
    """Write `manifest`'s items `times` times over to `out`; return how many lines it wrote."""
    root = manifest.resolve().parent
    items = [json.loads(line) for line in manifest.open() if line.strip()]
    for item in items:
        image = Path(item["image"])
        item["image"] = str(image if image.is_absolute() else root / image)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as fh:
        for k in range(times):
            for item in items:
                fh.write(json.dumps({**item, "id": f"{item['id']}-r{k}"}) + "\n")
    return len(items) * times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("corpus", type=Path, help="a corpus folder (its manifest.jsonl) or manifest")
    p.add_argument("--times", type=int, required=True, help="how many times to list each item")
    p.add_argument("--out", type=Path, required=True, help="the manifest to write")
    args = p.parse_args(argv)
    manifest = args.corpus / "manifest.jsonl" if args.corpus.is_dir() else args.corpus
    if args.times < 1:
        p.error("--times must be at least 1")
    if not manifest.is_file():
        p.error(f"no manifest at {manifest}")
    n = repeat(manifest, args.times, args.out)
    print(f"{args.out}: {n:,} items ({args.times} x {n // args.times:,})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
