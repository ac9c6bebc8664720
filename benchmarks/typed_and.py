"""Two-thing queries typed with "and", as people write them, against the grammar's "with", on
the validation split (never a test split).

    .venv/bin/python benchmarks/typed_and.py [--model-dir models/weights] [--queries 3000]

The world's captions join two things with "with" ("a red circle with a blue square") and never
write "and". Of `--queries` partial queries (world seed 999,998, as `models.tune_fusion`) it
keeps those that name two things joined by "with", and prints P@1 / P@10 over 1,000 validation
images (world seed 999,999) for dot, the cross-encoder alone and the served ADD_λ, three ways:
as written ("with"), with "and" in its place read as the tokenizer reads it now
(`models.shipped.ALIASES`: as "with"), and with "and" read as [UNK] (no aliases).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models import world
from models.builtin import BuiltinModel
from models.evaluate import partial_precision
from models.fusion import DEFAULT_FUSION_LAMBDA
from models.tokenizer import WordTokenizer
from models.trainconfig import DEFAULT_WEIGHTS, HELD_OUT_SEED_BASE


def two_thing_queries(n: int) -> list[tuple[str, world.Desc]]:
    """The validation partial queries (of `n`) that join two things with "with"."""
    return [
        (t, d)
        for t, d in world.partial_queries(n, HELD_OUT_SEED_BASE - 2)
        if d.b is not None and d.relation is None and " with " in f" {t} "
    ]


def main() -> None:
    """Print one JSON line per way of reading the queries."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, default=DEFAULT_WEIGHTS)
    p.add_argument("--queries", type=int, default=3000)
    args = p.parse_args()
    model = BuiltinModel.load(args.model_dir)
    val = list(world.generate(1000, HELD_OUT_SEED_BASE - 1, n_captions=5))
    images, scenes = [s.image for s in val], [s.scene for s in val]
    queries = two_thing_queries(args.queries)
    typed = [(f" {t} ".replace(" with ", " and ").strip(), d) for t, d in queries]
    aliased = model.tokenizer
    bare = WordTokenizer(aliased.itos[3:], aliased.max_len, aliases={})
    for way, qs, tok in (
        ("with", queries, aliased),
        ("and", typed, aliased),
        ("and as [UNK]", typed, bare),
    ):
        model.tokenizer = tok
        res = partial_precision(model, images, scenes, qs, lambdas=(DEFAULT_FUSION_LAMBDA,))
        print(json.dumps({"written": way, "queries": len(qs), **res}))


if __name__ == "__main__":
    main()
