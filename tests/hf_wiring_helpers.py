"""The tiny random checkpoints the wiring tests (test_hf_wiring*.py) share."""

from __future__ import annotations

from pathlib import Path

from tests.hf_checkpoints import make_blip, make_clip, make_siglip


def make_checkpoints(root: Path) -> dict[str, Path]:
    """Tiny random CLIP, SigLIP and BLIP ITM checkpoints under `root`, by kind."""
    return {
        "clip": make_clip(root / "clip"),
        "siglip": make_siglip(root / "siglip"),
        "blip": make_blip(root / "blip"),
    }
