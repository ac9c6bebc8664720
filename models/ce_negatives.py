"""Stage 2's training pairs: the hard negatives a caption and an image are shown against.

Per caption (full or partial) a random wrong image, two training images the bi-encoder ranks
high for it at ranks drawn log-uniformly below `ranks`, its scene perturbed (rendered); per
image the perturbed scene's caption and a training caption the bi-encoder ranks high for it.
No negative fits: a partial caption is only paired with a perturbed image that breaks something
it says, and ranked images or captions that fit are skipped. `ce_pairs` lays one step's pairs
out for `models.train_ce.bce_and_grounding`, with the index lists of its listwise term.
The pool's image states and vectors live on the model's device, its indices in CPU memory.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from PIL import Image

from models import world
from models.builtin import pixel_bytes
from models.ce_moves import moved_images
from models.joint import JointModel
from models.tokenizer import WordTokenizer


def perturbed_twin(
    rng: random.Random, scene: world.Scene, flip: float, count: float = 0.0
) -> world.Scene:
    """A hard negative scene: with probability `count` (pairs only) another count of its first
    thing (`world.count_twin`), else the relation flipped with probability `flip` (pairs only),
    else `world.perturb` (which changes a count rarely, and only two against three)."""
    if count > 0 and scene.b is not None and rng.random() < count:
        return world.count_twin(rng, scene)
    if scene.relation is not None and rng.random() < flip:
        return replace(scene, relation=world.INVERSE[scene.relation])
    return world.perturb(rng, scene)


def token_batch(
    tok: WordTokenizer, texts: list[str], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """`tok.batch(texts)` (token ids, padding mask) on `device`."""
    ids, pad = tok.batch(texts)
    return ids.to(device), pad.to(device)


@torch.no_grad()
def _states(
    model: JointModel,
    images: Sequence[Image.Image],
    batch: int = 500,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(image states (N, T, d) float16, image vectors (N, e)), on the model's device."""
    px = pixel_bytes(images, world.IMAGE_SIZE)
    states, vecs = [], []
    for s in range(0, len(px), batch):
        st = model.image_tokens(px[s : s + batch].to(model.itm_token.device).float() / 255.0)
        states.append(st.half())
        vecs.append(model.embed_images(st))
    return torch.cat(states), torch.cat(vecs)


def _log_uniform_rank(rng: random.Random, n: int) -> int:
    """A rank below `n` drawn log-uniformly: the hardest few as likely as each decade below."""
    return min(int(math.exp(rng.uniform(0.0, math.log(n + 1)))) - 1, n - 1)


def _ranked_draw(
    rng: random.Random, ranked: Sequence[int], fits: Callable[[int], bool], tries: int
) -> int:
    """One of `ranked` (best first) that does not `fit`, at a rank drawn log-uniformly (the
    hardest few as likely as each decade below them); -1 when `tries` draws all fit."""
    for _ in range(tries):
        i = ranked[_log_uniform_rank(rng, len(ranked))]
        if not fits(i):
            return i
    return -1


def ranked_negative(
    rng: random.Random,
    ranked: Sequence[int],
    desc: world.Desc,
    scenes: Sequence[world.Scene],
    tries: int = 10,
) -> int:
    """One of `ranked` (training images, best first) that `desc` does not fit (`_ranked_draw`)."""
    return _ranked_draw(rng, ranked, lambda i: world.satisfies(desc, scenes[i]), tries)


def mined_negative(
    rng: random.Random, mined: Sequence[int], desc: world.Desc, scenes: Sequence[world.Scene]
) -> int:
    """One of an image's `mined` negatives (`models.ce_mining`) that `desc`, the caption it is
    shown with this step (perhaps partial), does not fit, drawn at random; -1 when none."""
    usable = [j for j in mined if j >= 0 and not world.satisfies(desc, scenes[j])]
    return rng.choice(usable) if usable else -1


def ranked_caption(
    rng: random.Random,
    ranked: Sequence[int],
    scene: world.Scene,
    caption_scenes: Sequence[world.Scene],
    tries: int = 10,
) -> int:
    """One of `ranked` (training captions, best first for an image of `scene`) that `scene`
    does not fit (`_ranked_draw`)."""
    return _ranked_draw(
        rng, ranked, lambda c: world.satisfies(world.full_desc(caption_scenes[c]), scene), tries
    )


@torch.no_grad()
def _caption_vectors(
    model: JointModel, tok: WordTokenizer, captions: Sequence[str], batch: int = 2048
) -> torch.Tensor:
    """The bi-encoder's vectors of `captions` (N, e), on the model's device."""
    out = []
    for s in range(0, len(captions), batch):
        ids, pad = token_batch(tok, list(captions[s : s + batch]), model.itm_token.device)
        out.append(model.embed_texts(model.text_tokens(ids, pad), pad))
    return torch.cat(out)


