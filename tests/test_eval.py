"""`duet eval`: recalls checked against brute force on a real built index and the real model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from duet import evaluation
from duet.evaluation import evaluate_index, load_pool
from models.builtin import BuiltinModel
from models.eval_metrics import top_m
from models.eval_modes import EvalError
from models.eval_pool import TextTokens, TokenScorer
from models.fusion import DEFAULT_FUSION_LAMBDA, fuse, norm_fuse
from models.rerankers import REGISTRY
from tests.conftest import REPO


def test_norm_add_normalises_each_querys_candidates() -> None:
    dots = np.array([[0.2, 0.4, 0.6]])
    logits = np.array([[0.0, 0.0, np.log(3.0)]])  # sigmoid: 0.5, 0.5, 0.75
    # 0-1 normalised: dots 0, .5, 1; probs 0, 0, 1
    np.testing.assert_allclose(norm_fuse(dots, logits, 0.5), [[0.0, 0.25, 1.0]])
    np.testing.assert_allclose(norm_fuse(np.ones((1, 3)), logits, 0.5), [[0.0, 0.0, 0.5]])
    np.testing.assert_allclose(fuse(dots, logits, 0.5), [[0.35, 0.45, 0.675]])


def test_recalls_match_brute_force(index_dir: Path, model: BuiltinModel) -> None:
    _, pool = load_pool(index_dir, model.fingerprint)
    assert pool.sizes == {"images": 40, "texts": 200}
    res = evaluate_index(
        pool, model, candidates=40, modes=("dot", "coop", "ce-full"), ce_full_queries=8
    )
    # dot: brute-force argsort of the stored vectors
    sim = pool.text_vecs @ pool.image_vecs.T
    ranks = np.argsort(-sim, axis=1, kind="stable")
    for k in (1, 5, 10):
        want = 100 * np.mean([pool.owner[q] in ranks[q, :k] for q in range(len(sim))])
        assert res["modes"]["dot"]["t2i"][f"R@{k}"] == pytest.approx(want, abs=0.01)
    i2t = np.argsort(-sim.T, axis=1, kind="stable")
    want = 100 * np.mean([pool.owner[i2t[i, 0]] == i for i in range(40)])
    assert res["modes"]["dot"]["i2t"]["R@1"] == pytest.approx(want, abs=0.01)
    # with M = the whole image pool, coop and ce-full rank the same scores the same way
    full = res["modes"]["ce-full"]
    assert full["queries"] == {"t2i": 8, "i2t": 8}
    assert full["t2i"] == full["coop_same_queries"]["t2i"]
    assert set(res["modes"]) == {"dot", "coop", "ce-full"}
    assert all(res["modes"][m]["ms_per_query"]["t2i"] > 0 for m in res["modes"])


def test_sweeps_and_distractors(
    index_dir: Path, tmp_path: Path, model: BuiltinModel, corpus: Path
) -> None:
    from index_builder.build import build
    from models.trainconfig import HELD_OUT_SEED_BASE
    from models.world import write_corpus

    other = write_corpus(tmp_path / "c", 30, HELD_OUT_SEED_BASE + 12, progress=False)
    build(other, tmp_path / "d", model, progress=False)
    _, plain = load_pool(index_dir, model.fingerprint)
    _, mixed = load_pool(index_dir, model.fingerprint, distractors=tmp_path / "d")
    assert mixed.sizes == {"images": 70, "texts": 350} and mixed.n_texts == 200
    with pytest.raises(EvalError, match="holds the evaluated index's own corpus"):
        load_pool(index_dir, model.fingerprint, distractors=index_dir)
    a = evaluate_index(plain, model, modes=("dot", "coop"), m_sweep=(10, 20), fusion_sweep=True)
    b = evaluate_index(mixed, model, modes=("dot", "coop"))
    for d in ("t2i", "i2t"):  # distractors can only push the right answer down
        assert b["modes"]["dot"][d]["R@10"] <= a["modes"]["dot"][d]["R@10"]
    assert set(a["sweeps"]["M"]) == {"10", "20"}
    assert a["sweeps"]["M"]["20"]["t2i"] == a["modes"]["coop"]["t2i"]  # M=20 is the default
    assert set(a["sweeps"]["fusion"]) == {
        f"{f}_{lam}" for f in ("ADD", "NORM_ADD") for lam in (0.1, 0.5, 0.9)
    } | {f"ADD_{DEFAULT_FUSION_LAMBDA}"}


def _eval_scorer(name: str, model: object, theta: float) -> TokenScorer:
    """`duet eval`'s scorer of registry entry `name` (what cmd_eval builds)."""
    entry = REGISTRY[name]
    assert entry.evaluate is not None
    scorer = entry.evaluate(model, theta)
    assert not isinstance(scorer, str), scorer
    return scorer


