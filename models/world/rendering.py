"""Drawing scenes: where each shape goes (honouring the scene's position or relation), the
shapes themselves, and the layout the trainer uses for patch supervision."""

from __future__ import annotations

import random

from PIL import Image, ImageDraw

from models.world.scenes import COLOURS, IMAGE_SIZE, POSITIONS, SIZES, Scene, Thing

Layout = list[tuple[Thing, float, float, float]]  # (thing, centre x, centre y, radius) per shape


def _place(rng: random.Random, s: Scene) -> list[tuple[Thing, float, float, float]]:
    """Centres and radii for every drawn shape, honouring position and relation."""
    lo = 2.0
    hi = IMAGE_SIZE - 2.0

    def radius(t: Thing) -> float:
        low, high = SIZES[t.size]
        return float(rng.randint(low, high))

    if s.kind == "single":
        col, row = POSITIONS[s.position or "center"]
        r = radius(s.a)
        cell = IMAGE_SIZE / 3
        cx = min(max(cell * (col + 0.5) + rng.uniform(-3, 3), lo + r), hi - r)
        cy = min(max(cell * (row + 0.5) + rng.uniform(-3, 3), lo + r), hi - r)
        return [(s.a, cx, cy, r)]
    assert s.b is not None
    for _ in range(10_000):
        ra = radius(s.a)
        rb = radius(s.b)
        b_xy = (rng.uniform(lo + rb, hi - rb), rng.uniform(lo + rb, hi - rb))
        placed: list[tuple[Thing, float, float, float]] = [(s.b, b_xy[0], b_xy[1], rb)]
        ok = True
        for _i in range(s.a.count):
            x, y = rng.uniform(lo + ra, hi - ra), rng.uniform(lo + ra, hi - ra)
            if not _relation_holds(s.relation or "", (x, y), b_xy, ra + rb, s.a.count > 1):
                ok = False
                break
            if any((x - px) ** 2 + (y - py) ** 2 < (ra + pr + 2) ** 2 for _t, px, py, pr in placed):
                ok = False
                break
            placed.append((s.a, x, y, ra))
        if ok:
            return placed
    raise RuntimeError(f"could not place scene {s}")  # pragma: no cover - sizes always fit


def _relation_holds(
    rel: str, a: tuple[float, float], b: tuple[float, float], gap: float, group: bool
) -> bool:
    dx, dy = a[0] - b[0], a[1] - b[1]
    main, other = {
        "left of": (-dx, dy),
        "right of": (dx, dy),
        "above": (-dy, dx),
        "below": (dy, dx),
    }[rel]
    # clearly on that side: beyond touching distance and mostly along that axis
    return main > gap + 2 and abs(other) < (0.9 if group else 0.6) * main


def render(rng: random.Random, s: Scene) -> Image.Image:
    """Draw the scene on a plain dark background."""
    return render_layout(rng, s)[0]


def render_layout(rng: random.Random, s: Scene) -> tuple[Image.Image, Layout]:
    """Draw the scene and say where each shape went (the trainer's patch supervision)."""
    grey = rng.randint(35, 85)
    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (grey, grey, grey))
    draw = ImageDraw.Draw(img)
    placed = _place(rng, s)
    for t, x, y, r in placed:
        _draw_shape(draw, t.shape, COLOURS[t.colour], x, y, r)
    return img, placed


def centre(layout: Layout, thing: Thing) -> tuple[float, float]:
    """Mean centre of the drawn shapes of `thing` (a group's members), in [0, 1] image units."""
    xs = [(x, y) for t, x, y, _r in layout if t == thing]
    return (
        sum(x for x, _ in xs) / len(xs) / IMAGE_SIZE,
        sum(y for _, y in xs) / len(xs) / IMAGE_SIZE,
    )


def _draw_shape(
    draw: ImageDraw.ImageDraw, shape: str, fill: tuple[int, int, int], x: float, y: float, r: float
) -> None:
    if shape == "circle":
        draw.ellipse((x - r, y - r, x + r, y + r), fill=fill)
    elif shape == "square":
        k = r * 0.85
        draw.rectangle((x - k, y - k, x + k, y + k), fill=fill)
    elif shape == "triangle":
        draw.polygon([(x, y - r), (x + r, y + r * 0.8), (x - r, y + r * 0.8)], fill=fill)
    elif shape == "diamond":
        draw.polygon([(x, y - r), (x + r, y), (x, y + r), (x - r, y)], fill=fill)
    elif shape == "cross":
        w = max(r * 0.35, 1.5)
        draw.rectangle((x - r, y - w, x + r, y + w), fill=fill)
        draw.rectangle((x - w, y - r, x + w, y + r), fill=fill)
    else:  # pragma: no cover - SHAPES is closed
        raise ValueError(shape)
