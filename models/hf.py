"""Local Hugging Face checkpoints behind duet's protocols.

- `HFDualEncoder`: a CLIP or SigLIP directory as the bi-encoder (`BiEncoder`). Its image
  "tokens" are the vision tower's patch features (CLIP: through `post_layernorm` and
  `visual_projection`, so they live in the joint space; SigLIP: the last hidden state).
- `HFBlipReranker`: a BLIP image-text-matching directory (`BlipForImageTextRetrieval`) as
  the cross-encoder (`PairReranker`). Its image tokens are the BLIP vision encoder's output,
  which the builder stores so a query never re-encodes candidate images.

Nothing is downloaded: every load is `from_pretrained(directory, local_files_only=True)`.
transformers is imported lazily, so the built-in model never needs it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from models.blip_itm import BlipItmScorer
from models.device import resolve_device
from models.hf_load import (
    DUAL_ENCODER_TYPES,
    RERANKER_TYPES,
    _load,
    _tokenize,
    fingerprint,
    max_tokens,
    too_long,
)
from models.tokenizer import unique_texts

LENGTH_STEP = 8  # the BLIP scorer's sentence-length groups (tokens)


def _pooled(out: Any) -> torch.Tensor:
    """transformers < 5 returns the projected features, >= 5 an output with `pooler_output`."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def length_groups(
    lengths: np.ndarray, step: int = LENGTH_STEP, call_cost: float = 0.0
) -> list[np.ndarray]:
    """Pair positions grouped by sentence length rounded up to `step` tokens, so that a
    group padded to its own longest spares a batch's short sentences its longest's length.
    Each group is one more scorer call: `call_cost` is what a call costs beyond its pairs,
    in pair-tokens of work (`HFBlipReranker.calibrate`), and a group whose padding to the
    next longer group's length would cost less than that joins it (on a GPU a few dozen
    pairs cost less than launching their call: there 50 pairs of different sentences in
    three groups scored at 0.66x the module's one padded call)."""
    buckets = (lengths + step - 1) // step
    groups = [np.flatnonzero(buckets == g) for g in np.unique(buckets)]
    if call_cost <= 0:
        return groups
    merged: list[np.ndarray] = []
    carry = groups[0]
    for nxt in groups[1:]:
        padding = len(carry) * (int(lengths[nxt].max()) - int(lengths[carry].max()))
        if padding < call_cost:
            carry = np.sort(np.concatenate([carry, nxt]))
        else:
            merged.append(carry)
            carry = nxt
    merged.append(carry)
    return merged


def _rgb(images: Sequence[Image.Image]) -> list[Image.Image]:
    return [img.convert("RGB") for img in images]


