"""The builtin model as serving knows it: where its shipped weights live and how its word
tokenizer reads a text. Torch-free, and free of training code: serving, training and the
CLI all import it (training and the world generator from here, never the other way)."""

from __future__ import annotations

import re
from pathlib import Path

DEFAULT_WEIGHTS = Path(__file__).resolve().parent / "weights"

_WORD = re.compile(r"[a-z]+|\d+")
_PLAIN = re.compile(r"[a-z ]*")  # a text whose words are its space-separated runs

# Words people type that the world's grammar never writes, each read as the word the grammar
# uses for the same thing: captions join two things with "with" ("a red circle with a blue
# square"), people with "and". Read as [UNK], "and" cost two-thing queries 19 points of served
# P@1 on validation (`python benchmarks/typed_and.py`; docs/evaluation.md). The tokenizer
# (`models.tokenizer.WordTokenizer`) and the world's parser (`models.world.parse`) both read them.
ALIASES = {"and": "with"}


def caption_words(text: str) -> list[str]:
    """The words of a text as duet's tokenizer reads them: lower-cased letters or digits, the
    rest dropped (the world generator uses this too, so word indices there are token
    positions in `models.tokenizer`, after its [CLS]). Split at its spaces when it has no
    other characters (most captions and queries: 0.6 against 1.3 us)."""
    lower = text.lower()
    return lower.split() if _PLAIN.fullmatch(lower) else _WORD.findall(lower)
