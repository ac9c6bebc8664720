"""benchmarks/index_scale.py's vectors: synthetic, but shaped like embeddings rather than noise
(that script's docstring says how and why)."""

from __future__ import annotations

import numpy as np

DIM = 128  # duet's embedding size
GROUPS, PER_GROUP = 64, 64
GROUP_SPREAD = 0.7  # norm of a component centre's offset from its group's unit centre
NOISE = 0.9  # norm of a vector's offset from its component centre
SPECTRUM_DECAY = 0.5  # noise scale of the i-th principal direction ~ i**-SPECTRUM_DECAY
DATA_SEED = 0


class Mixture:
    """Clustered unit vectors; the same instance gives base and query vectors one distribution."""

    def __init__(self, seed: int = DATA_SEED) -> None:
        rng = np.random.default_rng(seed)
        groups = _unit(rng.standard_normal((GROUPS, DIM), dtype=np.float32))
        offsets = rng.standard_normal((GROUPS * PER_GROUP, DIM), dtype=np.float32)
        self.centres = _unit(
            np.repeat(groups, PER_GROUP, axis=0) + offsets * np.float32(GROUP_SPREAD / np.sqrt(DIM))
        )
        basis, _ = np.linalg.qr(rng.standard_normal((DIM, DIM)))
        scale = np.arange(1, DIM + 1, dtype=np.float64) ** -SPECTRUM_DECAY
        scale *= NOISE / np.sqrt((scale**2).sum())
        self.noise = (scale[:, None] * basis).astype(np.float32)

    def sample(self, n: int, seed: int, chunk: int = 1 << 16) -> np.ndarray:
        """n float32 unit vectors, built chunk by chunk so 1M costs one 512 MB array."""
        rng = np.random.default_rng(seed)
        out = np.empty((n, DIM), dtype=np.float32)
        for lo in range(0, n, chunk):
            m = min(chunk, n - lo)
            x = self.centres[rng.integers(len(self.centres), size=m)]
            x += rng.standard_normal((m, DIM), dtype=np.float32) @ self.noise
            out[lo : lo + m] = _unit(x)
        return out


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)