@torch.no_grad()
def _caption_top(
    vecs: torch.Tensor,
    caption_vecs: torch.Tensor,
    owner: torch.Tensor,
    ranks: int,
    batch: int = 256,
) -> torch.Tensor:
    """Per image (rows of `vecs`), the `ranks` captions the bi-encoder ranks highest for it among
    those of other images (`owner`: the image each caption describes), best first (N, ranks)
    int32. Computed once: the encoders are frozen in stage 2, so the ranking never changes."""
    k = min(ranks, len(caption_vecs) - 1)
    out = []
    owner = owner.to(vecs.device)
    for s in range(0, len(vecs), batch):
        sim = vecs[s : s + batch] @ caption_vecs.t()
        mine = torch.arange(s, s + len(sim), device=sim.device)
        sim.masked_fill_(owner[None, :] == mine[:, None], float("-inf"))
        out.append(sim.topk(k, dim=1).indices.int().cpu())
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
    """A caption of `sample` its perturbed twin does not fit: partial with probability
    `partial` when one of `tries` partial descriptions names what the twin changed, else full."""
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


@dataclass
class CePool:
    """Everything stage 2 draws from, computed once: the encoders are frozen."""

    samples: Sequence[world.Sample]
    scenes: list[world.Scene]
    twins: list[world.Scene]  # each sample's perturbed scene
    twin_captions: list[str]
    states: torch.Tensor  # image states (N, T, d) float16, on the model's device
    vecs: torch.Tensor  # image vectors (N, e), on the model's device
    twin_states: torch.Tensor
    captions: list[str]  # every training caption, for image->text negatives
    caption_scenes: list[world.Scene]
    # per image, the training captions of other images the bi-encoder ranks highest for it,
    # best first (N, ranks), in CPU memory
    caption_top: torch.Tensor
    # per image, the wrong images the cross-encoder itself scores highest (models.ce_mining),
    # -1 padded; None: not mined
    mined: torch.Tensor | None = None
    # each image moved a few pixels (models.ce_moves): the moves (N, 2) and the moved
    # images' states; None: not asked for
    moves: torch.Tensor | None = None
    moved_states: torch.Tensor | None = None
    typed: float = 0.0  # share of the step's captions written as people type them


def ce_pool(
    model: JointModel,
    tok: WordTokenizer,
    samples: Sequence[world.Sample],
    flip: float,
    rng: random.Random,
    progress: bool,
    ranks: int,
    count: float = 0.0,
    move: bool = False,
    typed: float = 0.0,
) -> CePool:
    """Twins (`perturbed_twin`) rendered, states and vectors of every training image, each
    image's `ranks` best-ranked captions of other images; with `move`, each image's states
    moved a few pixels too (`models.ce_moves`)."""
    from models.bars import tqdm

    twins = [perturbed_twin(rng, s.scene, flip, count) for s in samples]
    twin_images = [
        world.render(rng, w)
        for w in tqdm(twins, desc="rendering twins", unit="img", disable=not progress)
    ]
    twin_captions = [world.captions(rng, w, 1)[0] for w in twins]
    scenes = [s.scene for s in samples]
    captions = [c for s in samples for c in s.captions]
    owner = torch.tensor([i for i, s in enumerate(samples) for _c in s.captions])
    caption_vecs = _caption_vectors(model, tok, captions)
    states, vecs = _states(model, [s.image for s in samples])
    twin_states, _ = _states(model, twin_images)
    moves, moved_states = None, None
    if move:
        moved, moves = moved_images(rng, samples)
        moved_states, _ = _states(model, moved)
    return CePool(
        samples,
        scenes,
        twins,
        twin_captions,
        states,
        vecs,
        twin_states,
        captions,
        [scenes[i] for i in owner.tolist()],
        _caption_top(vecs, caption_vecs, owner, ranks),
        moves=moves,
        moved_states=moved_states,
        typed=typed,
    )


@dataclass
class CePairs:
    """One step's pairs: caption rows into `txt`, image states, the listwise index lists."""

    texts: list[str]  # the positives' captions, in batch order
    txt: torch.Tensor
    pad: torch.Tensor
    t_idx: torch.Tensor
    img: torch.Tensor
    lists: list[torch.Tensor]


@torch.no_grad()
def encode_texts(
    model: JointModel, tok: WordTokenizer, texts: list[str]
) -> tuple[torch.Tensor, ...]:
    """(text states, padding mask) of `texts`, on the model's device."""
    ids, pad = token_batch(tok, texts, model.itm_token.device)
    return model.text_tokens(ids, pad), pad


def _mined_draws(
    rng: random.Random, pool: CePool, idx: torch.Tensor, said: Sequence[tuple[str, world.Desc]]
) -> torch.Tensor | None:
    """Per row of the step, one of its image's mined negatives that its caption does not fit
    (-1: none); None, drawing nothing, when the pool was not mined (unmined runs keep their
    draws)."""
    if pool.mined is None:
        return None
    lists = pool.mined[idx].tolist()
    return torch.tensor(
        [mined_negative(rng, lists[r], d, pool.scenes) for r, (_t, d) in enumerate(said)],
        dtype=torch.long,
    )