class HFDualEncoder:
    """A CLIP or SigLIP checkpoint as duet's bi-encoder, on `device` (auto, cpu or cuda)."""

    def __init__(self, directory: Path, device: str | torch.device = "cpu") -> None:
        self.device = resolve_device(device) if isinstance(device, str) else device
        self.model, self.processor, self.kind = _load(
            directory, DUAL_ENCODER_TYPES, "encoder (DUET_ENCODER)", self.device
        )
        self.name = f"hf-{self.kind}"
        self.fingerprint = fingerprint(self.kind, Path(directory))
        self._tokenizing = threading.Lock()  # see _tokenize
        cfg = self.model.config
        self.max_tokens = max_tokens(self.processor.tokenizer, cfg.text_config)
        self.dim = int(getattr(cfg, "projection_dim", 0) or cfg.text_config.hidden_size)
        vision = cfg.vision_config
        patches = (vision.image_size // vision.patch_size) ** 2
        width = self.dim if self.kind == "clip" else vision.hidden_size
        self.token_shape = (patches, width)

    def _text_inputs(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        # SigLIP was trained on max-length padding; CLIP on the longest in the batch
        padding = "max_length" if self.kind == "siglip" else True
        enc = _tokenize(self.processor.tokenizer, self._tokenizing, texts, padding, self.max_tokens)
        return {
            k: v.to(self.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")
        }

    def too_long(self, text: str) -> str | None:
        """Why the encoder would not read all of `text` (422), or None."""
        return too_long(self.processor.tokenizer, self._tokenizing, text, self.max_tokens)

    def encode_texts(self, texts: Sequence[str]) -> np.ndarray:
        with torch.inference_mode():
            feats = _pooled(self.model.get_text_features(**self._text_inputs(texts)))
        return torch.nn.functional.normalize(feats.float(), dim=-1).cpu().numpy()

    def encode_images(self, images: Sequence[Image.Image]) -> tuple[np.ndarray, np.ndarray]:
        pix = self.processor.image_processor(_rgb(images), return_tensors="pt")["pixel_values"]
        pix = pix.to(self.device, self.model.dtype)
        with torch.inference_mode():  # one vision pass; get_image_features pools the same way
            out = self.model.vision_model(pixel_values=pix)
            hidden = out.last_hidden_state
            if self.kind == "clip":  # drop [CLS]; the same head the pooled feature goes through
                feats = self.model.visual_projection(out.pooler_output)
                tokens = self.model.visual_projection(
                    self.model.vision_model.post_layernorm(hidden[:, 1:])
                )
            else:  # SigLIP: the attention-pooling head's output is the image feature
                feats = out.pooler_output
                tokens = hidden
        vecs = torch.nn.functional.normalize(feats.float(), dim=-1).cpu().numpy()
        return vecs, tokens.to(torch.float16).cpu().numpy()


class HFBlipReranker:
    """A BLIP image-text-matching checkpoint as duet's cross-encoder, on `device`."""

    def __init__(self, directory: Path, device: str | torch.device = "cpu") -> None:
        self.device = resolve_device(device) if isinstance(device, str) else device
        self.model, self.processor, self.kind = _load(
            directory, RERANKER_TYPES, "re-ranker (DUET_RERANKER)", self.device
        )
        self.name = "hf-blip-itm"
        self.fingerprint = fingerprint("blip", Path(directory))
        self._tokenizing = threading.Lock()
        self.max_tokens = max_tokens(self.processor.tokenizer, self.model.config.text_config)
        # the text encoder restructured for scoring (models.blip_itm); None: the module's own
        self.scorer = BlipItmScorer.of(self.model)
        vision = self.model.config.vision_config
        self.token_shape = ((vision.image_size // vision.patch_size) ** 2 + 1, vision.hidden_size)
        self.call_cost = 0.0  # pair-tokens a scorer call costs beyond its pairs (calibrate)
        # pairs `calibrate` times: enough to keep a GPU busy; few on a CPU, where each is ~60
        # ms of BLIP base and the answer is about zero anyway
        self.calibration_pairs = 512 if self.device.type == "cuda" else 4

    def calibrate(self, states: np.ndarray | torch.Tensor, text: str = "a warm up query") -> float:
        """Measure what one more scorer call costs, in pair-tokens of work, and keep it for
        `score_pairs`' length groups: the scorer timed on 1 pair and on `len(states)` pairs
        of `text` (each the best of three calls, the first building its kernels), the
        difference giving the cost per pair and the rest of the 1-pair call the call's own.
        `states` should be
        enough pairs to keep the device busy (a few hundred on a GPU), so that the cost per
        pair is the one a large batch pays; no more is claimed than was measured (at most
        the pair-tokens timed). About zero on a CPU, where the pairs are the work; hundreds
        on a GPU, where launching a call's kernels is. Out of device memory: unchanged."""
        if self.scorer is None or len(states) < 2:
            return self.call_cost
        scorer, n = self.scorer, len(states)
        enc = _tokenize(
            self.processor.tokenizer, self._tokenizing, [text] * n, True, self.max_tokens
        )
        ids, mask = enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)

        def timed(k: int) -> float:
            best = float("inf")
            for _ in range(3):  # the first builds the shape's kernels
                sync()
                t0 = time.perf_counter()
                scorer.logits(ids[:k], mask[:k], image[:k])
                sync()
                best = min(best, time.perf_counter() - t0)
            return best

        try:
            image = self.states(states)
            one, many = timed(1), timed(n)
        except RuntimeError:  # out of device memory: the groups stay as they are
            return self.call_cost
        tokens = int(mask[0].sum())
        measured = n * tokens  # pair-tokens: past them the cost per pair is not known
        per_pair = (many - one) / (n - 1)
        own = one - per_pair
        self.call_cost = min(measured, own / per_pair * tokens) if per_pair > 0 else float(measured)
        self.call_cost = max(0.0, self.call_cost)
        return self.call_cost

    def image_tokens(self, images: Sequence[Image.Image]) -> np.ndarray:
        """The vision encoder's output per image (what `score_pairs` reads), float16."""
        pix = self.processor.image_processor(_rgb(images), return_tensors="pt")["pixel_values"]
        with torch.inference_mode():
            hidden = self.model.vision_model(
                pixel_values=pix.to(self.device, self.model.dtype)
            ).last_hidden_state
        return hidden.to(torch.float16).cpu().numpy()

    def states(self, image_tokens: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Image states on the model's device in its dtype. Host arrays travel in the index's
        float16 and are cast there: no float32 copy on the host (at BLIP base a request's 50
        candidates are 44 MB of float16; the float32 copy and its transfer were most of a
        GPU request's time). A tensor (a resident table's rows) is used where it is."""
        if isinstance(image_tokens, torch.Tensor):
            t = image_tokens
        else:
            arr = np.ascontiguousarray(image_tokens)
            t = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
        return t.to(self.device).to(self.model.dtype)

    def resident(self, tokens: np.ndarray, share: float = 0.5) -> StateTable | None:
        """An index's image states copied to the model's GPU (rows gathered there per
        request, nothing per request crosses from the host), when they fit `share` of its free
        memory; None on the CPU or when they do not fit (the host path reads them)."""
        if self.device.type != "cuda" or tokens.size == 0:
            return None
        need = tokens.size * torch.finfo(self.model.dtype).bits // 8
        free, _ = torch.cuda.mem_get_info(self.device)
        if need > share * free:
            return None
        try:
            return StateTable(tokens, self.device, self.model.dtype)
        except RuntimeError:  # out of device memory after all
            return None

    def score_pairs(
        self, texts: Sequence[str], image_tokens: np.ndarray | torch.Tensor
    ) -> np.ndarray:
        """ITM logit (match minus no-match) per (text, image tokens) pair."""
        if len(texts) == 0:
            return np.zeros(0, dtype=np.float32)
        if len(image_tokens) != len(texts):
            raise ValueError(f"{len(texts)} texts but {len(image_tokens)} images' states")
        # the scorer cuts each length group's columns from the right: right padding only
        if self.scorer is None or self.processor.tokenizer.padding_side != "right":
            return self.plain_scores(texts, image_tokens)
        unique, owner = unique_texts(texts)  # a request's sentence once, not per candidate
        enc = _tokenize(self.processor.tokenizer, self._tokenizing, unique, True, self.max_tokens)
        ids, mask = enc["input_ids"][owner], enc["attention_mask"][owner]
        lengths = mask.sum(dim=1).numpy()
        with torch.inference_mode():
            image = self.states(image_tokens)
            out = torch.empty(len(texts), device=self.device)
            for pairs in length_groups(lengths, call_cost=self.call_cost):
                n = int(lengths[pairs].max())
                if len(pairs) == len(texts):  # one group: no gathering
                    out = self.scorer.logits(
                        ids[:, :n].to(self.device), mask[:, :n].to(self.device), image
                    )
                    break
                at = torch.from_numpy(pairs).to(self.device)
                rows = torch.from_numpy(pairs)
                out[at] = self.scorer.logits(
                    ids[rows, :n].to(self.device),
                    mask[rows, :n].to(self.device),
                    image.index_select(0, at),
                )
        return out.cpu().numpy()

    def plain_scores(
        self, texts: Sequence[str], image_tokens: np.ndarray | torch.Tensor
    ) -> np.ndarray:
        """The same logits by the model's own forward (the plain script's way)."""
        if len(texts) == 0:
            return np.zeros(0, dtype=np.float32)
        enc = _tokenize(self.processor.tokenizer, self._tokenizing, texts, True, self.max_tokens)
        image = self.states(image_tokens)
        with torch.inference_mode():
            hidden = self.model.text_encoder(
                input_ids=enc["input_ids"].to(self.device),
                attention_mask=enc["attention_mask"].to(self.device),
                encoder_hidden_states=image,
                encoder_attention_mask=torch.ones(
                    image.shape[:2], dtype=torch.long, device=self.device
                ),
            ).last_hidden_state
            logits = self.model.itm_head(hidden[:, 0, :]).float()
        return (logits[:, 1] - logits[:, 0]).cpu().numpy()


class StateTable:
    """One index version's image states on a re-ranker's device, gathered by row there
    (`HFBlipReranker.resident`); released with the version (`IndexVersion.close`)."""

    SLICE = 4096  # rows copied at a time: a memory-mapped table never sits in RAM whole

    def __init__(self, tokens: np.ndarray, device: torch.device, dtype: torch.dtype) -> None:
        self.tokens = torch.empty(tokens.shape, dtype=dtype, device=device)
        for a in range(0, tokens.shape[0], self.SLICE):
            part = torch.from_numpy(np.array(tokens[a : a + self.SLICE]))
            self.tokens[a : a + self.SLICE] = part.to(device).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.tokens.element_size() * self.tokens.nelement()

    def rows(self, rows: np.ndarray) -> torch.Tensor:
        """The states of `rows` (FAISS rows), on the table's device."""
        index = torch.from_numpy(np.asarray(rows, dtype=np.int64)).to(self.tokens.device)
        return self.tokens.index_select(0, index)

    def release(self) -> None:
        """Free the device memory now (a swapped-out version's table)."""
        self.tokens = self.tokens.new_zeros((0, *self.tokens.shape[1:]))
