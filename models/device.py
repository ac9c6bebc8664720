"""Which torch device to run on: `auto` takes a CUDA GPU when torch sees one."""

from __future__ import annotations

import torch

from models.errors import UserError

DEVICES = ("auto", "cpu", "cuda")


class DeviceError(UserError, ValueError):
    """A device was asked for that this machine does not have."""


def resolve_device(device: str) -> torch.device:
    """auto -> cuda when present, else cpu; cuda without a GPU is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in DEVICES:
        raise DeviceError(f"unknown device {device!r}: use auto, cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise DeviceError(
            "device cuda asked for, but torch sees no CUDA GPU "
            "(use auto or cpu, or check the driver / NVIDIA runtime)"
        )
    return torch.device(device)
