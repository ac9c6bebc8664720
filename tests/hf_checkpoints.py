"""Tiny random Hugging Face checkpoints (CLIP, SigLIP, BLIP ITM) saved with their tokenizer and
processor files, built offline, for the adapter tests. Random weights: the tests check the
plumbing against the library's own forward pass, not retrieval quality."""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"
IMAGE = 32
PATCH = 8
SENTENCES = [
    "a small red circle",
    "two large blue squares",
    "a green triangle left of a cross",
    "three yellow diamonds",
    "a purple star above an orange circle",
] * 20


def _tiny(**extra: float) -> dict[str, float]:
    return {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        **extra,
    }


def _vision() -> dict[str, float]:
    # BLIP's vision default initializer_range is 1e-10: its tokens would all be ~0
    return _tiny(image_size=IMAGE, patch_size=PATCH, initializer_range=0.02)


def make_clip(out: Path) -> Path:
    """CLIP with a character-level BPE vocabulary (no merges)."""
    import transformers as tf

    torch.manual_seed(0)
    vocab = {c: i for i, c in enumerate(CHARS)}
    vocab |= {f"{c}</w>": len(CHARS) + i for i, c in enumerate(CHARS)}
    bos, eos = len(vocab), len(vocab) + 1
    vocab |= {"<|startoftext|>": bos, "<|endoftext|>": eos}
    out.mkdir(parents=True, exist_ok=True)
    (out / "vocab.json").write_text(json.dumps(vocab))
    (out / "merges.txt").write_text("#version: 0.2\n")
    tok = tf.CLIPTokenizer(str(out / "vocab.json"), str(out / "merges.txt"))
    cfg = tf.CLIPConfig(
        text_config=_tiny(
            vocab_size=len(vocab),
            max_position_embeddings=77,
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=eos,
        ),
        vision_config=_vision(),
        projection_dim=16,
    )
    images = tf.CLIPImageProcessor(
        size={"shortest_edge": IMAGE}, crop_size={"height": IMAGE, "width": IMAGE}
    )
    tf.CLIPModel(cfg).save_pretrained(out)
    tf.CLIPProcessor(image_processor=images, tokenizer=tok).save_pretrained(out)
    return out


def make_siglip(out: Path) -> Path:
    """SigLIP with a SentencePiece model trained on a few captions."""
    import sentencepiece as spm
    import transformers as tf

    torch.manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SENTENCES),
        model_writer=model,
        vocab_size=40,
        model_type="unigram",
        eos_id=1,
        unk_id=2,
        pad_id=0,
        bos_id=-1,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    (out / "spiece.model").write_bytes(model.getvalue())
    tok = tf.SiglipTokenizer(str(out / "spiece.model"), model_max_length=16)
    cfg = tf.SiglipConfig(
        text_config=_tiny(
            vocab_size=40,
            max_position_embeddings=16,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=1,
        ),
        vision_config=_vision(),
    )
    images = tf.SiglipImageProcessor(size={"height": IMAGE, "width": IMAGE})
    tf.SiglipModel(cfg).save_pretrained(out)
    tf.SiglipProcessor(image_processor=images, tokenizer=tok).save_pretrained(out)
    return out


def make_blip(out: Path) -> Path:
    """BLIP image-text matching with a BERT word-piece vocabulary."""
    import transformers as tf

    torch.manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)
    words = sorted({w for s in SENTENCES for w in s.split()})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *CHARS, *words]
    (out / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = tf.BertTokenizer(str(out / "vocab.txt"), model_max_length=32)
    cfg = tf.BlipConfig(
        text_config=_tiny(
            vocab_size=len(vocab),
            max_position_embeddings=32,
            encoder_hidden_size=32,
            pad_token_id=0,
            bos_token_id=2,
            sep_token_id=3,
            eos_token_id=3,
            is_decoder=True,
        ),  # cross-attention to the image
        vision_config=_vision(),
        projection_dim=16,
    )
    images = tf.BlipImageProcessor(size={"height": IMAGE, "width": IMAGE})
    tf.BlipForImageTextRetrieval(cfg).save_pretrained(out)
    tf.BlipProcessor(image_processor=images, tokenizer=tok).save_pretrained(out)
    return out
