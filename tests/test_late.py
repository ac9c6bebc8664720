"""Late interaction and k-means regions against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from models.late import kmeans_regions, late_scores, local_scores


def test_local_score_hand_computed() -> None:
    q = np.array([[[1.0, 0.0], [0.0, 2.0], [5.0, 5.0]]])  # third token is padding
    mask = np.array([[True, True, False]])
    items = np.array([[[1.0, 1.0], [0.0, -3.0]]])
    # token 1 -> best cos(1,0 ; 1,1) = 1/sqrt2; token 2 -> best cos(0,1 ; 1,1) = 1/sqrt2
    assert local_scores(q, mask, items)[0] == pytest.approx(1 / np.sqrt(2), abs=1e-6)
    items2 = np.array([[[3.0, 0.0], [0.0, 1.0]]])  # an exact match for each token
    assert local_scores(q, mask, items2)[0] == pytest.approx(1.0, abs=1e-6)


def test_item_mask_keeps_padding_out_of_the_max() -> None:
    q = np.array([[[1.0, 0.0]], [[1.0, 0.0]]])
    mask = np.ones((2, 1), dtype=bool)
    items = np.array([[[0.0, 1.0], [1.0, 0.0]], [[0.0, 1.0], [1.0, 0.0]]])
    item_mask = np.array([[True, False], [True, True]])  # item 0's exact match is padding
    np.testing.assert_allclose(local_scores(q, mask, items, item_mask), [0.0, 1.0], atol=1e-6)
    np.testing.assert_allclose(local_scores(q, mask, items), [1.0, 1.0], atol=1e-6)
    g = np.array([0.4, 0.4])
    np.testing.assert_allclose(
        late_scores(g, q, mask, items, 0.5, item_mask), [0.2, 0.7], atol=1e-6
    )


def test_late_score_mixes_global_and_local() -> None:
    q = np.array([[[1.0, 0.0]], [[0.0, 1.0]]])
    mask = np.ones((2, 1), dtype=bool)
    items = np.array([[[1.0, 0.0]], [[1.0, 0.0]]])  # local: 1 and 0
    g = np.array([0.2, 0.8])
    np.testing.assert_allclose(
        late_scores(g, q, mask, items, 0.25), [0.75 * 0.2 + 0.25 * 1.0, 0.75 * 0.8 + 0.0], atol=1e-6
    )
    np.testing.assert_allclose(late_scores(g, q, mask, items, 0.0), g, atol=1e-7)
    with pytest.raises(ValueError, match="theta"):
        late_scores(g, q, mask, items, 1.5)


def test_kmeans_regions_find_the_clusters() -> None:
    rng = np.random.default_rng(0)
    centres = np.array([[10.0, 0.0], [0.0, 10.0], [-10.0, -10.0]])
    pts = np.concatenate([c + rng.normal(0, 0.1, (20, 2)) for c in centres])
    got = kmeans_regions(pts, k=3)
    assert got.shape == (3, 2)
    for c in centres:  # every true centre has a region within the noise
        assert np.linalg.norm(got - c, axis=1).min() < 0.1
    assert kmeans_regions(pts[:5], k=32).shape == (5, 2)  # never more regions than patches
    np.testing.assert_array_equal(kmeans_regions(pts, k=3), got)  # deterministic
