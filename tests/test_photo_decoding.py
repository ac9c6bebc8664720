"""One decode path for the builder and the service (`models.images.open_rgb`): a photo is
indexed exactly as the same file is decoded when searched with, upright by its EXIF
orientation (on the CPU and on the device path), JPEGs at the DCT scale the model allows."""

from __future__ import annotations

import io
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from app.config import Settings
from app.errors import DuetError
from app.imaging import decode_image
from app.main import Resources, create_app
from index_builder.build import build
from index_builder.decode import DecodedBatch, PlanItem, decode
from index_builder.device_decode import resolve
from models.builtin import BuiltinModel, pixel_bytes
from models.images import DECODE, KEEP_SIDE, open_rgb, orientation, side_for, side_of, upright
from models.world import PhotoStyle, write_corpus
from store import indexio


def _jpeg(arr: np.ndarray, turn: int = 1, quality: int = 95) -> bytes:
    exif = Image.Exif()
    if turn != 1:
        exif[0x0112] = turn
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=quality, exif=exif)
    return buf.getvalue()


def _stored(data: bytes) -> torch.Tensor:
    """The pixels as the file stores them (no EXIF turn), (3, H, W) uint8."""
    img = Image.open(io.BytesIO(data)).convert("RGB")
    return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1)


@pytest.mark.parametrize("turn", range(1, 9))
def test_upright_turns_a_stored_picture_as_pil_does(turn: int) -> None:
    arr = np.random.default_rng(turn).integers(0, 255, (24, 40, 3), dtype=np.uint8)
    data = _jpeg(arr, turn)
    assert orientation(data) == turn
    pil = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
    ours = upright(_stored(data), turn).permute(1, 2, 0).numpy()
    assert ours.shape == pil.shape and np.array_equal(ours, pil)
    assert np.array_equal(np.asarray(open_rgb(data)), pil)  # the CPU path turns it too


def test_a_jpeg_is_decoded_at_the_dct_scale_the_model_allows() -> None:
    arr = np.random.default_rng(0).integers(0, 255, (384, 512, 3), dtype=np.uint8)
    data = _jpeg(arr)
    assert open_rgb(data, 64).size == (128, 96)  # 1/4: the smallest keeping both sides >= 64
    assert open_rgb(data, 100).size == (256, 192)
    assert open_rgb(data).size == (512, 384)  # KEEP_SIDE: whole
    # the service decodes an upload for the builtin model the same way
    assert decode_image(data, 10**7, 10**8, 64).size == (128, 96)
    scaled = pixel_bytes([open_rgb(data, 64)], 64).int()
    whole = pixel_bytes([open_rgb(data, KEEP_SIDE)], 64).int()
    diff = (scaled - whole).abs().float()
    assert float(diff.mean()) < 2.0  # the same picture at 64 x 64, a level or two apart


def test_orientation_of_a_file_without_exif_or_not_a_jpeg_is_upright() -> None:
    png = io.BytesIO()
    Image.new("RGB", (4, 4)).save(png, format="PNG")
    assert orientation(png.getvalue()) == 1
    assert orientation(b"\xff\xd8\xff broken") == 1
    assert orientation(_jpeg(np.zeros((8, 8, 3), np.uint8))) == 1


def test_a_sideways_photo_is_indexed_upright_as_it_is_searched(
    tmp_path: Path, model: BuiltinModel
) -> None:
    """A phone stores a portrait sideways with Orientation 6; the builder ignored that while
    the service turned an upload upright, so the photo's vector in the index was of a picture
    nobody sees and its own file searched with did not match it."""
    manifest = write_corpus(tmp_path / "c", 3, seed=5, progress=False, photo=PhotoStyle(tiles=1))
    rel = json.loads(manifest.read_text().splitlines()[1])["image"]
    path = manifest.parent / rel
    upright_arr = np.asarray(Image.open(path).convert("RGB"))
    sideways = np.ascontiguousarray(np.rot90(upright_arr, 1))  # stored turned a quarter
    path.write_bytes(_jpeg(sideways, turn=6))
    report = build(manifest, tmp_path / "idx", model, progress=False, workers=0)
    vecs = np.load(report.path / "image_vectors.npy")
    for i, line in enumerate(manifest.read_text().splitlines()):
        data = (manifest.parent / json.loads(line)["image"]).read_bytes()
        query = decode_image(data, 10**7, 10**8, model.decode_side)
        qvec, _ = model.encode_images([query])
        np.testing.assert_allclose(vecs[i], qvec[0], atol=1e-5)
    stored, _ = model.encode_images([Image.open(path)])  # the picture as stored, sideways
    assert float(vecs[1] @ stored[0]) < 0.999


