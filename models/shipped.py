"""The builtin model as serving knows it: where its shipped weights live and how its word
tokenizer reads a text. Torch-free, and free of training code: serving, training and the
CLI all import it (training and the world generator from here, never the other way)."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from typing import Any

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
    other characters (most captions and queries: 0.6 against 1.3 us).

    A text with other scripts' characters is read in Unicode's compatibility form first
    (full-width "ｒｅｄ" is "red", the ligature "ﬁ" is "fi"), and a run of letters that is
    not all ASCII is one word ("café", "naïve", "日本の猫"), which a vocabulary of English
    words does not know and `WordTokenizer.unknown_words` reports as typed; before, only its
    ASCII letters were kept ("caf", "na" and "ve") and the rest dropped unseen."""
    lower = text.lower()
    if _PLAIN.fullmatch(lower):
        return lower.split()
    if lower.isascii():
        return _WORD.findall(lower)
    words: list[str] = []
    for run in _runs(unicodedata.normalize("NFKC", text).lower()):
        words += _WORD.findall(run) if run.isascii() else [run]
    return words


def _runs(text: str) -> list[str]:
    """The runs of letters and digits of `text`, in any script, with their combining marks
    (a Devanagari word's vowel signs, the dot of a lowered "İ"): a run is one word as typed.
    A mark starts none: an emoji's variation selector ("❤️") was a word of its own."""
    runs: list[str] = []
    start = None
    for i, ch in enumerate(text):
        if ch.isalnum() or (start is not None and unicodedata.category(ch).startswith("M")):
            start = i if start is None else start
        elif start is not None:
            runs.append(text[start:i])
            start = None
    if start is not None:
        runs.append(text[start:])
    return runs


# what joins an emoji's parts into one picture: zero-width joiner, variation selectors, the
# enclosing keycap ("#️⃣") and the tags of a subdivision's flag (England's, Scotland's)
_JOINERS = frozenset("\u200d\ufe0e\ufe0f\u20e3") | frozenset(map(chr, range(0xE0020, 0xE0080)))


def dropped_symbols(text: str) -> list[str]:
    """The runs of non-ASCII symbols in `text` (emoji, "★", "→", "♥"), each as typed, that
    `caption_words` drops: they are no letter or digit, yet unlike punctuation they say
    something ("a red 🐶"), so the service lists them among a query's unknown words rather
    than ignore them without a word. An emoji with its skin tone or joined family is one."""
    if text.isascii():
        return []
    runs: list[str] = []
    run = ""
    for i, ch in enumerate(text):
        if ch == "\u20e3" and not run and text[:i].rstrip("\ufe0f")[-1:] in ("#", "*"):
            run = text[:i].rstrip("\ufe0f")[-1] + text[len(text[:i].rstrip("\ufe0f")) : i + 1]
        elif _dropped_sign(ch) or (run and ch in _JOINERS):
            run += ch
        elif run:
            runs.append(run)
            run = ""
    return [*runs, run] if run else runs


def _dropped_sign(ch: str) -> bool:
    """A sign `caption_words` drops: a symbol outside ASCII whose compatibility form has no
    letter or digit ("ⓡ" reads "r", "™" "tm", "㊗" "祝": words, not signs)."""
    return (
        not ch.isascii()
        and unicodedata.category(ch).startswith("S")
        and not any(c.isalnum() for c in unicodedata.normalize("NFKC", ch))
    )


def save_weights(state: dict[str, Any], path: Path) -> None:
    """Write tensors as safetensors with the permissions any file this process writes gets
    (0644 under the usual umask 022): safetensors' own file writer makes its file 0600, so a
    model trained by one user could not be read by the service's (uid 10001 in the image)."""
    from safetensors.torch import save  # torch's: only where weights are written

    path.write_bytes(save(state, metadata={"format": "pt"}))
