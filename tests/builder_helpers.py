"""What the builder-at-scale tests (test_builder_scale.py, test_builder_ann.py) share."""

from __future__ import annotations

# one FAISS factory string of each index family the builder offers, small enough for tests
FAMILIES = ["Flat", "IVF4,Flat", "IVF4_HNSW32,SQ8", "IVF4,PQ8x4", "HNSW32"]
