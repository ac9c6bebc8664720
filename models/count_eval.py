"""Counting, measured on validation only: P@1 of text queries that name a count ("a" / "one"
against "two" / "three") over a gallery that holds, for each query, a twin of its image that
differs in that count alone (issue 37: "green square and red triangle" put two green squares
with a red triangle first).

    python -m models.count_eval [--model-dir models/weights] [--seed 999999] [--images 1000]
                                [--queries 800] [--candidates 50] [--no-full] [--json]

The gallery is the validation split's images (world seed 999,999, as `models.tune_fusion` and
`duet train` read it) and one rendered twin per query. Each query describes one of the split's
two-thing scenes and names its group's count (its first thing: one, two or three of a shape);
what else it says is drawn at random (the size, the second thing, the relation may be left
out), and a quarter are written as people type ("green square and red triangle": no article,
"and" for "with"). The twin is the same scene with that count changed (1 -> 2 or 3, 2 -> 1 or 3,
3 -> 1 or 2; three only of small things, as the world draws them), and it does not fit the
query (`models.world.satisfies`; a draw whose twin would fit is skipped). Each query is
served as the service serves it: the dot product's top `candidates`, re-ranked by the
cross-encoder, fused ADD_λ at λ = DEFAULT_FUSION_LAMBDA; a hit counts when its scene fits the
query, so P@1 is out of every query (each has its own image in the gallery). Also printed: the
dot product and the cross-encoder alone, P@1 per kind ("one vs more": the query says a / one,
its twin has two or three; "more vs one"; "two vs three") and of the typed queries, the queries
whose first hit is their twin, and (unless --no-full) the split's plain full-caption R@1 both
ways (`models.evaluate`), so a retrain can be checked for regressions. Test splits (seeds at or
above 1,000,000) need --test, and are for reading a final figure once, never for choosing.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from models import world
from models.builtin import BuiltinModel
from models.device import DEVICES
from models.eval_metrics import fit_matrix, precision, reorder, top_m
from models.eval_pool import cross_scores, texts_to_images
from models.evaluate import PAIR_BATCH, encode_pool, evaluate
from models.fusion import DEFAULT_FUSION_LAMBDA, fuse
from models.trainconfig import DEFAULT_WEIGHTS, HELD_OUT_SEED_BASE, check_validation_seeds

KINDS = ("one vs more", "more vs one", "two vs three")
TYPED = 0.25  # share of the queries written as people type them (`world.typed`)


@dataclass(frozen=True)
class CountCase:
    """A query naming a count, the scene it describes (a gallery image's) and that scene's
    twin with another count (a gallery image the query does not fit)."""

    text: str
    desc: world.Desc
    scene: world.Scene
    twin: world.Scene
    typed: bool = False  # written as people type it (`world.typed`)

    @property
    def kind(self) -> str:
        """Which of `KINDS` the query and its twin are."""
        said, other = self.scene.a.count, self.twin.a.count
        if said == 1:
            return "one vs more"
        return "more vs one" if other == 1 else "two vs three"


def count_desc(rng: random.Random, s: world.Scene) -> world.Desc:
    """A description of the two-thing scene `s` that names its first thing's count and colour;
    the size, the second thing and the relation are each said or left out at random."""
    assert s.b is not None

    def size(t: world.Thing) -> str | None:
        return t.size if rng.random() < 0.5 else None

    a = world.Part(s.a.shape, s.a.colour, size(s.a), s.a.count)
    if rng.random() < 0.25:
        return world.Desc(a)
    b = world.Part(s.b.shape, s.b.colour, size(s.b), 1)
    return world.Desc(a, b, s.relation if rng.random() < 0.5 else None)


def count_cases(scenes: Sequence[world.Scene], n: int, seed: int) -> list[CountCase]:
    """Up to `n` count queries on the two-thing scenes of `scenes`, in order, one per scene
    (fewer when the scenes run out), drawn with a stream of their own for split `seed`."""
    rng = random.Random(f"count-{seed}")
    out: list[CountCase] = []
    for s in scenes:
        if len(out) >= n:
            break
        if s.b is None:
            continue
        twin = world.count_twin(rng, s)
        d = count_desc(rng, s)
        text = world.describe(rng, d)
        as_typed = rng.random() < TYPED
        if as_typed:
            text = world.typed(text)
        if all(world.satisfies(x, s) and not world.satisfies(x, twin) for x in (d, text)):
            out.append(CountCase(text, d, s, twin, as_typed))
    return out


def count_gallery(
    samples: Sequence[world.Sample], cases: Sequence[CountCase], seed: int
) -> tuple[list[Any], list[world.Scene]]:
    """(images, scenes) of the gallery: the split's samples, then each case's twin rendered."""
    rng = random.Random(f"count-twins-{seed}")
    images = [s.image for s in samples] + [world.render(rng, c.twin) for c in cases]
    return images, [s.scene for s in samples] + [c.twin for c in cases]


def served_ranking(
    model: BuiltinModel,
    images: Sequence[Any],
    texts: Sequence[str],
    candidates: int = 50,
    lam: float = DEFAULT_FUSION_LAMBDA,
) -> dict[str, np.ndarray]:
    """Each text query's ranked gallery rows (Q, candidates) by the dot product ("dot"), the
    cross-encoder alone over the dot product's top `candidates` ("ce_only") and the two fused as
    served ("served": ADD_λ), with `models.match_threshold`'s and `evaluate_partial_pool`'s
    building blocks."""
    pool = encode_pool(model, images, [])
    qv = model.encode_texts(list(texts))
    cand, dots = top_m(qv, pool.image_vecs, candidates)
    d = texts_to_images(pool, texts, qv)
    logits = cross_scores(model, d, np.arange(len(texts)), cand, PAIR_BATCH)
    return {
        "dot": cand,
        "ce_only": reorder(cand, logits),
        "served": reorder(cand, fuse(dots, logits, lam)),
    }


def count_split(
    model: BuiltinModel,
    samples: Sequence[world.Sample],
    seed: int,
    queries: int = 800,
    candidates: int = 50,
    show: int = 10,
) -> dict[str, Any]:
    """The count figures of split `seed` (its `samples`): P@1 / P@10 per mode over every query
    and per kind, the queries whose served first hit is their own twin, and up to `show` missed
    queries."""
    cases = count_cases([s.scene for s in samples], queries, seed)
    gallery, scenes = count_gallery(samples, cases, seed)
    fit = fit_matrix([c.desc for c in cases], scenes)
    ranked = served_ranking(model, gallery, [c.text for c in cases], candidates)
    kinds = np.array([c.kind for c in cases])
    as_typed = np.array([c.typed for c in cases], dtype=bool)
    out: dict[str, Any] = {"seed": seed, "images": len(gallery), "queries": len(cases)}
    out["P"] = {m: precision(r, fit) for m, r in ranked.items()}
    out["kinds"] = {
        k: {"queries": int((kinds == k).sum())}
        | {m: precision(r[kinds == k], fit[kinds == k])["P@1"] for m, r in ranked.items()}
        for k in KINDS
        if (kinds == k).any()
    }
    if as_typed.any():
        out["typed"] = {"queries": int(as_typed.sum())} | {
            m: precision(r[as_typed], fit[as_typed])["P@1"] for m, r in ranked.items()
        }
    first = ranked["served"][:, 0]
    twin_rows = len(samples) + np.arange(len(cases))
    out["served first is the twin"] = int((first == twin_rows).sum())
    missed = np.flatnonzero(~fit[np.arange(len(cases)), first])
    out["missed"] = [
        {
            "query": cases[q].text,
            "kind": cases[q].kind,
            "own": _scene_words(cases[q].scene),
            "put_first": _scene_words(scenes[first[q]]),
        }
        for q in missed[:show]
    ]
    return out


def _scene_words(s: world.Scene) -> str:
    """A scene in a few words: its things' counts, sizes, colours and shapes, and relation."""

    def thing(t: world.Thing) -> str:
        return f"{t.count} {t.size} {t.colour} {t.shape}"

    if s.b is None:
        return f"{thing(s.a)} ({s.position})"
    return f"{thing(s.a)} {s.relation} {thing(s.b)}"


def full_recall(
    model: BuiltinModel, val: Sequence[world.Sample], candidates: int
) -> dict[str, Any]:
    """The split's full-caption R@1 (t2i, i2t) of the dot product, the cross-encoder alone and
    the served default, as `models.tune_fusion` reads them (5 captions per image)."""
    res = evaluate(model, [s.image for s in val], [s.captions for s in val], candidates=candidates)
    names = {"dot": "dot", "ce_only": "ce_only", "rerank": "served"}
    return {
        name: {"t2i R@1": res[key]["t2i"]["R@1"], "i2t R@1": res[key]["i2t"]["R@1"]}
        for key, name in names.items()
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Print one split's count figures (and its full-caption R@1) as JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, default=DEFAULT_WEIGHTS)
    p.add_argument("--device", choices=DEVICES, default="cpu")
    p.add_argument("--seed", type=int, default=HELD_OUT_SEED_BASE - 1)
    p.add_argument("--images", type=int, default=1000)
    p.add_argument("--queries", type=int, default=800)
    p.add_argument("--candidates", type=int, default=50)
    p.add_argument("--show", type=int, default=10, help="missed queries listed")
    p.add_argument("--no-full", action="store_true", help="skip the full-caption R@1")
    p.add_argument("--test", action="store_true", help="allow a test split's seed (read once)")
    p.add_argument("--json", action="store_true", help="one JSON object, not indented")
    args = p.parse_args(argv)
    if not args.test:
        check_validation_seeds([args.seed])
    model = BuiltinModel.load(args.model_dir, args.device, "fp32")
    out = {"model": model.fingerprint, "fusion λ": DEFAULT_FUSION_LAMBDA}
    samples = list(world.generate(args.images, args.seed, n_captions=5))
    out |= count_split(model, samples, args.seed, args.queries, args.candidates, args.show)
    if not args.no_full:
        out["full captions"] = full_recall(model, samples, args.candidates)
    print(json.dumps(out, indent=None if args.json else 1))


if __name__ == "__main__":
    main()