def test_the_device_path_turns_a_deferred_jpeg_upright(tmp_path: Path) -> None:
    arr = np.random.default_rng(4).integers(0, 255, (16, 24, 3), dtype=np.uint8)
    paths = []
    for turn in (1, 6, 3):
        p = tmp_path / f"t{turn}.jpg"
        p.write_bytes(_jpeg(arr, turn))
        paths.append(p)
    plan = [PlanItem(i, f"i{i}", str(p), p.name, i + 1, ()) for i, p in enumerate(paths)]
    batch = DecodedBatch.collate([decode(it, 16, defer_jpeg=True) for it in plan])
    assert [d.orientation for _, d in batch.deferred] == [1, 6, 3]

    def stored_only(data: list[torch.Tensor]) -> list[torch.Tensor]:  # as nvJPEG: no EXIF
        return [_stored(d.numpy().tobytes()) for d in data]

    got = resolve(batch, plan, 16, torch.device("cpu"), stored_only)
    cpu = DecodedBatch.collate([decode(it, 16) for it in plan]).pixels
    assert got.pixels is not None and cpu is not None
    diff = (got.pixels.int() - cpu.int()).abs()
    assert int(diff.max()) <= 3 and float(diff.float().mean()) < 0.5


def test_a_photo_the_device_decodes_whole_is_the_cpus_scaled_decode_to_a_level_or_so(
    tmp_path: Path,
) -> None:
    """nvJPEG has no DCT scaling: a 512 x 384 photo decoded whole and resized on the device
    against the CPU's decode at 1/2 and PIL's resize, both at the builtin model's 64."""
    arr = np.asarray(Image.open(io.BytesIO(_jpeg(_photo(), quality=90))).convert("RGB"))
    path = tmp_path / "p.jpg"
    path.write_bytes(_jpeg(np.ascontiguousarray(np.rot90(arr, 1)), turn=6, quality=90))
    item = PlanItem(0, "p", str(path), "p.jpg", 1, ())
    deferred = DecodedBatch.collate([decode(item, 64, defer_jpeg=True)])

    def whole(data: list[torch.Tensor]) -> list[torch.Tensor]:
        return [_stored(d.numpy().tobytes()) for d in data]

    got = resolve(deferred, [item], 64, torch.device("cpu"), whole).pixels
    cpu = DecodedBatch.collate([decode(item, 64)]).pixels
    assert got is not None and cpu is not None
    diff = (got.int() - cpu.int()).abs().float()
    assert float(diff.max()) <= 3 and float(diff.mean()) < 0.5, (diff.max(), diff.mean())


def _photo() -> np.ndarray:
    """A smooth picture with fine grain, 512 x 384, as the JPEG demo corpus draws them."""
    rng = np.random.default_rng(6)
    y, x = np.mgrid[0:384, 0:512]
    base = np.stack([x / 2, y / 1.5, (x + y) / 3.5], -1) % 256
    return np.clip(base + rng.normal(0, 6, base.shape), 0, 255).astype(np.uint8)


def test_the_builder_reads_only_the_formats_the_service_reads(tmp_path: Path) -> None:
    """An ICO (or EPS, which runs Ghostscript) in a corpus is an unreadable image, named."""
    ico = tmp_path / "x.ico"
    Image.new("RGB", (16, 16)).save(ico)
    got = decode(PlanItem(0, "x", str(ico), "x.ico", 1, ()), 16)
    assert got.pixels is None and "cannot read image 'x.ico'" in got.error
    assert "not a PNG, JPEG, WebP, GIF, TIFF or BMP file" in got.error


