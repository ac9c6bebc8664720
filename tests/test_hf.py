"""Hugging Face adapters against the library's own forward pass, on tiny random checkpoints."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from models.builtin import ModelLoadError
from models.hf import HFBlipReranker, HFDualEncoder
from tests.hf_checkpoints import make_blip, make_clip, make_siglip

TEXTS = ["a small red circle", "two large blue squares", "a green triangle"]


@pytest.fixture(scope="module")
def images() -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
        for h, w in ((64, 64), (40, 72), (32, 32))
    ]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {
        "clip": make_clip(root / "clip"),
        "siglip": make_siglip(root / "siglip"),
        "blip": make_blip(root / "blip"),
    }


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_dual_encoder_matches_the_library_forward(
    kind: str, checkpoints: dict[str, Path], images: list[Image.Image]
) -> None:
    enc = HFDualEncoder(checkpoints[kind])
    texts = enc.encode_texts(TEXTS)
    vecs, tokens = enc.encode_images(images)
    assert texts.shape == (3, enc.dim) and vecs.shape == (3, enc.dim)
    assert texts.dtype == np.float32 and np.allclose(np.linalg.norm(texts, axis=1), 1, atol=1e-5)
    assert tokens.shape == (3, *enc.token_shape) and tokens.dtype == np.float16
    # the model's own forward computes the same embeddings (its text_embeds / image_embeds)
    padding = "max_length" if kind == "siglip" else True
    inputs = enc.processor(
        text=TEXTS, images=images, padding=padding, truncation=True, return_tensors="pt"
    )
    with torch.inference_mode():
        out = enc.model(**inputs)
    want_t = torch.nn.functional.normalize(out.text_embeds, dim=-1).numpy()
    want_i = torch.nn.functional.normalize(out.image_embeds, dim=-1).numpy()
    np.testing.assert_allclose(texts, want_t, atol=1e-5)
    np.testing.assert_allclose(vecs, want_i, atol=1e-5)
    assert enc.fingerprint.startswith(f"hf-{kind}:")


def test_blip_reranker_matches_the_library_itm_head(
    checkpoints: dict[str, Path], images: list[Image.Image]
) -> None:
    rr = HFBlipReranker(checkpoints["blip"])
    tokens = rr.image_tokens(images)
    assert tokens.shape == (3, *rr.token_shape) and tokens.dtype == np.float16
    got = rr.score_pairs(TEXTS, tokens)
    inputs = rr.processor(text=TEXTS, images=images, padding=True, return_tensors="pt")
    with torch.inference_mode():
        itm = rr.model(**inputs, use_itm_head=True).itm_score
    want = (itm[:, 1] - itm[:, 0]).numpy()
    np.testing.assert_allclose(got, want, atol=2e-3)  # image tokens are stored as float16
    # a different image changes the score: the text really attends to the image tokens
    swapped = rr.score_pairs(TEXTS, tokens[::-1].copy())
    assert not np.allclose(got[[0, 2]], swapped[[0, 2]], atol=1e-6)


def test_wrong_checkpoint_kind_is_a_clear_error(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    with pytest.raises(ModelLoadError, match=r"not a CLIP or SigLIP checkpoint.*'blip'"):
        HFDualEncoder(checkpoints["blip"])
    with pytest.raises(ModelLoadError, match=r"not a BLIP checkpoint.*'clip'"):
        HFBlipReranker(checkpoints["clip"])
    with pytest.raises(ModelLoadError, match=r"no readable config\.json"):
        HFDualEncoder(tmp_path)


def test_fingerprint_follows_the_weights(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    a = HFDualEncoder(checkpoints["clip"]).fingerprint
    assert HFDualEncoder(checkpoints["clip"]).fingerprint == a
    other = make_clip(tmp_path / "clip2")
    weights = next(other.glob("*.safetensors"))
    torch.manual_seed(1)
    import transformers

    model = transformers.CLIPModel.from_pretrained(other, local_files_only=True)
    with torch.no_grad():
        model.logit_scale.add_(1.0)
    model.save_pretrained(other)
    assert weights.exists() and HFDualEncoder(other).fingerprint != a


def test_checkpoints_duet_cannot_use_are_refused_at_load(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Without its tokenizer files transformers built an empty tokenizer without a word, and
    every text became one vector; a BLIP captioning checkpoint loaded as the re-ranker with
    its matching head random. Both are a ModelLoadError (exit 2) now."""
    import json
    import shutil

    bare = shutil.copytree(checkpoints["clip"], tmp_path / "clip-bare")
    for name in ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink(missing_ok=True)
    with pytest.raises(ModelLoadError, match="has no tokenizer files"):
        HFDualEncoder(bare)
    captioning = shutil.copytree(checkpoints["blip"], tmp_path / "blip-cap")
    config = json.loads((captioning / "config.json").read_text())
    config["architectures"] = ["BlipForConditionalGeneration"]
    (captioning / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="not image-text matching"):
        HFBlipReranker(captioning)


def test_a_query_longer_than_the_encoder_reads_is_told_and_long_texts_are_cut_at_its_limit(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """The tiny CLIP's tokenizer is saved without `model_max_length`: a long text failed in
    the model ("Sequence length must be less than max_position_embeddings", a 500 and a
    build's traceback). Texts are cut at the model's limit now, and a query over it is
    told (the service answers 422), as with the builtin model."""
    enc = HFDualEncoder(checkpoints["clip"])
    long = " ".join(["red circle"] * 200)
    assert enc.encode_texts([long]).shape == (1, enc.dim)  # cut, not a failure
    said = enc.too_long(long)
    assert said is not None and f"at most {enc.max_tokens} tokens" in said
    assert enc.too_long("a red circle") is None