def test_late_and_han_modes_rerank_the_same_candidates(
    index_dir: Path, model: BuiltinModel
) -> None:
    from models.han import HAN, HANConfig, HANReranker, with_dot
    from models.late import late_scores

    _, pool = load_pool(index_dir, model.fingerprint)
    tt = TextTokens.of(model, pool.texts, batch=64)  # several batches, padded
    assert tt.tokens.shape[:2] == tt.mask.shape and tt.mask.any(axis=1).all()
    torch.manual_seed(0)
    han = HANReranker(HAN(HANConfig()), model)
    res = evaluate_index(
        pool,
        None,
        candidates=10,
        modes=("dot", "late", "han"),
        token_scorers={
            "late": _eval_scorer("late", model, 0.0),
            "han": _eval_scorer("han", SimpleNamespace(joint=model, han=han), 0.0),
        },
        text_tokens=tt,
    )
    # theta = 0 is the bi-encoder alone: same order as dot inside its top 10
    for d in ("t2i", "i2t"):
        assert res["modes"]["late"][d] == res["modes"]["dot"][d]
    # han: brute force over the top-10 with HANReranker.score_pairs on the caption strings,
    # blended with the dot product as the service blends it
    cand, dots = top_m(pool.image_vecs, pool.text_vecs, 10)
    scores = np.stack(
        [
            with_dot(
                dots[i],
                han.score_pairs(
                    [pool.texts[j] for j in cand[i]],
                    np.repeat(pool.image_tokens[i : i + 1], 10, axis=0),
                ),
            )
            for i in range(40)
        ]
    )
    best = cand[np.arange(40), scores.argmax(axis=1)]
    want = 100 * np.mean(pool.owner[best] == np.arange(40))
    assert res["modes"]["han"]["i2t"]["R@1"] == pytest.approx(want, abs=0.01)
    # late with theta 1 is S_l alone: checked on one text query against models.late
    res1 = evaluate_index(
        pool,
        None,
        candidates=10,
        modes=("late",),
        token_scorers={"late": _eval_scorer("late", model, 1.0)},
        text_tokens=tt,
    )
    t_cand, t_dots = top_m(pool.text_vecs, pool.image_vecs, 10)
    q_tok, q_mask = model.text_token_features(pool.texts)
    s_l = np.stack(
        [
            late_scores(
                t_dots[q],
                np.repeat(q_tok[q : q + 1], 10, axis=0),
                np.repeat(q_mask[q : q + 1], 10, axis=0),
                pool.image_tokens[t_cand[q]].astype(np.float32),
                1.0,
            )
            for q in range(200)
        ]
    )
    top = t_cand[np.arange(200), s_l.argmax(axis=1)]
    want = 100 * np.mean(pool.owner[:200] == top)
    assert res1["modes"]["late"]["t2i"]["R@1"] == pytest.approx(want, abs=0.01)


def test_ce_full_refuses_a_large_pool(
    index_dir: Path, model: BuiltinModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(evaluation, "CE_FULL_MAX_POOL", 39)  # 40 images: one too many
    _, pool = load_pool(index_dir, model.fingerprint)
    with pytest.raises(EvalError, match="at most 39 images"):
        evaluate_index(pool, model, modes=("ce-full",))


def test_cli_json_and_errors(index_dir: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "duet.cli",
        "eval",
        "--index",
        str(index_dir),
        "--json",
        "--modes",
        "dot,coop",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert body["pool"] == {"images": 40, "texts": 200}
    assert set(body["modes"]["coop"]["t2i"]) == {"R@1", "R@5", "R@10"}
    assert {"t2i", "i2t"} <= set(body["modes"]["dot"]["ms_per_query"])
    # the re-ranker's scoring shows a progress bar per direction on stderr, unless asked not to
    assert "t2i: top 20" in out.stderr and "i2t: top 20" in out.stderr and "pair" in out.stderr
    quiet = subprocess.run(
        [*cmd, "--no-progress"], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert quiet.returncode == 0, quiet.stderr
    assert json.loads(quiet.stdout)["modes"]["coop"]["t2i"] == body["modes"]["coop"]["t2i"]
    assert "pair" not in quiet.stderr, quiet.stderr
    bad = subprocess.run(
        [*cmd[:-1], "dot,late-ish"], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert bad.returncode == 2 and "late-ish" in bad.stderr


def test_cli_han_without_a_head_says_how_to_get_one(index_dir: Path, tmp_path: Path) -> None:
    import shutil

    from models.trainconfig import DEFAULT_WEIGHTS

    bare = tmp_path / "weights"
    bare.mkdir()
    for name in ("model.safetensors", "config.json", "vocab.json"):
        shutil.copy(DEFAULT_WEIGHTS / name, bare / name)
    cmd = [
        sys.executable,
        "-m",
        "duet.cli",
        "eval",
        "--index",
        str(index_dir),
        "--json",
        "--model-dir",
        str(bare),
    ]
    out = subprocess.run(
        [*cmd, "--modes", "dot,han"], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert out.returncode == 2 and "duet train" in out.stderr
    # by default han is simply left out when the model has no head
    out = subprocess.run(
        [*cmd, "--modes", "dot,late"], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert set(json.loads(out.stdout)["modes"]) == {"dot", "late"}
