"""The synthetic compositional world duet trains and tests on.

Scenes hold 1-3 coloured shapes. Captions come from a small grammar with
paraphrases and always bind every attribute to its object, so "a small red
circle left of a blue square" and "a small blue circle left of a red square"
describe different images: a global embedding tends to confuse them, a
cross-encoder that reads both sides together should not.

The parts, each importing only those before it: `scenes` (things, scenes, sampling,
perturbation), `descriptions` (partial descriptions, parsing, judging, hard-negative scenes),
`captioning` (the full-caption grammar, its vocabulary, grounding), `rendering` (placement and
drawing) and `corpus` (samples, PNG bytes, corpora on disk).
"""

from models.world.captioning import captions, grounding, vocabulary
from models.world.corpus import PhotoStyle, Sample, generate, png_bytes, write_corpus
from models.world.descriptions import (
    Desc,
    Part,
    describe,
    full_desc,
    negative_scene,
    parse,
    partial_caption,
    partial_desc,
    partial_queries,
    satisfies,
    typed,
    typed_at,
)
from models.world.rendering import Layout, centre, render, render_layout
from models.world.scenes import (
    COLOURS,
    COUNT_WORDS,
    IMAGE_SIZE,
    INVERSE,
    POS_PHRASES,
    POSITIONS,
    REL_ITS,
    REL_WORDS,
    RELATIONS,
    SHAPES,
    SIZE_WORDS,
    SIZES,
    Scene,
    Thing,
    count_twin,
    other_counts,
    perturb,
    recount,
    recountable,
    sample_scene,
)

__all__ = [
    "COLOURS",
    "COUNT_WORDS",
    "IMAGE_SIZE",
    "INVERSE",
    "POSITIONS",
    "POS_PHRASES",
    "RELATIONS",
    "REL_ITS",
    "REL_WORDS",
    "SHAPES",
    "SIZES",
    "SIZE_WORDS",
    "Desc",
    "Layout",
    "Part",
    "PhotoStyle",
    "Sample",
    "Scene",
    "Thing",
    "captions",
    "centre",
    "count_twin",
    "describe",
    "full_desc",
    "generate",
    "grounding",
    "negative_scene",
    "other_counts",
    "parse",
    "partial_caption",
    "partial_desc",
    "partial_queries",
    "perturb",
    "png_bytes",
    "recount",
    "recountable",
    "render",
    "render_layout",
    "sample_scene",
    "satisfies",
    "typed",
    "typed_at",
    "vocabulary",
    "write_corpus",
]
