"""The plain alternative duet is measured against: the FastAPI script a user would write.

Same model, same index, per request (a sentence at /search/text, an upload at
/search/image): encode -> FAISS top-M -> the model's cross-encoder forward
(`JointModel.itm_logits`, its PyTorch module as trained) -> ADD_lambda -> top-k. A sync
endpoint (FastAPI runs it in its thread pool), torch's default threads, no cache, no
batching, no admission control.

    python benchmarks/baseline_server.py --index indexes/current --port 8100
"""

from __future__ import annotations

import argparse
import base64
import io
import sqlite3
from pathlib import Path

import faiss
import numpy as np
import torch
import uvicorn
from fastapi import FastAPI, HTTPException
from PIL import Image
from pydantic import BaseModel

from models.builtin import BuiltinModel
from models.fusion import DEFAULT_FUSION_LAMBDA, fuse, sigmoid


class Query(BaseModel):
    query: str
    top_k: int = 10
    candidates: int = 50
    rerank: bool = True


class ImageQuery(BaseModel):
    image_b64: str
    top_k: int = 10
    candidates: int = 50
    rerank: bool = True


def make_app(index_dir: Path, device: str = "cpu", reranker: Path | None = None) -> FastAPI:
    """The script over `index_dir`; `reranker`: a BLIP ITM directory re-ranks instead of the
    builtin cross-encoder (the index must have been built with it: its image states)."""
    model = BuiltinModel.load(device=device)
    model.model.serve_kernels(False)  # the model's modules as trained, not duet's runtime
    blip = None
    if reranker is not None:
        from models.hf import HFBlipReranker

        blip = HFBlipReranker(reranker, device=device)
    index = faiss.read_index(str(index_dir / "image.faiss"))
    captions = faiss.read_index(str(index_dir / "text.faiss"))
    tokens = np.load(index_dir / "image_tokens.npy", mmap_mode="r")
    db = sqlite3.connect(index_dir / "items.sqlite", check_same_thread=False)
    ids = [row[0] for row in db.execute("SELECT id FROM images ORDER BY row")]
    texts = db.execute("SELECT id, text FROM texts ORDER BY row").fetchall()
    app = FastAPI()

    @app.post("/search/image")
    def search_image(q: ImageQuery) -> dict[str, object]:
        """An upload finds captions: encode it, FAISS over the captions, the cross-encoder
        over (each candidate caption, the upload's states)."""
        if blip is not None:  # its states are the index's images', not an upload's
            raise HTTPException(501, "uploads are re-ranked with the builtin model only")
        img = Image.open(io.BytesIO(base64.b64decode(q.image_b64))).convert("RGB")
        with torch.inference_mode():
            vec, states = model.encode_images([img])
            dots, rows = captions.search(vec, q.candidates if q.rerank else q.top_k)
            dots, rows = dots[0], rows[0]
            score = dots
            if q.rerank:
                ids_t, pad = model.tokenizer.batch([texts[r][1] for r in rows])
                ids_t, pad = ids_t.to(model.device), pad.to(model.device)
                text = model.model.text_tokens(ids_t, pad)
                img_t = torch.from_numpy(np.asarray(states, dtype=np.float32)).to(model.device)
                logits = model.model.itm_logits(text, pad, img_t.expand(len(rows), -1, -1))
                score = fuse(dots, logits.cpu().numpy(), DEFAULT_FUSION_LAMBDA)
            order = np.argsort(-score)[: q.top_k]
        return {"hits": [{"id": texts[rows[i]][0], "score": float(score[i])} for i in order]}

    @app.post("/search/text")
    def search(q: Query) -> dict[str, object]:
        with torch.inference_mode():
            vec = model.encode_texts([q.query])
            dots, rows = index.search(vec, q.candidates if q.rerank else q.top_k)
            dots, rows = dots[0], rows[0]
            score = dots
            if q.rerank and blip is not None:  # the heavy re-ranker, its plain forward
                ce = sigmoid(blip.plain_scores([q.query] * len(rows), tokens[rows]))
                score = DEFAULT_FUSION_LAMBDA * dots + (1 - DEFAULT_FUSION_LAMBDA) * ce
            elif q.rerank:
                ids_t, pad = model.tokenizer.batch([q.query])  # the sentence once, shared
                ids_t, pad = ids_t.to(model.device), pad.to(model.device)
                text = model.model.text_tokens(ids_t, pad).expand(len(rows), -1, -1)
                pad = pad.expand(len(rows), -1)
                img = torch.from_numpy(np.array(tokens[rows], dtype=np.float32)).to(model.device)
                ce = torch.sigmoid(model.model.itm_logits(text, pad, img)).cpu().numpy()
                score = DEFAULT_FUSION_LAMBDA * dots + (1 - DEFAULT_FUSION_LAMBDA) * ce
            order = np.argsort(-score)[: q.top_k]
        return {"hits": [{"id": ids[rows[i]], "score": float(score[i])} for i in order]}

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--index",
        type=Path,
        default=Path("indexes/current"),
        help="an index version directory (default: indexes/current)",
    )
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument(
        "--reranker", type=Path, default=None, help="a BLIP ITM directory (DUET_RERANKER's kind)"
    )
    args = p.parse_args()
    uvicorn.run(
        make_app(args.index.resolve(), args.device, args.reranker),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
    )


if __name__ == "__main__":
    main()
