"""Word-level tokenizer for duet's own model (the synthetic world has a closed vocabulary)."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from models.shipped import ALIASES, DEFAULT_WEIGHTS, caption_words, dropped_symbols

PAD, UNK, CLS = "[PAD]", "[UNK]", "[CLS]"
# Words that alone say nothing about a picture: articles, prepositions, "and" / "with", and
# the captions' filler ("there is", "you can see", "a picture of"). A query whose every known
# word is one of these has nothing the model understood (the service answers 422 for it).
FUNCTION_WORDS = frozenset(
    {"a", "an", "the", "and", "or", "with", "of", "in", "on", "at", "to", "near", "over"}
    | {"under", "above", "below", "beneath", "is", "are", "it", "its", "there", "you", "can"}
    | {"see", "picture", "placed"}
)


def unique_texts(texts: Sequence[str]) -> tuple[list[str], list[int]]:
    """(each distinct text once, in first-seen order; each text's row in that list): a text
    query's candidates all share its sentence, so re-rankers encode it once."""
    row: dict[str, int] = {}
    rows = [row.setdefault(t, len(row)) for t in texts]
    return list(row), rows


def unknown_words(query: str, vocab: WordTokenizer | None = None) -> list[str]:
    """The words of `query` that `vocab` (default: the shipped weights' vocab.json) does not
    know, each once, in order."""
    return (vocab or _shipped_vocab()).unknown_words(query)


@functools.lru_cache(maxsize=1)
def _shipped_vocab() -> WordTokenizer:
    return WordTokenizer.load(DEFAULT_WEIGHTS / "vocab.json")


class WordTokenizer:
    """Maps words to ids; unknown words become [UNK], a [CLS] id leads every sequence."""

    def __init__(
        self, words: list[str], max_len: int = 32, aliases: dict[str, str] = ALIASES
    ) -> None:
        self.itos = [PAD, UNK, CLS, *words]
        self.stoi = {w: i for i, w in enumerate(self.itos)}
        # The aliases this vocabulary reads as another word: those it lacks, whose word it has.
        self.aliases = {a: w for a, w in aliases.items() if a not in self.stoi and w in self.stoi}
        for alias, word in self.aliases.items():
            self.stoi[alias] = self.stoi[word]
        self.max_len = max_len

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def ids(self, text: str) -> list[int]:
        """Token ids of one text, [CLS] first, cut at `max_len`."""
        unk = self.stoi[UNK]
        toks = [self.stoi[CLS], *(self.stoi.get(w, unk) for w in caption_words(text))]
        return toks[: self.max_len]

    def reading(self, text: str) -> str:
        """What this tokenizer reads of `text`: its words, each alias as its word ("a and b"
        reads "a with b"); texts with the same reading get the same ids (the cache's key).
        The symbols it drops come last: they change no id, but an answer lists them as
        unknown, so "a red 🐶" and "a red" must not share a cached answer."""
        words = [self.aliases.get(w, w) for w in caption_words(text)]
        return " ".join(words + list(dict.fromkeys(dropped_symbols(text))))  # each sign once

    def unknown_words(self, text: str) -> list[str]:
        """The words of `text` this vocabulary does not know (they are read as [UNK]), each
        once, in order, then the symbols it drops ("🐶", "★"); the service reports them so a
        user sees which words were ignored."""
        seen: dict[str, None] = {}
        for w in caption_words(text):
            if w not in self.stoi:
                seen.setdefault(w, None)
        for symbol in dropped_symbols(text):
            seen.setdefault(symbol, None)
        return list(seen)

    def too_long(self, text: str) -> str | None:
        """Why the model would not read all of `text` (it reads its first `max_len` - 1
        words, after [CLS]), or None: a query is refused rather than cut short unseen."""
        words = caption_words(text)
        limit = self.max_len - 1
        if len(words) <= limit:
            return None
        over = len(words) - limit
        return (
            f"the model reads at most {limit} words and this query has {len(words)}: shorten "
            f"it by {over} (its last {over}, from word {limit + 1}, "
            f'"{words[limit]}", on, would not be read)'
        )

    def content_words(self, text: str) -> list[str]:
        """The words of `text` this vocabulary knows, less `FUNCTION_WORDS`: what the model
        understood of it (none for "crimson box" or "a pink star")."""
        return [w for w in caption_words(text) if w in self.stoi and w not in FUNCTION_WORDS]

    def batch(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded ids (B, T) and a padding mask (True where padded)."""
        seqs = [self.ids(t) for t in texts]
        width = max(len(s) for s in seqs)
        # padded in numpy: a torch op per row cost 4x the tokenising (a build's 5M captions)
        rows = np.zeros((len(seqs), width), dtype=np.int64)
        for i, s in enumerate(seqs):
            rows[i, : len(s)] = s
        ids = torch.from_numpy(rows)
        return ids, ids == 0

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"words": self.itos[3:], "max_len": self.max_len}, indent=1))

    @classmethod
    def load(cls, path: Path) -> WordTokenizer:
        data = json.loads(path.read_text())
        return cls(list(data["words"]), int(data["max_len"]))
