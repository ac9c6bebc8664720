"""Stage 2's mined negatives: the wrong training images the cross-encoder itself ranks highest.

The ranked negatives of `models.ce_negatives` are drawn by the bi-encoder's rank, so the few
images the cross-encoder wrongly prefers deep in a list are seldom among them; those are the
ones that make a deeper list (M = 50) rank worse than a shallow one (M = 10). Mining scores,
for one full caption of every training image, the bi-encoder's top `depth` other images that
the caption does not fit, as the service would hand them to the re-ranker, and keeps the
`keep` the cross-encoder scores highest: the query's own worst confusions, shown to it as
negatives from then on.

Scoring runs on the model's device (the service's forward, `CrossEncoderRuntime`); the random
draws and the mined indices stay in CPU memory (a GPU run makes the draws a CPU run makes).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from models import world
from models.ce_negatives import CePool, encode_texts
from models.inference import CrossEncoderRuntime
from models.joint import JointModel
from models.tokenizer import WordTokenizer

KEEP = 4  # mined negatives kept per training image


@torch.no_grad()
def mine_negatives(
    model: JointModel,
    tok: WordTokenizer,
    pool: CePool,
    depth: int,
    rng: random.Random,
    progress: bool = True,
    keep: int = KEEP,
    chunk: int = 64,
    index: int = 0,
) -> torch.Tensor:
    """(N, keep) int64 training-image indices, per training image the wrong images its
    cross-encoder scores highest for one of its full captions among the bi-encoder's top
    `depth` that the caption does not fit, highest first; -1 where fewer were found.

    With `index` > 0 each caption's list is the top `depth` of its own random draw of about
    `index` training images (each kept with chance index / N), the band a served index of
    that size hands the re-ranker: the top 50 of 1,000 images reaches the top ~1,000 of
    20,000, where the top 50 of all 20,000 holds only the hardest few."""
    from models.bars import tqdm

    was_training = model.training
    model.eval()
    n, scenes = len(pool.samples), pool.scenes
    out = torch.full((n, keep), -1, dtype=torch.long)
    runtime = CrossEncoderRuntime(model)  # the service's forward: same logits, 1.5x faster
    dev = runtime.device
    texts = [rng.choice(s.captions) for s in pool.samples]
    draw = torch.Generator().manual_seed(rng.getrandbits(63)) if 0 < index < n else None
    bar = tqdm(total=n, desc="mining negatives", unit="caption", disable=not progress)
    for s in range(0, n, chunk):
        rows = range(s, min(n, s + chunk))
        txt, pad = encode_texts(model, tok, texts[s : s + len(rows)])
        sim = model.embed_texts(txt, pad) @ pool.vecs.t()
        if draw is not None:  # the images outside each caption's own draw are out of its list
            sim[(torch.rand(sim.shape, generator=draw) >= index / n).to(dev)] = float("-inf")
        sim[torch.arange(len(rows), device=dev), torch.tensor(rows, device=dev)] = float("-inf")
        near_sims, near = sim.topk(min(depth, n - 1), dim=1)
        top = near.masked_fill(near_sims == float("-inf"), -1).tolist()  # -1: outside the draw
        descs = [world.full_desc(scenes[i]) for i in rows]  # once per caption, not per candidate
        cands = [
            [j for j in top[r] if j >= 0 and not world.satisfies(descs[r], scenes[j])]
            for r in range(len(rows))
        ]
        who = torch.tensor([r for r, c in enumerate(cands) for _ in c], dtype=torch.long)
        flat = torch.tensor([j for c in cands for j in c], dtype=torch.long)
        if len(flat):
            lengths = (~pad).sum(dim=1).tolist()
            img = pool.states[flat.to(dev)].float()
            logits = runtime.logits(txt, lengths, who, img).cpu()
            for r, i in enumerate(rows):
                mine = who == r
                best = logits[mine].topk(min(keep, int(mine.sum()))).indices
                out[i, : len(best)] = flat[mine][best]
        bar.update(len(rows))
    bar.close()
    model.train(was_training)
    return out


@torch.no_grad()
def own_logits(
    model: JointModel,
    tok: WordTokenizer,
    pool: CePool,
    progress: bool = True,
    chunk: int = 256,
    parts: bool = False,
) -> torch.Tensor:
    """(N,) per training image the cross-encoder's lowest logit over its own full captions:
    below 0, it judges an image not to fit a caption written for it (measured on validation:
    such blind spots, not deep wrong images, are what a longer list exposes). With `parts`,
    over each two-thing scene's one-thing captions too ("a small yellow triangle" of a small
    yellow triangle beside a large yellow cross): the blind spots a short query meets."""
    from models.bars import tqdm

    was_training = model.training
    model.eval()
    runtime = CrossEncoderRuntime(model)
    texts = list(pool.captions)  # every training caption, image by image
    owners = [i for i, s in enumerate(pool.samples) for _c in s.captions]
    if parts:
        for i, text in one_thing_captions(pool.samples):
            texts.append(text)
            owners.append(i)
    owner = torch.tensor(owners)
    out = torch.empty(len(texts))
    for s in tqdm(range(0, len(texts), chunk), desc="scoring own captions", disable=not progress):
        txt, pad = encode_texts(model, tok, texts[s : s + chunk])
        rows = torch.arange(len(txt))
        lengths = (~pad).sum(dim=1).tolist()
        img = pool.states[owner[s : s + len(txt)].to(runtime.device)].float()
        out[s : s + len(txt)] = runtime.logits(txt, lengths, rows, img).cpu()
    model.train(was_training)
    lowest = torch.full((len(pool.samples),), float("inf"))
    return lowest.scatter_reduce(0, owner, out, reduce="amin")


def one_thing_captions(samples: Sequence[world.Sample]) -> list[tuple[int, str]]:
    """(image, caption) for each thing of each two-thing scene, naming that thing alone with
    all its attributes; the wording drawn from a generator seeded by the image's index, so
    the same every run."""
    out = []
    for i, s in enumerate(samples):
        if s.scene.b is None:
            continue
        rng = random.Random(i)
        for t in (s.scene.a, s.scene.b):
            part = world.Part(t.shape, t.colour, t.size, t.count)
            out.append((i, world.describe(rng, world.Desc(part))))
    return out


def draw_batch(
    rng: random.Random, n: int, batch: int, hard: list[int], share: float
) -> torch.Tensor:
    """`batch` distinct training-image indices: about `share` of them from `hard` (the images
    whose own captions the cross-encoder scores below 0), the rest uniform; with no `share`
    or no hard images, the plain uniform draw (the same random numbers as before)."""
    if share <= 0 or not hard:
        return torch.tensor(rng.sample(range(n), batch))
    picked = rng.sample(hard, min(len(hard), batch, round(share * batch)))
    taken = set(picked)
    while len(picked) < batch:
        i = rng.randrange(n)
        if i not in taken:
            taken.add(i)
            picked.append(i)
    return torch.tensor(picked)
