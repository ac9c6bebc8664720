"""Whether the model reads a corpus's captions: the shipped model knows only the demo world's
words, so a corpus of everyday captions ("a dog sleeping on a sofa") was built without a
word and every caption encoded alike (its searches then refused as unreadable). The build
looks at a sample of the captions before encoding and says what it could not read."""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

from index_builder.corpus import CorpusItem
from models.shipped import caption_words

log = logging.getLogger("duet.build")

SAMPLE = 20_000  # captions looked at, evenly spread: a share, not a count, is told
UNKNOWN_SHARE = 0.10  # of the words: past it, the warning
BLIND_SHARE = 0.01  # of the captions with words, none the model reads: past it, too


def _captions(items: Sequence[CorpusItem]) -> Iterator[str]:
    for it in items:
        yield from it.captions


def unread_words(items: Sequence[CorpusItem], model: Any) -> str | None:
    """A warning (also logged) when the model cannot read much of the items' captions, else
    None; None too for a model that cannot tell (a sub-word tokenizer reads every word)."""
    unknown_of = getattr(model, "unknown_words", None)
    content_of = getattr(model, "content_words", None)
    total = sum(len(it.captions) for it in items)
    if not callable(unknown_of) or not total:
        return None
    step = -(-total // SAMPLE)  # at most SAMPLE captions, evenly spread
    sample = list(itertools.islice(_captions(items), 0, None, step))
    words, blind, unknown = 0, 0, Counter[str]()
    for caption in sample:
        read = caption_words(caption)
        words += len(read)
        # `unknown_words` names each word once a caption: counted as often as it is said
        missing = set(unknown_of(caption))
        unknown.update(w for w in read if w in missing)
        if read and callable(content_of) and content_of(caption) == []:
            blind += 1
    share = sum(unknown.values()) / words if words else 0.0
    if share <= UNKNOWN_SHARE and blind <= BLIND_SHARE * len(sample):
        return None
    common = ", ".join(f"{w} ({n})" for w, n in unknown.most_common(8))
    looked = f"{len(sample):,} of the {total:,} captions" if step > 1 else "the captions"
    said = (
        f"the model cannot read all of these captions: in {looked}, {share:.0%} of the "
        f"words are not in its vocabulary (most often: {common or 'none'}) and "
        f"{blind / len(sample):.0%} of the captions have no word it reads (those are encoded "
        "alike, and a search in their words is refused). The shipped model knows only "
        "the demo world's words (shapes, colours, sizes, counts, places); for other captions "
        "build and serve with a CLIP or SigLIP checkpoint (--encoder, docs/models.md)"
    )
    log.warning("%s", said)
    return said