def own_states(pool: CePool, idx: torch.Tensor, shown: torch.Tensor | None) -> torch.Tensor:
    """The states of the images `idx` as shown: moved for the rows `shown` (bool) says."""
    idx = idx.to(pool.states.device)
    if shown is None or pool.moved_states is None:
        return pool.states[idx]
    shown = shown.to(pool.states.device)
    return torch.where(shown[:, None, None], pool.moved_states[idx], pool.states[idx])


def _take(states: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """`states[idx]` for indices in CPU memory and states perhaps on a GPU."""
    return states[idx.to(states.device)]


def ce_pairs(
    model: JointModel,
    tok: WordTokenizer,
    pool: CePool,
    idx: torch.Tensor,
    rng: random.Random,
    ranks: int,
    partial: float,
    shown: torch.Tensor | None = None,
) -> CePairs:
    """The pairs of one step over the samples `idx` (positives first, in batch order); the
    rows `shown` (bool) pair their captions with their image's moved states."""
    batch, picked, samples = len(idx), idx.tolist(), pool.samples
    said = [caption_beside_twin(rng, samples[i], pool.twins[i], partial) for i in picked]
    said = [(world.typed_at(rng, t, pool.typed), d) for t, d in said]
    texts = [t for t, _d in said]
    twin_texts = [
        twin_text(rng, pool.twins[i], pool.twin_captions[i], samples[i].scene, partial)
        for i in picked
    ]
    twin_texts = [world.typed_at(rng, t, pool.typed) for t in twin_texts]
    ctop = pool.caption_top[idx].tolist()
    rcap = [
        ranked_caption(rng, ctop[r], samples[i].scene, pool.caption_scenes)
        for r, i in enumerate(picked)
    ]
    keep_rc = torch.tensor([c >= 0 for c in rcap])
    ranked_texts = [pool.captions[c] for c in rcap if c >= 0]
    txt, pad = encode_texts(model, tok, texts + twin_texts + ranked_texts)
    with torch.no_grad():
        sim = model.embed_texts(txt[:batch], pad[:batch]) @ pool.vecs.t()
        sim[torch.arange(batch, device=sim.device), idx.to(sim.device)] = float("-inf")
        top = sim.topk(min(ranks, len(samples) - 1), dim=1).indices.tolist()
    hard = [ranked_negative(rng, top[r], d, pool.scenes) for r, (_t, d) in enumerate(said)]
    hard2 = [ranked_negative(rng, top[r], d, pool.scenes) for r, (_t, d) in enumerate(said)]
    shift = torch.roll(idx, 1)
    keep_shift = torch.tensor(
        [
            not world.satisfies(d, samples[j].scene)
            for (_t, d), j in zip(said, shift.tolist(), strict=True)
        ]
    )
    keep_hard = torch.tensor([h >= 0 for h in hard])
    keep_hard2 = torch.tensor([h >= 0 for h in hard2])
    rows, states, own = torch.arange(batch), pool.states, own_states(pool, idx, shown)
    segments = [  # the pairs, segment by segment: (caption rows, image states)
        (rows, own),  # positives
        (rows[keep_shift], _take(states, shift[keep_shift])),  # a random wrong image
        (rows[keep_hard], _take(states, torch.tensor(hard)[keep_hard])),  # ranked wrong images
        (rows[keep_hard2], _take(states, torch.tensor(hard2)[keep_hard2])),
        (rows, _take(pool.twin_states, idx)),  # the perturbed scene's image
        (rows + batch, own),  # the perturbed scene's caption
        (2 * batch + torch.arange(len(ranked_texts)), _take(own, keep_rc)),  # ranked
    ]
    mined = _mined_draws(rng, pool, idx, said)
    if mined is not None:  # the wrong images the cross-encoder itself prefers
        segments.append((rows[mined >= 0], _take(states, mined[mined >= 0])))
    start = torch.tensor([0, *itertools.accumulate(len(t) for t, _s in segments)])
    who = [rows, rows[keep_shift], rows[keep_hard], rows[keep_hard2], rows, rows]
    at = [start[k] + torch.arange(len(w)) for k, w in enumerate(who)]
    columns = [(who[k], at[k]) for k in (1, 2, 3, 4)]
    if mined is not None:
        columns.append((rows[mined >= 0], start[7] + torch.arange(int((mined >= 0).sum()))))
    lists = [
        # a caption against the images: its own, then each kind of wrong one
        _list_rows(batch, columns),
        # an image against the captions: its own, the twin's, a ranked wrong one
        _list_rows(
            batch,
            [(who[5], at[5]), (rows[keep_rc], start[6] + torch.arange(len(ranked_texts)))],
        ),
    ]
    return CePairs(
        texts,
        txt,
        pad,
        torch.cat([t for t, _s in segments]).to(txt.device),
        torch.cat([st for _t, st in segments]).float(),
        [r.to(txt.device) for r in lists],
    )
