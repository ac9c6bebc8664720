"""A BLIP-ITM-base-shaped re-ranker with random weights, made here from its configuration
(nothing is downloaded): the heavy cross-encoder of the serving benchmark's real-size row.

Real deployments re-rank with a model far heavier than duet's own (about 2 M parameters in
its cross-encoder). BLIP ITM base is the usual one: a ViT-B/16 vision encoder at 384 px
(577 states of 768 per image, what the index stores) and a BERT-base text encoder with
cross-attention to them, 12 layers of 768 each, about 224 M parameters. Its weights here are
random: the row measures serving speed, not ranking quality. The vocabulary is the demo
world's words (so its tokenizer reads the benchmark's queries), the embedding table keeps
BLIP's 30,524 rows.

    python benchmarks/blip_base.py --out /tmp/blip-base --device cuda     # on the GPU host
    duet build --corpus data/demo/manifest.jsonl --out /tmp/idx-blip --reranker /tmp/blip-base
    python benchmarks/serve_load.py --device cuda --index-dir /tmp/idx-blip \\
        --reranker /tmp/blip-base --skip-bound --concurrency 1,32
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, cast

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BASE_VOCAB = 30524  # BLIP's text vocabulary (BERT's plus its special tokens)


def _shapes(tiny: bool) -> tuple[dict[str, object], dict[str, object], int]:
    """(text config, vision config, projection dim): BLIP ITM base's, or a tiny stand-in."""
    if tiny:
        layer: dict[str, object] = {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
        }
        return (
            {**layer, "encoder_hidden_size": 32},
            {**layer, "image_size": 32, "patch_size": 8},
            16,
        )
    base: dict[str, object] = {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
    }
    return (
        {**base, "encoder_hidden_size": 768},
        {**base, "image_size": 384, "patch_size": 16},
        256,
    )


def make(out: Path, tiny: bool = False, dtype: str = "fp16", device: str = "cpu") -> Path:
    """Write the checkpoint (weights, config, BERT word-piece vocabulary, processor) to `out`."""
    import torch
    import transformers as tf

    from models.shipped import DEFAULT_WEIGHTS
    from models.tokenizer import WordTokenizer

    torch.manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)
    words = WordTokenizer.load(DEFAULT_WEIGHTS / "vocab.json").itos[3:]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    if not tiny:  # BLIP's embedding table, filled with unused entries
        vocab += [f"[unused{i}]" for i in range(BASE_VOCAB - len(vocab))]
    (out / "vocab.txt").write_text("\n".join(vocab) + "\n")
    text, vision, proj = _shapes(tiny)
    cfg = tf.BlipConfig(
        text_config={
            **text,
            "vocab_size": len(vocab),
            "max_position_embeddings": 512 if not tiny else 40,
            "pad_token_id": 0,
            "bos_token_id": 2,
            "sep_token_id": 3,
            "eos_token_id": 3,
            "is_decoder": True,  # the text encoder's cross-attention to the image states
        },
        # BLIP's vision default initializer_range (1e-10) would make every state ~0
        vision_config={**vision, "initializer_range": 0.02},
        projection_dim=proj,
    )
    t0 = time.perf_counter()
    with torch.device(device):
        model = tf.BlipForImageTextRetrieval(cfg)
    cast_to = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    model = cast(Any, model).to(cast_to)
    model.save_pretrained(out)
    size = int(vision["image_size"])  # type: ignore[call-overload]
    tok = tf.BertTokenizer(str(out / "vocab.txt"), model_max_length=35)
    images = tf.BlipImageProcessor(size={"height": size, "width": size})
    tf.BlipProcessor(image_processor=images, tokenizer=tok).save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"BLIP ITM {'tiny' if tiny else 'base'}-shaped, {params / 1e6:.0f} M parameters, "
        f"{dtype}, written to {out} in {time.perf_counter() - t0:.1f}s"
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tiny", action="store_true", help="a tiny stand-in of the same kind (tests)")
    p.add_argument("--dtype", default="fp16", choices=("fp16", "bf16", "fp32"))
    p.add_argument("--device", default="cpu", help="where the random weights are drawn")
    args = p.parse_args()
    make(args.out, args.tiny, args.dtype, args.device)


if __name__ == "__main__":
    main()
