"""Stage 2's moved views: every training image drawn again a few pixels off, its states computed
once with the frozen image tower, so the cross-encoder sees the same scene at two alignments
against the 16-pixel patch grid.

Why: on six validation splits the cross-encoder then shipped (`d5aa8044`) scored 437 of 30,000
captions below 0 against their own image, and 383 of those above 0 once the image was moved by
4 pixels (`benchmarks/border_probe.py`); 1- and 2-thing scenes with a centre within a pixel of
a patch border were blind two to four times as often as those with every centre 3 pixels or
more inside a patch. Every scene in training already falls at some alignment; what the cross-encoder
never sees is one scene at two, which is what tells it that a thing's meaning does not depend
on where it falls against the grid.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch
from PIL import Image

from models import world

MAX_MOVE = 4  # pixels: a quarter of a patch


def moved(image: Image.Image, dx: int, dy: int) -> Image.Image:
    """`image` moved by (dx, dy) pixels over its own background colour."""
    out = Image.new(image.mode, image.size, image.getpixel((0, 0)))
    out.paste(image, (dx, dy))
    return out


def move_of(rng: random.Random, layout: world.Layout, most: int = MAX_MOVE) -> tuple[int, int]:
    """A whole-pixel move of at most `most` along each axis that keeps every shape inside the
    picture (the pixel at a shape's far edge, x + r, is drawn too, so it must stay below
    the picture's size), drawn uniformly among those allowed (positions such as "on the left"
    are thirds of the picture and every single thing sits within 3 pixels of its third's
    centre, so a 4-pixel move never changes what a caption says)."""
    last = world.IMAGE_SIZE - 1
    lo_x = max(-most, -math.floor(min(x - r for _t, x, _y, r in layout)))
    hi_x = min(most, math.floor(last - max(x + r for _t, x, _y, r in layout)))
    lo_y = max(-most, -math.floor(min(y - r for _t, _x, y, r in layout)))
    hi_y = min(most, math.floor(last - max(y + r for _t, _x, y, r in layout)))
    return rng.randint(min(lo_x, 0), max(hi_x, 0)), rng.randint(min(lo_y, 0), max(hi_y, 0))


def moved_layout(layout: world.Layout, dx: int, dy: int) -> world.Layout:
    """`layout` after its picture moved by (dx, dy)."""
    return [(t, x + dx, y + dy, r) for t, x, y, r in layout]


def moved_images(
    rng: random.Random, samples: Sequence[world.Sample]
) -> tuple[list[Image.Image], torch.Tensor]:
    """(each sample's image moved by `move_of`, the moves (N, 2) int)."""
    moves = [move_of(rng, s.layout) for s in samples]
    images = [moved(s.image, dx, dy) for s, (dx, dy) in zip(samples, moves, strict=True)]
    return images, torch.tensor(moves, dtype=torch.long).reshape(-1, 2)


def pick_moved(rng: random.Random, n: int, share: float) -> torch.Tensor:
    """Which of a step's `n` images are shown moved (bool (n,)), each with probability `share`."""
    return torch.tensor([rng.random() < share for _ in range(n)], dtype=torch.bool)


def step_layouts(
    samples: Sequence[world.Sample],
    picked: Sequence[int],
    moves: torch.Tensor | None,
    shown: torch.Tensor | None,
) -> list[world.Layout]:
    """The layouts of the step's images as shown: moved where `shown` says so."""
    if moves is None or shown is None:
        return [samples[i].layout for i in picked]
    return [
        moved_layout(samples[i].layout, *map(int, moves[i])) if m else samples[i].layout
        for i, m in zip(picked, shown.tolist(), strict=True)
    ]
