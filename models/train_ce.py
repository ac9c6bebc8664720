"""Stage 2 of `duet train`: the cross-encoder, trained afresh on the frozen token states.

After stage 1 the towers and the shared transformer are final (so is every index built with
them); this stage gives the re-ranker many more steps than the joint stage can afford, at a
fraction of the cost, since only the fusion layers learn and every training image's states are
computed once. Per caption (full or, with probability `partial`, partial) the negatives are a
random image, a training image the bi-encoder ranks high for it, at a rank drawn log-uniformly
below `ranks` (over the whole training set: the candidates the service will hand the re-ranker,
from the hardest few to the easy-but-wrong ones deeper in its list), its scene perturbed
(rendered) and a caption of that perturbed scene. `flip` of the perturbations are relation
flips, the mistake the bi-encoder makes most. No negative fits the caption: a partial caption
is only paired with a perturbed image that breaks something it says, and ranked images that
fit it are skipped.

Each shape noun's state after the first `ground_layer` fusion layers regresses the centre of the
thing it names (grounding); the layers above are then free to compare those positions with the
relation words. Measured on validation: grounding at the top layer left flipped relations at
0.55-0.62 pairwise accuracy, grounding at layer 2 of 4 reached 0.88 with the same steps.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F
from PIL import Image

from models import world
from models.builtin import pixel_bytes
from models.joint import CROSS_ENCODER, JointModel
from models.losses import ce_bce_loss
from models.tokenizer import WordTokenizer

Grounding = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (rows, token positions, centres)


def grounding_targets(
    captions: list[str], scenes: list[world.Scene], layouts: list[world.Layout]
) -> Grounding:
    """(rows, token positions, centres (x, y)) for every shape noun of every caption: where in
    its image the thing the noun names is. Token positions count [CLS] as 0."""
    rows, pos, xy = [], [], []
    for r, (cap, scene, layout) in enumerate(zip(captions, scenes, layouts, strict=True)):
        for word, which in world.grounding(cap, scene):
            thing = scene.a if which == "a" or scene.b is None else scene.b
            rows.append(r)
            pos.append(word + 1)
            xy.append(world.centre(layout, thing))
    return (
        torch.tensor(rows, dtype=torch.long),
        torch.tensor(pos, dtype=torch.long),
        torch.tensor(xy, dtype=torch.float32).reshape(-1, 2),
    )


def bce_and_grounding(
    model: JointModel,
    txt: torch.Tensor,
    pad: torch.Tensor,
    img: torch.Tensor,
    b: int,
    ground: torch.nn.Module,
    where: Grounding,
    ground_weight: float,
    ground_layer: int,
    lists: Sequence[torch.Tensor] = (),
) -> tuple[torch.Tensor, float | None]:
    """(BCE over pairs whose first `b` are the positives (in batch order) plus the grounding
    regression on those positives' shape nouns after the first `ground_layer` fusion layers,
    the grounding MSE alone or None when there was none). Both training stages use it.

    Each of `lists` (n, 1 + k) indexes the pairs' logits, a positive in column 0 and its
    negatives after it (-1: none): a softmax cross-entropy per row is added, so the positive
    must outscore its own negatives, whatever the other rows' scores (BCE alone calibrates
    every pair against one threshold, and a query's ranking is all the service uses)."""
    h, tapped = model.fused_tap(txt, pad, img, ground_layer)
    logits = model.itm_head(h[:, 0]).squeeze(-1)
    loss = ce_bce_loss(logits[:b], logits[b:])
    for rows in lists:
        scores = logits[rows.clamp(min=0)].masked_fill(rows < 0, float("-inf"))
        loss = loss + F.cross_entropy(scores, torch.zeros(len(rows), dtype=torch.long))
    rows, pos, xy = where
    if ground_weight > 0 and len(rows):
        g = F.mse_loss(ground(tapped[rows, 1 + pos]), xy)
        return loss + ground_weight * g, g.item()
    return loss, None


def perturbed_twin(rng: random.Random, scene: world.Scene, flip: float) -> world.Scene:
    """A hard negative scene: the relation flipped with probability `flip` (pairs only), else
    `world.perturb`."""
    if scene.relation is not None and rng.random() < flip:
        return replace(scene, relation=world.INVERSE[scene.relation])
    return world.perturb(rng, scene)


