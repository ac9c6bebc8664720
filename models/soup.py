"""`duet soup`: one cross-encoder from several stage-2 fine-tunes of the same model, by
averaging their weights (a "model soup", Wortsman et al. 2022).

Fine-tunes that start from one cross-encoder, with a small learning rate, stay in one basin:
the mean of their weights scores about as the mean of their logits would, at the cost of one
cross-encoder. Each fine-tune of duet's has its own blind spots (images whose own captions it
scores below 0; `benchmarks/border_probe.py`), about half of them shared with another run, so
the mean has fewer: on six validation splits the cross-encoder shipped then (`d5aa8044`) was
blind to 265 of 6,000 images, three fine-tunes 265-281 each, their mean (`81f84bcb`) 162; the
weights that ship now average that mean once more (`models/weights/README.md`).

Only the cross-encoder's tensors (`models.joint.CROSS_ENCODER`) are averaged. Everything else
(towers, projections, HAN head, vocabulary, shape) must be identical in every source, which
`duet train --from` guarantees, so indexes built with any of them stay valid in meaning
(though the fingerprint, of the whole file, changes: rebuild or re-stamp them).
"""

from __future__ import annotations

import filecmp
import json
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from models.builtin import WEIGHTS_FILE, BuiltinModel, ModelLoadError
from models.errors import UserError
from models.han import HAN_CONFIG, HAN_WEIGHTS
from models.joint import CROSS_ENCODER
from models.shipped import save_weights
from models.trainconfig import VAL_IMAGES

log = logging.getLogger("duet.soup")

SHARED_FILES = ("config.json", "vocab.json")


class SoupError(UserError, ValueError):
    """The sources cannot be averaged: not trained models, or not the same encoders."""

    hint = (
        "`duet soup` averages cross-encoders fine-tuned on one model's frozen encoders: "
        "make each source with `duet train --from THE_SAME_DIR --ce-warm --han-steps 0 ...` "
        "(--han-steps 0 keeps that model's HAN head; a HAN head trained per run differs)"
    )


def _check_sources(sources: Sequence[Path]) -> None:
    if len(sources) < 2:
        raise SoupError(f"give two or more model directories to average (got {len(sources)})")
    if len({src.resolve() for src in sources}) < len(sources):
        raise SoupError("a source is given twice (it would weigh double); give each once")
    for src in sources:
        if not (src / WEIGHTS_FILE).is_file():
            raise SoupError(f"{src} is not a trained model directory (no {WEIGHTS_FILE})")
    _same_files(sources, SHARED_FILES)


def _same_files(sources: Sequence[Path], names: Sequence[str]) -> None:
    first = sources[0]
    for src in sources[1:]:
        for name in names:
            here, there = (first / name).is_file(), (src / name).is_file()
            if here != there or (here and not filecmp.cmp(first / name, src / name, False)):
                raise SoupError(f"{src} and {first} differ in {name}")


def averaged(sources: Sequence[Path]) -> dict[str, torch.Tensor]:
    """The weights of `sources` with their cross-encoder tensors averaged; every other tensor
    must be the same in each (else `SoupError`)."""
    _check_sources(sources)
    states = [load_file(str(src / WEIGHTS_FILE)) for src in sources]
    out: dict[str, torch.Tensor] = {}
    for key, first in states[0].items():
        if any(key not in s or s[key].shape != first.shape for s in states[1:]):
            raise SoupError(f"{key} is missing or shaped differently in one of the sources")
        if key.startswith(CROSS_ENCODER):
            out[key] = torch.stack([s[key].double() for s in states]).mean(0).to(first.dtype)
        elif any(not torch.equal(s[key], first) for s in states[1:]):
            raise SoupError(f"{key} differs between the sources: they do not share their encoders")
        else:
            out[key] = first
    if any(set(s) != set(out) for s in states[1:]):
        raise SoupError("the sources hold different tensors")
    _same_files(sources, (HAN_WEIGHTS, HAN_CONFIG))  # the HAN head reads the same states
    return out


def soup(out: Path, sources: Sequence[Path], val_images: int = VAL_IMAGES) -> dict[str, Any]:
    """Write into `out` the model whose cross-encoder is the mean of `sources`' (the rest
    copied from the first), with a train.json naming every source's own train.json and the
    soup's validation on `val_images` held-out images (0: none); return that summary. `out`
    may not be one of the sources."""
    from models.train import validate_model

    sources = [Path(s) for s in sources]
    if any(out.resolve() == s.resolve() for s in sources):
        raise SoupError(f"--out {out} is one of the sources; write the soup elsewhere first")
    log.info("averaging the cross-encoders of %s", ", ".join(map(str, sources)))
    state = averaged(sources)
    out.mkdir(parents=True, exist_ok=True)
    for name in (*SHARED_FILES, HAN_WEIGHTS, HAN_CONFIG):
        if (sources[0] / name).is_file():
            shutil.copyfile(sources[0] / name, out / name)
        else:  # no stale head of whatever `out` held before beside the new weights
            (out / name).unlink(missing_ok=True)
    save_weights(state, out / WEIGHTS_FILE)
    try:
        runtime = BuiltinModel.load(out)
    except ModelLoadError as exc:  # pragma: no cover - the sources loaded, so does the mean
        raise SoupError(f"the averaged model does not load: {exc}") from exc
    summary: dict[str, Any] = {
        "command": "duet soup --out " + " ".join([str(out), *map(str, sources)]),
        "fingerprint": runtime.fingerprint,
        "soup_of": [_source_record(s) for s in sources],
    }
    if val_images:  # the long part (a minute or so on 2 CPU cores): said before, not after
        log.info("validating the soup on %d held-out images (--val-images)", val_images)
        summary["validation"], summary["validation_partial"] = validate_model(runtime, val_images)
    (out / "train.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _source_record(src: Path) -> dict[str, Any]:
    """What a source says of itself: its train.json, or its fingerprint alone."""
    record = src / "train.json"
    if record.is_file():
        return dict(json.loads(record.read_text()))
    return {"fingerprint": BuiltinModel.load(src).fingerprint}
