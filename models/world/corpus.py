"""Corpora of the world: rendered samples with their captions, deterministic PNG bytes, and
a manifest plus images on disk."""

from __future__ import annotations

import io
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from models.world.captioning import captions
from models.world.rendering import Layout, render_layout
from models.world.scenes import Scene, sample_scene


@dataclass
class Sample:
    """One rendered scene with its captions."""

    scene: Scene
    image: Image.Image
    captions: list[str]
    layout: Layout


def generate(n_images: int, seed: int, n_captions: int = 5) -> Iterator[Sample]:
    """Yield `n_images` samples; the same seed always yields the same samples."""
    rng = random.Random(seed)
    for _ in range(n_images):
        scene = sample_scene(rng)
        image, layout = render_layout(rng, scene)
        yield Sample(scene, image, captions(rng, scene, n_captions), layout)


def png_bytes(img: Image.Image) -> bytes:
    """Encode deterministically (no timestamps or text chunks in the PNG)."""
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False, compress_level=6)
    return buf.getvalue()


def write_corpus(
    out: Path, n_images: int, seed: int, n_captions: int = 5, progress: bool = True
) -> Path:
    """Write `out/manifest.jsonl` and `out/images/*.png`; return the manifest path."""
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    (out / "images").mkdir(exist_ok=True)
    manifest = out / "manifest.jsonl"
    width = max(4, len(str(n_images - 1)))
    with manifest.open("w", encoding="utf-8") as fh:
        samples = generate(n_images, seed, n_captions)
        for i, sample in enumerate(
            tqdm(samples, total=n_images, desc="rendering", unit="img", disable=not progress)
        ):
            name = f"{i:0{width}d}"
            rel = f"images/{name}.png"
            (out / rel).write_bytes(png_bytes(sample.image))
            line = {
                "id": f"img-{name}",
                "image": rel,
                "captions": sample.captions,
                "meta": {"scene": sample.scene.to_json(), "seed": seed},
            }
            fh.write(json.dumps(line, sort_keys=True) + "\n")
    return manifest