def test_a_broken_png_is_called_corrupt_not_an_unknown_format(tmp_path: Path) -> None:
    """A PNG whose header checksum is wrong is a corrupt PNG, told with the PNG reader's own
    complaint (Pillow's open says only "cannot identify image file"), by the builder and by
    the service's upload path alike."""
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), "red").save(buf, "PNG")
    data = bytearray(buf.getvalue())
    data[29] ^= 0xFF  # the IHDR chunk's CRC
    path = tmp_path / "x.png"
    path.write_bytes(bytes(data))
    got = decode(PlanItem(0, "x", str(path), "x.png", 1, ()), 16)
    assert got.pixels is None and "a corrupt PNG file (broken PNG file" in got.error
    with pytest.raises(DuetError) as exc:
        decode_image(bytes(data), max_bytes=100_000, max_pixels=1_000_000)
    assert exc.value.status == 400 and "a corrupt PNG file" in exc.value.message


def test_a_phones_mpo_jpeg_is_decoded_at_a_dct_scale_too() -> None:
    rng = np.random.default_rng(2)
    frames = [Image.fromarray(rng.integers(0, 255, (384, 512, 3), dtype=np.uint8)) for _ in "ab"]
    buf = io.BytesIO()
    frames[0].save(buf, format="MPO", save_all=True, append_images=frames[1:])
    assert Image.open(io.BytesIO(buf.getvalue())).format == "MPO"
    assert open_rgb(buf.getvalue(), 128).size == (256, 192)


async def test_the_service_decodes_uploads_at_its_models_side(
    index_dir: Path, corpus: Path, model: BuiltinModel
) -> None:
    """The service sets its decoder's side from the models it loaded (the owner tells its
    fronts the same side), and a sideways photo of an indexed image finds that image."""
    assert side_of(model) == side_for(model.model.cfg.image_size) == 128
    assert side_of(object()) == KEEP_SIDE
    index = indexio.IndexVersion.open(
        indexio.resolve_current(index_dir), expect_fingerprint=model.fingerprint
    )
    app = create_app(Settings(index_dir=index_dir, index_poll_s=0), Resources(model, index))
    first = json.loads(corpus.read_text().splitlines()[0])
    big = Image.open(corpus.parent / first["image"]).convert("RGB").resize((256, 256))
    photo = _jpeg(np.ascontiguousarray(np.rot90(np.asarray(big), 1)), turn=6)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://duet") as client,
    ):
        assert app.state.decoder.side == 128
        r = await client.post("/search/image", files={"image": ("p.jpg", photo, "image/jpeg")})
    assert r.status_code == 200, r.text
    assert r.json()["hits"][0]["id"].split("#")[0] == first["id"]  # one of its captions


def test_a_version_records_its_decode_and_an_append_to_an_older_one_warns(
    tmp_path: Path, model: BuiltinModel, caplog: pytest.LogCaptureFixture
) -> None:
    manifest = write_corpus(tmp_path / "c", 4, seed=3, progress=False)
    lines = manifest.read_text().splitlines()
    first, more = tmp_path / "c" / "first.jsonl", tmp_path / "c" / "more.jsonl"
    first.write_text("\n".join(lines[:2]) + "\n")
    more.write_text("\n".join(lines[2:]) + "\n")
    out = tmp_path / "idx"
    base = build(first, out, model, progress=False, workers=0)
    assert base.manifest.build is not None and base.manifest.build.decode == DECODE
    # as a version built before the one decode path reads (no `decode` in its manifest)
    path = base.path / "manifest.json"
    old = json.loads(path.read_text())
    del old["build"]["decode"]
    path.write_text(json.dumps(old))
    with caplog.at_level("WARNING", logger="duet.build"):
        added = build(more, out, model, progress=False, append=True, workers=0)
    assert "built before duet turned photos upright" in caplog.text
    assert added.manifest.build is not None and added.manifest.build.decode == 0