@torch.no_grad()
def _states(
    model: JointModel,
    images: Sequence[Image.Image],
    batch: int = 500,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(image states (N, T, d) float16, image vectors (N, e))."""
    px = pixel_bytes(images, world.IMAGE_SIZE)
    states, vecs = [], []
    for s in range(0, len(px), batch):
        st = model.image_tokens(px[s : s + batch].float() / 255.0)
        states.append(st.half())
        vecs.append(model.embed_images(st))
    return torch.cat(states), torch.cat(vecs)


def ranked_negative(
    rng: random.Random,
    ranked: Sequence[int],
    desc: world.Desc,
    scenes: Sequence[world.Scene],
    tries: int = 10,
) -> int:
    """One of `ranked` (training images, best first) that `desc` does not fit, at a rank drawn
    log-uniformly (the hardest few as likely as each decade below them); -1 when `tries`
    draws all fit."""
    for _ in range(tries):
        r = min(int(math.exp(rng.uniform(0.0, math.log(len(ranked) + 1)))) - 1, len(ranked) - 1)
        if not world.satisfies(desc, scenes[ranked[r]]):
            return ranked[r]
    return -1


def ranked_caption(
    rng: random.Random,
    ranked: Sequence[int],
    scene: world.Scene,
    caption_scenes: Sequence[world.Scene],
    tries: int = 10,
) -> int:
    """One of `ranked` (training captions, best first for an image of `scene`) that `scene`
    does not fit, at a rank drawn log-uniformly; -1 when `tries` draws all fit."""
    for _ in range(tries):
        r = min(int(math.exp(rng.uniform(0.0, math.log(len(ranked) + 1)))) - 1, len(ranked) - 1)
        c = ranked[r]
        if not world.satisfies(world.full_desc(caption_scenes[c]), scene):
            return c
    return -1


@torch.no_grad()
def _caption_vectors(
    model: JointModel, tok: WordTokenizer, captions: Sequence[str], batch: int = 2048
) -> torch.Tensor:
    """The bi-encoder's vectors of `captions` (N, e)."""
    out = []
    for s in range(0, len(captions), batch):
        ids, pad = tok.batch(list(captions[s : s + batch]))
        out.append(model.embed_texts(model.text_tokens(ids, pad), pad))
    return torch.cat(out)


def _list_rows(b: int, columns: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """(b, 1 + len(columns)) logit indices: row r's positive (logit r) in column 0, then per
    column the logit index of row r's negative of that kind, -1 where it has none; each
    column is (rows that have one, their logit indices)."""
    out = torch.full((b, 1 + len(columns)), -1, dtype=torch.long)
    out[:, 0] = torch.arange(b)
    for k, (rows, at) in enumerate(columns):
        out[rows, k + 1] = at
    return out


def caption_beside_twin(
    rng: random.Random, sample: world.Sample, twin: world.Scene, partial: float, tries: int = 5
) -> tuple[str, world.Desc]:
    """A caption of `sample` that its perturbed twin does not fit: partial with probability
    `partial` when one of `tries` partial descriptions names what the twin changed, else
    full."""
    if rng.random() < partial:
        for _ in range(tries):
            text, desc = world.partial_caption(rng, sample.scene)
            if not world.satisfies(desc, twin):
                return text, desc
    return rng.choice(sample.captions), world.full_desc(sample.scene)


def twin_text(
    rng: random.Random,
    twin: world.Scene,
    full: str,
    scene: world.Scene,
    partial: float,
    tries: int = 5,
) -> str:
    """A caption of the twin that `scene` does not fit (a text negative for `scene`'s image):
    partial with probability `partial` when one of `tries` says what changed, else `full`."""
    if rng.random() < partial:
        for _ in range(tries):
            text, desc = world.partial_caption(rng, twin)
            if not world.satisfies(desc, scene):
                return text
    return full


def train_cross_encoder(
    model: JointModel,
    tok: WordTokenizer,
    samples: Sequence[world.Sample],
    steps: int,
    batch: int,
    lr: float,
    flip: float,
    ranks: int,
    ground_weight: float,
    ground_layer: int,
    rng: random.Random,
    progress: bool = True,
    partial: float = 0.0,
    reset: bool = True,
) -> None:
    """Train `model`'s cross-encoder in place, re-initialised first unless `reset` is False;
    everything else stays frozen."""
    from tqdm import tqdm

    batch = min(batch, len(samples))
    if reset:
        model.reset_cross_encoder()
    model.eval()  # no dropout anywhere; frozen parts stay frozen
    ground = torch.nn.Linear(model.cfg.d_model, 2)  # training-only: noun -> its thing's centre
    trained = [p for n, p in model.named_parameters() if n.startswith(CROSS_ENCODER)]
    for n, p in model.named_parameters():
        p.requires_grad_(n.startswith(CROSS_ENCODER))
    twins = [perturbed_twin(rng, s.scene, flip) for s in samples]
    twin_images = [
        world.render(rng, w)
        for w in tqdm(twins, desc="rendering twins", unit="img", disable=not progress)
    ]
    twin_captions = [world.captions(rng, w, 1)[0] for w in twins]
    scenes = [s.scene for s in samples]
    # every training caption, for image->text negatives at ranks the service will see
    all_captions = [c for s in samples for c in s.captions]
    caption_owner = torch.tensor([i for i, s in enumerate(samples) for _c in s.captions])
    caption_scenes = [scenes[i] for i in caption_owner.tolist()]
    caption_vecs = _caption_vectors(model, tok, all_captions)
    states, vecs = _states(model, [s.image for s in samples])
    twin_states, _ = _states(model, twin_images)
    opt = torch.optim.AdamW([*trained, *ground.parameters()], lr=lr, weight_decay=0.01)
    ema: dict[str, float] = {}
    bar = tqdm(range(steps), desc="training cross-encoder", unit="step", disable=not progress)
    for step in bar:
        for group in opt.param_groups:
            warm = min(1.0, (step + 1) / 50)
            group["lr"] = lr * warm * 0.5 * (1 + math.cos(math.pi * step / steps))
        idx = torch.tensor(rng.sample(range(len(samples)), batch))
        picked = idx.tolist()
        said = [caption_beside_twin(rng, samples[i], twins[i], partial) for i in picked]
        texts = [t for t, _d in said]
        twin_texts = [
            twin_text(rng, twins[i], twin_captions[i], samples[i].scene, partial) for i in picked
        ]
        with torch.no_grad():
            isim = vecs[idx] @ caption_vecs.t()  # these images against every caption
            isim.masked_fill_(caption_owner[None, :] == idx[:, None], float("-inf"))
            ctop = isim.topk(min(ranks, len(all_captions) - 1), dim=1).indices.tolist()
        rcap = [
            ranked_caption(rng, ctop[r], samples[i].scene, caption_scenes)
            for r, i in enumerate(picked)
        ]
        keep_rc = torch.tensor([c >= 0 for c in rcap])
        ranked_texts = [all_captions[c] for c in rcap if c >= 0]
        with torch.no_grad():
            ids, pad = tok.batch(texts + twin_texts + ranked_texts)
            txt = model.text_tokens(ids, pad)
            sim = model.embed_texts(txt[:batch], pad[:batch]) @ vecs.t()
            sim[torch.arange(batch), idx] = float("-inf")
            top = sim.topk(min(ranks, len(samples) - 1), dim=1).indices.tolist()
        hard = [ranked_negative(rng, top[r], d, scenes) for r, (_t, d) in enumerate(said)]
        hard2 = [ranked_negative(rng, top[r], d, scenes) for r, (_t, d) in enumerate(said)]
        shift = torch.roll(idx, 1)
        keep_shift = torch.tensor(
            [
                not world.satisfies(d, samples[j].scene)
                for (_t, d), j in zip(said, shift.tolist(), strict=True)
            ]
        )
        keep_hard = torch.tensor([h >= 0 for h in hard])
        keep_hard2 = torch.tensor([h >= 0 for h in hard2])
        rows = torch.arange(batch)
        # the pairs, segment by segment: (caption rows, image states)
        segments = [
            (rows, states[idx]),  # positives
            (rows[keep_shift], states[shift[keep_shift]]),  # a random wrong image
            (rows[keep_hard], states[torch.tensor(hard)[keep_hard]]),  # ranked wrong images
            (rows[keep_hard2], states[torch.tensor(hard2)[keep_hard2]]),
            (rows, twin_states[idx]),  # the perturbed scene's image
            (rows + batch, states[idx]),  # the perturbed scene's caption
            (2 * batch + torch.arange(len(ranked_texts)), states[idx[keep_rc]]),  # ranked
        ]
        t_idx = torch.cat([t for t, _s in segments])
        img = torch.cat([st for _t, st in segments]).float()
        start = torch.tensor([0, *itertools.accumulate(len(t) for t, _s in segments)])
        who = [rows, rows[keep_shift], rows[keep_hard], rows[keep_hard2], rows, rows]
        at = [start[k] + torch.arange(len(w)) for k, w in enumerate(who)]
        lists = [
            # a caption against the images: its own, then each kind of wrong one
            _list_rows(batch, [(who[k], at[k]) for k in (1, 2, 3, 4)]),
            # an image against the captions: its own, the twin's, a ranked wrong one
            _list_rows(
                batch,
                [(who[5], at[5]), (rows[keep_rc], start[6] + torch.arange(len(ranked_texts)))],
            ),
        ]
        where = grounding_targets(
            texts, [samples[i].scene for i in picked], [samples[i].layout for i in picked]
        )
        loss, g = bce_and_grounding(
            model,
            txt[t_idx],
            pad[t_idx],
            img,
            batch,
            ground,
            where,
            ground_weight,
            ground_layer,
            lists,
        )
        if g is not None:
            ema["ground"] = 0.98 * ema.get("ground", g) + 0.02 * g
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        ema["ce"] = 0.98 * ema.get("ce", loss.item()) + 0.02 * loss.item()
        bar.set_postfix({k: f"{v:.4f}" for k, v in ema.items()})
    for p in model.parameters():
        p.requires_grad_(True)
